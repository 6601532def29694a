"""From retrieved memory entries to a distribution over values: the one place memlm does it.

Every memory (a kNN-LM datastore, a continuous cache, TRIME's in-batch memories, NPM's reference corpus, a learned
``W_ds``) produces, for each query, the ``scores`` of its retrieved entries and their ``values``. This module turns
them into a distribution over values (Xu et al. 2023, Eq. 5; Khandelwal et al. 2020, Eq. 2)::

    p_mem(w | c) = sum_{i in top-k} 1[v_i = w] * n_i exp(s(h_ds(c), k_i) / tau) / sum_{i in top-k} n_i exp(s_i / tau)

where ``s`` is a similarity (negative squared L2 distance or inner product: larger = closer, :func:`similarity`),
``tau`` a temperature, ``n_i`` the number of original entries merged into entry ``i`` by datastore pruning (He et al.
2021; ``n_i = 1`` without pruning) and the sum over entries that share a value is Xu's ``M``
(:func:`value_logsumexp`). ``mask-to-k`` (:func:`mask_to_k`) keeps the ``k`` best of a dense score row. The LM and
the memory are then interpolated (Eq. 3, :func:`mix`), with a fixed or a per-token ``lambda``::

    p(w | c) = (1 - lambda) * p_LM(w | c) + lambda * p_mem(w | c)

or, as TRIME trains and tests (Zhong et al. 2022, Eq. 5 / App. A), normalised jointly with the LM's logits
(:func:`joint_target_logprob`)::

    P(w | c) = [exp(E_w f) + sum_{j: v_j = w} exp(s_j / tau)] / [sum_v exp(E_v f) + sum_j exp(s_j / tau)]

All of it runs in log space so that a memory that gives the target zero probability costs nothing numerically.
:func:`memory_lse` is the primitive: the log of the unnormalised total mass and of the target's mass.

Conventions: ``scores`` is float ``[..., k]``; ``values`` is integer ``[..., k]`` with ``-1`` marking an empty slot
(fewer than k neighbours); empty slots get score ``-inf``. ``values`` may also be any integer labels (NPM's phrase
ids). Everything here is plain torch on CPU or GPU and has a brute-force NumPy reference in ``tests/test_knn.py`` and
``tests/test_generalized.py``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

from memlm.errors import MemlmError

__all__ = [
    "METRICS",
    "check_metric",
    "check_temperature",
    "joint_distribution",
    "joint_target_logprob",
    "log_weights_from_logits",
    "knn_distribution",
    "knn_target_logprob",
    "knn_weights",
    "mask_to_k",
    "memory_lse",
    "mix",
    "mix_posterior",
    "perplexity",
    "similarity",
    "value_logsumexp",
]

METRICS = ("ip", "l2")
"""Similarity functions ``(x)`` of Eq. 5: inner product and negative squared L2 distance."""

_NINF = float("-inf")


def check_temperature(temperature: float) -> None:
    """Refuse a temperature that is not > 0 (the softmax of Eq. 2 / Eq. 5 divides by it)."""
    if not temperature > 0:
        raise MemlmError(f"temperature must be > 0, got {temperature}")


def check_metric(metric: str) -> None:
    """Refuse a similarity other than ``ip`` and ``l2``."""
    if metric not in METRICS:
        raise MemlmError(f"unknown similarity metric {metric!r}; use one of {', '.join(METRICS)}")


# ------------------------------------------------------------------------------------------ scores of entries


def similarity(h: torch.Tensor, W: torch.Tensor, metric: str) -> torch.Tensor:
    """The similarity ``W (x) h`` of Eq. 5 (Xu et al. 2023) between queries and every row of ``W``.

    ``h`` is ``[..., D]``, ``W`` is ``[N, D]``; returns float32 ``[..., N]``, larger = closer:

    * ``"ip"``: ``h . w``;
    * ``"l2"``: ``-||h - w||^2``, computed as ``2 h . w - ||h||^2 - ||w||^2`` in float32 and clamped to ``<= 0``
      (the same convention as :func:`memlm.storage.index.exact_search`).

    Inputs are cast to float32. Under ``torch.autocast`` the inner-product matmul runs in the autocast dtype; the L2
    one always runs in float32, because ``2 h . w - ||h||^2 - ||w||^2`` subtracts numbers of size ``||h||^2`` to get a
    small distance: with bfloat16 dot products (8 bits of mantissa) that cancels catastrophically.
    """
    check_metric(metric)
    if W.dim() != 2:
        raise MemlmError(f"W must be a [N, D] matrix, got shape {tuple(W.shape)}")
    if h.shape[-1] != W.shape[1]:
        raise MemlmError(
            f"query dimension {h.shape[-1]} does not match W's dimension {W.shape[1]}: h_ds and W_ds must come from "
            "the same layer of the same model"
        )
    h32, w32 = h.float(), W.float()
    if metric == "ip":
        return (h32 @ w32.T).float()
    with torch.autocast(h32.device.type, enabled=False):
        dots = h32 @ w32.T
        hn = (h32 * h32).sum(-1, keepdim=True)
        wn = (w32 * w32).sum(-1)
        return (2 * dots - hn - wn).clamp(max=0.0)


def mask_to_k(scores: torch.Tensor, k: int) -> torch.Tensor:
    """``mask-to-k`` of Eq. 5 (Xu et al. 2023): keep the ``k`` largest scores of each row, set the rest to ``-inf``.

    ``scores`` is ``[..., N]``; the result has the same shape. ``k >= N`` keeps everything (Eq. 4, the full datastore).
    Ties at the k-th score are broken by ``torch.topk`` (exactly ``k`` entries are kept).
    """
    if isinstance(k, bool) or not isinstance(k, int | np.integer) or k < 1:
        raise MemlmError(f"k must be a positive integer, got {k!r}")
    n = scores.shape[-1]
    if k >= n:
        return scores
    top, idx = torch.topk(scores, int(k), dim=-1)
    return torch.full_like(scores, _NINF).scatter(-1, idx, top)


# ----------------------------------------------------------------------------- entries -> distribution over values


def _logits(
    scores: torch.Tensor, values: torch.Tensor, temperature: float, log_counts: torch.Tensor | None
) -> torch.Tensor:
    """``s_i / tau + log n_i`` in at least float32, ``-inf`` in empty slots (value < 0)."""
    check_temperature(temperature)
    if scores.shape != values.shape:
        raise MemlmError(f"scores {tuple(scores.shape)} and values {tuple(values.shape)} must have the same shape")
    logits = scores.to(torch.promote_types(scores.dtype, torch.float32)) / temperature  # fp16/bf16 -> fp32
    if log_counts is not None:
        if log_counts.shape != scores.shape:
            raise MemlmError(f"log_counts {tuple(log_counts.shape)} must have the scores' shape {tuple(scores.shape)}")
        logits = logits + log_counts.to(device=logits.device, dtype=logits.dtype)
    return logits.masked_fill(values < 0, _NINF)


def memory_lse(
    scores: torch.Tensor,
    values: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    log_counts: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log sum_i n_i e^{s_i/tau}, log sum_{i: v_i = target} n_i e^{s_i/tau})`` per query: the memory's total mass
    and the target's mass, unnormalised. Shapes: scores, values ``[..., k]``; targets ``[...]`` -> two ``[...]``.

    The primitive behind Eq. 2 (:func:`knn_target_logprob` = hit - all) and TRIME's joint softmax
    (:func:`joint_target_logprob`). Both are ``-inf`` for a row with no entry (no hit).
    """
    logits = _logits(scores, values, temperature, log_counts)
    hit = values == targets.to(values.device).unsqueeze(-1)
    return torch.logsumexp(logits, dim=-1), torch.logsumexp(logits.masked_fill(~hit, _NINF), dim=-1)


def knn_weights(
    scores: torch.Tensor, values: torch.Tensor, temperature: float = 1.0, log_counts: torch.Tensor | None = None
) -> torch.Tensor:
    """Log-softmax over the retrieved entries: ``log softmax_i(s_i / tau + log n_i)`` with empty slots (value -1)
    masked out. Returns log-weights of the same shape as ``scores``; a row with no valid entry is all ``-inf``."""
    logits = _logits(scores, values, temperature, log_counts)
    # log_softmax of an all -inf row is nan; make it -inf (no memory mass) instead.
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)
    out = logits - lse
    return torch.where(torch.isfinite(lse), out, torch.full_like(out, _NINF))


def knn_target_logprob(
    scores: torch.Tensor,
    values: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    log_counts: torch.Tensor | None = None,
) -> torch.Tensor:
    """``log p_mem(target | c)`` (Eq. 2) for each query, without building the ``[Q, V]`` distribution.

    Sums the weight of every retrieved entry whose value equals the target (the ``M`` aggregation). ``-inf`` when no
    retrieved entry has the target as value. Shapes: scores, values ``[Q, k]``; targets ``[Q]`` -> ``[Q]``.
    """
    all_, hit = memory_lse(scores, values, targets, temperature, log_counts)
    return torch.where(torch.isfinite(all_), hit - all_, torch.full_like(hit, _NINF))


def value_logsumexp(logw: torch.Tensor, values: torch.Tensor, n_values: int) -> torch.Tensor:
    """``log M exp(logw)``: a per-value logsumexp over the last dim, ``[..., N] -> [..., n_values]``.

    ``values`` is ``[N]`` (shared by every row: a dense ``W_ds``) or ``[..., N]`` like ``logw`` (retrieved entries);
    entries with a negative value are ignored. Done as ``max_v + log sum exp(logw - max_v)`` with the per-value
    maximum ``max_v``, so nothing underflows. ``-inf`` for values with no entry.
    """
    lead = logw.shape[:-1]
    if logw.shape[-1] == 0:  # no entry retrieved (e.g. no candidate span): no value has mass
        return torch.full((*lead, n_values), _NINF, dtype=logw.dtype, device=logw.device)
    flat = logw.reshape(-1, logw.shape[-1])
    values = values.to(flat.device).long()
    idx = values.unsqueeze(0).expand_as(flat) if values.dim() == 1 else values.reshape(flat.shape)
    flat = flat.masked_fill(idx < 0, _NINF)
    idx = idx.clamp(min=0)
    vmax = torch.full((flat.shape[0], n_values), _NINF, dtype=flat.dtype, device=flat.device)
    vmax = vmax.scatter_reduce(-1, idx, flat, reduce="amax", include_self=True)
    shift = torch.where(torch.isfinite(vmax), vmax, torch.zeros_like(vmax))
    summed = torch.zeros_like(vmax).scatter_add(-1, idx, (flat - shift.gather(-1, idx)).exp())
    # A value with no finite mass has summed = 0: log(0) = -inf is the right value, but its gradient 1/0 times the
    # exp'(-inf) = 0 of its entries is NaN. Take the log of 1 there instead and put -inf back with where(), so the
    # -inf entries get a zero gradient (they carry no mass, so nothing moves them).
    has_mass = summed > 0
    out = torch.where(has_mass, torch.where(has_mass, summed, torch.ones_like(summed)).log() + shift, _NINF)
    return out.reshape(*lead, n_values)


def knn_distribution(
    scores: torch.Tensor,
    values: torch.Tensor,
    vocab_size: int,
    temperature: float = 1.0,
    log_counts: torch.Tensor | None = None,
) -> torch.Tensor:
    """The full memory distribution ``log p_mem(. | c)`` over a vocabulary of ``vocab_size`` values (Eq. 2 / Eq. 5).

    Shapes: scores, values ``[..., k]`` -> ``[..., vocab_size]`` log-probabilities (``-inf`` off the retrieved values).
    """
    if values.numel() and int(values.max()) >= vocab_size:
        raise MemlmError(
            f"memory value {int(values.max())} is out of range for a vocabulary of {vocab_size}: "
            "the datastore was built with a different tokenizer; rebuild it with this model's tokenizer"
        )
    return value_logsumexp(knn_weights(scores, values, temperature, log_counts), values, vocab_size)


# ------------------------------------------------------------------------------------------------- combiners


def log_weights_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """``log softmax_i(a_i)`` over the last dim: a gate's mixture weights ``log λ_i = a_i - log sum_j e^{a_j}``
    (:mod:`memlm.core.mixture`, ``a = W φ + b``). ``logits`` float ``[..., C]``, finite."""
    return logits - torch.logsumexp(logits, dim=-1, keepdim=True)


def _log_weights(log_weights: Sequence[Any] | None, weights: Sequence[Any] | None, n: int) -> Sequence[Any]:
    """:func:`mix`'s log-weights, taken from probability-space ``weights`` when given (``math.log`` of numbers, a
    float64 log of tensors; a weight in ``[-1e-9, 0)``, as ``1 - λ - λc`` can round to, is 0), refused unless the
    weights are one per component and sum to 1 (within 1e-6) at every position."""
    if (log_weights is None) == (weights is None):
        raise MemlmError("give the mixture weights once: log_weights (log space) or weights (probability space)")
    given = log_weights if weights is None else weights
    if not n or len(given) != n:
        raise MemlmError(f"a mixture needs one weight per component: {n} components, {len(given)} weights")
    if weights is not None and all(isinstance(w, int | float) and not isinstance(w, bool) for w in weights):
        log_weights = [math.log(w) if w > 0 else _NINF if w >= -1e-9 else math.nan for w in weights]
    elif weights is not None:
        w64 = [torch.as_tensor(w, dtype=torch.float64) for w in weights]
        log_weights = [torch.where(w >= -1e-9, w.clamp(min=0.0), math.nan).log() for w in w64]  # NaN below -1e-9
    with torch.no_grad():
        total = torch.stack(torch.broadcast_tensors(*(torch.as_tensor(w, dtype=torch.float64, device="cpu")
                                                      for w in log_weights))).exp().sum(0)  # fmt: skip
    if not bool(((total - 1.0).abs() <= 1e-6).all()):  # NaN fails too
        shown = f", got {list(given)}" if all(isinstance(w, int | float) for w in given) else ""
        raise MemlmError(f"mixture weights must be >= 0 and sum to 1 at every position (token, grid point){shown}")
    return log_weights


def _weighted(log_probs: Sequence[Any], log_weights: Any, weights: Any) -> Iterator[torch.Tensor]:
    """``log w_j + log p_j`` per component, lazily (``-inf`` where ``w_j = 0``, whatever ``p_j`` holds)."""
    log_weights = _log_weights(log_weights, weights, len(log_probs))
    lps = [torch.as_tensor(lp) for lp in log_probs]
    dtype = functools.reduce(torch.promote_types, (lp.dtype for lp in lps), torch.float32)
    for lp, lw in zip(lps, log_weights, strict=True):
        lw = torch.as_tensor(lw, dtype=dtype, device=lp.device)  # a Python float rounded once, to dtype
        yield torch.where(torch.isneginf(lw), _NINF, lw + lp.to(dtype))


def _log_total(terms: Iterable[torch.Tensor]) -> torch.Tensor:
    """``logsumexp_j`` of the terms, accumulated one at a time (``logaddexp``): no ``[C, ...]`` tensor."""
    total = None
    for term in terms:
        total = term if total is None else torch.logaddexp(total, term)
    assert total is not None  # _weighted refuses no components
    return total


def mix(
    log_probs: Sequence[Any], log_weights: Sequence[Any] | None = None, *, weights: Sequence[Any] | None = None
) -> torch.Tensor:
    """The mixture of distributions given as log-probabilities, in log space: the one combiner of memlm::

        log P = logsumexp_j(log w_j + log p_j) = log sum_j w_j p_j,        sum_j w_j = 1, w_j >= 0

    It is the kNN-LM's interpolation ``(1 - λ) p_LM + λ p_kNN`` (Khandelwal et al. 2020, Eq. 2; Eq. 3 of Xu et al.
    2023), with a continuous cache beside it (Table 1), the ∞-gram's ``λ p∞ + (1 - λ) p_neural`` (Liu et al. 2024,
    Sec. 5), TRIME's Eq. 9, an adaptive per-token λ_t (He et al. 2021) and the learned mixture's
    ``sum_i λ_i(c) P_i`` (:mod:`memlm.core.mixture`).

    ``log_probs``: C tensors (or a tensor ``[C, ...]``) of log-probabilities, ``-inf`` = probability 0. The weights,
    one entry per component, in log space (``log_weights``, ``-inf`` = weight 0) or, keyword-only, in probability
    space (``weights``: numbers or tensors, >= 0, summing to 1; a weight in ``[-1e-9, 0)`` counts as 0). Either way
    the weights must sum to 1 (within 1e-6) at every position, or MemlmError. Entry ``j`` broadcasts against
    ``log_probs[j]`` and the result has the broadcast shape:

    * a number (or 0-dim tensor) per component: constant weights (every paper's fixed λ);
    * a tensor shaped like the log-probabilities (or broadcastable: ``[N, 1]`` for rows ``[N, V]``): per-token
      weights (an adaptive gate's λ_t, the learned mixture's λ(c_t));
    * ``[G, 1, ..., 1]`` beside log-probabilities ``[N, ...]``: a grid of G weightings at once, ``[G, N, ...]`` out
      (a tuning grid in one pass).

    A component of weight 0 contributes nothing there, whatever it holds (``-inf``, NaN: a token whose search was
    skipped); a component with ``log p = -inf`` contributes nothing at any weight; where every weighted component is
    ``-inf`` the result is ``-inf``. Computed in the log-probabilities' floating dtype (float32 at least, float64 when
    one is), the weights rounded to it; accumulated one component at a time with ``logaddexp`` (no ``[C, N, V]``
    tensor over a vocabulary). Differentiable in both arguments.
    """
    return _log_total(_weighted(log_probs, log_weights, weights))


def mix_posterior(log_probs: Sequence[Any], log_weights: Sequence[Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`mix` and its posterior over the components (EM's responsibilities, Dempster et al. 1977)::

        log P = logsumexp_j(log w_j + log p_j),        log r_j = log w_j + log p_j - log P

    Arguments as :func:`mix`'s (log space). ``r`` are the learned mixture's EM step and the weights of its gate's
    gradient (:mod:`memlm.core.mixture`). Where ``P = 0`` every ``log r_j`` is ``-inf``. Returns
    ``(log P [...], log r [C, ...])``, the components stacked first.
    """
    terms = torch.stack(torch.broadcast_tensors(*_weighted(log_probs, log_weights, None)))
    total = _log_total(terms)
    return total, torch.where(torch.isfinite(total), terms - total, _NINF)


def joint_distribution(logits: torch.Tensor, value_masses: Sequence[torch.Tensor]) -> torch.Tensor:
    """TRIME's joint softmax over the vocabulary and the memories as a full distribution (Zhong et al. 2022, Eq. 5 /
    App. A Eq. 6)::

        log P(w | c) = log [exp(E_w f) + sum_m mass_m(w)] - log sum_v [exp(E_v f) + sum_m mass_m(v)]

    ``logits [..., V]`` (``E f``); each ``value_masses[m]`` ``[..., V]`` is a memory's unnormalised per-value mass
    ``log sum_{j: x_j = w} exp(s_j / τ_m)`` (:func:`value_logsumexp`). No memory gives ``log_softmax(E f)``.
    :func:`joint_target_logprob` is the same for the target only.
    """
    joint = torch.logsumexp(torch.stack([logits, *value_masses]), 0)
    return joint - torch.logsumexp(joint, -1, keepdim=True)


def joint_target_logprob(
    target_logit: torch.Tensor, logit_lse: torch.Tensor, memories: Sequence[tuple[torch.Tensor, torch.Tensor]]
) -> torch.Tensor:
    """TRIME's one softmax over the vocabulary and the memories (Zhong et al. 2022, Eq. 5 / App. A Eq. 6)::

        log P(w | c) = logsumexp(E_w f, hit_1, hit_2, ...) - logsumexp(logsumexp_v E_v f, all_1, all_2, ...)

    ``target_logit`` ``[...]`` (``E_w f``), ``logit_lse`` ``[...]`` (``logsumexp_v E_v f``) and, per memory, the
    ``(all, hit)`` pair of :func:`memory_lse` with its own temperature. No memory gives ``log_softmax(E f)_w``.
    """
    num = torch.stack([target_logit, *(hit for _, hit in memories)])
    den = torch.stack([logit_lse, *(all_ for all_, _ in memories)])
    return torch.logsumexp(num, 0) - torch.logsumexp(den, 0)


def perplexity(logprob: torch.Tensor | np.ndarray) -> float:
    """``exp(-mean log p)`` of per-token log-probabilities, in float64.

    ``inf`` when a token has probability 0 or when the mean log-probability is below about -709.78 (the perplexity
    is then beyond float64's range, e.g. a kNN-only mixture, λ = 1, at a small τ); ``nan`` for no tokens.
    """
    lp = torch.as_tensor(logprob)
    if not lp.numel():
        return float("nan")
    nll = -lp.double().mean().item()
    try:
        return math.exp(nll)
    except OverflowError:  # nll > log(float64 max) ~ 709.78
        return float("inf")
