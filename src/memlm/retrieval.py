"""Memories over a stored datastore: the :class:`memlm.core.memory.Memory` protocol on a datastore folder.

:class:`DatastoreMemory` answers ``search(queries, k)`` from a datastore (single or sharded) with its FAISS index
(approximate: Xu et al. 2023's "FAISS mask") or by brute force over all keys ("real mask"), keeping the index's
scores or recomputing them from the stored fp16 keys (Khandelwal et al. 2020's full-precision distances, "real
score"). It maps entry ids to their values, can drop self-matches (the evaluated token itself, when the evaluated
text is in the datastore) and carries the merged counts of a pruned datastore (He et al. 2021). The kNN-LM
(evaluation, generation, the lm-eval adapter, self-calibration) and TRIME's external memory all search through it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from memlm.core.memory import Memory, Retrieved
from memlm.errors import MemlmError
from memlm.io import schema
from memlm.io.fileio import sample_sha256, sha256_file
from memlm.models.keys import KeySpec
from memlm.storage.datastore import Datastore, DatastoreBase
from memlm.storage.searcher import (
    SEARCH_MODES,
    ExactSearcher,
    FaissSearcher,
    RescoredSearcher,
    Searcher,
    datastore_metric,
    open_searcher,
)
from memlm.storage.sharded_index import ShardedSearcher

__all__ = [
    "DatastoreMemory",
    "as_memory",
    "datastore_metric",
    "entry_values",
    "load_absorbed",
    "load_counts",
]

COUNTS_FILE = "counts.npy"
COUNTS_SIDECAR = "counts.json"
COUNTS_FORMAT = "memlm-datastore-counts"
ABSORBED_FILE = "absorbed.npy"  # merged-away entries: (doc_hash, offset) -> the pruned row that absorbed them
ABSORBED_DTYPE = np.dtype([("doc_hash", "<i8"), ("offset", "<i8"), ("row", "<i8")])
_FILE_CHECK = {"bytes": schema.Int(min=0), "sample_sha256": schema.Str(), "sha256": schema.Str()}
_SIDECAR_SCHEMA = schema.Obj(
    required={
        "format": schema.Str(),
        "count": schema.Int(min=0),
        "total": schema.Int(min=0),
        "build_id": schema.Str(),
        "file": schema.Obj(required=_FILE_CHECK),
    },
    optional={"absorbed": schema.Obj(required={"count": schema.Int(min=0), **_FILE_CHECK})},
)
_REPRUNE = "prune the source datastore again (memlm.knnlm.prune.prune_datastore)"


def load_counts(datastore: Datastore, verify: bool = False) -> np.ndarray | None:
    """The counts of a pruned datastore (int64 ``[count]``, memory-mapped), or ``None`` for an unpruned one.

    A datastore whose manifest records ``pruned`` must have ``counts.npy`` and a ``counts.json`` written for this very
    datastore (its build id), of the right length, matching the file's size and sampled SHA-256 (``verify``: the full
    SHA-256), with every count >= 1 and the total recorded at pruning; anything else is a :class:`MemlmError` (using
    the datastore without its counts would silently change the kNN distribution).
    """
    record = datastore.manifest.get("pruned")
    if record is None:
        return None
    path = datastore.path
    side_path = path / COUNTS_SIDECAR
    f = path / record.get("counts_file", COUNTS_FILE)
    if not side_path.exists() or not f.exists():
        raise MemlmError(
            f"datastore {path} is pruned but its counts ({f.name}, {side_path.name}) are missing (an interrupted "
            f"prune, or a copy or subsample of a pruned datastore); {_REPRUNE}"
        )
    side = schema.read_json(side_path, _SIDECAR_SCHEMA, "pruned datastore counts sidecar", _REPRUNE)
    if side["format"] != COUNTS_FORMAT or side["build_id"] != datastore.manifest.get("build_id"):
        raise MemlmError(f"{side_path} belongs to another datastore than {path} (build id differs); {_REPRUNE}")
    file = side["file"]
    if f.stat().st_size != file["bytes"] or sample_sha256(f) != file["sample_sha256"]:
        raise MemlmError(f"{f} does not match {side_path.name} (replaced, truncated or corrupt); {_REPRUNE}")
    if verify and sha256_file(f) != file["sha256"]:
        raise MemlmError(f"checksum mismatch in {f}: the file is corrupt; {_REPRUNE}")
    try:
        counts = np.load(f, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError) as e:
        raise MemlmError(f"{f} is not a counts array ({e}); {_REPRUNE}") from None
    if counts.shape != (len(datastore),) or counts.dtype != np.int64:
        raise MemlmError(
            f"{f} holds {counts.dtype} {counts.shape}, the datastore needs int64 ({len(datastore)},); {_REPRUNE}"
        )
    if len(counts) and (int(counts.min()) < 1 or int(counts.sum()) != side["total"]):
        raise MemlmError(f"{f} holds counts < 1 or a total other than recorded ({side['total']}); {_REPRUNE}")
    return counts


def load_absorbed(datastore: Datastore) -> np.ndarray | None:
    """Where a pruned datastore's merged-away entries went: a structured array ``(doc_hash, offset, row)`` sorted by
    ``(doc_hash, offset)`` (``row``: the entry of this datastore that absorbed it), checked against the counts
    sidecar; ``None`` for an unpruned datastore or one pruned before memlm recorded it."""
    if datastore.manifest.get("pruned") is None:
        return None
    side_path = datastore.path / COUNTS_SIDECAR
    side = schema.read_json(side_path, _SIDECAR_SCHEMA, "pruned datastore counts sidecar", _REPRUNE)
    if "absorbed" not in side:
        return None
    rec, f = side["absorbed"], datastore.path / ABSORBED_FILE
    if not f.exists() or f.stat().st_size != rec["bytes"] or sample_sha256(f) != rec["sample_sha256"]:
        raise MemlmError(f"{f} is missing or does not match {side_path.name}; {_REPRUNE}")
    try:
        arr = np.load(f, allow_pickle=False)
    except (ValueError, OSError) as e:
        raise MemlmError(f"{f} is not a merged-entries table ({e}); {_REPRUNE}") from None
    if arr.dtype != ABSORBED_DTYPE or arr.shape != (rec["count"],):
        raise MemlmError(f"{f} holds {arr.dtype} {arr.shape}, not the merged-entries table recorded; {_REPRUNE}")
    if len(arr) and (int(arr["row"].min()) < 0 or int(arr["row"].max()) >= len(datastore)):
        raise MemlmError(f"{f} points outside the datastore's {len(datastore)} entries; {_REPRUNE}")
    return arr


def _holders(absorbed: np.ndarray, provenance: dict[str, np.ndarray]) -> np.ndarray:
    """For each query token (``provenance``: its ``doc_hash`` and ``offset``) the row that absorbed its own entry when
    the datastore was pruned, or ``-1`` (not merged away, or not in the datastore)."""
    q = np.zeros(len(provenance["doc_hash"]), dtype=ABSORBED_DTYPE)
    q["doc_hash"], q["offset"] = provenance["doc_hash"], provenance["offset"]
    pos = np.minimum(np.searchsorted(absorbed, q), max(len(absorbed) - 1, 0))
    if not len(absorbed):
        return np.full(len(q), -1, dtype=np.int64)
    hit = (absorbed["doc_hash"][pos] == q["doc_hash"]) & (absorbed["offset"][pos] == q["offset"])
    return np.where(hit, absorbed["row"][pos], -1)


def entry_values(datastore: Datastore, ids: np.ndarray, provenance: dict[str, np.ndarray] | None = None) -> np.ndarray:
    """The values of entries ``ids [Q, k]`` (``-1`` where ``ids < 0``); with ``provenance`` (each query's
    ``doc_hash`` and ``offset``) an entry that is the query's own token is emptied too (self-match)."""
    valid = ids >= 0
    flat = np.where(valid, ids, 0).ravel()
    values = np.where(valid, np.asarray(datastore.values[flat]).reshape(ids.shape), -1)
    if provenance is not None:
        own = (
            valid
            & (np.asarray(datastore.doc_hash[flat]).reshape(ids.shape) == provenance["doc_hash"][:, None])
            & (np.asarray(datastore.offset[flat]).reshape(ids.shape) == provenance["offset"][:, None])
        )
        values = np.where(own, -1, values)
    return values.astype(np.int64)


class DatastoreMemory:
    """A datastore as a memory: ``search(queries, k) -> Retrieved`` (module docstring).

    The search itself is the ``searcher``'s (:class:`memlm.storage.searcher.Searcher`; default: :func:`open_searcher`
    with ``search`` -- ``"index"``, the index at ``index_path`` (default the datastore's own; a sharded datastore's
    searcher) or ``"exact"``, all keys --, ``scores`` -- ``"index"`` or ``"exact"``, recomputed from the stored keys --,
    ``nprobe`` and ``metric``, default the index's); a user's searcher is used as it is, a FAISS index already read
    goes through :func:`open_searcher` as the datastore's index would. A pruned datastore's merged counts ``[N]``
    (:func:`load_counts`) enter as ``log_counts``. :attr:`CHUNK` queries are searched at a time.
    """

    CHUNK = 4096

    def __init__(
        self,
        datastore: DatastoreBase,
        search: str = "index",
        scores: str = "index",
        nprobe: int = 32,
        index_path: str | Path | None = None,
        metric: str | None = None,
        progress: bool = False,
        searcher: Searcher | None = None,
    ) -> None:
        if search not in SEARCH_MODES or scores not in SEARCH_MODES:
            raise MemlmError("search and scores must each be 'index' or 'exact'")
        self.datastore, self.search_mode, self.scores_mode = datastore, search, scores
        self.chunk, self.progress = self.CHUNK, progress
        self.index_path = Path(index_path) if index_path is not None else datastore.index_path
        if searcher is None or not isinstance(searcher, Searcher):  # None: the datastore's own; a FAISS index read
            searcher = open_searcher(datastore, search, scores, index_path, nprobe, metric, base=searcher)
        self.searcher = searcher
        self.metric = searcher.metric
        self.nprobe = nprobe
        counts = load_counts(datastore)  # a pruned datastore's own counts, None for an unpruned one
        self.pruned = counts is not None and datastore.manifest.get("pruned") is not None
        self.absorbed = load_absorbed(datastore) if self.pruned else None
        if counts is not None and len(counts) != len(datastore):
            raise MemlmError(f"counts has {len(counts)} rows for a datastore of {len(datastore)} entries")
        self.counts = counts
        self.log_counts = None if counts is None else np.log(np.asarray(counts, dtype=np.float32))

    def search_ids(self, queries: np.ndarray, k: int, progress: bool | None = None) -> tuple[np.ndarray, np.ndarray]:
        """``(scores [Q, k], ids [Q, k])`` of the k nearest entries, larger = closer, best first (``progress``:
        override the memory's progress bar, e.g. off for many small searches)."""
        progress = self.progress if progress is None else progress
        out_s = np.empty((len(queries), k), dtype=np.float32)
        out_i = np.empty((len(queries), k), dtype=np.int64)
        exact = isinstance(self.searcher, ExactSearcher)
        chunk = max(self.chunk, len(queries)) if exact else self.chunk  # exact: one pass over the keys
        for s in tqdm(range(0, len(queries), chunk), desc="search", unit="chunk", disable=not progress,
                      leave=False):  # fmt: skip
            q = np.ascontiguousarray(queries[s : s + chunk], dtype=np.float32)
            out_s[s : s + len(q)], out_i[s : s + len(q)] = self.searcher.search(q, k)
        return out_s, out_i

    def retrieved(
        self, scores: np.ndarray, ids: np.ndarray, provenance: dict[str, np.ndarray] | None = None
    ) -> Retrieved:
        """Searched ``(scores, ids)`` -> :class:`Retrieved` with values (self-matches dropped with ``provenance``).

        On a pruned datastore a self-match is the evaluated token's own share, one of the merged entries' count: its
        absorber's count loses 1 (the entry is dropped only when nothing else is left in it), whether the token's
        entry was kept or merged into a neighbour.
        """
        if not self.pruned or provenance is None:
            values = entry_values(self.datastore, ids, provenance)
            empty = values < 0
            log_counts = None
            if self.log_counts is not None:
                log_counts = np.where(empty, 0.0, self.log_counts[np.where(ids >= 0, ids, 0)]).astype(np.float32)
        else:
            if self.absorbed is None:
                raise MemlmError(
                    f"{self.datastore.path} was pruned before memlm recorded where merged entries went, so "
                    f"--drop-self-matches cannot take the evaluated tokens out of its counts; {_REPRUNE}"
                )
            values = entry_values(self.datastore, ids)
            own = (values >= 0) & (entry_values(self.datastore, ids, provenance) < 0)  # the token's own entry, kept
            holder = _holders(self.absorbed, provenance)
            share = own | ((ids == holder[:, None]) & (holder[:, None] >= 0))  # ...or the one it was merged into
            c = np.asarray(self.counts)[np.where(ids >= 0, ids, 0)] - share
            empty = (values < 0) | (c <= 0)
            values = np.where(empty, -1, values)
            log_counts = np.where(empty, 0.0, np.log(np.maximum(c, 1).astype(np.float64))).astype(np.float32)
        return Retrieved(
            np.where(empty, -np.inf, scores).astype(np.float32), values, np.where(empty, -1, ids), log_counts
        )

    def search(self, queries: np.ndarray, k: int, provenance: dict[str, np.ndarray] | None = None) -> Retrieved:
        return self.retrieved(*self.search_ids(queries, k), provenance)

    @property
    def key_spec(self) -> KeySpec:
        """The hidden state its queries come from (the datastore's key)."""
        return self.datastore.key_spec

    def check_compatible(self, model, tokenizer) -> None:
        self.datastore.check_compatible(model, tokenizer)

    def describe(self) -> dict:
        """What this memory is, for result files."""
        return {
            "datastore": str(self.datastore.path),
            "datastore_entries": len(self.datastore),
            "key": self.datastore.key_spec.describe(),
            "search": self.search_mode,
            "scores": self.scores_mode,
            "metric": self.metric,
            "index": str(self.index_path) if self.search_mode == "index" else None,
            "nprobe": self.nprobe,
            "pruned": self.log_counts is not None,
            **({} if isinstance(self.searcher, _BUILT_IN) else {"searcher": self.searcher.describe()}),
        }


_BUILT_IN = (FaissSearcher, ExactSearcher, RescoredSearcher, ShardedSearcher)  # described by the fields above


def as_memory(source: Any, nprobe: int = 32, index: Any = None) -> Any:
    """What the kNN-LM's consumers (:func:`memlm.knnlm.scoring.score_tokens`, generation, the lm-eval adapter,
    :func:`memlm.wrap`) search: a datastore (plain or sharded) becomes a :class:`DatastoreMemory` over its own index
    (``index``: a FAISS index or searcher already open); a memory -- anything with ``search(queries, k) ->
    Retrieved`` and the ``key_spec`` (:class:`memlm.models.keys.KeySpec`) of the hidden state that queries it,
    optionally ``describe()`` and ``check_compatible(model, tokenizer)`` -- is used as it is."""
    if isinstance(source, DatastoreBase):
        return DatastoreMemory(source, nprobe=nprobe, searcher=index)
    if isinstance(source, Memory) and isinstance(getattr(source, "key_spec", None), KeySpec):
        return source
    raise MemlmError(
        f"expected a datastore or a memory (search(queries, k) -> Retrieved and a key_spec), got "
        f"{type(source).__name__}"
    )
