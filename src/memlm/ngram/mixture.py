"""The ∞-gram beside the LM (and the kNN-LM): its weights in the fixed-weight rule, and its statistics on a table.

Liu et al. (2024, Sec. 5) interpolate the ∞-gram with a neural LM with one weight for sparse estimates (P∞ puts all
its mass on one token) and one for the rest::

    P(w | c) = λ_∞(c) P∞(w | c) + (1 - λ_∞(c)) P_LM(w | c),     λ_∞(c) = λ_sparse if P∞(· | c) is sparse else λ_dense

With a kNN-LM datastore too, memlm mixes the three with one weight per memory (Khandelwal et al.'s Eq. 3 extended the
way the continuous cache is, Table 1)::

    P(w | c) = (1 - λ - λ_∞(c)) P_LM(w | c) + λ P_kNN(w | c) + λ_∞(c) P∞(w | c)

The rule is a :class:`~memlm.core.mixture.Mixture` (:func:`memlm.core.mixture.rule_mixture`: a gate on the sparse
flag, which also scales weights calibrated apart that sum past 1), fitted like every other form by
:func:`memlm.mixing.report.fit_table` (``form="rule"``: EM per sparse state, no grid). An index's default
``(λ_sparse, λ_dense)`` is the summary of the mixture stored with its calibration
(:func:`memlm.knnlm.calibration.ngram_parameters`).
"""

from __future__ import annotations

import math
import statistics
from typing import Any

import numpy as np

from memlm.errors import MemlmError

__all__ = [
    "per_index_lambdas",
    "DEFAULT_LAMBDA_SPARSE",
    "DEFAULT_LAMBDA_DENSE",
    "ngram_statistics",
    "reference_view",
]

DEFAULT_LAMBDA_SPARSE, DEFAULT_LAMBDA_DENSE = 0.1, 0.03  # the fallback when an index records no calibration


def per_index_lambdas(
    lambda_sparse, lambda_dense, n: int, names: tuple[str, str] = ("λ_sparse", "λ_dense")
) -> list[tuple[float | None, float | None]]:
    """Each of ``n`` indexes' ``(λ_sparse, λ_dense)`` as given: ``None`` (not given: the index's calibration, see
    :func:`memlm.knnlm.calibration.ngram_parameters`), one value for every index, or a sequence of one value per
    index, in order."""
    pairs = []
    for name, values in zip(names, (lambda_sparse, lambda_dense), strict=True):
        values = [values] if values is None or isinstance(values, int | float | str) else list(values)
        if len(values) not in (1, n):
            raise MemlmError(f"{name} got {len(values)} values for {n} ∞-gram indexes: give one, or one per index")
        pairs.append([None if v is None else float(v) for v in values] * (n if len(values) == 1 else 1))
    return list(zip(*pairs, strict=True))


def ngram_statistics(ts, mask: np.ndarray | None = None, name: str = "ngram") -> dict[str, Any]:
    """The ∞-gram ``name``'s own statistics on a per-token table beside the paper's: how often P∞ gives the target
    a probability (``ngram_target_nonzero``), above one half (``ngram_target_above_half``, the paper's 47%, Sec. 4.1),
    the share of sparse estimates and how often they are right, the effective n, how often P∞ beats the LM; ``mask``
    keeps only some tokens (e.g. without WikiText's formatting tokens)."""
    if name not in ts.columns:
        raise MemlmError("this table has no ∞-gram scores; rerun memlm eval with --memory ngram:DIR --dump")
    keep = np.ones(len(ts), dtype=bool) if mask is None else np.asarray(mask, dtype=bool)
    cols = ts.columns[name]
    ng = np.asarray(cols["logprob"], dtype=np.float64)[keep]
    lm = np.asarray(ts.lm_logprob, dtype=np.float64)[keep]
    sparse = np.asarray(cols["sparse"], dtype=bool)[keep]
    n = np.asarray(cols["n"])[keep]
    hits = np.isfinite(ng)
    return {
        "ngram_target_nonzero": float(hits.mean()),
        "ngram_target_above_half": float((ng > math.log(0.5)).mean()),
        "sparse_share": float(sparse.mean()),
        "sparse_correct": float(hits[sparse].mean()) if sparse.any() else None,
        "effective_n": {
            "median": float(statistics.median(n.tolist())) if len(n) else None,
            "mean": float(n.mean()) if len(n) else None,
            "histogram": {
                str(v): int(c) for v, c in zip(*np.unique(np.minimum(n, 16), return_counts=True), strict=True)
            },
            "histogram_note": "16 = 16 or more",
        },
        "ngram_beats_lm": float((ng > lm).mean()),
    }


def reference_view(ts, r: int):
    """The table with one ∞-gram reference, the ``r``-th (0 = the first), named ``ngram`` beside the other kinds'
    memories, for the one-reference functions (:func:`ngram_statistics`)."""
    name = ts.names("ngram")[r]
    return ts.select([n for n in ts.names() if ts.components[n].kind != "ngram" or n == name], rename={name: "ngram"})
