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

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from memlm.core.distribution import knn_target_logprob, memory_lse
from memlm.core.dumps import TokenDump
from memlm.errors import MemlmError
from memlm.models.forward import lm_entropy

__all__ = [
    "MixtureInputs",
    "component_logprobs",
    "component_name",
    "dump_components",
    "knn_columns",
    "lm_features",
    "memory_logprob",
    "neighbour_features",
    "mixture_inputs",
    "ngram_component",
    "ngram_features",
    "ngram_sparse",
    "retrieval_features",
]


def component_name(kind: str, r: int) -> str:
    """The mixture component name of the ``r``-th memory (0-based) of a kind (``knn``, ``ngram``, ``cache``): the
    kind, then ``<kind>2``, ``<kind>3``, ... (two datastores: knn, knn2; two ∞-gram indexes: ngram, ngram2)."""
    return kind if r == 0 else f"{kind}{r + 1}"


def ngram_component(r: int) -> str:
    """The mixture component name of the dump's ``r``-th ∞-gram reference (0-based): ngram, ngram2, ngram3, ..."""
    return component_name("ngram", r)


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


def _ngram_columns(ts: TokenDump) -> list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
    """``(log P∞, effective n, suffix count, sparse)`` of each ∞-gram reference of the dump, in order."""
    if ts.ngram_logprob is None:
        return []
    refs = [(ts.ngram_logprob, ts.ngram_n, ts.ngram_count, ts.ngram_sparse)]
    if ts.ngram_extra_logprob is not None:
        for r in range(ts.ngram_extra_logprob.shape[1]):
            refs.append(tuple(getattr(ts, f"ngram_extra_{f}")[:, r] for f in ("logprob", "n", "count", "sparse")))
    return refs


def knn_columns(ts: TokenDump) -> list[tuple[np.ndarray, np.ndarray, np.ndarray | None]]:
    """``(scores, values, log_counts)`` ``[N, k]`` of each datastore of the dump, in order: the first from
    ``knn_scores`` / ``knn_values`` / ``knn_log_counts``, the others from ``knn_extra_*[:, r]``."""
    if ts.knn_scores is None:
        return []
    out = [(ts.knn_scores, ts.knn_values, ts.knn_log_counts)]
    if ts.knn_extra_scores is not None:
        for r in range(ts.knn_extra_scores.shape[1]):
            counts = None if ts.knn_extra_log_counts is None else ts.knn_extra_log_counts[:, r]
            out.append((ts.knn_extra_scores[:, r], ts.knn_extra_values[:, r], counts))
    return out


def _per_datastore(temperature: float | Sequence[float], n: int) -> list[float]:
    """One τ per datastore: the same for all (a number), or one each."""
    taus = [float(temperature)] * n if isinstance(temperature, int | float) else [float(t) for t in temperature]
    if len(taus) != n:
        raise MemlmError(f"{len(taus)} temperatures for {n} datastores: give one, or one per datastore")
    return taus


def dump_components(ts: TokenDump) -> tuple[str, ...]:
    """The component names of every memory a dump holds, in :func:`mixture_inputs`' order."""
    names = ["lm"] + [component_name("knn", r) for r in range(len(knn_columns(ts)))]
    names += [ngram_component(r) for r in range(len(_ngram_columns(ts)))]
    return tuple(names + (["cache"] if ts.cache_scores is not None else []))


def component_logprobs(
    ts: TokenDump,
    temperature: float | Sequence[float] = 1.0,
    k: int | None = None,
    cache_temperature: float = 1.0,
    names: Sequence[str] | None = None,
) -> dict[str, torch.Tensor]:
    """log P_i(target) per token, float64 ``[N]``, of each component of the dump by name (``-inf`` = 0): the LM,
    each datastore's kNN term (Eq. 2) at its ``temperature`` (one for all, or one per datastore) over its ``k`` best
    neighbours, each ∞-gram's P∞, the cache at ``cache_temperature``. ``names``: only these."""
    want = dump_components(ts) if names is None else tuple(names)
    out: dict[str, torch.Tensor] = {}
    if "lm" in want:
        out["lm"] = torch.from_numpy(ts.lm_logprob).double()
    columns = knn_columns(ts)
    for r, ((scores, values, counts), tau) in enumerate(zip(columns, _per_datastore(temperature, len(columns)),
                                                            strict=True)):  # fmt: skip
        if (name := component_name("knn", r)) in want:
            out[name] = memory_logprob(scores, values, ts.targets, tau, k, counts).double()
    for r, (logprob, _, _, _) in enumerate(_ngram_columns(ts)):
        if (name := ngram_component(r)) in want:
            out[name] = torch.from_numpy(np.asarray(logprob)).double()
    if "cache" in want and ts.cache_scores is not None:
        out["cache"] = memory_logprob(ts.cache_scores, ts.cache_values, ts.targets, cache_temperature).double()
    missing = [c for c in want if c not in out]
    if missing:
        raise MemlmError(f"this dump has no {', '.join(missing)} (it holds {', '.join(dump_components(ts))}): rerun "
                         "memlm eval --dump with those memories (--datastore, --ngram, --cache)")  # fmt: skip
    return out


def ngram_sparse(ts: TokenDump) -> dict[str, np.ndarray]:
    """Each ∞-gram reference's sparse flag per token by component name (what :func:`rule_mixture`'s λ_sparse /
    λ_dense switch on, through :func:`memlm.core.mixture.sparse_state_features`)."""
    return {ngram_component(r): np.asarray(sparse) for r, (_, _, _, sparse) in enumerate(_ngram_columns(ts))}


def mixture_inputs(
    ts: TokenDump,
    temperature: float | Sequence[float] = 1.0,
    k: int | None = None,
    cache_temperature: float = 1.0,
) -> MixtureInputs:
    """The components and features (module docstring) of every memory a dump holds, each kNN term at its
    ``temperature`` (one for all, or one per datastore) over its ``k`` best neighbours (τ is still searched outside
    the mixture), the cache at ``cache_temperature``."""
    if ts.lm_entropy is None or ts.lm_max_logprob is None:
        raise MemlmError("this dump has no LM entropy / max log-prob (written by an older memlm): rerun memlm eval "
                         "--dump to get the LM's features")  # fmt: skip
    comps = component_logprobs(ts, temperature, k, cache_temperature)
    feats: dict[str, np.ndarray] = {"lm_entropy": ts.lm_entropy, "lm_max_logprob": ts.lm_max_logprob}
    columns = knn_columns(ts)
    for r, ((scores, values, counts), tau) in enumerate(zip(columns, _per_datastore(temperature, len(columns)),
                                                            strict=True)):  # fmt: skip
        feats.update(retrieval_features(component_name("knn", r), scores, values, tau, k, counts))
    for r, (_, n, count, sparse) in enumerate(_ngram_columns(ts)):
        feats.update(ngram_features(ngram_component(r), n, count, sparse))
    if ts.cache_scores is not None:
        feats.update(retrieval_features("cache", ts.cache_scores, ts.cache_values, cache_temperature, cache=True))
    return MixtureInputs(
        logprobs=np.stack([c.numpy() for c in comps.values()], axis=1),
        features=np.stack([np.asarray(c, dtype=np.float64) for c in feats.values()], axis=1),
        components=tuple(comps),
        feature_names=tuple(feats),
        doc_index=np.asarray(ts.doc_index),
    )
