"""Memories other than a datastore: the continuous cache over earlier positions of the evaluated document.

Continuous cache (Grave et al. 2017c; combined with kNN-LM in Khandelwal et al. 2020, Table 1)::

    p_cache(w | h_t) ∝ sum_{i < t, same document, t - i <= max_len} 1[x_{i+1} = w] exp(s(h_t, h_i) / tau)

The cache is just another memory: it returns (scores, values) for each query, which
:func:`memlm.core.distribution.knn_weights` turns into a distribution exactly like datastore neighbours. Its entries are
the evaluated text's own (key, next token) pairs, i.e. what a datastore built from the document so far would hold.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import torch

from memlm.errors import MemlmError
from memlm.mixing.component import Batch, Component, Step
from memlm.mixing.inputs import memory_logprob, neighbour_features
from memlm.models.keys import KeySpec

__all__ = ["CacheComponent", "continuous_cache"]


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


class CacheComponent(Component):
    """The continuous cache as a component of the mixture (:mod:`memlm.mixing.component`): each target's ``k`` best
    earlier positions of its own document (at most ``max_len`` back), keyed by the final hidden state (what the
    softmax reads, as Grave et al.), mixed at temperature ``temperature``. Columns ``scores`` / ``values`` ``[N, k]``;
    features the top score and the empty flag (a document's first token). Scoring only: at a generation step the
    cache would need every earlier step's state, which generation does not keep (one MemlmError)."""

    kind: ClassVar[str] = "cache"
    key_spec = KeySpec("final", -1)

    def __init__(self, k: int = 256, max_len: int = 2048, metric: str = "ip", temperature: float = 1.0) -> None:
        self.k, self.max_len, self.metric, self.temperature = int(k), int(max_len), metric, float(temperature)

    @classmethod
    def from_description(cls, description) -> CacheComponent:
        """Its saved columns read at the recorded settings."""
        d = description
        return cls(
            int(d.get("k", 256)), int(d.get("max_len", 2048)), d.get("metric", "ip"), float(d.get("temperature", 1.0))
        )

    def score(self, batch: Batch) -> dict[str, np.ndarray]:
        if batch.targets is None or batch.doc_index is None:
            raise MemlmError("the cache scores a stream of targets in their documents: the batch needs both")
        scores, values = continuous_cache(batch.query(self.key_spec), batch.targets, batch.doc_index, self.k,
                                          self.max_len, self.metric)  # fmt: skip
        return {"scores": scores, "values": values.astype(np.int32)}

    def logprob(self, columns, targets, temperature: float | None = None) -> torch.Tensor:
        tau = self.temperature if temperature is None else temperature
        return memory_logprob(columns["scores"], columns["values"], targets, tau).double()

    def features(self, columns, temperature: float | None = None) -> dict[str, np.ndarray]:
        tau = self.temperature if temperature is None else temperature
        found = neighbour_features(np.asarray(columns["scores"]), np.asarray(columns["values"]), tau)
        return {"top_score": found["top_score"], "empty": found["empty"]}

    def step(self, batch: Batch) -> Step:
        raise MemlmError("the continuous cache scores a corpus (memlm eval --cache); generation, memlm.wrap and "
                         "lm-eval have no cache: leave it out of their memories")  # fmt: skip

    def describe(self) -> dict:
        return {"kind": self.kind, "k": self.k, "max_len": self.max_len, "metric": self.metric,
                "temperature": self.temperature}  # fmt: skip
