"""Memories other than a datastore: the continuous cache over earlier positions of the evaluated document.

Continuous cache (Grave et al. 2017c; combined with kNN-LM in Khandelwal et al. 2020, Table 1)::

    p_cache(w | h_t) ∝ sum_{i < t, same document, t - i <= max_len} 1[x_{i+1} = w] exp(s(h_t, h_i) / tau)

The cache is just another memory: it returns (scores, values) for each query, which
:func:`memlm.core.distribution.knn_weights` turns into a distribution exactly like datastore neighbours. Its entries are
the evaluated text's own (key, next token) pairs, i.e. what a datastore built from the document so far would hold.
"""

from __future__ import annotations

import numpy as np
import torch

from memlm.errors import MemlmError

__all__ = ["continuous_cache"]


def _similarity(q: torch.Tensor, k: torch.Tensor, metric: str) -> torch.Tensor:
    if metric == "ip":
        return q @ k.T
    if metric == "l2":
        return -(q.pow(2).sum(-1, keepdim=True) - 2 * q @ k.T + k.pow(2).sum(-1)[None, :])
    raise MemlmError(f"unknown metric {metric!r}: use 'l2' or 'ip'")


def continuous_cache(
    keys: np.ndarray,
    targets: np.ndarray,
    doc_index: np.ndarray,
    k: int = 256,
    max_len: int = 2048,
    metric: str = "ip",
    block: int = 1024,
) -> tuple[np.ndarray, np.ndarray]:
    """Top-``k`` cache entries for every position of an evaluated stream.

    ``keys[n]`` is the representation of the context of target ``targets[n]`` (stream order), ``doc_index[n]`` its
    document. Entry ``m`` is visible to query ``n`` when ``m < n``, both are in the same document and
    ``n - m <= max_len``. Returns ``(scores [N, k] float32, values [N, k] int64)``, ``-inf`` / ``-1`` in empty slots.
    """
    n = len(targets)
    scores = np.full((n, k), -np.inf, dtype=np.float32)
    values = np.full((n, k), -1, dtype=np.int64)
    keys_t = torch.from_numpy(np.ascontiguousarray(keys, dtype=np.float32))
    targets_t = torch.from_numpy(np.asarray(targets, dtype=np.int64))
    # documents are contiguous runs in the stream
    bounds = np.flatnonzero(np.diff(doc_index)) + 1
    starts = np.concatenate([[0], bounds])
    ends = np.concatenate([bounds, [n]])
    for s, e in zip(starts.tolist(), ends.tolist(), strict=True):
        for q0 in range(s + 1, e, block):
            q1 = min(q0 + block, e)
            m0 = max(s, q0 - max_len)
            sim = _similarity(keys_t[q0:q1], keys_t[m0:q1], metric)  # [q, m]
            qpos = torch.arange(q0, q1)[:, None]
            mpos = torch.arange(m0, q1)[None, :]
            visible = (mpos < qpos) & (qpos - mpos <= max_len)
            sim = sim.masked_fill(~visible, float("-inf"))
            kk = min(k, sim.shape[1])
            top, idx = sim.topk(kk, dim=1)
            vals = targets_t[m0:q1][idx]
            vals = vals.masked_fill(torch.isinf(top), -1)
            scores[q0:q1, :kk] = top.numpy()
            values[q0:q1, :kk] = vals.numpy()
    return scores, values
