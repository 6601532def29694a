"""Generation with the ∞-gram: a LogitsProcessor for Liu et al.'s (2024) interpolation, and where each token came from.

At every step each row's context (its tokens so far, from its last EOS) gives P∞ over the next token
(:meth:`memlm.ngram.memory.NgramMemory.search`: the longest suffix seen in the corpus and the counts of what followed
it), and the LM's distribution becomes::

    p(w | c) = λ_∞(c) P∞(w | c) + (1 - λ_∞(c)) p_LM(w | c),   λ_∞ = λ_sparse when one token follows every occurrence

With a datastore too (:class:`memlm.knnlm.generate.KNNLogitsProcessor` given ``ngram=``), the three-way mixture of
``memlm eval``: ``(1 - λ - λ_∞(c)) p_LM + λ p_kNN + λ_∞(c) P∞``.

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

from memlm.core.distribution import interpolate_per_token, knn_distribution
from memlm.errors import MemlmError
from memlm.ngram.mixture import per_token_lambda

__all__ = ["NgramLogitsProcessor", "token_sources"]


class NgramLogitsProcessor(LogitsProcessor):
    """Interpolate each generation step's distribution with P∞ (``k``: at most this many distinct next tokens)."""

    def __init__(self, memory, lambda_sparse: float, lambda_dense: float, k: int = 1000) -> None:
        self.memory, self.k = memory, k
        self.lambda_sparse, self.lambda_dense = float(lambda_sparse), float(lambda_dense)
        self.history: list[tuple[bool, int]] = []  # (sparse, effective n) of row 0 at every step

    def __enter__(self) -> NgramLogitsProcessor:
        return self

    def __exit__(self, *exc) -> None:
        return None

    def step(self, input_ids: torch.LongTensor, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(log P∞ [rows, vocab], λ_∞ [rows])`` of each row's next token: λ_sparse where one token follows every
        occurrence of the row's longest matching suffix, λ_dense elsewhere (recorded for row 0 in ``history``)."""
        r = self.memory.search([row.tolist() for row in input_ids.cpu()], self.k)
        filled = (torch.as_tensor(r.values) >= 0).sum(-1)
        sparse = filled == 1
        p_inf = knn_distribution(torch.as_tensor(r.scores), torch.as_tensor(r.values), vocab, 1.0)
        lam = per_token_lambda(sparse, self.lambda_sparse, self.lambda_dense)
        self.history.append((bool(sparse[0]), int(r.ids[0, 0])))
        return p_inf, lam

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        lm = torch.log_softmax(scores.float(), dim=-1)
        p_inf, lam = self.step(input_ids, lm.shape[-1])
        return interpolate_per_token(lm, p_inf.to(lm.device), lam.unsqueeze(-1).to(lm.device)).to(scores.dtype)


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
