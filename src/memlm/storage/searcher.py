"""Searchers: the top-k search under every memory over stored keys (the ⊗ and mask-to-k of Xu et al. 2023, Eq. 5).

A :class:`Searcher` answers ``search(queries [Q, D], k) -> (scores [Q, k], ids [Q, k])`` (larger = closer, best
first, ``-inf`` / ``-1`` in empty slots), says its ``metric`` (``l2``: negative squared L2; ``ip``: inner product) and
``describe()``s itself for result files. :func:`open_searcher` is the one way to get one for a datastore:

* ``search="index"``: the datastore's own index (:meth:`memlm.storage.datastore.Datastore.searcher`): a
  :class:`FaissSearcher` over a FAISS index read into RAM or memory-mapped, or for a sharded datastore a
  :class:`memlm.storage.sharded_index.ShardedSearcher` (threads or Ray actors over the shards' indexes) -- Xu et al.'s
  "FAISS mask";
* ``search="exact"``: :class:`ExactSearcher`, brute force over all stored keys ("real mask");
* ``scores="exact"`` over an index: :class:`RescoredSearcher`, the index's ids rescored from the stored keys
  (Khandelwal et al. 2020's full-precision distances, Xu et al.'s "real score") and re-sorted.

:class:`memlm.retrieval.DatastoreMemory` holds one; a new index library is a new class with these three members.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import faiss
import numpy as np

from memlm.errors import MemlmError
from memlm.storage import index as index_lib
from memlm.storage.folder import advise_random

__all__ = [
    "ExactSearcher",
    "FaissSearcher",
    "RescoredSearcher",
    "Searcher",
    "as_searcher",
    "datastore_metric",
    "open_searcher",
]

SEARCH_MODES = ("index", "exact")


@runtime_checkable
class Searcher(Protocol):
    """Top-k search over stored keys; see the module docstring."""

    metric: str

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]: ...

    def describe(self) -> dict[str, Any]: ...


class FaissSearcher:
    """A FAISS index (read into RAM or memory-mapped) as a searcher; ``index`` is the FAISS object itself."""

    def __init__(self, index: faiss.Index, path: str | Path | None = None) -> None:
        self.index, self.path = index, None if path is None else Path(path)
        self.metric = index_lib.index_metric(index)

    @property
    def nprobe(self) -> int | None:
        ivf = faiss.try_extract_index_ivf(self.index)
        return None if ivf is None else int(ivf.nprobe)

    def set_nprobe(self, nprobe: int) -> None:
        index_lib.set_nprobe(self.index, nprobe)

    @property
    def ntotal(self) -> int:
        return int(self.index.ntotal)

    @property
    def d(self) -> int:
        return int(self.index.d)

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        return index_lib.search(self.index, queries, k)

    def describe(self) -> dict[str, Any]:
        return {"search": "index", "index": None if self.path is None else str(self.path), "nprobe": self.nprobe,
                "metric": self.metric}  # fmt: skip


class ExactSearcher:
    """Brute force over all keys (:func:`memlm.storage.index.exact_search`), one pass over the keys per call."""

    def __init__(self, keys: np.ndarray, metric: str) -> None:
        index_lib._check_metric(metric)
        self.keys, self.metric, self.nprobe = keys, metric, None

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        return index_lib.exact_search(self.keys, queries, k, self.metric)

    def describe(self) -> dict[str, Any]:
        return {"search": "exact", "index": None, "nprobe": None, "metric": self.metric}


class RescoredSearcher:
    """Another searcher's ids with their similarities recomputed from the stored keys under ``metric`` (default the
    searcher's), re-sorted best first (:func:`memlm.storage.index.exact_scores`). Used for the kNN-LM's full-precision
    distances and for scores that must share one scale across searchers (RetoMaton's pointer rows)."""

    def __init__(self, inner: Searcher, keys: np.ndarray, metric: str | None = None) -> None:
        self.inner, self.keys = inner, keys
        self.metric = metric or inner.metric
        advise_random(keys)  # rescoring reads the keys of scattered ids: no read-ahead

    @property
    def nprobe(self) -> int | None:
        return getattr(self.inner, "nprobe", None)

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        q = np.ascontiguousarray(queries, dtype=np.float32)
        _, ids = self.inner.search(q, k)
        sc = index_lib.exact_scores(self.keys, ids, q, self.metric)
        order = np.argsort(-sc, axis=1, kind="stable")
        return np.take_along_axis(sc, order, 1), np.take_along_axis(ids, order, 1)

    def describe(self) -> dict[str, Any]:
        return {**self.inner.describe(), "scores": "exact", "metric": self.metric}


def as_searcher(index: Any, path: str | Path | None = None) -> Searcher:
    """A searcher from what callers used to pass as ``index=``: a searcher as it is, a FAISS index wrapped."""
    if isinstance(index, faiss.Index):
        return FaissSearcher(index, path)
    if isinstance(index, Searcher):
        return index
    raise MemlmError(f"expected a FAISS index or a searcher (search, metric, describe), got {type(index).__name__}")


def datastore_metric(datastore: Any, index_path: str | Path | None = None) -> str:
    """The similarity of a datastore's index (``l2`` when it has no index yet)."""
    meta = index_lib.read_index_meta(index_path if index_path is not None else datastore.index_path)
    return meta["metric"] if meta else "l2"


def open_searcher(
    datastore: Any,
    search: str = "index",
    scores: str = "index",
    index_path: str | Path | None = None,
    nprobe: int = 32,
    metric: str | None = None,
    base: Any = None,
) -> Searcher:
    """The searcher for ``datastore`` (plain or sharded); see the module docstring.

    ``index_path``: another index of the same datastore (``memlm eval --index``; refused unless built from it).
    ``metric``: the similarity of exact search (default: the index's, ``l2`` without one); with ``search="index"``
    an index of another metric is refused. ``base``: an index already open (a FAISS index or a searcher) in place of
    the datastore's own."""
    if search not in SEARCH_MODES or scores not in SEARCH_MODES:
        raise MemlmError("search and scores must each be 'index' or 'exact'")
    if search == "exact":
        return ExactSearcher(datastore.keys, metric or datastore_metric(datastore, index_path))
    base = datastore.searcher(index_path, nprobe) if base is None else as_searcher(base, index_path)
    if metric is not None and metric != base.metric:
        where = index_path if index_path is not None else datastore.index_path
        raise MemlmError(f"index {where} uses {base.metric}, not {metric}: build an {metric} index")
    return RescoredSearcher(base, datastore.keys) if scores == "exact" else base
