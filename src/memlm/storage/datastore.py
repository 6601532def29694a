"""The kNN-LM datastore: (key = h_ds(context), value = next token) for every corpus token (Khandelwal et al. Eq. 1).

    D = {(f(c_i), w_i) | (c_i, w_i) in corpus}

A datastore is a folder that describes itself, like a ``save_pretrained`` folder (:mod:`memlm.storage.folder`'s format,
shared with NPM's phrase index: manifest, arrays, checksums, resumable writer, lock)::

    manifest.json   model and tokenizer fingerprints, key role/layer/dim, count, dtypes, sources, windowing, checksums
    keys.bin        float16 [count, dim]   (raw C-order; shape and dtype are in the manifest, never typed by a user)
    values.bin      int32   [count]        next-token ids
    doc_hash.bin    int64   [count]        64-bit hash of the source document (to drop exact self-matches)
    offset.bin      int32   [count]        position of the target inside its document
    index.faiss     the FAISS index over the keys (memlm.storage.index), with index.faiss.json beside it

Building (:func:`memlm.knnlm.write.write_datastore`, the forward pass that writes the entries) streams: memory does
not grow with the corpus (keys are appended to disk batch by batch). After every batch the files are flushed and
``progress.json`` is replaced atomically, so a build killed at any moment (even ``kill -9``) resumes where it stopped
with no entry lost or duplicated: bytes past the recorded count are truncated. Appending more text later uses the same
mechanism. A build holds the folder's writer lock (:mod:`memlm.io.locking`): a second
writer is refused with the holder's pid and command. A rerun with other settings (key, window, corpus, model, ...) is
refused with the differences named, never silently answered with the old datastore.

What is checked when (:meth:`Datastore.open`):

* always: the manifest's schema and its own checksum (``manifest_sha256``: a hand edit is refused), the key role, each
  file's size, each file's sampled SHA-256 (``fileio.sample_sha256``: whole files up to 1 MiB, 256 blocks of
  larger ones), and ``values.bin`` in one vectorised pass: every value in ``[0, vocab_size)`` and the min/max recorded
  at build time;
* ``verify=True`` (``memlm datastore info --verify``): also the full SHA-256 of every file (and of the index);
* at the end of every build, append or subsample: the checksums are computed from the files on disk.
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from memlm.errors import MemlmError
from memlm.io import schema
from memlm.io.fileio import disk_full_error, is_disk_full, unique_tmp
from memlm.models.compute import check_compute_paths, describe_compute_path
from memlm.models.keys import KeySpec, num_layers
from memlm.models.resources import model_fingerprint, tokenizer_fingerprint
from memlm.storage import index as index_lib
from memlm.storage.folder import FolderFormat
from memlm.storage.folder import manifest_digest as _manifest_digest  # noqa: F401 (the name older callers import)
from memlm.storage.searcher import FaissSearcher, Searcher

__all__ = ["Datastore", "FORMAT_VERSION", "model_identity"]

FORMAT_VERSION = 1
FILES = {"keys": "float16", "values": "int32", "doc_hash": "int64", "offset": "int32"}
REBUILD = "rebuild it with `memlm datastore build ... --overwrite` (or delete the folder)"
_PROGRESS_FIX = "delete progress.json (and the .bin files) or rerun with --overwrite to start over"

#: the datastore's folder format (:mod:`memlm.storage.folder`): manifest, arrays, progress file, checksums, lock
FOLDER = FolderFormat(
    kind="datastore",
    title="a memlm datastore",
    arrays=FILES,
    wide="keys",
    dim_field=("key", "dim"),
    format_version=FORMAT_VERSION,
    manifest_schema=schema.DATASTORE_MANIFEST,
    progress_schema=schema.DATASTORE_PROGRESS,
    builder="memlm datastore build",
    fix=REBUILD,
    progress_fix=_PROGRESS_FIX,
    resume="run the same `memlm datastore build` command again to resume it",
    verify_command="memlm datastore info --verify",
    extra_files=("counts.npy", "counts.json", "absorbed.npy"),  # a pruned datastore's (memlm.retrieval's names)
)


def _publish(manifest: dict[str, Any], folder: Path) -> dict[str, Any]:
    """Record the values' min/max and a fresh build id, then seal and write the manifest (:meth:`FolderFormat.publish`:
    checksums of every file and of the manifest itself)."""
    n = int(manifest["count"])
    values = FOLDER.array(folder, "values", n, 1)
    manifest.update(values_range={"min": int(values.min()), "max": int(values.max())} if n else None,
                    build_id=uuid.uuid4().hex)  # fmt: skip
    del values
    return FOLDER.publish(folder, manifest)


def _settings(config: dict[str, Any]) -> dict[str, Any]:
    """The user-facing settings of a build config (progress.json), flattened for messages."""
    src = config.get("source") or {}
    key = config.get("key") or {}
    return {
        "key": f"{key.get('role')}@{key.get('layer')}",
        "window": config.get("window"),
        "min-context": config.get("min_context"),
        "block-start": config.get("block_start"),
        "batch-size": config.get("batch_size"),
        "model": config.get("model_fingerprint"),
        "tokenizer": config.get("tokenizer_fingerprint"),
        "dtype": config.get("dtype"),
        "corpus": src.get("corpus"),
        "split": src.get("split"),
        "max-tokens": src.get("max_tokens"),
        "corpus content": src.get("fingerprint"),
        "held-out slice": describe_holdout(src) if "holdout" in src else None,
    }


def _diff(old: dict[str, Any], new: dict[str, Any], skip: tuple[str, ...] = ()) -> list[str]:
    return [f"{k} {old[k]} -> {new.get(k)}" for k in old if k not in skip and k in new and old[k] != new[k]]


def _manifest_settings(manifest: dict[str, Any]) -> dict[str, Any]:
    build = manifest.get("build") or {}
    settings = {
        "key": f"{manifest['key']['role']}@{manifest['key']['layer']}",
        "window": manifest["window"],
        "min-context": manifest["min_context"],
        "block-start": manifest.get("block_start"),
        "model": manifest["model"]["fingerprint"],
        "tokenizer": manifest["tokenizer"]["fingerprint"],
    }
    if "dtype" in build:
        settings["dtype"] = build["dtype"]
    return settings


def holdout_key(source: dict[str, Any]) -> str | None:
    """The identity of the slice a source held out of the datastore (``None``: nothing held out, e.g. a datastore
    built before ``--holdout`` existed or with ``--holdout 0``). Two builds with equal corpora and equal keys put the
    same text into the datastore (:func:`memlm.knnlm.calibration.holdout_split` is deterministic)."""
    hold = source.get("holdout") or {}
    return str(hold.get("ids_sha256")) if hold.get("documents") else None


def describe_holdout(source: dict[str, Any]) -> str:
    """The held-out slice of a source in words, for messages."""
    hold = source.get("holdout") or {}
    if not hold.get("documents"):
        return "none (all of the corpus is in the datastore)"
    n = hold["documents"]
    return f"{hold.get('tokens', 0):,} tokens of {n} document{'s' if n != 1 else ''} (--holdout {hold.get('fraction')})"


def _same_corpus(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Same corpus, split, --max-tokens and text (an --append of it would add it twice, whatever its slice)."""
    return all(a.get(k) == b.get(k) for k in ("corpus", "split", "max_tokens", "fingerprint"))


def _same_source(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Same corpus, split, --max-tokens, text and held-out slice: the same entries."""
    return _same_corpus(a, b) and holdout_key(a) == holdout_key(b)


def _source_diff(sources: list[dict[str, Any]], source: dict[str, Any]) -> list[str]:
    if any(_same_source(s, source) for s in sources):
        return []
    if len(sources) == 1:
        old = sources[0]
        out = [
            f"{name} {old.get(k)} -> {source.get(k)}"
            for name, k in (("corpus", "corpus"), ("split", "split"), ("max-tokens", "max_tokens"))
            if old.get(k) != source.get(k)
        ]
        if not out and old.get("fingerprint") != source.get("fingerprint"):
            out.append(f"corpus content {old.get('fingerprint')} -> {source.get('fingerprint')} (the text changed)")
        if holdout_key(old) != holdout_key(source):
            out.append(f"held-out slice {describe_holdout(old)} -> {describe_holdout(source)}")
        return out
    have = ", ".join(f"{s.get('corpus')}/{s.get('split')}" for s in sources)
    return [f"corpus {source.get('corpus')}/{source.get('split')} is not one of its sources ({have})"]


def model_identity(model, tokenizer) -> dict[str, Any]:
    """What a datastore records about the model that made its keys; compared on every use."""
    cfg = model.config
    return {
        "model": {
            "name": getattr(cfg, "memlm_name", None) or getattr(cfg, "_name_or_path", None),
            "fingerprint": model_fingerprint(model),
            "architecture": type(model).__name__,
        },
        "tokenizer": {
            "fingerprint": tokenizer_fingerprint(tokenizer),
            "vocab_size": len(tokenizer),
            "eos_id": tokenizer.eos_token_id,
        },
    }


def _check_values(path: Path, manifest: dict[str, Any], values: np.ndarray) -> None:
    """One vectorised pass over values.bin: ids in the tokenizer's range and equal to the recorded min/max."""
    vmin, vmax = int(values.min()), int(values.max())
    vocab = manifest["tokenizer"]["vocab_size"]
    if vmin < 0 or vmax >= vocab:
        raise MemlmError(
            f"{path / 'values.bin'} holds token ids in [{vmin}, {vmax}], outside the tokenizer's vocabulary "
            f"[0, {vocab}): the file is corrupt or not from this datastore; {REBUILD}"
        )
    rec = manifest.get("values_range")
    if rec is not None and (rec["min"], rec["max"]) != (vmin, vmax):
        raise MemlmError(
            f"{path / 'values.bin'} changed since the build (min/max {vmin}/{vmax}, the manifest recorded "
            f"{rec['min']}/{rec['max']}); {REBUILD}"
        )


class DatastoreBase:
    """What every datastore (one folder, :class:`Datastore`, or shards, :class:`memlm.storage.sharded.ShardedDatastore`)
    offers its consumers: ``path``, ``manifest``, the entry arrays ``keys [N, D]`` / ``values`` / ``doc_hash`` /
    ``offset``, the key spec, the model check, and :meth:`searcher` -- the one way to its index."""

    path: Path
    manifest: dict[str, Any]
    keys: Any
    values: Any
    doc_hash: Any
    offset: Any

    def __len__(self) -> int:
        return int(self.manifest["count"])

    @property
    def dim(self) -> int:
        return int(self.manifest["key"]["dim"])

    @property
    def key_spec(self) -> KeySpec:
        return KeySpec(self.manifest["key"]["role"], int(self.manifest["key"]["layer"]))

    @property
    def model_name(self) -> str | None:
        return self.manifest["model"]["name"]

    @property
    def index_path(self) -> Path:
        """The default index: ``index.faiss`` in the folder (for a sharded datastore, the sharded index's name)."""
        return self.path / "index.faiss"

    def searcher(self, index_path: str | Path | None = None, nprobe: int = 32) -> Searcher:
        """The :class:`memlm.storage.searcher.Searcher` over the index at ``index_path`` (default :attr:`index_path`),
        refused unless that index was built from this datastore."""
        raise NotImplementedError

    def checksum(self) -> str:
        raise NotImplementedError

    def record_calibration(self, calibration: dict[str, Any]) -> None:
        raise NotImplementedError

    def write_rows(
        self, out: str | Path, rows: np.ndarray, record: dict[str, Any], what: str = "write a datastore subset"
    ) -> Datastore:
        """The entries at ``rows`` (sorted row numbers) written to ``out`` as a new datastore, ``record`` (e.g.
        ``{"subsample": {...}}``) added to its manifest; used by :meth:`Datastore.subsample` and
        :mod:`memlm.knnlm.prune` (from a sharded datastore too: the result is one folder)."""
        out = Path(out)
        keep = np.asarray(rows, dtype=np.int64)
        with FOLDER.writing(out, what):
            FOLDER.check_out(out, overwrite=True)  # it replaces a datastore there: nothing else
            (out / "manifest.json").unlink(missing_ok=True)  # the folder is not a datastore until it is complete
            for name in FILES:
                src = getattr(self, name)
                tmp = unique_tmp(out / f"{name}.bin")
                try:
                    with open(tmp, "wb") as f:
                        for s in range(0, len(keep), 65536):
                            f.write(np.ascontiguousarray(src[keep[s : s + 65536]]).tobytes())
                    os.replace(tmp, out / f"{name}.bin")
                except OSError as e:
                    if is_disk_full(e):
                        raise disk_full_error(out / f"{name}.bin", resume=False) from None
                    raise
                finally:
                    tmp.unlink(missing_ok=True)
            manifest = json.loads(json.dumps(self.manifest))
            for stale in ("manifest_sha256", "build_id", "values_range", "files", "sharded"):
                manifest.pop(stale, None)
            manifest.update(count=len(keep), **record)
            _publish(manifest, out)
            return Datastore.open(out)

    def check_compatible(self, model, tokenizer, key_spec: KeySpec | None = None) -> None:
        """Refuse a model, tokenizer or key role other than the ones the datastore was built with."""
        ident = model_identity(model, tokenizer)
        if ident["tokenizer"]["fingerprint"] != self.manifest["tokenizer"]["fingerprint"]:
            raise MemlmError(
                f"datastore {self.path} was built with a different tokenizer "
                f"(vocab {self.manifest['tokenizer']['vocab_size']}"
                f" vs {ident['tokenizer']['vocab_size']}): use the model it was built with "
                f"({self.model_name}) or build a new datastore for this model"
            )
        if ident["model"]["fingerprint"] != self.manifest["model"]["fingerprint"]:
            raise MemlmError(
                f"datastore {self.path} was built with model {self.model_name} "
                f"({self.manifest['model']['fingerprint'][:12]}), not this one "
                f"({ident['model']['name']}, {ident['model']['fingerprint'][:12]}): keys from different models are not "
                "comparable; pass --model to match the datastore or build a new datastore"
            )
        build = self.manifest.get("build") or {}
        built = build.get("compute_path") or ({"dtype": build["dtype"]} if "dtype" in build else None)
        check_compute_paths(built, describe_compute_path(model), f"datastore {self.path}")
        if key_spec is not None and key_spec.normalized(num_layers(model)) != self.key_spec:
            raise MemlmError(
                f"datastore {self.path} holds {self.key_spec.describe()} keys, but {key_spec.describe()} was asked: "
                "omit --key to use the datastore's, or build a datastore with that key"
            )


@dataclass
class Datastore(DatastoreBase):
    """An opened datastore: memory-mapped arrays plus the manifest that describes them. ``mmap_index``: its index
    is searched memory-mapped (:func:`memlm.storage.index.load_index_mmap`) instead of read into RAM."""

    path: Path
    manifest: dict[str, Any]
    keys: np.ndarray  # [N, D] float16 memmap
    values: np.ndarray  # [N] int32 memmap
    doc_hash: np.ndarray  # [N] int64 memmap
    offset: np.ndarray  # [N] int32 memmap
    mmap_index: bool = False

    @classmethod
    def open(cls, path: str | Path, verify: bool = False, mmap_index: bool = False) -> Datastore:
        """Open a datastore folder; see the module docstring for what is checked (``verify``: full checksums)."""
        path = Path(path)
        manifest = FOLDER.read_manifest(path)
        try:
            KeySpec(manifest["key"]["role"], manifest["key"]["layer"])
        except MemlmError as e:
            raise MemlmError(f"{path / 'manifest.json'} has an invalid key ({e}); {REBUILD}") from None
        arrays = FOLDER.open_arrays(path, manifest, verify)
        if manifest["count"]:
            _check_values(path, manifest, arrays["values"])
        return cls(path, manifest, **arrays, mmap_index=mmap_index)

    def index_source(self) -> dict[str, Any]:
        """The identity an index over these keys records (:func:`memlm.storage.index.build_index`'s ``source``)."""
        return index_lib.datastore_source(self.manifest)

    def build_index(
        self,
        factory: str | None = None,
        metric: str = "l2",
        train_size: int | None = None,
        path: str | Path | None = None,
        progress: bool = True,
        **kw: Any,
    ):
        """:func:`memlm.storage.index.build_index` over this datastore's keys, recording its identity (default path
        ``index.faiss`` in the folder)."""
        out = Path(path) if path is not None else self.index_path
        return index_lib.build_index(
            self.keys, out, factory=factory, metric=metric, train_size=train_size, progress=progress,
            source=self.index_source(), **kw,
        )  # fmt: skip

    def load_index(self, path: str | Path | None = None, nprobe: int = 32, verify: bool = False, **kw: Any):
        """:func:`memlm.storage.index.load_index`, refusing an index not built from this datastore."""
        out = Path(path) if path is not None else self.index_path
        return index_lib.load_index(
            out, nprobe=nprobe, expect=self.index_source(), verify=verify, expect_from=self.path, **kw
        )

    def index_problem(self, path: str | Path | None = None) -> str | None:
        """Why the index at ``path`` (default ``index.faiss``) cannot serve this datastore, or ``None`` if it can.

        Cheap (sidecar + sampled checksum; the FAISS file is not read): for deciding whether to (re)build.
        """
        out = Path(path) if path is not None else self.index_path
        try:
            meta = index_lib.read_index_meta(out)
        except MemlmError as e:
            return str(e)
        if meta is None:
            return f"no index at {out}"
        diff = index_lib._source_diff(meta.get("source"), self.index_source())
        if diff or (meta["n"], meta["d"]) != (len(self), self.dim):
            return f"index {out} was not built from the datastore {self.path} ({'; '.join(diff) or 'size differs'})"
        return None

    def searcher(self, index_path: str | Path | None = None, nprobe: int = 32) -> Searcher:
        path = Path(index_path) if index_path is not None else self.index_path
        if not self.mmap_index:  # an index given with --index must have been built from this datastore
            return FaissSearcher(self.load_index(path, nprobe=nprobe), path)
        problem = self.index_problem(path)  # the sidecar against the datastore searched, as load_index does
        if problem is not None:
            raise MemlmError(f"{problem}; {index_lib._REBUILD}")
        return FaissSearcher(index_lib.load_index_mmap(path, nprobe), path)

    def checksum(self) -> str:
        """One SHA-256 over all files' checksums, as recorded in the manifest."""
        return hashlib.sha256("".join(self.manifest["files"][k]["sha256"] for k in FILES).encode()).hexdigest()

    def record_calibration(self, calibration: dict[str, Any]) -> None:
        """Store the calibration (:mod:`memlm.knnlm.calibration`: the mixture fitted on the build's held-out slice) in
        ``manifest.json``.

        Only the manifest's own checksum changes (the build id and file checksums stay, so the index still matches).
        """
        manifest = json.loads(json.dumps(self.manifest))
        manifest["calibration"] = calibration
        self.manifest = FOLDER.rewrite_manifest(self.path, manifest)

    def subsample(self, out: str | Path, fraction: float, seed: int = 0) -> Datastore:
        """A random ``fraction`` of the entries (Xu et al.'s 5% datastore; Khandelwal Fig. 2), written to ``out``."""
        if not 0 < fraction <= 1:
            raise MemlmError(f"fraction must be in (0, 1], got {fraction}")
        n = len(self)
        keep = np.sort(np.random.default_rng(seed).choice(n, size=max(1, round(n * fraction)), replace=False))
        record = {"subsample": {"of": str(self.path), "fraction": fraction, "seed": seed}}
        return self.write_rows(out, keep, record, "write a subsampled datastore")
