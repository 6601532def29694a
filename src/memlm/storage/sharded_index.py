"""A sharded FAISS index: one quantizer trained once, one index per shard, searched in parallel and merged.

**Build** (:func:`build_sharded_index`). The index is trained once, exactly as :func:`memlm.storage.index.build_index`
trains a one-process index: ``train_size`` keys sampled without replacement with ``seed`` from *all* entries (global
ids, so every shard contributes in proportion to its size). The trained, empty index (IVF coarse quantizer, PQ/SQ
codebooks) is saved as ``index.faiss.trained``; each shard's index is a copy of it filled with that shard's keys (FAISS
``read_index`` of the trained file + ``add``), in parallel: Ray tasks with ``ray=``, else a thread pool. Every shard
index stores *local* ids ``0 .. n_s - 1``, so a shard folder stays a normal datastore with a normal index; the
searcher adds the shard's offset. An IVF list of the sharded index is the union of the shards' lists for the same
centroid, so at equal ``nprobe`` every query probes the same centroids and scans the same entries as one index over
all keys with this quantizer, and the merged top-k are the same (up to ties in score).

    files: index.faiss.json (description: factory, metric, n, d, shards, trained file's SHA-256),
           index.faiss.trained, shard-*/index.faiss (+ .json)

**Search** (:class:`ShardedSearcher`). Each shard index is opened memory-mapped (``IO_FLAG_MMAP``: IVF lists are read
from the file through the page cache; flat codes with ``IO_FLAG_MMAP_IFC``), searched for the top-k, its ids shifted
by the shard's offset, and the S lists merged:

    top-k(q) = k best of  ⋃_s { (score, offset_s + id) : (score, id) in top-k_s(q) }

which equals the top-k of one index over all entries (any entry of the global top-k is in its own shard's top-k).
Shards are searched by a thread pool (FAISS releases the GIL) or by Ray actors, one per shard (``ray=``).
"""

from __future__ import annotations

import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import faiss
import numpy as np

from memlm.errors import MemlmError
from memlm.io.fileio import atomic_write_json, sha256_file, unique_tmp
from memlm.storage import index as index_lib
from memlm.storage.index import load_index_mmap, set_nprobe

__all__ = [
    "ShardedSearcher",
    "faiss_gpus",
    "to_gpu_if_available",
    "build_sharded_index",
    "load_index_mmap",
    "merge_topk",
    "search_with_offset",
]

TRAINED_SUFFIX = ".trained"


def _write_index(index: faiss.Index, path: Path) -> None:
    tmp = unique_tmp(path)
    try:
        faiss.write_index(index, str(tmp))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _read_sidecar(index_path: str | Path) -> dict[str, Any] | None:
    """The JSON beside a shard index or a sharded index description (``<name>.json``); ``None`` if absent.

    Not :func:`memlm.storage.index.read_index_meta`: a sharded datastore's ``index.faiss.json`` describes shard indexes
    and has no ``index.faiss`` file of its own, and a shard index records the trained index it was filled from.
    """
    side = index_lib.meta_path(index_path)
    if not side.is_file():
        return None
    try:
        meta = json.loads(side.read_text())
    except (OSError, ValueError) as e:
        raise MemlmError(f"{side} is unreadable ({e}); rebuild it with `memlm index build DIR`") from None
    if not isinstance(meta, dict):
        raise MemlmError(f"{side} is not an index description (a JSON object); rebuild it with `memlm index build DIR`")
    return meta


# ------------------------------------------------------------------------------------------------------- build


def add_shard_index(trained: str, keys_path: str, n: int, d: int, out: str, meta: dict, chunk_size: int = 65536) -> int:
    """Fill a copy of the trained index at ``trained`` with the ``[n, d]`` float16 keys at ``keys_path``; save it."""
    index = faiss.read_index(trained)
    keys = np.memmap(keys_path, dtype=np.float16, mode="r", shape=(n, d))
    for s in range(0, n, chunk_size):
        index.add(np.ascontiguousarray(keys[s : s + chunk_size], dtype=np.float32))
    out_path = Path(out)
    _write_index(index, out_path)
    # the shard folder's identity, so the shard opens as a normal datastore whose index load_index accepts
    source = index_lib.expected_source(out_path)
    atomic_write_json(index_lib.meta_path(out_path), {**meta, "n": n, "shard_index": True, "source": source}, False)
    return n


def build_sharded_index(
    datastore,
    factory: str | None = None,
    metric: str = "l2",
    train_size: int | None = None,
    seed: int = 0,
    name: str = "index.faiss",
    ray: str | None = None,
    workers: int = 1,
    chunk_size: int = 65536,
    progress: bool = True,
) -> dict[str, Any]:
    """Train once on a sample of all shards of ``datastore`` (a ShardedDatastore) and fill one index per shard.

    ``factory=None``: :func:`memlm.storage.index.default_factory` for the *total* number of entries. ``workers`` threads
    add the shards in this process; ``ray`` (an address or ``"local"``) adds them as Ray tasks instead. A rerun keeps
    the shard indexes already filled from the same trained file. Returns the description written to ``<name>.json``.
    """
    t0 = time.perf_counter()
    n, d = len(datastore), datastore.dim
    plan = index_lib.plan_index(n, d, factory, metric, train_size)
    folder = Path(datastore.path)
    trained_path = folder / (name + TRAINED_SUFFIX)
    if progress:
        print(f"sharded {plan} in {len(datastore.shards)} shards", file=sys.stderr, flush=True)
    # as build_index, on a sample of all shards' keys by global id
    index = index_lib.trained_index(datastore.keys, plan, seed, chunk_size, progress, " from all shards")
    _write_index(index, trained_path)
    trained_sha = sha256_file(trained_path)
    common = {
        "factory": plan.factory,
        "metric": metric,
        "d": d,
        "train_size": plan.train_size,
        "seed": seed,
        "chunk_size": chunk_size,
        "faiss_version": faiss.__version__,
        "trained_sha256": trained_sha,
    }
    jobs = []
    for shard in datastore.shards:
        out = shard.path / name
        meta = _read_sidecar(out)
        if out.is_file() and meta and meta.get("trained_sha256") == trained_sha and meta.get("n") == len(shard):
            continue  # filled by an earlier run from the same trained index
        mem, disk = index_lib._index_bytes(index, len(shard))
        meta_s = {**common, "memory_bytes": mem, "disk_bytes": disk}
        jobs.append((str(trained_path), str(shard.path / "keys.bin"), len(shard), d, str(out), meta_s))
    if progress:
        print(f"adding {len(jobs)} of {len(datastore.shards)} shard indexes", file=sys.stderr, flush=True)
    if jobs and ray is not None:
        from memlm.storage.ray_backend import add_shard_indexes_on_ray

        add_shard_indexes_on_ray(ray, jobs, add_shard_index)
    elif jobs:
        with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
            list(pool.map(lambda j: add_shard_index(*j, chunk_size=chunk_size), jobs))
    description = {
        **common,
        "n": n,
        "memory_bytes": plan.memory_bytes,
        "disk_bytes": plan.disk_bytes,
        "sharded": True,
        "trained": trained_path.name,
        "shards": [str(Path(s.path).name) + "/" + name for s in datastore.shards],
        "offsets": [int(o) for o in datastore.offsets],
        "build_seconds": round(time.perf_counter() - t0, 3),
    }
    atomic_write_json(index_lib.meta_path(folder / name), description, sort_keys=False)
    return description


# ------------------------------------------------------------------------------------------------------- search


def faiss_gpus() -> int:
    """GPUs FAISS can use here: 0 with the CPU wheel (``faiss-cpu``), else ``faiss.get_num_gpus()``."""
    get = getattr(faiss, "get_num_gpus", None)
    try:
        return int(get()) if get is not None and hasattr(faiss, "StandardGpuResources") else 0
    except RuntimeError:
        return 0


def to_gpu_if_available(index: faiss.Index, device: str = "auto") -> faiss.Index:
    """``index`` copied to all GPUs when ``device`` is ``auto``/``cuda`` and a GPU FAISS build sees one, else as is.

    (Untested here: the machines this was written on have no GPU and the CPU wheel; with ``device="cuda"`` and no GPU
    FAISS a :class:`MemlmError` says so.)
    """
    if device == "cpu":
        return index
    if faiss_gpus() == 0:
        if device.startswith("cuda"):
            raise MemlmError("--device cuda for search needs a GPU build of FAISS (faiss-gpu) and a GPU; use cpu")
        return index
    return faiss.index_cpu_to_all_gpus(index)


def search_with_offset(index: faiss.Index, queries: np.ndarray, k: int, offset: int) -> tuple[np.ndarray, np.ndarray]:
    """:func:`memlm.storage.index.search` with valid ids shifted by ``offset`` (a shard's first global id)."""
    scores, ids = index_lib.search(index, queries, k)
    if offset:
        ids = np.where(ids >= 0, ids + offset, ids)
    return scores, ids


def merge_topk(parts: list[tuple[np.ndarray, np.ndarray]], k: int, block: int = 256) -> tuple[np.ndarray, np.ndarray]:
    """The ``k`` best of several ``(scores [Q, k_s], ids [Q, k_s])`` lists (larger = closer); ties keep list order.

    Merged ``block`` queries at a time, so the temporaries stay at ``block x S x k`` whatever the number of queries.
    """
    nq = parts[0][0].shape[0]
    if nq > block:
        merged = [
            merge_topk([(s[i : i + block], d[i : i + block]) for s, d in parts], k, block) for i in range(0, nq, block)
        ]
        return np.concatenate([m[0] for m in merged]), np.concatenate([m[1] for m in merged])
    scores = np.concatenate([p[0] for p in parts], axis=1)
    ids = np.concatenate([p[1] for p in parts], axis=1)
    if scores.shape[1] > k:
        part = np.argpartition(-scores, k - 1, axis=1)[:, :k]
        part.sort(axis=1)  # keep the shard/rank order among equal scores before the stable sort
        scores, ids = np.take_along_axis(scores, part, 1), np.take_along_axis(ids, part, 1)
    order = np.argsort(-scores, axis=1, kind="stable")
    return np.take_along_axis(scores, order, 1), np.take_along_axis(ids, order, 1)


class ShardedSearcher:
    """Top-k over all shards of a sharded datastore: ``search(queries, k) -> (scores [Q, k], global ids [Q, k])``.

    Same conventions as :func:`memlm.storage.index.search` (larger = closer, ``-inf`` / ``-1`` in empty slots).
    ``metric`` is the index's (``l2`` / ``ip``). Close it (or use ``with``) to stop its Ray actors.
    """

    def __init__(
        self,
        description: dict[str, Any],
        folder: Path,
        nprobe: int,
        ray: str | None,
        workers: int,
        device: str = "cpu",
        path: Path | None = None,
    ):
        self.description = description
        self.metric: str = description["metric"]
        self.ntotal = int(description["n"])
        self.d = int(description["d"])
        self.path = path if path is not None else folder / "index.faiss"  # the description's index name
        self.paths = [str(folder / p) for p in description["shards"]]
        self.offsets = [int(o) for o in description["offsets"]]
        self.nprobe = int(nprobe)
        self.pool = None
        self.indexes: list[faiss.Index] = []
        if ray is not None:
            from memlm.storage.ray_backend import ShardActorPool

            ops = (load_index_mmap, search_with_offset, set_nprobe)  # what the actors run, passed in (no import)
            self.pool = ShardActorPool(ray, self.paths, self.offsets, nprobe, ops)
        else:
            self.indexes = [to_gpu_if_available(load_index_mmap(p, nprobe), device) for p in self.paths]
            self.executor = ThreadPoolExecutor(max_workers=max(1, workers)) if workers > 1 else None

    @classmethod
    def open(
        cls,
        datastore,
        index_path: str | Path | None = None,
        nprobe: int = 32,
        ray: str | None = None,
        workers: int = 1,
        device: str = "cpu",
    ) -> ShardedSearcher:
        """The searcher of ``datastore``'s sharded index ``index_path`` (default ``index.faiss``: its description
        is ``index.faiss.json`` in the datastore folder). ``workers`` threads search shards at once; ``device``
        ``auto``/``cuda`` moves the shard indexes to the GPUs of a GPU FAISS build (:func:`to_gpu_if_available`)."""
        path = Path(index_path) if index_path is not None else datastore.index_path
        description = _read_sidecar(path)
        if not description or not description.get("sharded"):
            raise MemlmError(
                f"sharded datastore {datastore.path} has no sharded index {path.name}; build it with "
                f"`memlm index build {datastore.path}`"
            )
        if description["n"] != len(datastore) or description["offsets"] != [int(o) for o in datastore.offsets]:
            raise MemlmError(f"sharded index {path} does not match {datastore.path}'s shards; rebuild it")
        return cls(description, path.parent, nprobe, ray, workers, device, path)

    def describe(self) -> dict[str, Any]:
        """What a result file records (the :class:`memlm.storage.searcher.Searcher` protocol)."""
        return {"search": "index", "index": str(self.path), "nprobe": self.nprobe,
                "metric": self.metric, "shards": len(self.paths), "ray": self.pool is not None}  # fmt: skip

    def set_nprobe(self, nprobe: int) -> None:
        self.nprobe = int(nprobe)
        if self.pool is not None:
            self.pool.set_nprobe(nprobe)
        for index in self.indexes:
            set_nprobe(index, nprobe)

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        q = np.ascontiguousarray(queries, dtype=np.float32)
        if q.ndim != 2 or q.shape[1] != self.d:
            raise MemlmError(
                f"queries must be [Q, {self.d}] to match the keys, got shape {tuple(q.shape)}; "
                "use the same model and layer as the datastore"
            )
        if self.pool is not None:
            parts = self.pool.search(q, k)
            return merge_topk(parts, k)
        if self.executor is not None:
            parts = list(
                self.executor.map(
                    lambda j: search_with_offset(self.indexes[j], q, k, self.offsets[j]),
                    range(len(self.indexes)),
                )
            )
        else:
            parts = [search_with_offset(ix, q, k, o) for ix, o in zip(self.indexes, self.offsets, strict=True)]
        return merge_topk(parts, k)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool = None
        if getattr(self, "executor", None) is not None:
            self.executor.shutdown()
            self.executor = None

    def __enter__(self) -> ShardedSearcher:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
