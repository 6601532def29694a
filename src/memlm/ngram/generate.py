"""Generation with the ∞-gram: the LM and ∞-gram indexes at a generation step, and where each token came from.

Each index is a component of the one mixture at every step (:class:`memlm.ngram.step.NgramComponent`: P∞ of each
row's longest matching suffix, Liu et al. 2024, and its features); :class:`memlm.knnlm.generate.MixtureLogitsProcessor`
mixes it with the LM and any other memory through one :class:`memlm.core.mixture.Mixture`. Under the fixed-weight
rule, as ``memlm eval`` mixes (:func:`memlm.core.mixture.rule_mixture`, weights calibrated apart that sum past 1
scaled as it says)::

    p(w | c) = (1 - Σ_j λ_j - Σ_r λ_r(c)) p_LM + Σ_j λ_j p_kNN,j + Σ_r λ_r(c) P∞_r(w | c),
    λ_r(c) = λ_sparse,r when one token follows every occurrence of reference r's matched suffix, else λ_dense,r

:func:`token_sources` answers, for each generated token, which reference documents hold the longest suffix of the
text that ends with it (document index, the document's id from the build, token offset), through the engine's
document search.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from memlm.errors import MemlmError
from memlm.ngram.step import next_token_distribution

__all__ = [
    "approximation_note",
    "next_token_distribution",
    "token_sources",
]


def approximation_note(step) -> str | None:
    """One line for a command's output when ``step`` (an ∞-gram generation step) mixed in a P∞ that was not exact
    over the whole vocabulary at some step (:meth:`memlm.ngram.step.NgramComponent.approximate`), else None."""
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
