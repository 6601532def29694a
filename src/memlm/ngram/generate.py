"""Generation with the ∞-gram: a LogitsProcessor for Liu et al.'s (2024) interpolation, and where each token came from.

At every step each row's context (its tokens so far, from its last EOS) gives P∞ over the next token
(:meth:`memlm.ngram.memory.NgramMemory.search`: the longest suffix seen in the corpus and the counts of what followed
it), and the LM's distribution becomes::

    p(w | c) = λ_∞(c) P∞(w | c) + (1 - λ_∞(c)) p_LM(w | c),   λ_∞ = λ_sparse when one token follows every occurrence

With a datastore too (:class:`memlm.knnlm.generate.KNNLogitsProcessor` given ``ngram=``), the three-way mixture of
``memlm eval``: ``(1 - λ - λ_∞(c)) p_LM + λ p_kNN + λ_∞(c) P∞``. With several indexes
(:class:`MultiNgramLogitsProcessor`), each its own pair of weights: ``(1 - λ - Σ_r λ_r(c)) p_LM + λ p_kNN +
Σ_r λ_r(c) P∞_r`` (:func:`memlm.ngram.mixture.multi_ngram_mixture`, the mixture ``memlm eval`` uses).

:func:`token_sources` answers, for each generated token, which reference documents hold the longest suffix of the
text that ends with it (document index, the document's id from the build, token offset), through the engine's
document search.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import torch
from transformers import LogitsProcessor

from memlm.core.distribution import interpolate_per_token, knn_distribution, mix_logprobs_per_token
from memlm.errors import MemlmError
from memlm.ngram.mixture import multi_ngram_mixture, per_token_lambda

__all__ = [
    "MultiNgramLogitsProcessor",
    "NgramLogitsProcessor",
    "next_token_distribution",
    "ngram_logits_processor",
    "token_sources",
]


def next_token_distribution(memory, contexts: Sequence[Sequence[int]], vocab: int, k: int = 1000) -> tuple:
    """``(log P∞(. | c) [n, vocab], sparse [n], retrieved)`` of each context from the ``k`` most frequent next tokens
    of its longest matching suffix (:meth:`memlm.ngram.memory.NgramMemory.search`); sparse where one token follows
    every occurrence of that suffix."""
    r = memory.search(contexts, k)
    sparse = (torch.as_tensor(r.values) >= 0).sum(-1) == 1
    return knn_distribution(torch.as_tensor(r.scores), torch.as_tensor(r.values), vocab, 1.0), sparse, r


class _NgramStep(LogitsProcessor):
    """What the one- and several-reference steps share: ``mix`` the LM's log-probabilities with the ∞-gram(s)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None

    def mix(self, input_ids: torch.LongTensor, lm: torch.Tensor, knn: torch.Tensor | None = None, lam: float = 0.0):
        raise NotImplementedError

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        lm = torch.log_softmax(scores.float(), dim=-1)
        return self.mix(input_ids, lm).to(scores.dtype)


class NgramLogitsProcessor(_NgramStep):
    """Interpolate each generation step's distribution with P∞ (``k``: at most this many distinct next tokens)."""

    def __init__(self, memory, lambda_sparse: float, lambda_dense: float, k: int = 1000) -> None:
        self.memory, self.k = memory, k
        self.lambda_sparse, self.lambda_dense = float(lambda_sparse), float(lambda_dense)
        self.history: list[tuple[bool, int]] = []  # (sparse, effective n) of row 0 at every step

    @property
    def memories(self) -> list:
        return [self.memory]

    @property
    def max_weight(self) -> float:
        """The largest weight the ∞-gram can take at a step."""
        return max(self.lambda_sparse, self.lambda_dense)

    def search(self, input_ids: torch.LongTensor, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(log P∞ [rows, vocab], sparse [rows])`` of each row's next token: sparse where one token follows every
        occurrence of the row's longest matching suffix (recorded for row 0 in ``history`` with the effective n)."""
        p_inf, sparse, r = next_token_distribution(
            self.memory, [row.tolist() for row in input_ids.cpu()], vocab, self.k
        )
        self.history.append((bool(sparse[0]), int(r.ids[0, 0])))
        return p_inf, sparse

    def step(self, input_ids: torch.LongTensor, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(log P∞ [rows, vocab], λ_∞ [rows])``: λ_sparse where :meth:`search` finds the row sparse, else
        λ_dense."""
        p_inf, sparse = self.search(input_ids, vocab)
        return p_inf, per_token_lambda(sparse, self.lambda_sparse, self.lambda_dense)

    def mix(self, input_ids: torch.LongTensor, lm: torch.Tensor, knn: torch.Tensor | None = None, lam: float = 0.0):
        """``log p(. | c)`` ``[rows, vocab]`` from the LM's log-probabilities ``lm``: ``(1 - λ_∞) p_LM + λ_∞ P∞``,
        or with a kNN term ``knn`` of weight ``lam``, ``(1 - λ - λ_∞) p_LM + λ p_kNN + λ_∞ P∞``."""
        p_inf, lam_inf = self.step(input_ids, lm.shape[-1])
        lam_inf = lam_inf.unsqueeze(-1).to(lm.device)
        if knn is None:
            return interpolate_per_token(lm, p_inf.to(lm.device), lam_inf)
        return mix_logprobs_per_token([lm, knn, p_inf.to(lm.device)], [1.0 - lam - lam_inf, lam, lam_inf])


class MultiNgramLogitsProcessor(_NgramStep):
    """Several ∞-gram references at each generation step, each with its own (λ_sparse, λ_dense) (``memlm generate
    --ngram A --ngram B``): :func:`memlm.ngram.mixture.multi_ngram_mixture` over the vocabulary, as ``memlm eval``
    mixes them::

        p(w | c) = (1 - λ - Σ_r λ_r(c)) p_LM + λ p_kNN + Σ_r λ_r(c) P∞_r(w | c)

    ``parts``: one :class:`NgramLogitsProcessor` per reference (its memory and weights; its ``history``)."""

    def __init__(self, parts: Sequence[NgramLogitsProcessor]) -> None:
        if len(parts) < 2:
            raise MemlmError("MultiNgramLogitsProcessor takes two or more ∞-gram steps; use NgramLogitsProcessor")
        self.parts = list(parts)

    @property
    def memories(self) -> list:
        return [p.memory for p in self.parts]

    @property
    def max_weight(self) -> float:
        """The largest weight the ∞-grams can take together at a step."""
        return sum(p.max_weight for p in self.parts)

    def mix(self, input_ids: torch.LongTensor, lm: torch.Tensor, knn: torch.Tensor | None = None, lam: float = 0.0):
        """``log p(. | c)`` ``[rows, vocab]`` (the class docstring), computed in float64 on the CPU."""
        refs = []
        for part in self.parts:
            p_inf, sparse = part.search(input_ids, lm.shape[-1])
            refs.append((p_inf, sparse.unsqueeze(-1)))
        weights = [(p.lambda_sparse, p.lambda_dense) for p in self.parts]
        knn = None if knn is None else knn.cpu()
        return multi_ngram_mixture(lm.cpu(), refs, weights, knn, lam).to(lm.device)


def ngram_logits_processor(memories: Sequence, weights: Sequence[Sequence[float]]) -> _NgramStep:
    """The generation step for ∞-gram ``memories``, each with its ``(λ_sparse, λ_dense)`` (already shared beside any
    kNN weight: :func:`memlm.ngram.mixture.shared_weights`): one :class:`NgramLogitsProcessor`, or a
    :class:`MultiNgramLogitsProcessor` for several."""
    parts = [NgramLogitsProcessor(m, w[0], w[1]) for m, w in zip(memories, weights, strict=True)]
    if not parts:
        raise MemlmError("no ∞-gram memory to generate with")
    return parts[0] if len(parts) == 1 else MultiNgramLogitsProcessor(parts)


def token_sources(memory, tokens: Sequence[int], start: int, n_docs: int = 1) -> list[dict[str, Any]]:
    """For each token ``tokens[i]``, ``i >= start``: the longest suffix of ``tokens[:i + 1]`` (within its document)
    that occurs in the reference corpus, its count, and up to ``n_docs`` documents that hold it."""
    eos, sep = memory.eos, memory.sep
    out = []
    for i in range(start, len(tokens)):
        ctx = [int(t) for t in tokens[: i + 1]]
        if eos in ctx[:-1]:
            ctx = ctx[len(ctx) - 1 - ctx[:-1][::-1].index(eos) :]
        q = [sep, *(sep if t == eos else t for t in ctx)]
        length = 0
        for length in range(len(q), 0, -1):
            if memory._find(q[len(q) - length :])[0] > 0:
                break
        else:
            length = 0
        suffix = q[len(q) - length :]
        rec: dict[str, Any] = {"token": int(tokens[i]), "suffix_len": length, "count": 0, "documents": []}
        if length:
            r = memory.engine.search_docs(suffix, maxnum=n_docs, max_disp_len=length + 20)
            if "error" in r:
                raise MemlmError(f"∞-gram document search refused: {r['error']}")
            rec["count"] = int(r["cnt"])
            for d in r["documents"]:
                try:
                    doc_id = json.loads(d["metadata"]).get("id") if d["metadata"] else None
                except (ValueError, AttributeError):
                    doc_id = None
                rec["documents"].append({"doc_ix": int(d["doc_ix"]), "id": doc_id,
                                         "offset": int(d["needle_offset"])})  # fmt: skip
        out.append(rec)
    return out
