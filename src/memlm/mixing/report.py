"""One report for rows of mixtures over a per-token table: each row's perplexity, its bootstrap interval over
documents, the paired differences between rows, and the change by frequency of the target.

A row is a :class:`memlm.core.mixture.Mixture` over the table's components (the fixed-weight rule, constant weights
or a gate), mixed on every token as every consumer mixes::

    P(w_t | c_t) = sum_i λ_i(c_t) P_i(w_t | c_t),      ppl = exp(-mean_t log P(w_t | c_t))

or a row given per token (``[N]`` log-probabilities: a memory alone, the oracle, a per-token λ). The evidence is
:mod:`memlm.core.bootstrap`'s (percentile intervals over resampled documents, Efron & Tibshirani 1993; paired
differences ``ppl_B / ppl_A - 1`` on the same resamples) and :mod:`memlm.core.frequency`'s buckets. ``memlm eval``
and ``memlm tune`` report through it (:func:`memlm.knnlm.evaluate.perplexities`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from memlm.core.bootstrap import DIFFERENCES, evidence
from memlm.core.distribution import perplexity
from memlm.core.frequency import bucket_table
from memlm.core.mixture import FitOptions, Mixture, MixtureFit, fit, token_blocks
from memlm.mixing.dump import rule_logprob
from memlm.mixing.inputs import mixture_inputs

__all__ = ["fit_table", "mixture_logprob", "report"]

Row = Mixture | torch.Tensor | np.ndarray


def mixture_logprob(table: Any, mixture: Mixture, temperature: Any = 1.0, k: Any = None,
                    cache_temperature: float = 1.0) -> torch.Tensor:  # fmt: skip
    """``log P(target)`` float64 ``[N]`` of ``mixture`` on ``table``: the fixed-weight rule by its components' sparse
    flags (:func:`memlm.mixing.dump.rule_logprob`), any other form by the features it was fitted on
    (:func:`memlm.mixing.inputs.mixture_inputs`); each memory read at its settings (a datastore's τ and k: one for
    all, one per datastore, or a dict by component name; the cache's τ)."""
    if mixture.form == "rule" or not mixture.feature_names:
        return rule_logprob(table, mixture, temperature, k, cache_temperature)
    inp = mixture_inputs(table, temperature, k, cache_temperature)
    logprobs = {c: inp.logprobs[:, inp.components.index(c)] for c in mixture.components}
    features = {f: inp.features[:, j] for j, f in enumerate(inp.feature_names)}
    return mixture.mix(logprobs, features)


def report(
    table: Any,
    rows: Mapping[str, Row],
    pairs: Sequence[tuple[str, str]] = DIFFERENCES,
    target_counts: np.ndarray | None = None,
    counted_in: str = "the datastore's values",
    buckets: Sequence[str] = ("knn_ppl",),
    mask: np.ndarray | None = None,
    **settings: Any,
) -> dict[str, Any]:
    """``tokens``, each row's perplexity by name (``base_ppl``, ``knn_ppl``, ...), ``mixtures`` (each Mixture row's
    ``to_dict()``), ``bootstrap`` / ``intervals`` / ``differences`` (:func:`memlm.core.bootstrap.evidence`, over
    ``pairs`` present among the rows) and, with ``target_counts`` (c(w_t) of every target in the memory's corpus,
    ``counted_in`` naming it), ``frequency_buckets`` of the rows in ``buckets``. ``mask`` keeps some tokens only.
    ``settings``: ``temperature``, ``k``, ``cache_temperature`` of the memories' reads (:func:`mixture_logprob`)."""
    logprobs = {name: _logprob(table, row, settings) for name, row in rows.items()}
    keep = slice(None) if mask is None else torch.as_tensor(np.asarray(mask, dtype=bool))
    out: dict[str, Any] = {"tokens": int(len(table) if mask is None else np.asarray(mask, dtype=bool).sum())}
    out.update({name: perplexity(lp[keep]) for name, lp in logprobs.items()})
    mixtures = {name: row.to_dict() for name, row in rows.items() if isinstance(row, Mixture)}
    if mixtures:
        out["mixtures"] = mixtures
    out.update(evidence(logprobs, table.doc_index, pairs=pairs, mask=mask))
    if target_counts is not None:
        found = {name: bucket_table(table, logprobs[name], target_counts, counted_in) for name in buckets
                 if name in logprobs}  # fmt: skip
        if found:
            out["frequency_buckets"] = found
    return out


def _logprob(table: Any, row: Row, settings: Mapping[str, Any]) -> torch.Tensor:
    if isinstance(row, Mixture):
        return mixture_logprob(table, row, **settings)
    return torch.as_tensor(row)


def fit_table(table: Any, form: str = "guarded", options: FitOptions | None = None, **settings: Any) -> MixtureFit:
    """The one fitter (:func:`memlm.core.mixture.fit`) on a per-token table: every component's log p and features
    (:func:`memlm.mixing.inputs.mixture_inputs`, each memory at its ``settings``: a datastore's ``temperature`` and
    ``k``), each token's document (a held-out slice of one file cut into blocks, :func:`token_blocks`), and ``form``
    (constant, rule, gate or guarded)."""
    inp = mixture_inputs(table, **settings)
    return fit(inp.logprobs, inp.features, token_blocks(inp.doc_index), inp.components, inp.feature_names, form,
               options or FitOptions())  # fmt: skip
