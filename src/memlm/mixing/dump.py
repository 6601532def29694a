"""The mixture of a per-token table fitted with its memories' read settings, stored, applied to another table, and
the fixed-weight rule it is compared with.

``memlm tune`` and a memory's calibration fit it (:func:`memlm.mixing.report.fit_table`); ``memlm eval --mixture
FIT.json`` applies it (:meth:`DumpMixture.logprob`). A :class:`DumpMixture` is one fitted
:class:`~memlm.core.mixture.Mixture` (:func:`memlm.core.mixture.fit`: the rule, constant weights, the gate or the
guarded choice among them) with the read settings its inputs were computed at (the kNN term's τ over its k best
neighbours, the cache's τc), and its own summary as the fixed-weight rule (:attr:`DumpMixture.rule_weights`: each
memory's mean weight on the tokens it was fitted on, an ∞-gram's per sparse / dense state)::

    P(w | c) = sum_i λ_i(c) P_i(w | c),     λ̄_i = mean_t λ_i(c_t),     λ̄_sparse,r = mean_{t: P∞_r sparse} λ_r(c_t)

The fixed-weight rule of ``--lambda`` / ``--ngram-lambda-*`` and of eval's comparison rows (Khandelwal et al. 2020,
Eq. 3; Liu et al. 2024's λ_sparse / λ_dense) is the same :class:`~memlm.core.mixture.Mixture` (:func:`rule_for`, a
gate on the ∞-grams' sparse flags), and :func:`rule_logprob` mixes a table by it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from memlm.core.mixture import Mixture, MixtureFit, rule_mixture, sparse_state_features
from memlm.errors import MemlmError
from memlm.mixing.inputs import (
    MixtureInputs,
    component_logprobs,
    dump_components,
    mixture_inputs,
    ngram_sparse,
)

__all__ = ["DumpMixture", "mix_by_rule", "rule_for", "rule_logprob", "rule_rows", "rule_summary", "rule_weights",
           "table_inputs"]  # fmt: skip


@dataclass
class DumpMixture:
    """A fit and the retrieval settings its inputs were computed with: the kNN term's ``temperature`` over its ``k``
    best neighbours (None: no datastore), the cache's ``cache_temperature`` (None: no cache); ``search`` records each
    (τ, τc) tried with the form chosen there and its log-likelihoods; ``rule_weights`` its summary as the
    fixed-weight rule (module docstring, :func:`rule_summary`), by memory."""

    fit: MixtureFit
    temperature: float | None = None
    k: int | None = None
    cache_temperature: float | None = None
    search: list[dict[str, Any]] = field(default_factory=list)
    rule_weights: dict[str, Any] = field(default_factory=dict)

    @property
    def mixture(self) -> Mixture:
        return self.fit.mixture

    def inputs(self, ts: Any, where: str = "this dump") -> MixtureInputs:
        """The mixture's inputs on ``ts``, its columns in the fit's order (components and features are matched by
        name, whatever order the memories were given in), or one MemlmError when its memories are not the fit's."""
        m = self.mixture
        inp = table_inputs(ts, m.form, self.temperature or 1.0, self.k, self.cache_temperature or 1.0)
        missing = [f for f in m.feature_names if f not in inp.feature_names]
        if sorted(inp.components) != sorted(m.components) or missing:
            raise MemlmError(
                f"the mixture was fitted on components {', '.join(m.components)} (features "
                f"{', '.join(m.feature_names)}), {where} gives {', '.join(inp.components)} (features "
                f"{', '.join(inp.feature_names)}): give the same memories (--memory) as the valid dump it was "
                "fitted on, or fit again with memlm tune"
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
                "cache_temperature": self.cache_temperature, "search": self.search,
                "rule_weights": self.rule_weights}  # fmt: skip

    @classmethod
    def load(cls, path: str | Path) -> DumpMixture:
        """The fit in a JSON file (``memlm tune --json``, or its ``mixture`` record), or one MemlmError naming it."""
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, ValueError) as error:
            raise MemlmError(f"--mixture {path}: not a readable JSON file ({error})") from error
        return cls.from_dict(data, f"--mixture {path}")

    @classmethod
    def from_dict(cls, d: Any, source: str = "the file") -> DumpMixture:
        """From :meth:`to_dict`'s record, or a ``memlm tune --json`` result that holds one (``mixture``)."""
        if isinstance(d, dict) and isinstance(d.get("mixture"), dict) and "fit" in d["mixture"]:
            d = d["mixture"]
        if not (isinstance(d, dict) and isinstance(d.get("fit"), dict)):
            raise MemlmError(f"{source} holds no fitted mixture: give the JSON of memlm tune --json FILE (or its "
                             "'mixture' record)")  # fmt: skip
        try:
            return cls(MixtureFit.from_dict(d["fit"]), d.get("temperature"), d.get("k"), d.get("cache_temperature"),
                       list(d.get("search") or []), dict(d.get("rule_weights") or {}))  # fmt: skip
        except MemlmError as error:
            raise MemlmError(f"{source}: {error}") from error


def table_inputs(ts: Any, form: str, temperature: Any = 1.0, k: Any = None,
                 cache_temperature: float = 1.0) -> MixtureInputs:  # fmt: skip
    """:func:`memlm.mixing.inputs.mixture_inputs` of ``ts`` and, for the rule (``form == "rule"``), the one-hot
    joint sparse states of its ∞-grams (:func:`memlm.core.mixture.sparse_state_features`) the rule switches on."""
    inp = mixture_inputs(ts, temperature, k, cache_temperature)
    flags = ngram_sparse(ts)
    if form != "rule" or not flags:
        return inp
    states = {n: v.numpy() for n, v in sparse_state_features(flags).items()}
    return MixtureInputs(inp.logprobs, np.concatenate([inp.features, np.stack(list(states.values()), 1)], 1),
                         inp.components, (*inp.feature_names, *states), inp.doc_index)  # fmt: skip


def rule_summary(mixture: Mixture, inp: MixtureInputs, sparse: Mapping[str, Any]) -> dict[str, Any]:
    """A fitted mixture as the fixed-weight rule: each memory's mean weight ``mean_t λ_i(c_t)`` over the tokens of
    ``inp``; an ∞-gram's (a memory with a flag in ``sparse``) ``[λ_sparse, λ_dense]``, its mean weight where its P∞
    is sparse and where it is not (a state without tokens takes the mean over all). Exact for a rule or a constant
    fit; for a gate, the weights it gives on average."""
    named = {f: inp.features[:, j] for j, f in enumerate(inp.feature_names)}
    weights = mixture.log_weights(mixture.features_of(named, len(inp.logprobs))).exp().numpy()
    out: dict[str, Any] = {}
    for i, c in enumerate(mixture.components[1:], 1):
        mean = float(weights[:, i].mean())
        if c not in sparse:
            out[c] = mean
            continue
        flag = np.asarray(sparse[c], dtype=bool)
        out[c] = [float(weights[flag, i].mean()) if flag.any() else mean,
                  float(weights[~flag, i].mean()) if (~flag).any() else mean]  # fmt: skip
    return out


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
