"""The learned mixture (:mod:`memlm.core.mixture`) on per-token dumps: fitted on a valid dump with the kNN
temperature searched, stored, applied to another dump, beside the fixed-weight rule it is compared with.

``memlm tune --mixture gate`` fits it (:func:`fit_dump`); ``memlm eval --mixture FIT.json`` applies it
(:meth:`DumpMixture.logprob`). For each τ of the grid (the cache's τc too), the memories of the dump become the
mixture's components and features (:func:`memlm.mixing.inputs.mixture_inputs`) and the guarded fit
(:func:`memlm.core.mixture.fit_guarded`) chooses the LM alone, EM's constant weights or the gate::

    P(w | c) = sum_i λ_i(c) P_i(w | c),     λ(c) = softmax(W φ(c) + b)

τ is the one whose chosen form has the highest mean log-likelihood on the part of the slice the fit kept apart.
The fixed-weight rule of ``memlm tune`` and ``memlm eval`` (Khandelwal et al. 2020, Eq. 3; Liu et al. 2024's
λ_sparse / λ_dense) is the same :class:`~memlm.core.mixture.Mixture` (:func:`rule_for`, a gate on the ∞-grams'
sparse flags), and :func:`rule_logprob` mixes a dump by it: every fixed-weight row eval and tune report.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from memlm.core.mixture import FitOptions, Mixture, MixtureFit, fit_guarded, rule_mixture, sparse_state_features
from memlm.errors import MemlmError
from memlm.mixing.component import component_name
from memlm.mixing.inputs import (
    MixtureInputs,
    component_logprobs,
    dump_components,
    mixture_inputs,
    ngram_sparse,
)

__all__ = ["DumpMixture", "fit_dump", "mix_by_rule", "rule_for", "rule_logprob", "rule_rows",
           "rule_weights", "tune_beside", "tune_datastores_beside"]  # fmt: skip


@dataclass
class DumpMixture:
    """A guarded fit and the retrieval settings its inputs were computed with: the kNN term's ``temperature`` over
    its ``k`` best neighbours (None: no datastore), the cache's ``cache_temperature`` (None: no cache); ``search``
    records each (τ, τc) tried with the form chosen there and its held-out log-likelihoods."""

    fit: MixtureFit
    temperature: float | None = None
    k: int | None = None
    cache_temperature: float | None = None
    search: list[dict[str, Any]] = field(default_factory=list)

    @property
    def mixture(self) -> Mixture:
        return self.fit.mixture

    def inputs(self, ts: Any, where: str = "this dump") -> MixtureInputs:
        """The mixture's inputs on ``ts``, its columns in the fit's order (components and features are matched by
        name, whatever order the memories were given in), or one MemlmError when its memories are not the fit's."""
        inp = mixture_inputs(ts, self.temperature or 1.0, self.k, self.cache_temperature or 1.0)
        m = self.mixture
        if (sorted(inp.components), sorted(inp.feature_names)) != (sorted(m.components), sorted(m.feature_names)):
            raise MemlmError(
                f"the mixture was fitted on components {', '.join(m.components)} (features "
                f"{', '.join(m.feature_names)}), {where} gives {', '.join(inp.components)} (features "
                f"{', '.join(inp.feature_names)}): give the same memories (--memory) as the valid dump it was "
                "fitted on, or fit again with memlm tune --mixture gate"
            )
        comps = [inp.components.index(c) for c in m.components]
        feats = [inp.feature_names.index(f) for f in m.feature_names]
        return MixtureInputs(inp.logprobs[:, comps], inp.features[:, feats], m.components, m.feature_names,
                             inp.doc_index)  # fmt: skip

    def logprob(self, ts: Any, where: str = "this dump") -> torch.Tensor:
        """``log P(target)`` per token of the fitted mixture on ``ts``, float64 ``[N]``."""
        inp = self.inputs(ts, where)
        return self.mixture.logprob(inp.logprobs, inp.features)

    def to_dict(self) -> dict[str, Any]:
        return {"fit": self.fit.to_dict(), "temperature": self.temperature, "k": self.k,
                "cache_temperature": self.cache_temperature, "search": self.search}  # fmt: skip

    @classmethod
    def from_dict(cls, d: Any, source: str = "the file") -> DumpMixture:
        """From :meth:`to_dict`'s record, or a ``memlm tune --mixture gate`` result that holds one (``mixture``)."""
        if isinstance(d, dict) and isinstance(d.get("mixture"), dict) and "fit" in d["mixture"]:
            d = d["mixture"]
        if not (isinstance(d, dict) and isinstance(d.get("fit"), dict)):
            raise MemlmError(f"{source} holds no fitted mixture: give the JSON of memlm tune --mixture gate --json "
                             "FILE (or its 'mixture' record)")  # fmt: skip
        try:
            return cls(MixtureFit.from_dict(d["fit"]), d.get("temperature"), d.get("k"), d.get("cache_temperature"),
                       list(d.get("search") or []))  # fmt: skip
        except MemlmError as error:
            raise MemlmError(f"{source}: {error}") from error


def fit_dump(
    ts: Any,
    temperatures: Sequence[float],
    k: int | None = None,
    cache_temperatures: Sequence[float] = (1.0,),
    options: FitOptions | None = None,
) -> DumpMixture:
    """The guarded mixture of every memory of ``ts`` (module docstring), τ (and τc) searched on the kept part. The
    fit's size warnings are in ``fit.warnings`` (logged by the fit once per τ otherwise: the caller shows them)."""
    has_knn = "knn" in ts.columns
    taus: Sequence[float | None] = temperatures if has_knn else [None]
    cache_taus: Sequence[float | None] = cache_temperatures if "cache" in ts.columns else [None]
    k_used = (k or ts.columns["knn"]["scores"].shape[1]) if has_knn else None
    best: tuple[float, MixtureFit, float | None, float | None] | None = None
    search = []
    quiet = logging.getLogger("memlm.core.mixture")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # the size warning is the caller's to show, once, not once per τ
    try:
        for tau, cache_tau in itertools.product(taus, cache_taus):
            inp = mixture_inputs(ts, tau or 1.0, k_used, cache_tau or 1.0)
            fit = fit_guarded(inp.logprobs, inp.features, inp.doc_index, inp.components, inp.feature_names,
                              options or FitOptions())  # fmt: skip
            score = fit.heldout_loglik[fit.form]
            search.append({"temperature": tau, "cache_temperature": cache_tau, "form": fit.form,
                           "heldout_loglik": fit.heldout_loglik})  # fmt: skip
            if best is None or score > best[0]:
                best = (score, fit, tau, cache_tau)
    finally:
        quiet.setLevel(level)
    assert best is not None
    return DumpMixture(best[1], best[2], k_used, best[3], search)


def rule_for(ts: Any, weights: Mapping[str, float | Sequence[float]]) -> Mixture:
    """The fixed-weight rule (:func:`memlm.core.mixture.rule_mixture`) over the LM and the memories of ``ts`` that
    ``weights`` names (by component: ``knn``, ``knn2``, ... a constant λ; ``ngram``, ``ngram2``, ... a pair
    ``(λ_sparse, λ_dense)``, or a constant; ``cache`` λc), in the dump's order; one MemlmError for a memory the dump
    does not hold."""
    held = dump_components(ts)
    missing = [c for c in weights if c not in held]
    if missing:
        raise MemlmError(f"this dump has no {', '.join(missing)} (it holds {', '.join(held)}): rerun memlm eval "
                         "--dump with those memories (--memory)")  # fmt: skip
    return rule_mixture([c for c in held if c == "lm" or c in weights], weights)


def rule_logprob(
    ts: Any,
    rule: Mixture | Mapping[str, float | Sequence[float]],
    temperature: float | Sequence[float] = 1.0,
    k: int | None = None,
    cache_temperature: float = 1.0,
) -> torch.Tensor:
    """``log P(target)`` per token, float64 ``[N]``, of the fixed-weight rule on ``ts`` (its weights by component,
    :func:`rule_for`, or the rule's :class:`Mixture` as a result recorded it), mixed by :meth:`Mixture.mix` as
    every consumer mixes: each kNN term at its ``temperature`` (one for all, or one per datastore) over its ``k``
    best neighbours, the cache at ``cache_temperature``, the ∞-gram weights switched by each reference's sparse flag
    (:func:`memlm.core.mixture.sparse_state_features`)::

        P = (1 - Σ_j λ_j - Σ_r λ_r(c)) P_LM + Σ_j λ_j P_j + Σ_r λ_r(c) P∞_r,   λ_r(c) = λ_sparse,r or λ_dense,r

    (Khandelwal et al. 2020, Eq. 3 and Table 1; Liu et al. 2024, Sec. 5; weights calibrated apart that sum past 1
    scaled as :func:`~memlm.core.mixture.rule_mixture` says)."""
    mixture = rule if isinstance(rule, Mixture) else rule_for(ts, rule)
    logprobs = component_logprobs(ts, temperature, k, cache_temperature, mixture.components)
    flags = {c: f for c, f in ngram_sparse(ts).items() if c in _switched(mixture)}
    return mixture.mix(logprobs, sparse_state_features(flags) if flags else {})


def _switched(mixture: Mixture) -> list[str]:
    """The components whose sparse flags a rule mixture's state features switch on (none: a constant mixture)."""
    if not mixture.feature_names:
        return []
    return [flag.split("=")[0] for flag in mixture.feature_names[0].removeprefix("sparse_state:").split(",")]


def mix_by_rule(
    logprobs: Mapping[str, Any], weights: Mapping[str, float | Sequence[float]], sparse: Mapping[str, Any]
) -> torch.Tensor:
    """``log P`` of the fixed-weight rule over the components ``logprobs`` (by name, the LM first: ``[N]`` or
    ``[N, V]``), each memory at its ``weights`` (a constant, or ``(λ_sparse, λ_dense)`` switched by its flag in
    ``sparse``, by name): :func:`memlm.core.mixture.rule_mixture` and :meth:`Mixture.mix`."""
    mixture = rule_mixture(list(logprobs), weights)
    flags = {c: f for c, f in sparse.items() if c in weights and not isinstance(weights[c], int | float)}
    return mixture.mix(logprobs, sparse_state_features(flags) if flags else {})


def rule_rows(
    ts: Any,
    rows: Mapping[str, Mapping[str, float | Sequence[float]]],
    temperature: float | Sequence[float] = 1.0,
    k: int | None = None,
    cache_temperature: float = 1.0,
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Several fixed-weight rows of a report at once, by key (``{"knn_ppl": {"knn": λ}, ...}``): each row's
    :func:`rule_logprob` and its rule (``Mixture.to_dict()``, what a result records under ``mixtures``)."""
    logprobs = {key: rule_logprob(ts, w, temperature, k, cache_temperature) for key, w in rows.items()}
    return logprobs, {key: rule_for(ts, w).to_dict() for key, w in rows.items()}


def tune_beside(
    ts: Any,
    weights: Mapping[str, float | Sequence[float]],
    component: str,
    grid: tuple[Sequence[float], Sequence[float]],
    temperature: float | Sequence[float] = 1.0,
    k: int | None = None,
    cache_temperature: float = 1.0,
) -> dict[str, Any]:
    """One memory's constant weight and temperature (a further datastore's λ_j, τ_j, or the cache's λc, τc) tuned
    beside the rule's other ``weights``, fixed, for the lowest perplexity of :func:`rule_logprob` on ``ts``: a grid
    search (:func:`memlm.core.tuning.grid_search`) over ``grid = (lambdas, temperatures)``, points whose constant
    weights leave the LM nothing skipped (∞-gram weights are scaled by the rule as eval scales them). Returns
    ``{"best", "grid"}`` with points ``{"lambda", "temperature", "ppl"}``."""
    from memlm.core.distribution import perplexity
    from memlm.core.tuning import grid_search

    datastores = [c for c in dump_components(ts) if c.startswith("knn")]
    if component != "cache" and component not in datastores:
        raise MemlmError(f"{component} is not a datastore or the cache of this dump ({', '.join(datastores)})")
    taus = [float(temperature)] * len(datastores) if isinstance(temperature, int | float) else list(temperature)
    others = sum(float(w) for c, w in weights.items() if c != component and isinstance(w, int | float))

    def ppl(lam: float, tau: float) -> float:
        if component == "cache":
            return perplexity(rule_logprob(ts, {**weights, component: lam}, taus, k, tau))
        at = [tau if c == component else t for c, t in zip(datastores, taus, strict=True)]
        return perplexity(rule_logprob(ts, {**weights, component: lam}, at, k, cache_temperature))

    return grid_search(lambda **p: ppl(p["lambda"], p["temperature"]),
                       {"lambda": list(grid[0]), "temperature": list(grid[1])},
                       keep=lambda p: others + p["lambda"] < 1.0)  # fmt: skip


def tune_datastores_beside(
    ts: Any,
    weights: Mapping[str, float | Sequence[float]],
    grid: tuple[Sequence[float], Sequence[float]],
    temperature: float = 1.0,
    k: int | None = None,
    cache_temperature: float = 1.0,
) -> list[dict[str, Any]]:
    """Each datastore after the first of a dump of several (components knn2, ...): its λ_j, τ_j over ``grid`` beside
    the rule found so far, fixed (``weights``, the first datastore's at ``temperature``, and the datastores tuned
    before it; :func:`tune_beside`): one pass of coordinate search, never worse on ``ts`` than without the datastore
    when 0 is among the λ's. Returns ``[{"component", "lambda", "temperature", "ppl"}, ...]``."""
    weights = dict(weights)
    taus = [float(temperature)] + [1.0] * (len(ts.names("knn")) - 1)
    found = []
    for r in range(1, len(taus)):
        name = component_name("knn", r)
        b = tune_beside(ts, weights, name, grid, taus, k, cache_temperature)["best"]
        weights[name], taus[r] = b["lambda"], b["temperature"]
        found.append({"component": name, "lambda": b["lambda"], "temperature": b["temperature"], "ppl": b["ppl"]})
    return found


def rule_weights(mixture: Mixture) -> dict[str, Any]:
    """Each memory's weight in a rule mixture (:func:`rule_for`), as the mixture gives it (after any scaling): a
    number, or ``[λ_sparse, λ_dense]`` for a memory switched by a sparse flag (read where every ∞-gram is sparse,
    and where none is). Rounded to 12 digits (the rule is exact to ~1e-12)."""
    if not mixture.feature_names:
        lam = np.exp(mixture.log_weights(np.zeros((1, 0)))[0].numpy())
        return {c: round(float(w), 12) for c, w in zip(mixture.components[1:], lam[1:], strict=True)}
    dense = np.exp(mixture.log_weights(np.eye(len(mixture.feature_names))[:1]).numpy()[0])
    sparse = np.exp(mixture.log_weights(np.eye(len(mixture.feature_names))[-1:]).numpy()[0])
    pairs = _switched(mixture)
    out: dict[str, Any] = {}
    for i, c in enumerate(mixture.components[1:], 1):
        out[c] = [round(float(sparse[i]), 12), round(float(dense[i]), 12)] if c in pairs else round(float(dense[i]), 12)
    return out
