"""From retrieved memory entries to a distribution over values, and interpolation with the LM.

This module is the spine of memlm. Every memory (a kNN-LM datastore, a continuous cache, TRIME's in-batch memories,
NPM's reference corpus) produces, for each query, the ``scores`` of its retrieved entries and their ``values``. One
function turns them into a distribution over values (Xu et al. 2023, Eq. 5; Khandelwal et al. 2020, Eq. 2)::

    p_mem(w | c) = sum_{i in top-k} 1[v_i = w] * softmax_i( s(h_ds(c), k_i) / tau )

where ``s`` is a similarity (negative squared L2 distance or inner product: larger = closer), ``tau`` a temperature and
the sum over entries that share a value is Xu's ``M``. The LM and the memory are then interpolated (Eq. 3)::

    p(w | c) = (1 - lambda) * p_LM(w | c) + lambda * p_mem(w | c)

done in log space so that a memory that gives the target zero probability costs nothing numerically.

A pruned datastore (:mod:`memlm.knnlm.prune`, He et al. 2021 Sec. 5.2) stores one entry for ``c_i`` merged ones;
its count enters the softmax as a multiplicity, ``p_mem(w) ∝ sum_{i: v_i = w} c_i * exp(s_i / tau)``: pass
``log_counts = log c_i`` (same shape as ``scores``; ``None`` = every count 1), which is added to the logits.

Conventions: ``scores`` is float ``[..., k]``; ``values`` is integer ``[..., k]`` with ``-1`` marking an empty slot
(fewer than k neighbours); empty slots get score ``-inf``. Everything here is plain torch on CPU or GPU and has a
brute-force NumPy reference in ``tests/test_knn.py``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from memlm.errors import MemlmError

__all__ = [
    "knn_weights",
    "knn_target_logprob",
    "knn_distribution",
    "interpolate",
    "mix_logprobs",
]


def knn_weights(
    scores: torch.Tensor,
    values: torch.Tensor,
    temperature: float = 1.0,
    log_counts: torch.Tensor | None = None,
) -> torch.Tensor:
    """Log-softmax over the retrieved entries: ``log softmax_i(s_i / tau + log c_i)`` with empty slots (value -1)
    masked out.

    ``log_counts`` (``log c_i``, same shape as ``scores``; ``None``: all counts 1) weighs entry ``i`` as ``c_i`` copies
    of itself (a merged entry of a pruned datastore). Returns log-weights of the same shape as ``scores``; a row with
    no valid entry is all ``-inf``.
    """
    if temperature <= 0:
        raise MemlmError(f"temperature must be > 0, got {temperature}")
    if scores.shape != values.shape:
        raise MemlmError(f"scores {tuple(scores.shape)} and values {tuple(values.shape)} must have the same shape")
    logits = scores.to(torch.promote_types(scores.dtype, torch.float32)) / temperature  # fp16/bf16 -> fp32
    if log_counts is not None:
        if log_counts.shape != scores.shape:
            raise MemlmError(
                f"log_counts {tuple(log_counts.shape)} must have the shape of scores {tuple(scores.shape)}"
            )
        logits = logits + log_counts.to(device=logits.device, dtype=logits.dtype)
    logits = logits.masked_fill(values < 0, float("-inf"))
    # log_softmax of an all -inf row is nan; make it -inf (no memory mass) instead.
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)
    out = logits - lse
    return torch.where(torch.isfinite(lse), out, torch.full_like(out, float("-inf")))


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
    ``log_counts``: see :func:`knn_weights`.
    """
    logw = knn_weights(scores, values, temperature, log_counts)
    hit = values == targets.unsqueeze(-1)
    return torch.logsumexp(logw.masked_fill(~hit, float("-inf")), dim=-1)


def knn_distribution(
    scores: torch.Tensor,
    values: torch.Tensor,
    vocab_size: int,
    temperature: float = 1.0,
    log_counts: torch.Tensor | None = None,
) -> torch.Tensor:
    """The full memory distribution ``log p_mem(. | c)`` over a vocabulary of ``vocab_size`` values (Eq. 2 / Eq. 5).

    Shapes: scores, values ``[..., k]`` -> ``[..., vocab_size]`` log-probabilities (``-inf`` off the retrieved values).
    ``log_counts``: see :func:`knn_weights`.
    """
    if values.numel() and int(values.max()) >= vocab_size:
        raise MemlmError(
            f"memory value {int(values.max())} is out of range for a vocabulary of {vocab_size}: "
            "the datastore was built with a different tokenizer; rebuild it with this model's tokenizer"
        )
    weights = knn_weights(scores, values, temperature, log_counts).exp()
    probs = torch.zeros(*scores.shape[:-1], vocab_size, dtype=weights.dtype, device=weights.device)
    probs.scatter_add_(-1, values.clamp(min=0).long(), weights)  # empty slots have weight 0
    return probs.log()


def interpolate(lm_logprob: torch.Tensor, mem_logprob: torch.Tensor, lam: float) -> torch.Tensor:
    """Eq. 3 in log space: ``log((1 - lambda) * p_LM + lambda * p_mem)``; works on any matching shapes."""
    return mix_logprobs([lm_logprob, mem_logprob], [1.0 - lam, lam])


def mix_logprobs(logprobs: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """``log sum_j w_j p_j`` for a mixture of distributions given as log-probabilities (weights sum to 1).

    Used for LM + kNN (Eq. 3) and LM + kNN + continuous cache (Khandelwal et al. Table 1).
    """
    if len(logprobs) != len(weights) or not logprobs:
        raise MemlmError("mix_logprobs needs one weight per distribution")
    if any(w < -1e-9 for w in weights) or not math.isclose(sum(weights), 1.0, abs_tol=1e-6):
        raise MemlmError(f"interpolation weights must be >= 0 and sum to 1, got {list(weights)}")
    weights = [max(0.0, w) for w in weights]  # 1 - λ - λc can round to -1e-17
    terms = [
        lp.float() + math.log(w) if w > 0 else torch.full_like(lp, float("-inf"), dtype=torch.float32)
        for lp, w in zip(logprobs, weights, strict=True)
    ]
    return torch.logsumexp(torch.stack(terms), dim=0)
