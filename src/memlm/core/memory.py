"""The memory protocol: anything that answers ``search(queries, k) -> Retrieved(scores, values, ids)``.

Xu et al. (2023, Eq. 5) write every memory-augmented LM with one ``W_ds``: a datastore of training contexts
(kNN-LM), the current segment, earlier segments or other sequences of the batch (TRIME's local, long-term and
external memories), a learned matrix, or every token of a reference corpus (NPM). In memlm each is a ``Memory``:

* :class:`DenseMemory` (here): exact search over an in-memory ``[N, D]`` matrix with values, an optional scale and
  a per-query visibility mask (TRIME's local and long-term memories);
* :class:`memlm.retrieval.DatastoreMemory`: a datastore folder with its FAISS index (approximate), exact search,
  index or exact scores, a sharded datastore, self-match removal, merged counts of a pruned datastore (the kNN-LM,
  its generation and lm-eval adapter, TRIME's external memory);
* :func:`memlm.knnlm.pointer.pointer_retrieve`: RetoMaton's pointer reuse over a datastore memory's search;
* :func:`memlm.knnlm.cache.continuous_cache`: the evaluated document's own earlier positions (Grave et al. 2017c);
* :class:`memlm.npm.inference.PhraseMemory`: NPM's phrase index (every token of a reference corpus).

What comes back is always the same :class:`Retrieved`: ``scores [Q, k]`` (larger = closer; ``-inf`` in empty
slots), ``values [Q, k]`` (``-1`` in empty slots), ``ids [Q, k]`` (the entries' row numbers, ``-1`` when empty) and
optionally ``log_counts`` (pruning). :mod:`memlm.core.distribution` turns it into a distribution; nothing else does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np
import torch

from memlm.core.distribution import check_metric, similarity
from memlm.errors import MemlmError

__all__ = ["DenseMemory", "Memory", "Retrieved"]


@dataclass
class Retrieved:
    """What a memory returns for ``Q`` queries: ``k`` entries each, best first, empty slots ``-inf`` / ``-1``."""

    scores: np.ndarray | torch.Tensor  # [Q, k] float, larger = closer
    values: np.ndarray | torch.Tensor  # [Q, k] int, -1 in empty slots
    ids: np.ndarray | torch.Tensor  # [Q, k] int64, -1 in empty slots
    log_counts: np.ndarray | torch.Tensor | None = None  # [Q, k] log of merged entries per slot (pruned datastores)

    def __len__(self) -> int:
        return len(self.scores)

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``(scores, values as int64, log_counts)`` as torch tensors for :mod:`memlm.core.distribution`."""
        as_t = torch.as_tensor
        counts = None if self.log_counts is None else as_t(self.log_counts)
        return as_t(self.scores), as_t(self.values).long(), counts


@runtime_checkable
class Memory(Protocol):
    """Anything that retrieves ``k`` (score, value) entries per query."""

    def search(self, queries: np.ndarray, k: int) -> Retrieved: ...


class DenseMemory:
    """Exact search over an in-memory ``W_ds`` (``keys [N, D]``, ``values [N]``), on CPU or GPU, differentiable.

    ``score = scale * (keys (x) query)`` with ``(x)`` the inner product or negative squared L2 distance
    (:func:`memlm.core.distribution.similarity`); ``visible [Q, N]`` (optional, per call) hides entries from some
    queries (TRIME's local memory: only earlier positions). ``k >= N`` returns every entry in row order (no sort):
    the form TRIME's joint softmax and Xu's Eq. 4 (``k = N_ds``) use.
    """

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, metric: str = "ip", scale: float = 1.0) -> None:
        check_metric(metric)
        if keys.dim() != 2 or values.shape != keys.shape[:1]:
            raise MemlmError(f"a dense memory needs keys [N, D] and values [N], got {tuple(keys.shape)}, "
                             f"{tuple(values.shape)}")  # fmt: skip
        self.keys, self.values, self.metric, self.scale = keys, values.long(), metric, float(scale)

    def __len__(self) -> int:
        return int(self.keys.shape[0])

    def search(self, queries: torch.Tensor, k: int, visible: torch.Tensor | None = None) -> Retrieved:
        q = torch.as_tensor(queries)
        if self.metric == "ip":  # in the queries' dtype (autograd and autocast as the caller set them)
            scores = (q @ self.keys.to(q.dtype).T) * self.scale
        else:
            scores = similarity(q, self.keys, "l2") * self.scale
        n = len(self)
        values = self.values.to(scores.device).unsqueeze(0).expand(scores.shape[0], n)
        ids = torch.arange(n, device=scores.device).unsqueeze(0).expand_as(values)
        if visible is not None:
            values = values.masked_fill(~visible, -1)
            scores = scores.masked_fill(~visible, float("-inf"))
            ids = ids.masked_fill(~visible, -1)
        if k < n:
            scores, order = torch.topk(scores, k, dim=-1)
            values, ids = values.gather(-1, order), ids.gather(-1, order)
            values = values.masked_fill(~torch.isfinite(scores), -1)
        return Retrieved(scores, values, ids)
