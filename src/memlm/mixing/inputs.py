"""A per-token dump as the learned mixture's inputs: each component's log-probability of the target and the features
of each retrieval (:mod:`memlm.core.mixture`).

Components, in order, as far as the dump holds them: ``lm``; ``knn`` and ``knn2``, ``knn3``, ... (each datastore's
neighbours, Eq. 2 at temperature τ, the k best); ``ngram`` and ``ngram2``, ``ngram3``, ... (each ∞-gram reference,
Liu et al. 2024); ``cache`` (the continuous cache, Grave et al. 2017, at its own temperature). Features, each memory
its own columns:

=========================  ===================================================================================
``lm_entropy``             H(p_LM(· | c)), nats
``lm_max_logprob``         max_w log p_LM(w | c)
``knn_top_score``          the best neighbour's score s_1 (0 where nothing was retrieved)
``knn_logsumexp``          log sum_i n_i exp(s_i / τ) over the k neighbours (0 where nothing was retrieved)
``knn_top_value_share``    p_kNN(v_1 | c): the share of the memory's mass on the best neighbour's value
``knn_empty``              1 where no neighbour was retrieved
``ngram_log_n``            log(1 + n), n the effective n of P∞ (the matched suffix's length + 1)
``ngram_log_count``        log(1 + cnt(suffix)), how often the matched suffix occurs in the reference
``ngram_sparse``           1 where P∞(· | c) puts all its mass on one token
``cache_top_score``        the cache's best entry's score (0 where the cache is empty)
``cache_empty``            1 where the cache holds no entry (a document's first token)
=========================  ===================================================================================

(further datastores: ``knn2_top_score``, ...; further ∞-gram references: ``ngram2_log_n``, ...). ``-inf`` scores of
an empty retrieval become 0 with the ``*_empty`` flag beside them, so every feature is finite.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from memlm.core.distribution import knn_target_logprob, memory_lse
from memlm.errors import MemlmError
from memlm.models.forward import lm_entropy

__all__ = [
    "MixtureInputs",
    "component_logprobs",
    "dump_components",
    "lm_features",
    "memory_logprob",
    "neighbour_features",
    "mixture_inputs",
    "ngram_features",
    "ngram_sparse",
    "read_settings",
    "retrieval_features",
]


@dataclass(frozen=True)
class MixtureInputs:
    """``logprobs [N, C]`` (float64, ``-inf`` = 0), ``features [N, F]`` (finite), their names, and each token's
    document (``doc_index``, for :func:`memlm.core.mixture.fit_guarded`'s kept part)."""

    logprobs: np.ndarray
    features: np.ndarray
    components: tuple[str, ...]
    feature_names: tuple[str, ...]
    doc_index: np.ndarray


def lm_features(lm_logprobs: torch.Tensor) -> dict[str, np.ndarray]:
    """``lm_entropy``, ``lm_max_logprob`` of each row of the LM's log-distribution ``[N, V]`` (a generation step, a
    wrapped forward pass; a dump stores them from the forward pass)."""
    lp = lm_logprobs.double()
    return {"lm_entropy": lm_entropy(lp).cpu().numpy(), "lm_max_logprob": lp.max(-1).values.cpu().numpy()}


def ngram_features(name: str, n, count, sparse) -> dict[str, np.ndarray]:
    """``<name>_log_n``, ``<name>_log_count``, ``<name>_sparse`` of an ∞-gram's effective n, suffix count and sparse
    flag per row (module docstring)."""
    return {
        f"{name}_log_n": np.log1p(np.maximum(np.asarray(n), 0).astype(np.float64)),
        f"{name}_log_count": np.log1p(np.maximum(np.asarray(count), 0).astype(np.float64)),
        f"{name}_sparse": np.asarray(sparse).astype(np.float64),
    }


def retrieval_features(name: str, scores, values, temperature: float, k: int | None = None, log_counts=None,
                       cache: bool = False) -> dict[str, np.ndarray]:  # fmt: skip
    """A dense memory's features from its k retrieved (score, value) rows ``[N, k]``: ``<name>_top_score``,
    ``<name>_logsumexp``, ``<name>_top_value_share``, ``<name>_empty`` (the cache: top score and empty only)."""
    found = neighbour_features(np.asarray(scores), np.asarray(values), temperature, k,
                                None if log_counts is None else np.asarray(log_counts))  # fmt: skip
    keep = ("top_score", "empty") if cache else tuple(found)
    return {f"{name}_{f}": found[f] for f in keep}


def neighbour_features(scores, values, temperature, k=None, log_counts=None) -> dict[str, np.ndarray]:
    """``top_score``, ``logsumexp`` (of the scores / τ), ``top_value_share`` and ``empty`` of ``k`` retrieved
    entries ``[N, k]`` (module docstring), unprefixed."""
    k = scores.shape[1] if k is None else k
    s = torch.from_numpy(np.ascontiguousarray(scores[:, :k]))
    v = torch.from_numpy(np.ascontiguousarray(values[:, :k]).astype(np.int64))
    lc = None if log_counts is None else torch.from_numpy(np.ascontiguousarray(log_counts[:, :k]))
    total, top_value = memory_lse(s, v, v[:, 0], temperature, lc)
    empty = ~torch.isfinite(total)
    zero = torch.zeros_like(total, dtype=torch.float64)
    return {
        "top_score": torch.where(empty, zero, s[:, 0].double()).numpy(),
        "logsumexp": torch.where(empty, zero, total.double()).numpy(),
        "top_value_share": torch.where(empty, zero, (top_value - total).double().exp()).numpy(),
        "empty": empty.double().numpy(),
    }


def memory_logprob(
    scores: np.ndarray,
    values: np.ndarray,
    targets: np.ndarray,
    temperature: float,
    k: int | None = None,
    log_counts: np.ndarray | None = None,
) -> torch.Tensor:
    """``log p_mem(target)`` from dumped neighbours, keeping the ``k`` best (Eq. 2; merged counts when pruned)."""
    k = scores.shape[1] if k is None else k
    if k > scores.shape[1]:
        raise MemlmError(
            f"k={k} is larger than the {scores.shape[1]} neighbours in the dump; rerun memlm eval with --k {k}"
        )
    return knn_target_logprob(
        torch.from_numpy(scores[:, :k]),
        torch.from_numpy(values[:, :k].astype(np.int64)),
        torch.from_numpy(targets),
        temperature,
        None if log_counts is None else torch.from_numpy(log_counts[:, :k]),
    )


def _per_datastore(temperature: float | Sequence[float], n: int) -> list[float]:
    """One τ per datastore: the same for all (a number), or one each."""
    taus = [float(temperature)] * n if isinstance(temperature, int | float) else [float(t) for t in temperature]
    if len(taus) != n:
        raise MemlmError(f"{len(taus)} temperatures for {n} datastores: give one, or one per datastore")
    return taus


def read_settings(
    table: Any,
    temperature: float | Sequence[float] | Mapping[str, float] = 1.0,
    k: int | Mapping[str, int] | None = None,
    cache_temperature: float = 1.0,
) -> dict[str, dict[str, Any]]:
    """Each memory's own read settings by component name, for its ``logprob`` / ``features``: every datastore (kind
    ``knn``) its τ and k (``temperature``: one for all, one per datastore in order, or a dict by name; ``k``: one
    for all or a dict by name), the cache (kind ``cache``) its τ (``cache_temperature``, or ``temperature[name]``
    when a dict names it); memories without settings none."""
    knn = table.names("knn")
    if isinstance(temperature, Mapping):
        taus = [float(temperature.get(n, 1.0)) for n in knn]
    else:
        taus = _per_datastore(temperature, len(knn))
    out: dict[str, dict[str, Any]] = {}
    for name, tau in zip(knn, taus, strict=True):
        out[name] = {"temperature": tau, "k": k.get(name) if isinstance(k, Mapping) else k}
    for name in table.names("cache"):
        tau = temperature.get(name, cache_temperature) if isinstance(temperature, Mapping) else cache_temperature
        out[name] = {"temperature": float(tau)}
    return out


def dump_components(ts: Any) -> tuple[str, ...]:
    """The component names of a per-token table: ``lm``, then each memory in the order it was scored."""
    return ("lm", *ts.names())


def component_logprobs(
    ts: Any,
    temperature: float | Sequence[float] | Mapping[str, float] = 1.0,
    k: int | Mapping[str, int] | None = None,
    cache_temperature: float = 1.0,
    names: Sequence[str] | None = None,
) -> dict[str, torch.Tensor]:
    """log P_i(target) per token, float64 ``[N]``, of each component of the table by name (``-inf`` = 0), each
    memory's own :meth:`~memlm.mixing.component.Component.logprob` at its settings (:func:`read_settings`: a
    datastore's Eq. 2 at its τ over its k best neighbours, the cache at its τ). ``names``: only these."""
    settings = read_settings(ts, temperature, k, cache_temperature)
    want = dump_components(ts) if names is None else tuple(names)
    return {name: ts.logprob(name, **settings.get(name, {})) for name in want}


def ngram_sparse(ts: Any) -> dict[str, np.ndarray]:
    """Each memory's sparse flag per token by component name (the ∞-gram indexes': what :func:`rule_mixture`'s
    λ_sparse / λ_dense switch on, through :func:`memlm.core.mixture.sparse_state_features`)."""
    return {name: np.asarray(f) for name in ts.names() if (f := ts.sparse(name)) is not None}


def mixture_inputs(
    ts: Any,
    temperature: float | Sequence[float] | Mapping[str, float] = 1.0,
    k: int | Mapping[str, int] | None = None,
    cache_temperature: float = 1.0,
) -> MixtureInputs:
    """The components and features (module docstring) of every memory of a per-token table
    (:class:`memlm.knnlm.table.TokenTable`), each from its own class's ``logprob`` and ``features`` at its settings
    (:func:`read_settings`: τ is still searched outside the mixture); features are named ``<component>_<feature>``
    after the LM's."""
    if ts.lm_entropy is None or ts.lm_max_logprob is None:
        raise MemlmError("this table has no LM entropy / max log-prob: rerun memlm eval --dump to get the LM's "
                         "features")  # fmt: skip
    settings = read_settings(ts, temperature, k, cache_temperature)
    comps = {name: ts.logprob(name, **settings.get(name, {})) for name in dump_components(ts)}
    feats: dict[str, np.ndarray] = {"lm_entropy": ts.lm_entropy, "lm_max_logprob": ts.lm_max_logprob}
    for name in ts.names():
        feats.update({f"{name}_{f}": v for f, v in ts.features(name, **settings.get(name, {})).items()})
    return MixtureInputs(
        logprobs=np.stack([c.numpy() for c in comps.values()], axis=1),
        features=np.stack([np.asarray(c, dtype=np.float64) for c in feats.values()], axis=1),
        components=tuple(comps),
        feature_names=tuple(feats),
        doc_index=np.asarray(ts.doc_index),
    )
