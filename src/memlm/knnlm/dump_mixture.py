"""The learned mixture (:mod:`memlm.core.mixture`, issue 35) on per-token dumps: fitted on a valid dump with the kNN
temperature searched, stored, applied to another dump, beside the fixed-weight rule it is compared with.

``memlm tune --mixture gate`` fits it (:func:`fit_dump`); ``memlm eval --mixture FIT.json`` applies it
(:meth:`DumpMixture.logprob`). For each τ of the grid (the cache's τc too), the memories of the dump become the
mixture's components and features (:func:`memlm.knnlm.mixture_inputs.mixture_inputs`) and the guarded fit
(:func:`memlm.core.mixture.fit_guarded`) chooses the LM alone, EM's constant weights or the gate::

    P(w | c) = sum_i λ_i(c) P_i(w | c),     λ(c) = softmax(W φ(c) + b)

τ is the one whose chosen form has the highest mean log-likelihood on the part of the slice the fit kept apart.
The fixed-weight rule of ``memlm tune`` and ``memlm eval`` (Khandelwal et al. 2020, Eq. 3; Liu et al. 2024's
λ_sparse / λ_dense) is scored by :func:`rule_logprob` from its weights, through the same formulas as its reports.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from memlm.core.mixture import FitOptions, Mixture, MixtureFit, fit_guarded
from memlm.errors import MemlmError
from memlm.knnlm.evaluate import TokenScores
from memlm.knnlm.mixture_inputs import MixtureInputs, mixture_inputs, ngram_component

__all__ = ["DumpMixture", "components_of", "fit_dump", "rule_logprob"]


def components_of(datastore: bool, ngrams: int, cache: bool) -> tuple[str, ...]:
    """The mixture's components for these memories, in :func:`mixture_inputs`' order (to check a stored fit against
    ``memlm eval``'s options before anything is scored)."""
    names = ["lm"] + (["knn"] if datastore else []) + [ngram_component(r) for r in range(ngrams)]
    return tuple(names + (["cache"] if cache else []))


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

    def inputs(self, ts: TokenScores, where: str = "this dump") -> MixtureInputs:
        """The mixture's inputs on ``ts``, or one MemlmError when its memories are not the fit's."""
        inp = mixture_inputs(ts, self.temperature or 1.0, self.k, self.cache_temperature or 1.0)
        m = self.mixture
        if (inp.components, inp.feature_names) != (m.components, m.feature_names):
            raise MemlmError(
                f"the mixture was fitted on components {', '.join(m.components)} (features "
                f"{', '.join(m.feature_names)}), {where} gives {', '.join(inp.components)} (features "
                f"{', '.join(inp.feature_names)}): give the same memories (--datastore, each --ngram in the same "
                "order, --cache) as the valid dump it was fitted on, or fit again with memlm tune --mixture gate"
            )
        return inp

    def logprob(self, ts: TokenScores, where: str = "this dump") -> torch.Tensor:
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
    ts: TokenScores,
    temperatures: Sequence[float],
    k: int | None = None,
    cache_temperatures: Sequence[float] = (1.0,),
    options: FitOptions | None = None,
) -> DumpMixture:
    """The guarded mixture of every memory of ``ts`` (module docstring), τ (and τc) searched on the kept part. The
    fit's size warnings are in ``fit.warnings`` (logged by the fit once per τ otherwise: the caller shows them)."""
    taus: Sequence[float | None] = temperatures if ts.knn_scores is not None else [None]
    cache_taus: Sequence[float | None] = cache_temperatures if ts.cache_scores is not None else [None]
    k_used = (k or ts.knn_scores.shape[1]) if ts.knn_scores is not None else None
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


def rule_logprob(
    ts: TokenScores,
    lam: float | None = None,
    temperature: float = 1.0,
    k: int | None = None,
    ngram_weights: Sequence[Sequence[float]] | None = None,
    cache: tuple[float, float] = (0.0, 1.0),
) -> torch.Tensor:
    """``log P(target)`` per token of the fixed-weight rule: the kNN term at weight ``lam`` (τ, k), each ∞-gram
    reference with its ``(λ_sparse, λ_dense)`` (:func:`memlm.ngram.mixture.ngram_logprobs`, several:
    :func:`~memlm.ngram.mixture.ngrams_logprob`), the cache at ``cache = (λc, τc)``; without the ∞-gram the
    constant mixture ``(1 - λ - λc) p_LM + λ p_kNN + λc p_cache`` (:meth:`Mixture.constant`)."""
    from memlm.ngram.mixture import ngram_logprobs, ngrams_logprob

    has_knn = lam is not None and ts.knn_scores is not None
    if ngram_weights:
        if cache[0]:
            raise MemlmError("the fixed-weight rule does not mix the cache with the ∞-gram (memlm tune tunes them "
                             "apart); compare the cache with the learned mixture alone")  # fmt: skip
        if ts.ngram_extra_logprob is not None:
            return ngrams_logprob(ts, ngram_weights, lam if has_knn else 0.0, temperature, k)
        rows = ngram_logprobs(ts, tuple(ngram_weights[0]), lam if has_knn else None, temperature, k)
        return rows["knn_ngram_ppl" if has_knn else "ngram_ppl"]
    lam = lam if has_knn else 0.0
    inp = mixture_inputs(ts, temperature, k, cache[1])
    want = {"lm": 1.0 - lam - cache[0], "knn": lam, "cache": cache[0]}
    weights = [want.get(c, 0.0) for c in inp.components]
    return Mixture.constant(inp.components, weights).logprob(inp.logprobs, None)
