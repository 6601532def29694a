"""From retrieved memory entries to a distribution over values: the one place memlm does it.

Every memory (a kNN-LM datastore, a continuous cache, TRIME's in-batch memories, NPM's reference corpus, a learned
``W_ds``) produces, for each query, the ``scores`` of its retrieved entries and their ``values``. This module turns
them into a distribution over values (Xu et al. 2023, Eq. 5; Khandelwal et al. 2020, Eq. 2)::

    p_mem(w | c) = sum_{i in top-k} 1[v_i = w] * n_i exp(s(h_ds(c), k_i) / tau) / sum_{i in top-k} n_i exp(s_i / tau)

where ``s`` is a similarity (negative squared L2 distance or inner product: larger = closer, :func:`similarity`),
``tau`` a temperature, ``n_i`` the number of original entries merged into entry ``i`` by datastore pruning (He et al.
2021; ``n_i = 1`` without pruning) and the sum over entries that share a value is Xu's ``M``
(:func:`value_logsumexp`). ``mask-to-k`` (:func:`mask_to_k`) keeps the ``k`` best of a dense score row. The LM and
the memory are then interpolated (Eq. 3), with a fixed or a per-token ``lambda``::

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

import math
from collections.abc import Sequence

import numpy as np
import torch

from memlm.errors import MemlmError

__all__ = [
    "METRICS",
    "check_metric",
    "check_temperature",
    "interpolate",
    "interpolate_per_token",
    "joint_distribution",
    "joint_target_logprob",
    "log_weights_from_logits",
    "knn_distribution",
    "knn_target_logprob",
    "knn_weights",
    "mask_to_k",
    "memory_lse",
    "mix_log_distributions",
    "mix_logprobs",
    "mix_logprobs_per_token",
    "mixture_posterior",
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


def interpolate(lm_logprob: torch.Tensor, mem_logprob: torch.Tensor, lam: float) -> torch.Tensor:
    """Eq. 3 in log space: ``log((1 - lambda) * p_LM + lambda * p_mem)``; works on any matching shapes."""
    return mix_logprobs([lm_logprob, mem_logprob], [1.0 - lam, lam])


def _as_logprob(x, name: str) -> torch.Tensor:
    t = torch.as_tensor(x)
    if not t.is_floating_point():
        raise MemlmError(f"{name} must hold float log-probabilities, got {t.dtype}")
    return t.to(torch.float64) if t.dtype == torch.float64 else t.float()


def interpolate_per_token(lm_logprob, knn_logprob, lam) -> torch.Tensor:
    """Eq. 3 with a per-token λ in log space: ``log((1 - λ_t) p_LM + λ_t p_kNN)`` (He et al. 2021's adaptive gate).

    ``lam`` is a tensor/array of per-token weights in ``[0, 1]`` (or a scalar). The convention of
    :func:`mix_logprobs`: log-probabilities in, ``-inf`` = probability 0; a component with
    weight 0 is left out, so where ``λ_t = 0`` the result is exactly ``log p_LM`` whatever ``knn_logprob`` holds
    there (``-inf``, nan or garbage: a token whose search was skipped), and where ``λ_t = 1`` exactly ``log p_kNN``.
    """
    lm = _as_logprob(lm_logprob, "lm_logprob")
    knn = _as_logprob(knn_logprob, "knn_logprob").to(lm.dtype)
    lam = torch.as_tensor(lam, dtype=torch.float64)
    if torch.isnan(lam).any() or (lam < 0).any() or (lam > 1).any():
        raise MemlmError("per-token λ must be in [0, 1]")
    lam = torch.broadcast_to(lam, torch.broadcast_shapes(lam.shape, lm.shape, knn.shape))
    neg_inf = torch.tensor(float("-inf"), dtype=lm.dtype)
    w_lm = torch.log1p(-lam).to(lm.dtype)  # -inf at λ = 1
    w_knn = torch.log(lam).to(lm.dtype)  # -inf at λ = 0
    a = torch.where(lam < 1, lm + w_lm, neg_inf)
    b = torch.where(lam > 0, knn + w_knn, neg_inf)
    return torch.logsumexp(torch.stack([a, b]), dim=0)


def mix_logprobs(logprobs: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """``log sum_j w_j p_j`` for a mixture of distributions given as log-probabilities (weights sum to 1).

    Used for LM + kNN (Eq. 3), LM + kNN + continuous cache (Khandelwal et al. Table 1) and TRIME's Eq. 9. Computed
    in float32, or float64 when an input is float64. A component with weight 0 contributes nothing, whatever it holds.
    """
    if len(logprobs) != len(weights) or not logprobs:
        raise MemlmError("mix_logprobs needs one weight per distribution")
    if any(w < -1e-9 for w in weights) or not math.isclose(sum(weights), 1.0, abs_tol=1e-6):
        raise MemlmError(f"interpolation weights must be >= 0 and sum to 1, got {list(weights)}")
    weights = [max(0.0, w) for w in weights]  # 1 - λ - λc can round to -1e-17
    dtype = torch.float64 if any(lp.dtype == torch.float64 for lp in logprobs) else torch.float32
    terms = [
        lp.to(dtype) + math.log(w) if w > 0 else torch.full_like(lp, _NINF, dtype=dtype)
        for lp, w in zip(logprobs, weights, strict=True)
    ]
    return torch.logsumexp(torch.stack(terms), dim=0)


def mix_logprobs_grid(logprobs: Sequence[torch.Tensor], weights: Sequence[Sequence[float]]) -> torch.Tensor:
    """:func:`mix_logprobs` for a grid of weightings at once: ``out[g] = log sum_j w_j[g] p_j`` of shape
    ``[G, *logprobs[0].shape]``, ``weights[j][g]`` the weight of component ``j`` in weighting ``g`` (each weighting's
    weights >= 0, summing to 1; clamped at 0 as there). Same dtype rule as :func:`mix_logprobs`, and a component with
    weight 0 contributes nothing. Used to tune a weight over a grid in one pass (e.g. the ∞-gram's λ_sparse)."""
    if len(logprobs) != len(weights) or not logprobs:
        raise MemlmError("mix_logprobs_grid needs one weight row per distribution")
    w = torch.tensor([[float(x) for x in row] for row in weights], dtype=torch.float64)  # [J, G]
    ones = torch.ones(w.shape[-1], dtype=w.dtype)
    if w.ndim != 2 or bool((w < -1e-9).any()) or not torch.allclose(w.sum(0), ones, rtol=0.0, atol=1e-6):
        raise MemlmError("every weighting of mix_logprobs_grid must have weights >= 0 that sum to 1")
    w = w.clamp_min(0.0)  # 1 - λ - w can round to -1e-17
    dtype = torch.float64 if any(lp.dtype == torch.float64 for lp in logprobs) else torch.float32
    shape = (-1,) + (1,) * logprobs[0].ndim
    terms = [
        torch.where(wj.view(shape) > 0, lp.to(dtype)[None] + wj.clamp_min(1e-300).log().to(dtype).view(shape), _NINF)
        for lp, wj in zip(logprobs, w, strict=True)
    ]
    return torch.logsumexp(torch.stack(terms), dim=0)


def mix_logprobs_per_token(logprobs: Sequence[torch.Tensor], weights: Sequence[torch.Tensor | float]) -> torch.Tensor:
    """:func:`mix_logprobs` with per-token weights: ``log sum_j w_j(t) p_j(t)``, computed in float64.

    Each ``weights[j]`` is a scalar or a tensor broadcastable to the log-probabilities (e.g. an adaptive gate's
    ``λ_t``, He et al. 2021); at every token the weights are >= 0 and sum to 1. A component with weight 0 at a token
    contributes nothing there, whatever it holds (``-inf``, nan: a token whose search was skipped).
    """
    if len(logprobs) != len(weights) or not logprobs:
        raise MemlmError("mix_logprobs_per_token needs one weight per distribution")
    lp = torch.stack([torch.as_tensor(x).double() for x in torch.broadcast_tensors(*logprobs)])
    w = torch.stack([torch.as_tensor(x, dtype=torch.float64).expand(lp.shape[1:]) for x in weights])
    if torch.isnan(w).any() or (w < -1e-9).any() or not torch.allclose(w.sum(0), torch.ones(()).double(), atol=1e-6):
        raise MemlmError("per-token interpolation weights must be >= 0 and sum to 1 at every token")
    w = w.clamp(min=0.0)  # 1 - λ_t - λc can round to -1e-17
    return torch.logsumexp(torch.where(w > 0, lp + w.log(), _NINF), dim=0)


def log_weights_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """``log softmax_i(a_i)`` over the last dim: a gate's mixture weights ``log λ_i = a_i - log sum_j e^{a_j}``
    (:mod:`memlm.core.mixture`, ``a = W φ + b``). ``logits`` float ``[..., C]``, finite."""
    return logits - torch.logsumexp(logits, dim=-1, keepdim=True)


def mix_log_distributions(logprobs: Sequence[torch.Tensor], log_weights: torch.Tensor) -> torch.Tensor:
    """``log sum_i λ_ti p_ti`` with per-row weights, for targets or whole distributions::

        log P(w | c_t) = logsumexp_i(log λ_ti + log p_i(w | c_t))

    ``logprobs[i]`` is component i's log-probabilities, ``[N]`` (of each target) or ``[N, V]`` (over the
    vocabulary); ``log_weights`` ``[N, C]`` (``-inf`` = weight 0: that component contributes nothing there, whatever
    it holds). Accumulated one component at a time (no ``[N, V, C]`` tensor), in the floating dtype of the
    log-probabilities (float64 when the weights are and the inputs are one value per row)."""
    if not logprobs or log_weights.ndim != 2 or log_weights.shape[1] != len(logprobs):
        raise MemlmError(f"mix_log_distributions needs [rows, {len(logprobs)}] log-weights, one column per "
                         f"component; got {tuple(log_weights.shape)}")  # fmt: skip
    first = torch.as_tensor(logprobs[0])
    dtype = torch.promote_types(first.dtype, torch.float32)
    if first.ndim == 1:
        dtype = torch.promote_types(dtype, log_weights.dtype)
    out = None
    for i, lp in enumerate(logprobs):
        lp = torch.as_tensor(lp).to(dtype)
        lw = log_weights[:, i].to(device=lp.device, dtype=dtype).reshape(-1, *([1] * (lp.ndim - 1)))
        term = torch.where(torch.isneginf(lw), _NINF, lw + lp)
        out = term if out is None else torch.logaddexp(out, term)
    return out


def mixture_posterior(logprobs: torch.Tensor, log_weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A mixture ``P_t = sum_i λ_ti p_ti`` and its posterior over components, in log space::

        log P_t = logsumexp_i(log λ_ti + log p_ti),     log r_ti = log λ_ti + log p_ti - log P_t

    ``logprobs`` ``[..., C]`` (``-inf`` = probability 0), ``log_weights`` broadcastable to it (``-inf`` = weight 0).
    ``r`` are EM's responsibilities and the weights of the gate's gradient (:mod:`memlm.core.mixture`). A component
    with weight 0 contributes nothing whatever it holds; where ``P_t = 0`` every ``log r_ti`` is ``-inf``.
    Returns ``(log P [...], log r [..., C])``.
    """
    logprobs, log_weights = torch.broadcast_tensors(logprobs, log_weights)
    terms = torch.where(torch.isneginf(log_weights), _NINF, log_weights + logprobs)
    total = torch.logsumexp(terms, dim=-1)
    posterior = torch.where(torch.isfinite(total).unsqueeze(-1), terms - total.unsqueeze(-1), _NINF)
    return total, posterior


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
