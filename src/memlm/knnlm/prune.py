"""Datastore pruning by greedy merging (He, Neubig, Berg-Kirkpatrick 2021, "Efficient Nearest Neighbor Language
Models", EMNLP, Sec. 5.2).

Many datastore entries are near-copies of each other: the same next token after nearly the same context. Greedy merging
replaces such a group by one entry that carries a weight (a count). Every entry starts with weight ``w_i = 1``. The
entries are visited once each, in a random order (seeded; He et al.'s ``greedy_merge.py`` shuffles, seed 22 there) or
a given one. Visiting ``i``: if ``i`` has been merged away (``w_i = 0``) it is skipped; otherwise each of its
``k_merge + 1`` nearest neighbours ``j`` in the datastore (the entry itself, usually the first, is passed over) with

    j != i,   v_j = v_i,   w_j = 1  (j is not merged and has absorbed nothing yet)

is merged into it: ``w_i += w_j``, ``w_j = 0``. A neighbour visited earlier that was kept but absorbed nothing still
has ``w_j = 1`` and is merged too (their rule); one that absorbed something (``w_j > 1``) is never merged, so no merge
is undone and the weights always sum to the original size. Pruning a pruned datastore starts from its counts and
merges an entry that has absorbed nothing *in this pass* (``w_j = 1`` generalised), adding its count.

The weights enter the kNN distribution as multiplicities (:func:`memlm.core.distribution.knn_weights`)::

    p_kNN(w | c) ∝ sum_{i in top-k, v_i = w} w_i * exp(s(q, k_i) / tau)

He et al.'s code adds ``log w_i`` to the score *before* dividing by the temperature, ``softmax((s + log w) / tau)``,
i.e. ``w_i ** (1 / tau)``; the two agree at their default ``tau = 1``. memlm keeps ``w_i * exp(s / tau)`` because it is
the count of the entries the kept one stands for at every ``tau``: where the merged entries are exact duplicates the
pruned datastore gives exactly the unpruned distribution (``tests/test_knnlm_efficiency.py``), and memlm tunes ``tau``
(often far from 1), where ``w ** (1 / tau)`` would shrink a merged group's mass towards one entry's.

:func:`greedy_merge` is the algorithm on arrays (candidate pairs vectorised, one flat loop over candidate pairs in
visiting order); :func:`prune_datastore` searches every key of a datastore for its neighbours (its FAISS index, or
exact search), merges, and writes a new datastore folder with the kept rows
(:meth:`memlm.storage.datastore.Datastore.write_rows`) plus ``counts.npy`` (int64 ``[count]``), ``absorbed.npy`` (which
kept row each merged-away entry went into, by its document hash and offset: ``--drop-self-matches`` takes the evaluated
token's own share out of its absorber's count) and their sidecar ``counts.json``; :func:`load_counts` reads the counts
back, checked against the datastore; :func:`neighbour_log_counts` gives the ``log_counts`` of retrieved ids for
:mod:`memlm.core.distribution`.
"""

from __future__ import annotations

import io
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from memlm.core.config import RetrievalConfig
from memlm.errors import MemlmError
from memlm.io.fileio import atomic_write_bytes, atomic_write_json, sample_sha256, sha256_file
from memlm.io.locking import folder_lock
from memlm.retrieval import (  # noqa: F401 - load_counts, load_absorbed re-exported
    ABSORBED_DTYPE,
    ABSORBED_FILE,
    COUNTS_FILE,
    COUNTS_FORMAT,
    COUNTS_SIDECAR,
    load_absorbed,
    load_counts,
)
from memlm.storage.datastore import FOLDER, Datastore
from memlm.storage.searcher import open_searcher

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


def merge_candidates(values: np.ndarray, rows: np.ndarray, neighbour_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The pairs ``(i, j)`` that greedy merging may merge: ``j`` among ``i``'s neighbours, ``j != i``, same value.

    ``rows`` ``[B]`` are entry ids, ``neighbour_ids`` ``[B, k]`` their neighbours (``-1``: none). Returns
    ``(src, dst)`` in row-then-neighbour order; whether ``j`` can still be merged is decided in visiting order
    (:func:`merge_edges`).
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
    cand = valid & (safe != rows[:, None]) & (values[safe] == values[rows][:, None])
    r, c = np.nonzero(cand)
    return rows[r], nb[r, c]


def merge_edges(
    n: int, src: np.ndarray, dst: np.ndarray, rank: np.ndarray, counts: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Greedy merging given its candidate pairs (:func:`merge_candidates`): ``(keep_ids, counts, into)``.

    Pairs are visited by the rank of their source (stable: neighbour order within a source). A source merged away by
    then is skipped; otherwise its target is merged into it if the target is neither merged nor has absorbed anything
    (He et al.'s ``weights[v] == 1``). ``into[j]`` is the entry ``j`` was merged into (``-1``: kept). The one loop runs
    over candidate pairs only, on Python lists.
    """
    counts = np.ones(n, dtype=np.int64) if counts is None else np.asarray(counts, dtype=np.int64)
    if counts.shape != (n,):
        raise MemlmError(f"counts must be [{n}], got shape {counts.shape}")
    src = np.asarray(src, dtype=np.int64)
    dst = np.asarray(dst, dtype=np.int64)
    by_visit = np.argsort(rank[src], kind="stable")
    merged = bytearray(n)
    absorbed = bytearray(n)
    into_j, into_i = [], []  # merges, j into i
    for i, j in zip(src[by_visit].tolist(), dst[by_visit].tolist(), strict=True):
        if merged[i] or merged[j] or absorbed[j]:
            continue
        merged[j] = 1
        absorbed[i] = 1
        into_j.append(j)
        into_i.append(i)
    out = counts.copy()
    gone = np.asarray(into_j, dtype=np.int64)
    np.add.at(out, np.asarray(into_i, dtype=np.int64), counts[gone])  # a merged entry absorbed nothing itself
    into = np.full(n, -1, dtype=np.int64)
    into[gone] = np.asarray(into_i, dtype=np.int64)
    keep = into < 0
    keep_ids = np.flatnonzero(keep)
    return keep_ids, out[keep_ids], into


def greedy_merge(
    values: np.ndarray,
    neighbour_ids: np.ndarray,
    counts: np.ndarray | None = None,
    order: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Greedy merging (He et al. 2021 Sec. 5.2) of ``N`` entries: ``(keep_ids, counts)``.

    ``values`` ``[N]``: each entry's value; ``neighbour_ids`` ``[N, k]``: the ids of each entry's nearest neighbours in
    the same datastore (``-1`` for none; the entry itself, if listed, is passed over); ``counts`` ``[N]``: existing
    counts (a pruned datastore; default all 1); ``order``: the visiting order (a permutation; default row order).
    ``keep_ids`` (sorted ascending) are the entries that stay, ``counts`` their counts (int64, summing to
    ``sum(counts)``). See the module docstring for the rule.
    """
    values = np.asarray(values)
    n = len(values)
    rank = _visit_rank(n, order)
    src, dst = merge_candidates(values, np.arange(n), neighbour_ids)
    keep, out, _ = merge_edges(n, src, dst, rank, counts)
    return keep, out


def _check_out(out: Path, source: Path, overwrite: bool) -> None:
    """Refuse to prune into the source, or over a finished datastore without ``overwrite``."""
    from memlm.storage.sharded import is_sharded

    if out.resolve() == source.resolve():
        raise MemlmError(f"cannot prune datastore {source} into itself; give another output folder")
    if is_sharded(out):
        raise MemlmError(f"{out} holds a sharded datastore; give another output folder (or delete it first)")
    FOLDER.check_out(out, overwrite=True)  # the pruned datastore replaces only a datastore's own files
    if not overwrite and (out / "manifest.json").exists():
        raise MemlmError(
            f"{out} already holds a datastore; give another output folder, or --overwrite (overwrite=True) to "
            "replace it with the pruned one"
        )


def _absorbed_map(datastore: Datastore, keep: np.ndarray, into: np.ndarray, old: np.ndarray | None) -> np.ndarray:
    """Where every merged-away entry now lives: ``(doc_hash, offset, row)`` sorted by ``(doc_hash, offset)``, ``row``
    a row of the pruned datastore. ``old``: the source's own map (a pruned datastore pruned again), carried over."""
    holder = np.where(into >= 0, into, np.arange(len(into)))  # an absorber is never merged away itself
    new_row = np.searchsorted(keep, holder)  # source row -> pruned row
    gone = np.flatnonzero(into >= 0)
    parts = [(np.asarray(datastore.doc_hash)[gone], np.asarray(datastore.offset)[gone], new_row[gone])]
    if old is not None and len(old):
        parts.append((old["doc_hash"], old["offset"], new_row[old["row"]]))
    out = np.zeros(sum(len(p[0]) for p in parts), dtype=ABSORBED_DTYPE)
    for name, i in (("doc_hash", 0), ("offset", 1), ("row", 2)):
        out[name] = np.concatenate([p[i] for p in parts]) if parts else []
    return np.sort(out, order=["doc_hash", "offset"])


def _write_pruned(datastore, out: Path, keep: np.ndarray, counts: np.ndarray, absorbed: np.ndarray, record: dict):
    """The kept rows as a datastore at ``out`` with ``counts.npy``, ``absorbed.npy`` and the sidecar that ties them to
    it (written last: the counts are trusted only once the datastore is complete)."""
    with folder_lock(out, "write a pruned datastore"):
        out.mkdir(parents=True, exist_ok=True)
        (out / COUNTS_SIDECAR).unlink(missing_ok=True)  # the counts are trusted only once the datastore is complete
        files = {}
        for name, arr in ((COUNTS_FILE, counts.astype(np.int64)), (ABSORBED_FILE, absorbed)):
            buf = io.BytesIO()
            np.save(buf, arr, allow_pickle=False)
            atomic_write_bytes(out / name, buf.getvalue())
            files[name] = out / name
        pruned = datastore.write_rows(out, keep, {"pruned": record}, "write a pruned datastore")
        f, fa = files[COUNTS_FILE], files[ABSORBED_FILE]
        sidecar = {
            "format": COUNTS_FORMAT,
            "count": len(keep),
            "total": int(counts.sum()),
            "build_id": pruned.manifest["build_id"],
            "file": {"bytes": f.stat().st_size, "sample_sha256": sample_sha256(f), "sha256": sha256_file(f)},
            "absorbed": {"count": len(absorbed), "bytes": fa.stat().st_size, "sample_sha256": sample_sha256(fa),
                         "sha256": sha256_file(fa)},
        }  # fmt: skip
        atomic_write_json(out / COUNTS_SIDECAR, sidecar)
    return pruned


def prune_datastore(
    datastore: Datastore,
    out: str | Path,
    k_merge: int = 8,
    config: RetrievalConfig | None = None,
    *,
    seed: int | None = 0,
    chunk: int = 4096,
    progress: bool = True,
    overwrite: bool = False,
    **options: Any,
) -> Datastore:
    """Greedy-merge ``datastore`` (He et al. 2021 Sec. 5.2) and write the kept entries to ``out`` with their counts.

    Each entry's ``k_merge + 1`` nearest entries (itself among them, passed over: He et al.'s ``ret[:, :k + 1]``) come
    from the datastore's FAISS index (``search="index"``; ``index_path`` for another than ``index.faiss``, ``nprobe``
    for IVF) or from exact search over all keys (``search="exact"``, with ``metric``: for tests and small datastores,
    quadratic in N). Entries are visited in a random order drawn with ``seed`` (He et al.'s; ``None``: row order). A
    datastore that is itself pruned keeps its counts (they add up). ``out`` becomes a normal memlm datastore (its
    manifest records ``pruned``: the source, ``k_merge``, the search, the seed, the sizes) plus ``counts.npy``,
    ``absorbed.npy`` and ``counts.json``; build its index with ``memlm index build``. A folder that already holds a
    datastore is replaced only with ``overwrite``. Returns the opened pruned datastore; :func:`load_counts` gives its
    counts. The search settings (``search``, ``index_path`` / ``index``, ``nprobe``, ``metric``) come from ``config``
    (:class:`memlm.core.config.RetrievalConfig`) or ``options`` by name.
    """
    c = RetrievalConfig.with_options(config, **options)
    search, index_path, nprobe, metric = c.search, c.index, c.nprobe, c.metric
    out = Path(out)
    _check_out(out, datastore.path, overwrite)
    if k_merge < 1:
        raise MemlmError(f"k_merge must be >= 1, got {k_merge}; He et al. use up to 100")
    if search not in ("index", "exact"):
        raise MemlmError(f"search must be 'index' or 'exact', got {search!r}")
    t0 = time.perf_counter()
    n = len(datastore)
    if n == 0:
        raise MemlmError(f"datastore {datastore.path} is empty; nothing to prune")
    searcher = open_searcher(datastore, search, "index", index_path, nprobe, metric)  # plain or sharded
    old_counts = load_counts(datastore)
    old_absorbed = load_absorbed(datastore) if old_counts is not None else None
    rank = _visit_rank(n, None if seed is None else np.random.default_rng(seed).permutation(n))
    values = np.asarray(datastore.values)
    srcs, dsts = [], []
    k = min(k_merge + 1, n)
    for s in tqdm(range(0, n, chunk), desc="merge neighbours", unit="chunk", disable=not progress, leave=False):
        e = min(s + chunk, n)
        q = np.ascontiguousarray(datastore.keys[s:e], dtype=np.float32)
        _, ids = searcher.search(q, k)
        src, dst = merge_candidates(values, np.arange(s, e, dtype=np.int64), ids)
        srcs.append(src)
        dsts.append(dst)
    keep, counts, into = merge_edges(n, np.concatenate(srcs), np.concatenate(dsts), rank, old_counts)
    absorbed = _absorbed_map(datastore, keep, into, old_absorbed)
    record: dict[str, Any] = {
        "of": str(datastore.path),
        "of_count": n,
        "k_merge": k_merge,
        "neighbours": k,
        "search": search,
        "metric": searcher.metric,
        "order": "rows" if seed is None else f"random (seed {seed})",
        "seed": seed,
        "rule": "He et al. 2021: merge a same-valued neighbour that is not merged and has absorbed nothing",
        "total": int(counts.sum()),
        "counts_file": COUNTS_FILE,
        "seconds": round(time.perf_counter() - t0, 3),
    }
    if search == "index":
        record.update(index=str(index_path or datastore.index_path), nprobe=nprobe)
    pruned = _write_pruned(datastore, out, keep, counts, absorbed, record)
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
