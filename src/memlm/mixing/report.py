"""One report for rows of mixtures over a per-token table: each row's perplexity, its bootstrap interval over
documents, the paired differences between rows, and the change by frequency of the target.

A row is a :class:`memlm.core.mixture.Mixture` over the table's components (the fixed-weight rule, constant weights
or a gate), mixed on every token as every consumer mixes::

    P(w_t | c_t) = sum_i λ_i(c_t) P_i(w_t | c_t),      ppl = exp(-mean_t log P(w_t | c_t))

or a row given per token (``[N]`` log-probabilities: a memory alone, the oracle, a per-token λ). The evidence is
:mod:`memlm.core.bootstrap`'s (percentile intervals over resampled documents, Efron & Tibshirani 1993; paired
differences ``ppl_B / ppl_A - 1`` on the same resamples) and :mod:`memlm.core.frequency`'s buckets. ``memlm eval``
(:func:`memlm.knnlm.evaluate.perplexities`, :func:`memlm.ngram.results.ngram_result`) and ``memlm tune``
(:func:`fit_table`, :func:`fit_report`) report through it.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from memlm.core.bootstrap import DIFFERENCES, evidence
from memlm.core.distribution import perplexity
from memlm.core.frequency import bucket_table
from memlm.core.mixture import FIT_FORMS, FitOptions, Mixture, MixtureFit, fit, token_blocks
from memlm.errors import MemlmError
from memlm.mixing.dump import DumpMixture, rule_logprob, rule_summary, table_inputs
from memlm.mixing.inputs import mixture_inputs, ngram_sparse

__all__ = ["fit_report", "fit_summary", "fit_table", "mixture_beside", "mixture_logprob", "report"]

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


def fit_table(
    table: Any,
    form: str = "guarded",
    temperatures: Sequence[float] = (1.0,),
    k: int | None = None,
    cache_temperatures: Sequence[float] = (1.0,),
    options: FitOptions | None = None,
) -> DumpMixture:
    """The one fitter (:func:`memlm.core.mixture.fit`) on a per-token table: a mixture of ``form`` (rule, constant,
    gate or guarded; :data:`memlm.core.mixture.FIT_FORMS`) over the LM and every memory, each memory's own read
    settings searched on a small grid (a datastore's τ over ``temperatures``, its ``k`` best neighbours; the cache's
    τc over ``cache_temperatures``): at each, every component's log p and features
    (:func:`memlm.mixing.dump.table_inputs`) and each token's document (a held-out slice of one file cut into
    blocks, :func:`token_blocks`) are fitted by maximum likelihood, no grid over the weights. The setting kept is
    the one whose fit has the highest mean log-likelihood per token on the tokens that judge it (guarded: the part
    kept apart; any other form: every token). The fit's size warnings are in ``fit.warnings`` (logged once, not
    once per setting). Returns a :class:`~memlm.mixing.dump.DumpMixture` with its summary as the fixed-weight rule
    (:func:`memlm.mixing.dump.rule_summary`)."""
    if form not in FIT_FORMS:
        raise MemlmError(f"unknown mixture form {form!r}: use one of {', '.join(FIT_FORMS)}")
    has_knn, has_cache = bool(table.names("knn")), bool(table.names("cache"))
    taus: Sequence[float | None] = list(temperatures) if has_knn else [None]
    cache_taus: Sequence[float | None] = list(cache_temperatures) if has_cache else [None]
    k_used = (k or table.columns[table.names("knn")[0]]["scores"].shape[1]) if has_knn else None
    best: tuple[float, MixtureFit, Any, float | None, float | None] | None = None
    search = []
    quiet = logging.getLogger("memlm.core.mixture")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # the size warning is the caller's to show, once, not once per setting
    try:
        for tau, cache_tau in itertools.product(taus, cache_taus):
            inp = table_inputs(table, form, tau or 1.0, k_used, cache_tau or 1.0)
            empty = [c for i, c in enumerate(inp.components) if i and not np.isfinite(inp.logprobs[:, i]).any()]
            if empty:  # e.g. a τ so small that the target's share underflows on every token: no fit at this τ
                search.append({"temperature": tau, "cache_temperature": cache_tau, "skipped": f"{empty[0]} gives "
                               "every token probability 0"})  # fmt: skip
                continue
            found = fit(inp.logprobs, inp.features, token_blocks(inp.doc_index), inp.components, inp.feature_names,
                        form, options or FitOptions())  # fmt: skip
            score = found.heldout_loglik[found.form if form == "guarded" else form]
            search.append({"temperature": tau, "cache_temperature": cache_tau, "form": found.form,
                           "heldout_loglik": found.heldout_loglik})  # fmt: skip
            if best is None or score > best[0]:
                best = (score, found, inp, tau, cache_tau)
    finally:
        quiet.setLevel(level)
    if best is None:
        raise MemlmError(f"no setting to fit at: {search[0]['skipped']} at every τ tried; leave that memory out, "
                         "check its scores or try other --temperatures")  # fmt: skip
    _, found, inp, tau, cache_tau = best
    return DumpMixture(found, tau, k_used, cache_tau, search, rule_summary(found.mixture, inp, ngram_sparse(table)))


def fit_summary(dm: DumpMixture) -> dict[str, Any]:
    """A fit's settings and weights as flat numbers (what ``memlm tune`` prints and records under ``best``): its form,
    the τ, k and τc it was fitted at, its summary as the fixed-weight rule (a memory's weight; an ∞-gram's
    ``<name>_sparse`` and ``<name>_dense``), and ``ppl``, the perplexity on the tokens that chose it (guarded: the
    part kept apart; another form: every token)."""
    f = dm.fit
    loglik = f.heldout_loglik[f.form] if f.form in f.heldout_loglik else next(iter(f.heldout_loglik.values()))
    out: dict[str, Any] = {"form": f.form, "ppl": math.exp(-loglik)}
    out.update({k: v for k, v in (("temperature", dm.temperature), ("k", dm.k),
                                  ("cache_temperature", dm.cache_temperature)) if v is not None})  # fmt: skip
    for name, w in dm.rule_weights.items():
        out.update({name: w} if isinstance(w, int | float) else {f"{name}_sparse": w[0], f"{name}_dense": w[1]})
    return out


def fit_report(dm: DumpMixture, table: Any) -> dict[str, Any]:
    """:func:`report` of a fit on a table (the one it was fitted on, or another scored with the same memories): the
    LM alone (``base_ppl``) and the fit at its own read settings (``mixture_ppl``), with their intervals and paired
    difference."""
    rows: dict[str, Row] = {"base_ppl": torch.from_numpy(np.asarray(table.lm_logprob)), "mixture_ppl": dm.mixture}
    return report(table, rows, [("base_ppl", "mixture_ppl")], temperature=dm.temperature or 1.0, k=dm.k,
                  cache_temperature=dm.cache_temperature or 1.0)  # fmt: skip


def mixture_beside(dm: DumpMixture, table: Any, res: Mapping[str, Any], source: str) -> dict[str, Any]:
    """A fit applied beside a result's fixed-weight rows (``memlm eval --mixture``, or eval's default fit):
    ``mixture_ppl`` of ``dm`` on ``table``, its interval and its paired differences against the base LM and each row
    of ``res`` (re-mixed by the rule it recorded under ``mixtures``, at the result's τ and k), merged into ``res``'s
    ``intervals`` and ``differences``; ``mixture`` records the fit and where it came from (``source``)."""
    rules = {key: Mixture.from_dict(record) for key, record in (res.get("mixtures") or {}).items()}
    rows: dict[str, Row] = {"base_ppl": torch.from_numpy(np.asarray(table.lm_logprob)), **rules,
                            "mixture_ppl": dm.logprob(table, "this eval (its --memory)")}  # fmt: skip
    taus = res.get("temperatures") or res.get("temperature") or 1.0  # several datastores: one τ each
    own = report(table, rows, [(key, "mixture_ppl") for key in rows if key != "mixture_ppl"], temperature=taus,
                 k=res.get("k"), cache_temperature=res.get("cache_temperature") or 1.0)  # fmt: skip
    return {
        "mixture_ppl": own["mixture_ppl"],
        "mixture_form": dm.fit.form,
        "mixture": {"from": source, **dm.to_dict()},
        "intervals": {**res.get("intervals", {}), "mixture_ppl": own["intervals"]["mixture_ppl"]},
        "differences": {**res.get("differences", {}), **own["differences"]},
    }
