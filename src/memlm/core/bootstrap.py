"""Bootstrap intervals over documents for perplexities and their differences (Efron & Tibshirani 1993).

Tokens of one document are not independent (a copied name helps every later mention of it), so the unit resampled
is the **document**: the evaluation's D documents are drawn D times with replacement, B times, and each statistic is
recomputed on every resample b from the per-document sums (NLL_d = -Σ_{t in d} log p(w_t), T_d = tokens of d)::

    ppl*_b = exp(Σ_d c_bd NLL_d / Σ_d c_bd T_d)          c_bd = times document d is drawn in resample b

The 95% **percentile interval** is the 2.5th and 97.5th percentile of the B values (Efron & Tibshirani, ch. 13.3;
NumPy's default linear interpolation between order statistics). A difference between two systems A and B scored on
the same tokens is **paired**: both are recomputed on the same resampled documents, and the statistic is the relative
change of perplexity ``ppl_B / ppl_A - 1`` (negative: B is better); its interval excludes 0 only when the change is
larger than the document-to-document variation of the difference.

Resample b draws its documents as ``numpy.random.default_rng(seed).integers(0, D, size=D)``, the b-th such call on
one generator: fixed by ``seed`` (default 0), the same for every system and every difference of one evaluation.
Fewer than 2 documents give no interval, with a note saying so; fewer than 10, an interval with a caution (with n
documents there are at most C(2n-1, n) distinct resamples, 35 for n = 4, and the percentile interval is known to be
too narrow for small n).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

__all__ = ["DEFAULT_RESAMPLES", "DEFAULT_SEED", "LEVEL", "DocumentBootstrap", "evidence", "DIFFERENCES"]

DEFAULT_RESAMPLES = 1000
DEFAULT_SEED = 0
LEVEL = 0.95
FEW_DOCUMENTS = 10  # below this, the interval is given with a caution
_CHUNK_CELLS = 4_000_000  # resamples x documents per block of the counts matrix (32 MB of float64)

#: The differences every perplexity result reports when both rows are present: (reference A, system B), the change
#: being ppl_B / ppl_A - 1. Memory vs base, each mixture vs the memory it adds to.
DIFFERENCES: tuple[tuple[str, str], ...] = (
    ("base_ppl", "knn_ppl"),
    ("base_ppl", "lm_cache_ppl"),
    ("base_ppl", "knn_cache_ppl"),
    ("knn_ppl", "knn_cache_ppl"),
    ("base_ppl", "ngram_ppl"),
    ("base_ppl", "knn_ngram_ppl"),
    ("knn_ppl", "knn_ngram_ppl"),
    ("ngram_ppl", "knn_ngram_ppl"),
    ("base_ppl", "multi_ngram_ppl"),
    ("base_ppl", "knn_multi_ngram_ppl"),
    ("knn_ppl", "knn_multi_ngram_ppl"),
)


def difference_key(a: str, b: str) -> str:
    """The JSON key of the difference of system ``b`` against reference ``a``: ``"knn_ppl vs base_ppl"``."""
    return f"{b} vs {a}"


class DocumentBootstrap:
    """Resampled documents of one evaluation, shared by every statistic computed from it (so differences are paired).

    ``doc_index`` gives each token's document (any integer ids: a dump's ``doc_index``); documents are numbered in
    the order of their ids. Nothing is stored per resample: the counts ``c_bd`` are drawn again, identically, in
    blocks of rows each time sums are asked for, so memory stays bounded for any number of documents.
    """

    def __init__(
        self, doc_index: np.ndarray, resamples: int = DEFAULT_RESAMPLES, seed: int = DEFAULT_SEED, level: float = LEVEL
    ) -> None:
        if resamples < 1:
            raise ValueError(f"resamples must be >= 1, got {resamples}")
        if not 0.0 < level < 1.0:
            raise ValueError(f"level must be in (0, 1), got {level}")
        _, self.document_of_token = np.unique(np.asarray(doc_index), return_inverse=True)
        self.documents = int(self.document_of_token.max()) + 1 if len(self.document_of_token) else 0
        self.resamples, self.seed, self.level = int(resamples), int(seed), float(level)

    @property
    def note(self) -> str | None:
        """Why there is no interval (fewer than 2 documents), else None."""
        if self.documents >= 2:
            return None
        return (f"{self.documents} document(s): a bootstrap over documents needs at least 2, so no interval is "
                "given; evaluate more documents (--max-tokens)")  # fmt: skip

    @property
    def caution(self) -> str | None:
        """A warning for 2 to :data:`FEW_DOCUMENTS` - 1 documents, else None."""
        if not 2 <= self.documents < FEW_DOCUMENTS:
            return None
        return (f"only {self.documents} documents: the percentile bootstrap has few distinct resamples and its "
                "intervals tend to be too narrow; read them as a lower bound on the uncertainty and evaluate more "
                "documents")  # fmt: skip

    def describe(self) -> dict[str, Any]:
        """What a result records about the resampling."""
        return {"documents": self.documents, "resamples": self.resamples, "seed": self.seed, "level": self.level,
                "method": "percentile bootstrap over documents (memlm.core.bootstrap)"}  # fmt: skip

    def per_document(self, values: np.ndarray, mask: np.ndarray | None = None) -> np.ndarray:
        """Σ over each document's tokens (those in ``mask``) of ``values`` [N] (or [N, S]): [D] (or [D, S])."""
        values = np.asarray(values, dtype=np.float64)
        keep = np.ones(len(values), dtype=bool) if mask is None else np.asarray(mask, dtype=bool)
        cols = values.reshape(len(values), -1)
        out = np.zeros((self.documents, cols.shape[1]))
        for s in range(cols.shape[1]):
            out[:, s] = np.bincount(self.document_of_token[keep], weights=cols[keep, s], minlength=self.documents)
        return out.reshape((self.documents, *values.shape[1:]))

    def _count_blocks(self) -> Iterator[np.ndarray]:
        """The counts c_bd, [rows, D] float64 blocks in resample order (resample b: the b-th draw of D ids)."""
        rng = np.random.default_rng(self.seed)
        rows = max(1, _CHUNK_CELLS // max(self.documents, 1))
        for start in range(0, self.resamples, rows):
            block = np.empty((min(rows, self.resamples - start), self.documents))
            for r in range(len(block)):
                block[r] = np.bincount(rng.integers(0, self.documents, size=self.documents), minlength=self.documents)
            yield block

    def resampled(self, per_document: np.ndarray) -> np.ndarray:
        """Σ_d c_bd x_d for every resample b: [B] for x [D], [B, S] for x [D, S]."""
        per_document = np.asarray(per_document, dtype=np.float64)
        return np.concatenate([block @ per_document for block in self._count_blocks()])

    def percentiles(self, values: np.ndarray) -> tuple[float, float]:
        """The percentile interval of the resampled ``values`` (NaN resamples, e.g. with no token, left out)."""
        tail = 100.0 * (1.0 - self.level) / 2.0
        lo, hi = np.nanpercentile(values, [tail, 100.0 - tail])
        return float(lo), float(hi)

    def intervals(
        self, logprobs: Mapping[str, np.ndarray], pairs: Sequence[tuple[str, str]] = (), mask: np.ndarray | None = None
    ) -> dict[str, Any]:
        """Each system's perplexity with its interval, and each pair's relative change with its paired interval.

        ``logprobs``: name -> log p(target) per token [N] (the same tokens for all); ``pairs``: (A, B) names, the
        change ``ppl_B / ppl_A - 1``; ``mask`` keeps only some tokens (a frequency bucket), documents still resampled
        as wholes. A system with a token of probability 0 (infinite perplexity) gets no interval, with a note.
        """
        names = list(logprobs)
        nll = -np.stack([np.asarray(logprobs[n], dtype=np.float64) for n in names], axis=1)
        keep = np.ones(len(nll), dtype=bool) if mask is None else np.asarray(mask, dtype=bool)
        tokens = int(keep.sum())
        finite = {n: bool(np.isfinite(nll[keep, i]).all()) for i, n in enumerate(names)}
        boot_nll = boot_tokens = None
        if self.note is None and tokens:
            doc_nll = self.per_document(np.where(np.isfinite(nll), nll, 0.0), keep)
            boot_nll = self.resampled(doc_nll)
            boot_tokens = self.resampled(self.per_document(np.ones(len(nll)), keep))
            boot_tokens = np.where(boot_tokens > 0, boot_tokens, np.nan)  # a resample without a kept token: left out
        rows: dict[str, Any] = {}
        for i, n in enumerate(names):
            ppl = _ppl(nll[keep, i].sum(), tokens) if finite[n] else math.inf
            row: dict[str, Any] = {"ppl": ppl, "low": None, "high": None}
            if not finite[n]:
                row["note"] = "infinite perplexity (a target of probability 0): no interval"
            elif boot_nll is not None:
                row["low"], row["high"] = self.percentiles(_ppl_array(boot_nll[:, i], boot_tokens))
            rows[n] = row
        diffs: dict[str, Any] = {}
        for a, b in pairs:
            if a not in rows or b not in rows:
                continue
            ia, ib = names.index(a), names.index(b)
            row = {"reference": a, "system": b, "relative_change": None, "low": None, "high": None,
                   "excludes_zero": False}  # fmt: skip
            if not (finite[a] and finite[b]):
                row["note"] = "a perplexity is infinite: no relative change"
            else:
                row["relative_change"] = _change(nll[keep, ib].sum() - nll[keep, ia].sum(), tokens)
                if boot_nll is not None:
                    lo, hi = self.percentiles(_change(boot_nll[:, ib] - boot_nll[:, ia], boot_tokens))
                    row.update(low=lo, high=hi, excludes_zero=bool(lo > 0.0 or hi < 0.0))
            diffs[difference_key(a, b)] = row
        return {"intervals": rows, "differences": diffs}


def _ppl(nll_sum: float, tokens: float) -> float:
    if not tokens:
        return math.nan
    try:
        return math.exp(nll_sum / tokens)
    except OverflowError:
        return math.inf


def _ppl_array(nll_sum: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore", invalid="ignore"):
        return np.exp(nll_sum / tokens)


def _change(nll_diff, tokens):
    """ppl_B / ppl_A - 1 = exp((NLL_B - NLL_A) / T) - 1 (exact through expm1, scalar or array)."""
    with np.errstate(over="ignore", invalid="ignore"):
        out = np.expm1(np.asarray(nll_diff, dtype=np.float64) / tokens)
    return float(out) if np.ndim(out) == 0 else out


def evidence(
    logprobs: Mapping[str, Any],
    doc_index: np.ndarray,
    pairs: Sequence[tuple[str, str]] = DIFFERENCES,
    resamples: int = DEFAULT_RESAMPLES,
    seed: int = DEFAULT_SEED,
    mask: np.ndarray | None = None,
) -> dict[str, Any]:
    """``{"bootstrap", "intervals", "differences"}`` for the systems of one evaluation (see the module docstring):
    ``logprobs`` maps a result's perplexity key (``base_ppl``, ``knn_ppl``...) to its per-token log-probabilities
    (NumPy or torch), ``doc_index`` gives each token's document; ``mask`` keeps only some tokens."""
    boot = DocumentBootstrap(doc_index, resamples, seed)
    arrays = {k: np.asarray(v.numpy() if hasattr(v, "numpy") else v, dtype=np.float64) for k, v in logprobs.items()}
    out = {"bootstrap": boot.describe(), **boot.intervals(arrays, pairs, mask)}
    if boot.note or boot.caution:
        out["bootstrap"]["note"] = boot.note or boot.caution
    return out
