"""Perplexity by token-frequency bucket, the frequency counted in the memory's corpus (Nishida et al., NAACL Findings
2025: the kNN-LM's gains come from tokens frequent in the datastore, not from the long tail).

Each target token w_t falls into the bucket of c(w_t), the number of times w_t occurs in the memory's corpus (a
datastore: among its stored next-token values; an ∞-gram index: among its tokens). Buckets are log-spaced::

    0 (never in the memory), 1-10, 11-100, 101-1,000, 1,001-10,000, 10,001-100,000, > 100,000

For each bucket: its tokens, the base LM's and the memory mixture's perplexity on them, the relative change
``ppl_memory / ppl_base - 1`` with its paired bootstrap interval over documents (:mod:`memlm.core.bootstrap`, the
same resamples as the whole result's), and ``nats_gained``, Σ over its tokens of log p_memory - log p_base (the
buckets' nats add up to the whole gain, so they say where it comes from).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from memlm.core.bootstrap import DocumentBootstrap

__all__ = ["BUCKET_EDGES", "bucket_labels", "bucket_table", "frequency_buckets"]

#: Lower edges of the buckets: [0, 1), [1, 11), [11, 101), ... [100001, inf).
BUCKET_EDGES = (0, 1, 11, 101, 1_001, 10_001, 100_001)


def bucket_labels(edges: tuple[int, ...] = BUCKET_EDGES) -> list[str]:
    """``["0", "1-10", "11-100", ..., ">100,000"]`` for the lower edges."""
    labels = []
    for lo, hi in zip(edges, (*edges[1:], None), strict=True):
        if hi is None:
            labels.append(f">{lo - 1:,}")
        elif hi - lo == 1:
            labels.append(f"{lo:,}")
        else:
            labels.append(f"{lo:,}-{hi - 1:,}")
    return labels


def frequency_buckets(
    target_counts: np.ndarray,
    base: np.ndarray,
    memory: np.ndarray,
    boot: DocumentBootstrap,
    edges: tuple[int, ...] = BUCKET_EDGES,
) -> list[dict[str, Any]]:
    """One row per bucket (see the module docstring); ``target_counts`` [N] is c(w_t) of every scored token,
    ``base`` / ``memory`` [N] the log-probabilities of its target without and with the memory."""
    counts = np.asarray(target_counts, dtype=np.int64)
    base = np.asarray(base, dtype=np.float64)
    memory = np.asarray(memory, dtype=np.float64)
    bucket = np.searchsorted(np.asarray(edges), counts, side="right") - 1
    rows = []
    for b, label in enumerate(bucket_labels(edges)):
        mask = bucket == b
        row: dict[str, Any] = {"bucket": label, "count_min": edges[b],
                               "count_max": edges[b + 1] - 1 if b + 1 < len(edges) else None,
                               "tokens": int(mask.sum())}  # fmt: skip
        if mask.any():
            ev = boot.intervals({"base_ppl": base, "memory_ppl": memory}, [("base_ppl", "memory_ppl")], mask=mask)
            change = ev["differences"]["memory_ppl vs base_ppl"]
            row.update(
                base_ppl=ev["intervals"]["base_ppl"]["ppl"],
                memory_ppl=ev["intervals"]["memory_ppl"]["ppl"],
                relative_change=change["relative_change"],
                low=change["low"],
                high=change["high"],
                excludes_zero=change["excludes_zero"],
                nats_gained=float(np.sum(memory[mask] - base[mask])),
            )
        rows.append(row)
    return rows


def bucket_table(ts, memory, target_counts: np.ndarray, counted_in: str) -> dict[str, Any]:
    """A memory mixture's change against the base LM by frequency of the target in the memory's corpus
    (:func:`frequency_buckets`), with the resamples of the perplexities' intervals over documents: ``memory`` holds the
    mixture's per-token log-probabilities, ``ts`` is the dump (its ``lm_logprob`` and ``doc_index``)."""
    rows = frequency_buckets(target_counts, ts.lm_logprob, np.asarray(memory, dtype=np.float64),
                             DocumentBootstrap(ts.doc_index))  # fmt: skip
    return {"counted_in": counted_in, "rows": rows}
