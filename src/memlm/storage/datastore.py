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

Building streams: memory does not grow with the corpus (keys are appended to disk batch by batch). After every batch the
files are flushed and ``progress.json`` is replaced atomically, so a build killed at any moment (even ``kill -9``)
resumes where it stopped with no entry lost or duplicated: bytes past the recorded count are truncated. Appending more
text later uses the same mechanism. A build holds the folder's writer lock (:mod:`memlm.io.locking`): a second
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
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from memlm import __version__
from memlm.data.windows import batched, count_targets, resolve_stride, sliding_windows, tokenize_documents
from memlm.errors import MemlmError, option
from memlm.io import schema
from memlm.io.fileio import disk_full_error, is_disk_full, unique_tmp
from memlm.models.compute import check_compute_paths, describe_compute_path
from memlm.models.forward import forward_windows
from memlm.models.keys import KeySpec, key_dim, num_layers
from memlm.models.resources import model_fingerprint, tokenizer_fingerprint
from memlm.storage import index as index_lib
from memlm.storage.folder import FolderFormat
from memlm.storage.folder import manifest_digest as _manifest_digest  # noqa: F401 (the name older callers import)
from memlm.storage.index import meta_path
from memlm.storage.searcher import FaissSearcher, Searcher

__all__ = ["Datastore", "build_datastore", "FORMAT_VERSION", "model_identity"]

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
        src = {
            "kind": "datastore",
            "count": len(self),
            "dim": self.dim,
            "sha256": self.manifest["files"]["keys"]["sha256"],
        }
        if "build_id" in self.manifest:
            src["build_id"] = self.manifest["build_id"]
        return src

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
        """Store the λ/τ tuned on the build's held-out slice (:mod:`memlm.knnlm.calibration`) in ``manifest.json``.

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


def build_datastore(
    model,
    tokenizer,
    documents: Sequence,
    out: str | Path,
    key: KeySpec | None = None,
    window: int = 1024,
    min_context: int = 512,
    batch_size: int = 4,
    source: dict[str, Any] | None = None,
    append: bool = False,
    progress: bool = True,
    overwrite: bool = False,
    stride: int | None = None,
    block_start: str = "skip",
) -> Datastore:
    """Build (or resume, or ``append`` to) a datastore in ``out`` from ``documents`` with one forward pass.

    ``key`` selects h_ds (default: ``ffn_in`` of the last layer, Khandelwal's best key). ``source`` describes the
    corpus for the manifest (name, split, fingerprint).
    Rerunning the same call after an interruption resumes; a finished datastore built with the same settings and
    source is returned as is. Other settings (key, window, min_context, model, tokenizer, dtype, corpus) are refused
    with the differences named, unless ``append=True`` (adds ``documents`` as a new source; model, key and windows
    must match) or ``overwrite=True`` (the folder's datastore, index and any unfinished build are deleted first).
    The folder is locked for the whole build (:func:`memlm.io.locking.folder_lock`).
    ``stride`` (default ``window - min_context``) equal to ``window`` gives non-overlapping blocks whose first token is
    skipped or scored from BOS (``block_start``, see :func:`memlm.data.windows.sliding_windows`).
    """
    if append and overwrite:
        raise MemlmError(
            f"give {option('--append')} (add to the datastore) or {option('--overwrite')} (replace it), not both"
        )
    key = (key or KeySpec()).normalized(num_layers(model))
    stride, min_context = resolve_stride(window, None if stride is not None else min_context, stride)
    block = block_start if stride == window else None  # only blocks have a first token to skip or score
    with FOLDER.writing(Path(out), "build a datastore", overwrite=overwrite) as out:
        return _build_locked(model, tokenizer, documents, out, key, window, min_context, batch_size, source, append,
                             progress, stride, block)  # fmt: skip


def _build_locked(
    model,
    tokenizer,
    documents: Sequence,
    out: Path,
    key: KeySpec,
    window: int,
    min_context: int,
    batch_size: int,
    source: dict[str, Any] | None,
    append: bool,
    progress: bool,
    stride: int,
    block_start: str | None,
) -> Datastore:
    manifest_path, progress_path = out / "manifest.json", FOLDER.progress_path(out)
    ident = model_identity(model, tokenizer)
    source = dict(source or {})
    dtype = str(next(iter(model.parameters())).dtype).replace("torch.", "")
    config = {
        "key": {"role": key.role, "layer": key.layer},
        "window": window,
        "min_context": min_context,
        **({"block_start": block_start} if block_start else {}),
        "batch_size": batch_size,
        "source": source,
        "model_fingerprint": ident["model"]["fingerprint"],
        "tokenizer_fingerprint": ident["tokenizer"]["fingerprint"],
        "dtype": dtype,
    }
    how = f"rerun with the same settings, use a new {option('--out')}, or {option('--overwrite')} to replace it"

    if progress_path.exists():
        state = FOLDER.read_progress(out)
        if state["config"] != config:
            diff = _diff(_settings(state["config"]), _settings(config)) or ["the recorded settings differ"]
            raise MemlmError(
                f"{out} holds an interrupted build with other settings ({'; '.join(diff)}): rerun it with its "
                f"settings to resume, use a new {option('--out')}, or {option('--overwrite')} to discard it"
            )
        base = state["base"]
        if base["manifest"] is not None:
            schema.check(base["manifest"], schema.DATASTORE_MANIFEST, progress_path, "datastore build progress file",
                         _PROGRESS_FIX)  # fmt: skip
    elif manifest_path.exists():
        existing = Datastore.open(out)
        old = _manifest_settings(existing.manifest)
        new = _settings(config)
        diff = _diff(old, new)
        if not append:
            diff += _source_diff(existing.manifest["sources"], source)
            if diff:
                if all(d.startswith("held-out slice") for d in diff):  # same text, another slice held out of it
                    fix = (f"{how} (the entries hold the text this slice would calibrate on); to calibrate it as it "
                           f"is, name text outside it: `memlm datastore calibrate {out} --corpus FILE`")  # fmt: skip
                else:
                    fix = f"{how}, or {option('--append')} to add this corpus to it"
                raise MemlmError(
                    f"{out} already holds a datastore built with other settings ({'; '.join(diff)}): {fix}"
                )
            print(f"datastore {out} already built ({len(existing)} entries); nothing to do", file=sys.stderr)
            return existing
        if diff:
            raise MemlmError(
                f"cannot append to {out}: it was built with other settings ({'; '.join(diff)}); append with the "
                f"datastore's own model, key, window and min-context, or use a new {option('--out')}"
            )
        existing.check_compatible(model, tokenizer, key)
        if any(_same_corpus(s, source) for s in existing.manifest["sources"]):
            print(f"datastore {out} already holds this corpus ({len(existing)} entries); nothing to append",
                  file=sys.stderr)  # fmt: skip
            return existing
        base = {"count": len(existing), "manifest": existing.manifest}
        for stale in (existing.index_path, meta_path(existing.index_path)):
            stale.unlink(missing_ok=True)  # the index no longer covers every entry
        state = {"config": config, "base": base, "windows_done": 0, "count": base["count"], "seconds": 0.0}
        FOLDER.start(out, state)
    else:
        if append:
            flag = option("--append")
            raise MemlmError(f"{flag} needs an existing datastore in {out}; build it first without {flag}")
        base = {"count": 0, "manifest": None}
        state = {"config": config, "base": base, "windows_done": 0, "count": 0, "seconds": 0.0}
        FOLDER.start(out, state)

    dim = key_dim(model, key)
    # a shard (memlm.storage.sharded.ShardDocuments) brings its own windows: those of the one-process build for its
    # targets
    custom = hasattr(documents, "memlm_windows")
    n_total = (
        documents.memlm_count_targets(tokenizer)
        if custom
        else count_targets(documents, tokenizer, window, stride, block_start or "skip")
    )
    if n_total == 0:
        if base["count"] == 0:
            progress_path.unlink(missing_ok=True)
        raise MemlmError(f"corpus {source.get('corpus', '')} has no tokens to store; give it some text")

    count = _write_entries(model, tokenizer, documents, out, key, dim, window, stride, block_start, batch_size, state,
                           base, n_total, progress)  # fmt: skip
    prev = base["manifest"]
    sources = (prev["sources"] if prev else []) + [{**source, "targets": count - base["count"]}]
    manifest = {
        "format_version": FORMAT_VERSION,
        "memlm_version": __version__,
        **ident,
        "key": {"role": key.role, "layer": key.layer, "dim": dim, "describe": key.describe()},
        "count": count,
        "window": window,
        "min_context": min_context,
        "stride": stride,
        **({"block_start": block_start} if block_start else {}),
        "sources": sources,
        "build": {"dtype": config["dtype"], "batch_size": batch_size, "compute_path": describe_compute_path(model)},
        "build_seconds": (prev["build_seconds"] if prev and "build_seconds" in prev else 0.0) + float(state["seconds"]),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    _publish(manifest, out)
    return Datastore.open(out)


def _write_entries(
    model,
    tokenizer,
    documents: Sequence,
    out: Path,
    key: KeySpec,
    dim: int,
    window: int,
    stride: int,
    block_start: str | None,
    batch_size: int,
    state: dict[str, Any],
    base: dict[str, Any],
    n_total: int,
    progress: bool,
) -> int:
    """The streaming part of a build: append every remaining window's entries, recording progress per batch."""
    bos_id = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    if hasattr(documents, "memlm_windows"):  # a shard of a sharded build (memlm.storage.sharded)
        windows = documents.memlm_windows(tokenizer, window, window - stride)
    else:
        windows = sliding_windows(
            tokenize_documents(documents, tokenizer),
            window,
            stride=stride,
            block_start=block_start or "skip",
            bos_id=bos_id,
        )
    skip = int(state["windows_done"])
    bar = tqdm(
        total=n_total,
        initial=int(state["count"]) - base["count"],
        unit="tok",
        desc=f"datastore {out.name}",
        disable=not progress,
        dynamic_ncols=True,
    )
    t0 = time.perf_counter()
    seconds0 = float(state["seconds"])
    remaining = (w for w in windows if w.index >= skip)
    # truncates what was written after the last recorded batch (a crash between data and progress writes)
    with FOLDER.appender(out, dim, state) as writer, bar:
        for outputs in forward_windows(model, batched(remaining, batch_size), [key], with_logprobs=False):
            for o in outputs:
                rows = slice(o.window.score_from, len(o.window.input_ids))
                bar.update(writer.append(keys=o.keys[key], values=o.targets, doc_hash=o.window.doc_hash[rows],
                                         offset=o.window.offset[rows]))  # fmt: skip
            writer.commit(windows_done=outputs[-1].window.index + 1, seconds=seconds0 + time.perf_counter() - t0)
    return writer.count
