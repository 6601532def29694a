"""Generation with the ∞-gram: a LogitsProcessor for Liu et al.'s (2024) interpolation, and where each token came from.

At every step each row's context (its tokens so far after its leading EOS padding; an EOS inside it is a token of
the document, :func:`memlm.ngram.memory.context_document`) gives P∞ over the next token
(:meth:`memlm.ngram.memory.NgramMemory.next_tokens`: the longest suffix seen in the corpus and the exact counts of
what followed it), and the LM's distribution becomes::

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

import numpy as np
import torch
from transformers import LogitsProcessor

from memlm.core.distribution import interpolate_per_token, mix_logprobs_per_token, value_logsumexp
from memlm.errors import MemlmError
from memlm.ngram.mixture import multi_ngram_mixture, per_token_lambda

__all__ = [
    "MultiNgramLogitsProcessor",
    "NgramLogitsProcessor",
    "approximation_note",
    "next_token_distribution",
    "ngram_logits_processor",
    "token_sources",
]


def next_token_distribution(memory, contexts: Sequence[Sequence[int]], vocab: int, k: int = 1000) -> tuple:
    """``(log P∞(. | c) [n, vocab], sparse [n], next_tokens)`` of each context: ``P∞(w | c) = cnt(suffix · w) /
    cnt(suffix)`` for the ``k`` most frequent next tokens ``w`` of its longest matching suffix, with exact counts
    (:meth:`memlm.ngram.memory.NgramMemory.next_tokens`, which recounts what the engine samples past ``max_support``
    occurrences), ``-inf`` elsewhere; sparse (exact) where one token follows every occurrence of that suffix.

    Each listed token's P∞ is exact. A row whose suffix has more distinct next tokens than it holds (past ``k``, or
    past the recount's budget) leaves their mass unassigned (the row sums to less than one, by ``next_tokens.missing``)
    rather than spreading it over the listed tokens: ``next_tokens.approximate()`` says so."""
    nt = memory.next_tokens(contexts, k)
    r = nt.retrieved
    log_total = torch.as_tensor(np.log(np.maximum(nt.count, 1)), dtype=torch.float32)[:, None]
    logw = torch.as_tensor(r.scores) - log_total  # log P∞ of each listed token (-inf in empty slots)
    return value_logsumexp(logw, torch.as_tensor(r.values), vocab), torch.as_tensor(nt.sparse), nt


class _NgramStep(LogitsProcessor):
    """What the one- and several-reference steps share: ``mix`` the LM's log-probabilities with the ∞-gram(s).

    ``prefix``: tokens of the document before every row's first token (default none), so the ∞-gram's context can
    reach further back than the LM's window (lm_eval's ``generate_until`` cuts the context to the LM's
    ``max_length``); meant for one unpadded row."""

    prefix: tuple[int, ...] = ()

    def set_prefix(self, tokens: Sequence[int]) -> None:
        self.prefix = tuple(int(t) for t in tokens)

    def approximate(self) -> dict | None:
        """None when every step's P∞ was exact over the vocabulary, else how many were not, and why."""
        raise NotImplementedError

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
        self.steps = self.approximate_steps = 0  # rows searched, and rows whose P∞ left some mass unassigned
        self.max_missing = 0.0

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
        contexts = [[*self.prefix, *row.tolist()] for row in input_ids.cpu()]
        p_inf, sparse, nt = next_token_distribution(self.memory, contexts, vocab, self.k)
        self.history.append((bool(sparse[0]), int(nt.retrieved.ids[0, 0])))
        self.steps += len(nt.missing)
        self.approximate_steps += int((nt.missing > 0).sum())
        self.max_missing = max(self.max_missing, float(nt.missing.max(initial=0.0)))
        return p_inf, sparse

    def approximate(self) -> dict | None:
        """None when every step's P∞ was exact over the vocabulary, else how many were not, and why
        (:func:`next_token_distribution`)."""
        if not self.approximate_steps:
            return None
        return {
            "steps": self.approximate_steps,
            "of": self.steps,
            "max_missing_mass": self.max_missing,
            "reason": f"P∞ over the vocabulary keeps the k={self.k} most frequent next tokens of a suffix, counted "
            "exactly (also past the engine's max_support sampling, up to max_support more distinct tokens); the "
            "mass of the others is unassigned",
        }

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

    def set_prefix(self, tokens: Sequence[int]) -> None:
        for part in self.parts:
            part.set_prefix(tokens)

    def approximate(self) -> dict | None:
        """Each reference's :meth:`NgramLogitsProcessor.approximate` that is not None, by position (1-based)."""
        notes = {f"reference {i + 1}": a for i, part in enumerate(self.parts) if (a := part.approximate()) is not None}
        return notes or None

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


def approximation_note(step) -> str | None:
    """One line for a command's output when ``step`` (an ∞-gram generation step) mixed in a P∞ that was not exact
    over the whole vocabulary at some step (:meth:`NgramLogitsProcessor.approximate`), else None."""
    a = None if step is None else step.approximate()
    if a is None:
        return None
    parts = a.values() if "steps" not in a else [a]
    steps, of = sum(x["steps"] for x in parts), sum(x["of"] for x in parts)
    worst = max(x["max_missing_mass"] for x in parts)
    return (
        f"note: at {steps} of {of} ∞-gram steps P∞ over the vocabulary left up to {worst:.1%} of its mass "
        "unassigned (next tokens past the k kept, or past the exact recount of a suffix seen > max_support times); "
        "each listed token's P∞ and every sparse flag were exact"
    )


def token_sources(memory, tokens: Sequence[int], start: int, n_docs: int = 1) -> list[dict[str, Any]]:
    """For each token ``tokens[i]``, ``i >= start``: the longest suffix of ``tokens[:i + 1]`` (within its document)
    that occurs in the reference corpus, its count, and up to ``n_docs`` documents that hold it."""
    from memlm.ngram.memory import context_document, document_query

    out = []
    for i in range(start, len(tokens)):
        q = document_query(context_document(tokens[: i + 1], memory.eos), memory.sep)
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
