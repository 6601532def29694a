"""Datastore pruning by greedy merging (He, Neubig, Berg-Kirkpatrick 2021, "Efficient Nearest Neighbor Language
Models", Sec. 5.2).

Many datastore entries are near-copies of each other: the same next token after nearly the same context. Greedy merging
replaces such a group by one entry that carries a count. Every entry ``i`` is visited once, in a fixed order (row
order, or a given permutation: He et al. traverse in random order); an entry that has already been merged is skipped;
otherwise it is *kept*, and each of its ``k_merge`` nearest neighbours ``j`` (in the datastore itself, other than ``i``)
with the same value, ``v_j = v_i``, that is neither kept nor merged yet (``j`` comes later in the order) is merged into
it. A kept entry's count is ``c_i = 1 + (number of entries merged into it)`` (more generally the sum of the counts of
what it absorbed, so pruning a pruned datastore stays consistent; the counts always sum to the original size).

The counts enter the kNN distribution as multiplicities (He et al. Sec. 5.2;
:func:`memlm.core.distribution.knn_weights`)::

    p_kNN(w | c) ∝ sum_{i in top-k, v_i = w} c_i * exp(s(q, k_i) / tau)

so that where the merged entries are exact duplicates (same key, same value) the pruned datastore gives exactly the
unpruned distribution (``tests/test_knnlm_efficiency.py``); in general a merged entry stands for neighbours that are
close to it, and the pruned distribution approximates the full one.

:func:`greedy_merge` is the algorithm on arrays (candidate pairs vectorised, one flat loop over candidate pairs in
visiting order); :func:`prune_datastore` searches every key of a datastore for its neighbours (its FAISS index, or
exact search), merges, and writes a new datastore folder with the kept rows
(:meth:`memlm.datastore.Datastore.write_rows`) plus ``counts.npy`` (int64 ``[count]``) and its sidecar
``counts.json``; :func:`load_counts` reads them back, checked against the datastore; :func:`neighbour_log_counts`
gives the ``log_counts`` of retrieved ids for :mod:`memlm.core.distribution`.
"""

from __future__ import annotations

import io
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from memlm import index as index_lib
from memlm.datastore import Datastore
from memlm.errors import MemlmError
from memlm.fileio import atomic_write_bytes, atomic_write_json, sample_sha256, sha256_file
from memlm.locking import folder_lock
from memlm.retrieval import COUNTS_FILE, COUNTS_FORMAT, COUNTS_SIDECAR, load_counts  # noqa: F401 - re-exported

__all__ = [
    "greedy_merge",
    "merge_candidates",
    "merge_edges",
    "neighbour_log_counts",
    "prune_datastore",
]


def _visit_rank(n: int, order: np.ndarray | None) -> np.ndarray:
    """``rank[i]``: when entry ``i`` is visited (``order`` is a permutation of ``0..n-1``; ``None``: row order)."""
    if order is None:
        return np.arange(n, dtype=np.int64)
    order = np.asarray(order, dtype=np.int64)
    if order.shape != (n,) or not np.array_equal(np.sort(order), np.arange(n)):
        raise MemlmError(f"order must be a permutation of the {n} entries, got an array of shape {order.shape}")
    rank = np.empty(n, dtype=np.int64)
    rank[order] = np.arange(n, dtype=np.int64)
    return rank


def merge_candidates(
    values: np.ndarray, rows: np.ndarray, neighbour_ids: np.ndarray, rank: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """The pairs ``(i, j)`` that greedy merging may merge: ``j`` among ``i``'s neighbours, same value, visited later.

    ``rows`` ``[B]`` are entry ids, ``neighbour_ids`` ``[B, k]`` their neighbours (``-1``: none), ``rank`` the visiting
    rank of every entry. Returns ``(src, dst)`` in row-then-neighbour order. A neighbour visited earlier than ``i`` is
    already kept or merged when ``i`` is visited, so it is never a candidate (nor is ``i`` itself).
    """
    n = len(values)
    nb = np.asarray(neighbour_ids, dtype=np.int64)
    rows = np.asarray(rows, dtype=np.int64)
    if nb.ndim != 2 or nb.shape[0] != len(rows):
        raise MemlmError(f"neighbour_ids must be [{len(rows)}, k], got shape {nb.shape}")
    if nb.size and int(nb.max()) >= n:
        raise MemlmError(f"neighbour id {int(nb.max())} is out of range for {n} entries (another datastore's index?)")
    valid = nb >= 0
    safe = np.where(valid, nb, 0)
    cand = valid & (rank[safe] > rank[rows][:, None]) & (values[safe] == values[rows][:, None])
    r, c = np.nonzero(cand)
    return rows[r], nb[r, c]


def merge_edges(
    n: int, src: np.ndarray, dst: np.ndarray, rank: np.ndarray, counts: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Greedy merging given its candidate pairs (:func:`merge_candidates`): ``(keep_ids, counts)``.

    Pairs are visited by the rank of their source (stable: neighbour order within a source). A source that has been
    merged by then is skipped (only earlier-visited entries merge, so every merge into it has happened); otherwise
    its target, if not merged yet, is merged into it. The one loop runs over candidate pairs only, on Python lists.
    """
    counts = np.ones(n, dtype=np.int64) if counts is None else np.asarray(counts, dtype=np.int64)
    if counts.shape != (n,):
        raise MemlmError(f"counts must be [{n}], got shape {counts.shape}")
    src = np.asarray(src, dtype=np.int64)
    dst = np.asarray(dst, dtype=np.int64)
    by_visit = np.argsort(rank[src], kind="stable")
    merged = bytearray(n)
    into_j, into_i = [], []  # merges, j into i
    for i, j in zip(src[by_visit].tolist(), dst[by_visit].tolist(), strict=True):
        if merged[i] or merged[j]:
            continue
        merged[j] = 1
        into_j.append(j)
        into_i.append(i)
    out = counts.copy()
    gone = np.asarray(into_j, dtype=np.int64)
    np.add.at(out, np.asarray(into_i, dtype=np.int64), counts[gone])  # a merged entry absorbed nothing itself
    keep = np.ones(n, dtype=bool)
    keep[gone] = False
    keep_ids = np.flatnonzero(keep)
    return keep_ids, out[keep_ids]


def greedy_merge(
    values: np.ndarray,
    neighbour_ids: np.ndarray,
    counts: np.ndarray | None = None,
    order: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Greedy merging (He et al. 2021 Sec. 5.2) of ``N`` entries: ``(keep_ids, counts)``.

    ``values`` ``[N]``: each entry's value; ``neighbour_ids`` ``[N, k]``: the ids of each entry's nearest neighbours in
    the same datastore (``-1`` for none; the entry itself, if listed, is ignored); ``counts`` ``[N]``: existing counts
    (a pruned datastore; default all 1); ``order``: the visiting order (a permutation; default row order).
    ``keep_ids`` (sorted ascending) are the entries that stay, ``counts`` their counts (int64, summing to
    ``sum(counts)``). See the module docstring for the rule.
    """
    values = np.asarray(values)
    n = len(values)
    rank = _visit_rank(n, order)
    src, dst = merge_candidates(values, np.arange(n), neighbour_ids, rank)
    return merge_edges(n, src, dst, rank, counts)


def _neighbours_without_self(rows: np.ndarray, ids: np.ndarray, k: int) -> np.ndarray:
    """Drop each row's own id from its ``k + 1`` neighbours (or the farthest one when it is not among them)."""
    drop = ids == rows[:, None]
    drop[~drop.any(1), -1] = True
    pos = np.argsort(drop, axis=1, kind="stable")[:, :k]
    return np.take_along_axis(ids, pos, 1)


def prune_datastore(
    datastore: Datastore,
    out: str | Path,
    k_merge: int = 8,
    search: str = "index",
    index_path: str | Path | None = None,
    nprobe: int = 32,
    metric: str | None = None,
    seed: int | None = None,
    chunk: int = 4096,
    progress: bool = True,
) -> Datastore:
    """Greedy-merge ``datastore`` (He et al. 2021 Sec. 5.2) and write the kept entries to ``out`` with their counts.

    Each entry's ``k_merge`` nearest other entries come from the datastore's FAISS index (``search="index"``;
    ``index_path`` for another than ``index.faiss``, ``nprobe`` for IVF) or from exact search over all keys
    (``search="exact"``, with ``metric``: for tests and small datastores, quadratic in N). Entries are visited in row
    order, or in a random order drawn with ``seed`` (He et al.'s). A datastore that is itself pruned keeps its counts
    (they add up). ``out`` becomes a normal memlm datastore (its manifest records ``pruned``: the source, ``k_merge``,
    the search, the sizes) plus ``counts.npy`` and ``counts.json``; build its index with ``memlm index build``.
    Returns the opened pruned datastore; :func:`load_counts` gives its counts.
    """
    out = Path(out)
    if out.resolve() == datastore.path.resolve():
        raise MemlmError(f"cannot prune datastore {datastore.path} into itself; give another output folder")
    if k_merge < 1:
        raise MemlmError(f"k_merge must be >= 1, got {k_merge}; He et al. use up to 100")
    if search not in ("index", "exact"):
        raise MemlmError(f"search must be 'index' or 'exact', got {search!r}")
    t0 = time.perf_counter()
    n = len(datastore)
    if n == 0:
        raise MemlmError(f"datastore {datastore.path} is empty; nothing to prune")
    index = None
    if search == "index":
        from memlm.sharded_index import index_metric_of, open_index

        index = open_index(datastore, index_path, nprobe=nprobe)
        metric = metric or index_metric_of(index)
    elif metric is None:
        meta = index_lib.read_index_meta(datastore.index_path)
        metric = meta["metric"] if meta else "l2"
    old_counts = load_counts(datastore)
    rank = _visit_rank(n, None if seed is None else np.random.default_rng(seed).permutation(n))
    values = np.asarray(datastore.values)
    srcs, dsts = [], []
    k = min(k_merge + 1, n)
    for s in tqdm(range(0, n, chunk), desc="merge neighbours", unit="chunk", disable=not progress, leave=False):
        e = min(s + chunk, n)
        q = np.ascontiguousarray(datastore.keys[s:e], dtype=np.float32)
        if index is not None:
            from memlm.sharded_index import search_index

            _, ids = search_index(index, q, k)
        else:
            _, ids = index_lib.exact_search(datastore.keys, q, k, metric)
        rows = np.arange(s, e, dtype=np.int64)
        src, dst = merge_candidates(values, rows, _neighbours_without_self(rows, ids, k - 1), rank)
        srcs.append(src)
        dsts.append(dst)
    keep, counts = merge_edges(n, np.concatenate(srcs), np.concatenate(dsts), rank, old_counts)
    record: dict[str, Any] = {
        "of": str(datastore.path),
        "of_count": n,
        "k_merge": k_merge,
        "search": search,
        "metric": metric,
        "order": "rows" if seed is None else f"random (seed {seed})",
        "total": int(counts.sum()),
        "counts_file": COUNTS_FILE,
        "seconds": round(time.perf_counter() - t0, 3),
    }
    if search == "index":
        record.update(index=str(index_path or datastore.index_path), nprobe=nprobe)
    with folder_lock(out, "write a pruned datastore"):
        out.mkdir(parents=True, exist_ok=True)
        (out / COUNTS_SIDECAR).unlink(missing_ok=True)  # the counts are trusted only once the datastore is complete
        buf = io.BytesIO()
        np.save(buf, counts.astype(np.int64), allow_pickle=False)
        atomic_write_bytes(out / COUNTS_FILE, buf.getvalue())
        pruned = datastore.write_rows(out, keep, {"pruned": record}, "write a pruned datastore")
        f = out / COUNTS_FILE
        sidecar = {
            "format": COUNTS_FORMAT,
            "count": len(keep),
            "total": int(counts.sum()),
            "build_id": pruned.manifest["build_id"],
            "file": {"bytes": f.stat().st_size, "sample_sha256": sample_sha256(f), "sha256": sha256_file(f)},
        }
        atomic_write_json(out / COUNTS_SIDECAR, sidecar)
    if progress:
        print(f"pruned {datastore.path}: {n:,} -> {len(keep):,} entries ({len(keep) / n:.1%}) with k_merge={k_merge} "
              f"in {time.perf_counter() - t0:.1f} s", file=sys.stderr)  # fmt: skip
    return pruned


def neighbour_log_counts(counts: np.ndarray | None, ids: np.ndarray) -> np.ndarray:
    """``log c_i`` of retrieved ids ``[Q, k]`` (float32; 0 where ``id == -1`` or ``counts`` is ``None``):
    the ``log_counts`` argument of :func:`memlm.core.distribution.knn_target_logprob` /
    :func:`memlm.core.distribution.knn_distribution`."""
    ids = np.asarray(ids)
    if counts is None:
        return np.zeros(ids.shape, dtype=np.float32)
    valid = ids >= 0
    c = np.asarray(counts)[np.where(valid, ids, 0)]
    return np.where(valid, np.log(c.astype(np.float64)), 0.0).astype(np.float32)
