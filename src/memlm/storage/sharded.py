"""Sharded datastores: one datastore split by documents into N self-describing shard folders, built in parallel.

A corpus ``d_0 .. d_{M-1}`` becomes one token stream (each document's tokens, then EOS; :mod:`memlm.data.windows`) with
``T`` tokens at positions ``0 .. T-1``. A one-process build stores one entry per target position ``p = 1 .. T-1``,
computed in the sliding window that scores ``p``:

    window(p) = 0                          if p < W
              = (p - W) // (W - C) + 1     otherwise          (W = window, C = min_context)

**Shards and order.** Shard ``s`` owns a contiguous run of documents ``[lo_s, hi_s)`` in corpus order; the cut points
balance target counts (shard ``s`` ends at the first document boundary at or after ``(s+1) * (T-1) / N`` targets).
It stores the targets at stream positions ``[max(P_lo, 1), P_hi)`` (``P_d`` = position of document ``d``'s first
token), each computed in exactly the global window a one-process build uses, over the same preceding tokens; a
window that straddles a cut is computed by both neighbouring shards, each keeping its own targets. Entry ``i`` of
shard ``s`` is therefore global entry ``offset_s + i`` of a one-process build (same value, doc hash and offset; the
key equal up to float rounding from the different batching): **the sharded datastore's order is shard 0's entries,
then shard 1's, ..., i.e. exactly the one-process order.**

**Folder** (``--out``)::

    shards.json         format, settings, the plan (documents, targets of each shard), counts once complete
    shard-00000/        a normal datastore (manifest.json, keys.bin, ..., progress.json while unfinished)
    shard-00001/        ...
    index.faiss.json    the sharded index's description (memlm.storage.sharded_index), once built

Each shard is built by :func:`memlm.knnlm.write.write_datastore`, so each resumes on its own: a rerun of the same
command skips finished shards and resumes unfinished ones from their ``progress.json``. With ``ray`` each shard is a
Ray task (a model per worker process, loaded once and reused); without, shards are built one after the other in this
process (same files).

:class:`ShardedDatastore` opens the folder and behaves like a :class:`~memlm.storage.datastore.Datastore` (``keys``,
``values``, ``doc_hash``, ``offset`` are row-concatenated views over the shards' memory maps, global row = global
id); :func:`open_datastore` opens either kind.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from memlm.errors import MemlmError
from memlm.io import schema
from memlm.io.fileio import atomic_write_json
from memlm.storage.datastore import Datastore, DatastoreBase
from memlm.storage.sharded_index import ShardedSearcher

__all__ = [
    "SHARDS_FILE",
    "ShardPlan",
    "ShardedArray",
    "ShardedDatastore",
    "is_sharded",
    "open_datastore",
    "plan_shards",
    "shard_name",
]

SHARDS_FILE = "shards.json"
FORMAT = "memlm-sharded-datastore"
FORMAT_VERSION = 1


def shard_name(i: int) -> str:
    """Folder name of shard ``i`` (``shard-00000``): lexical order = shard order."""
    return f"shard-{i:05d}"


def is_sharded(path: str | Path) -> bool:
    """Whether ``path`` is a sharded datastore folder (holds ``shards.json``)."""
    return (Path(path) / SHARDS_FILE).is_file()


# ------------------------------------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class ShardPlan:
    """Where shard ``index`` starts and ends in the global token stream (see the module docstring)."""

    index: int
    doc_lo: int  # first document owned
    doc_hi: int  # one past the last document owned
    target_lo: int  # first stream position stored (>= 1)
    target_hi: int  # one past the last
    first_window: int  # global index of the first window that scores one of its targets
    read_doc: int  # first document read (the one holding the first window's first token)
    read_skip: int  # tokens of read_doc before that first token

    @property
    def count(self) -> int:
        return self.target_hi - self.target_lo

    def as_dict(self) -> dict[str, int]:
        return {k: int(getattr(self, k)) for k in self.__dataclass_fields__}


def _window_of(p: int, window: int, min_context: int) -> int:
    return 0 if p < window else (p - window) // (window - min_context) + 1


def plan_shards(doc_lengths: Sequence[int], n_shards: int, window: int, min_context: int) -> list[ShardPlan]:
    """Cut documents with ``doc_lengths`` tokens (EOS included) into ``n_shards`` runs of balanced target counts."""
    if n_shards < 1:
        raise MemlmError(f"--shards must be >= 1, got {n_shards}")
    if window < 2 or not 0 <= min_context < window:
        raise MemlmError(f"invalid window {window} / min_context {min_context}: need 0 <= min_context < window")
    lengths = np.asarray(doc_lengths, dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)])  # P_d, and T at the end
    total = int(starts[-1])
    n_targets = total - 1
    if len(lengths) < n_shards or n_targets < n_shards:
        raise MemlmError(
            f"cannot split {len(lengths)} documents ({max(n_targets, 0)} targets) into {n_shards} shards; "
            "use fewer --shards or a larger corpus"
        )
    # document cut points: first boundary at or after each equal share of targets (1 + share = stream position)
    cuts = [0]
    for s in range(1, n_shards):
        goal = 1 + (s * n_targets) // n_shards
        d = int(np.searchsorted(starts, goal, side="left"))
        d = min(max(d, cuts[-1] + 1), len(lengths) - (n_shards - s))  # every shard keeps >= 1 document
        cuts.append(d)
    cuts.append(len(lengths))
    stride = window - min_context
    plans = []
    for s in range(n_shards):
        lo, hi = cuts[s], cuts[s + 1]
        t_lo, t_hi = max(int(starts[lo]), 1), int(starts[hi])
        if t_hi <= t_lo:
            raise MemlmError(f"shard {s} would hold no targets; use fewer --shards")
        w0 = _window_of(t_lo, window, min_context)
        first_tok = w0 * stride
        read_doc = int(np.searchsorted(starts, first_tok, side="right")) - 1
        plans.append(ShardPlan(s, lo, hi, t_lo, t_hi, w0, read_doc, first_tok - int(starts[read_doc])))
    return plans


# ------------------------------------------------------------------------------------------------------- reading


class ShardedArray:
    """Row-concatenation of the shards' arrays (memory maps), indexed by global row; nothing is copied up front.

    Supports what memlm's readers use: ``len``, ``shape``, ``dtype``, ``a[i]``, ``a[start:stop]`` and ``a[ids]`` for an
    integer array of any shape (returns a new array).
    """

    def __init__(self, parts: Sequence[np.ndarray]) -> None:
        self.parts = list(parts)
        sizes = [len(p) for p in self.parts]
        self.bounds = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        first = self.parts[0]
        self.shape = (int(self.bounds[-1]), *first.shape[1:])
        self.dtype = first.dtype
        self.ndim = first.ndim

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, item):
        if isinstance(item, (int, np.integer)):
            i = int(item) + (len(self) if item < 0 else 0)
            if not 0 <= i < len(self):
                raise IndexError(f"row {item} out of range for {len(self)} rows")
            s = int(np.searchsorted(self.bounds, i, side="right")) - 1
            return self.parts[s][i - self.bounds[s]]
        if isinstance(item, slice):
            start, stop, step = item.indices(len(self))
            if step != 1:
                return self[np.arange(start, stop, step)]
            out = []
            for s, part in enumerate(self.parts):
                a, b = max(start, self.bounds[s]), min(stop, self.bounds[s + 1])
                if a < b:
                    out.append(np.asarray(part[a - self.bounds[s] : b - self.bounds[s]]))
            return np.concatenate(out) if out else np.empty((0, *self.shape[1:]), self.dtype)
        ids = np.asarray(item)
        if ids.dtype == bool or not np.issubdtype(ids.dtype, np.integer):
            raise TypeError("a ShardedArray is indexed by ints, slices or integer arrays")
        flat = ids.ravel()
        if flat.size and (flat.min() < 0 or flat.max() >= len(self)):
            raise IndexError(f"ids out of range for {len(self)} rows")
        shard = np.searchsorted(self.bounds, flat, side="right") - 1
        out = np.empty((flat.size, *self.shape[1:]), self.dtype)
        for s in np.unique(shard):
            sel = shard == s
            local = flat[sel] - self.bounds[s]
            order = np.argsort(local, kind="stable")  # read each memmap front to back
            rows = np.empty_like(order)
            rows[order] = np.arange(len(order))
            out[np.flatnonzero(sel)] = np.asarray(self.parts[s][local[order]])[rows]
        return out.reshape(*ids.shape, *self.shape[1:])

    def __array__(self, dtype=None, copy=None):
        arr = self[:]
        return arr if dtype is None else arr.astype(dtype)


@dataclass
class ShardedDatastore(DatastoreBase):
    """A sharded datastore opened for reading: the interface of :class:`~memlm.storage.datastore.Datastore` over all
    shards.

    ``manifest`` is shard 0's with the total ``count`` and a ``sharded`` entry; ``shards`` are the opened shards in
    order and ``offsets[s]`` the global id of shard ``s``'s first entry.
    """

    path: Path
    manifest: dict[str, Any]
    shards: list[Datastore]
    offsets: np.ndarray
    keys: ShardedArray
    values: ShardedArray
    doc_hash: ShardedArray
    offset: ShardedArray
    ray: str | None = None  # search with Ray actors at this address ("local" starts a cluster); None: threads

    @classmethod
    def open(cls, path: str | Path, verify: bool = False, ray: str | None = None) -> ShardedDatastore:
        path = Path(path)
        sp = path / SHARDS_FILE
        if not sp.is_file():
            raise MemlmError(f"{path} is not a sharded datastore (no {SHARDS_FILE}); build one with --shards N")
        try:
            state = json.loads(sp.read_text())
        except json.JSONDecodeError as e:
            raise MemlmError(f"{sp} is corrupt ({e}); rebuild the sharded datastore") from None
        if state.get("format") != FORMAT or state.get("format_version") != FORMAT_VERSION:
            raise MemlmError(f"{sp} is not a {FORMAT} v{FORMAT_VERSION} file; rebuild it with this memlm")
        if not state.get("complete"):
            raise MemlmError(
                f"sharded datastore {path} is unfinished: rerun the same `memlm datastore build --shards` command "
                "to finish it"
            )
        shards = [Datastore.open(path / shard_name(p["index"]), verify=verify) for p in state["plan"]]
        first = shards[0].manifest
        for s in shards[1:]:
            m = s.manifest
            for field in ("model", "tokenizer", "key", "window", "min_context"):
                if m[field] != first[field]:
                    raise MemlmError(
                        f"shard {s.path} has another {field} than {shards[0].path}; the shards do not belong together: "
                        "rebuild the sharded datastore"
                    )
        counts = [len(s) for s in shards]
        if counts != [p["target_hi"] - p["target_lo"] for p in state["plan"]]:
            raise MemlmError(f"the shards of {path} hold {counts} entries, not the planned counts; rebuild it")
        offsets = np.concatenate([[0], np.cumsum(counts)])[:-1].astype(np.int64)
        manifest = json.loads(json.dumps(first))
        manifest.update(
            count=int(sum(counts)),
            sources=[state["config"]["source"]],
            sharded={"shards": len(shards), "offsets": offsets.tolist(), "plan": state["plan"]},
        )
        if state.get("calibration") is not None:
            fix = "rerun `memlm datastore calibrate` on it, or remove the calibration from the file"
            manifest["calibration"] = schema.check(state["calibration"], schema.CALIBRATION, sp, "calibration", fix)
        arrays = {n: ShardedArray([getattr(s, n) for s in shards]) for n in ("keys", "values", "doc_hash", "offset")}
        return cls(path, manifest, shards, offsets, ray=ray, **arrays)

    def checksum(self) -> str:
        import hashlib

        return hashlib.sha256("".join(s.checksum() for s in self.shards).encode()).hexdigest()

    def record_calibration(self, calibration: dict[str, Any]) -> None:
        """Store the calibration (:mod:`memlm.knnlm.calibration`: the mixture fitted on the build's held-out slice) in
        ``shards.json``."""
        sp = self.path / SHARDS_FILE
        state = json.loads(sp.read_text())
        state["calibration"] = calibration
        atomic_write_json(sp, state)
        self.manifest["calibration"] = calibration

    def searcher(self, index_path: str | Path | None = None, nprobe: int = 32) -> ShardedSearcher:
        """A :class:`memlm.storage.sharded_index.ShardedSearcher` over the shards' indexes (Ray actors when
        ``self.ray``; the sharded index's description is ``index_path``, default ``index.faiss.json``)."""
        return ShardedSearcher.open(self, index_path, nprobe=nprobe, ray=self.ray)


def open_datastore(
    path: str | Path, verify: bool = False, ray: str | None = None, mmap_index: bool = False
) -> Datastore | ShardedDatastore:
    """Open a datastore folder of either kind: :class:`ShardedDatastore` when it holds ``shards.json``.

    ``ray``: search a sharded datastore with Ray actors. ``mmap_index``: memory-map a single datastore's index when
    searching (:meth:`memlm.storage.datastore.Datastore.searcher`; sharded indexes always are).
    """
    if is_sharded(path):
        return ShardedDatastore.open(path, verify=verify, ray=ray)
    return Datastore.open(path, verify=verify, mmap_index=mmap_index)
