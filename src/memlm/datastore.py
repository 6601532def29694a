"""The kNN-LM datastore: (key = h_ds(context), value = next token) for every corpus token (Khandelwal et al. Eq. 1).

    D = {(f(c_i), w_i) | (c_i, w_i) in corpus}

A datastore is a folder that describes itself, like a ``save_pretrained`` folder::

    manifest.json   model and tokenizer fingerprints, key role/layer/dim, count, dtypes, sources, windowing, checksums
    keys.bin        float16 [count, dim]   (raw C-order; shape and dtype are in the manifest, never typed by a user)
    values.bin      int32   [count]        next-token ids
    doc_hash.bin    int64   [count]        64-bit hash of the source document (to drop exact self-matches)
    offset.bin      int32   [count]        position of the target inside its document
    index.faiss     the FAISS index over the keys (memlm.index), with index.faiss.json beside it

Building streams: memory does not grow with the corpus (keys are appended to disk batch by batch). After every batch the
files are flushed and ``progress.json`` is replaced atomically, so a build killed at any moment (even ``kill -9``)
resumes where it stopped with no entry lost or duplicated: bytes past the recorded count are truncated. Appending more
text later uses the same mechanism.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from memlm import __version__
from memlm.errors import MemlmError
from memlm.fileio import atomic_write_json
from memlm.forward import forward_windows
from memlm.index import meta_path
from memlm.keys import KeySpec, key_dim, num_layers
from memlm.resources import model_fingerprint, tokenizer_fingerprint
from memlm.windows import batched, count_targets, sliding_windows, tokenize_documents

__all__ = ["Datastore", "build_datastore", "FORMAT_VERSION", "model_identity"]

FORMAT_VERSION = 1
FILES = {"keys": "float16", "values": "int32", "doc_hash": "int64", "offset": "int32"}


def _sha256(path: Path, nbytes: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        left = nbytes
        while left > 0:
            block = f.read(min(1 << 24, left))
            if not block:
                break
            h.update(block)
            left -= len(block)
    return h.hexdigest()


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


@dataclass
class Datastore:
    """An opened datastore: memory-mapped arrays plus the manifest that describes them."""

    path: Path
    manifest: dict[str, Any]
    keys: np.ndarray  # [N, D] float16 memmap
    values: np.ndarray  # [N] int32 memmap
    doc_hash: np.ndarray  # [N] int64 memmap
    offset: np.ndarray  # [N] int32 memmap

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
        return self.path / "index.faiss"

    @classmethod
    def open(cls, path: str | Path, verify: bool = False) -> Datastore:
        """Open a datastore folder. Sizes are checked always; ``verify=True`` also checks the SHA-256 checksums."""
        path = Path(path)
        manifest_path = path / "manifest.json"
        if (path / "progress.json").exists():
            raise MemlmError(
                f"datastore {path} has an unfinished build (progress.json): run the same `memlm datastore build` "
                "command again to resume it"
            )
        if not manifest_path.exists():
            raise MemlmError(
                f"{path} is not a memlm datastore (no manifest.json): build one with memlm datastore build"
            )
        try:
            manifest = json.loads(manifest_path.read_text())
        except json.JSONDecodeError as e:
            raise MemlmError(f"{manifest_path} is corrupt ({e}); rebuild the datastore") from e
        if manifest.get("format_version") != FORMAT_VERSION:
            raise MemlmError(
                f"{path} has datastore format {manifest.get('format_version')}, this memlm reads {FORMAT_VERSION}"
            )
        n, d = int(manifest["count"]), int(manifest["key"]["dim"])
        arrays = {}
        for name, dtype in FILES.items():
            f = path / f"{name}.bin"
            shape = (n, d) if name == "keys" else (n,)
            expected = int(np.prod(shape)) * np.dtype(dtype).itemsize
            size = f.stat().st_size if f.exists() else -1
            if size != expected:
                what = "missing" if size < 0 else f"{size} bytes, the manifest says {expected}"
                raise MemlmError(
                    f"datastore file {f} is {what} (truncated or corrupt); "
                    "rebuild the datastore with memlm datastore build"
                )
            if verify and manifest["files"][name]["sha256"] != _sha256(f, expected):
                raise MemlmError(f"checksum mismatch in {f}: the file is corrupt; rebuild the datastore")
            arrays[name] = np.memmap(f, dtype=dtype, mode="r", shape=shape) if n else np.zeros(shape, dtype=dtype)
        return cls(path, manifest, **arrays)

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
        if key_spec is not None and key_spec.normalized(num_layers(model)) != self.key_spec:
            raise MemlmError(
                f"datastore {self.path} holds {self.key_spec.describe()} keys, but {key_spec.describe()} was asked: "
                "omit --key to use the datastore's, or build a datastore with that key"
            )

    def checksum(self) -> str:
        """One SHA-256 over all files' checksums, as recorded in the manifest."""
        return hashlib.sha256("".join(self.manifest["files"][k]["sha256"] for k in FILES).encode()).hexdigest()

    def subsample(self, out: str | Path, fraction: float, seed: int = 0) -> Datastore:
        """A random ``fraction`` of the entries (Xu et al.'s 5% datastore; Khandelwal Fig. 2), written to ``out``."""
        if not 0 < fraction <= 1:
            raise MemlmError(f"fraction must be in (0, 1], got {fraction}")
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        n = len(self)
        keep = np.sort(np.random.default_rng(seed).choice(n, size=max(1, round(n * fraction)), replace=False))
        files = {}
        for name in FILES:
            src = getattr(self, name)
            tmp = out / f"{name}.bin.tmp"
            with open(tmp, "wb") as f:
                for s in range(0, len(keep), 65536):
                    f.write(np.ascontiguousarray(src[keep[s : s + 65536]]).tobytes())
            os.replace(tmp, out / f"{name}.bin")
            nbytes = (out / f"{name}.bin").stat().st_size
            files[name] = {"dtype": FILES[name], "sha256": _sha256(out / f"{name}.bin", nbytes)}
        manifest = json.loads(json.dumps(self.manifest))
        manifest.update(
            count=len(keep), files=files, subsample={"of": str(self.path), "fraction": fraction, "seed": seed}
        )
        atomic_write_json(out / "manifest.json", manifest)
        return Datastore.open(out)


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
) -> Datastore:
    """Build (or resume, or ``append`` to) a datastore in ``out`` from ``documents`` with one forward pass.

    ``key`` selects h_ds (default: ``ffn_in`` of the last layer, Khandelwal's best key). ``source`` describes the
    corpus for the manifest (name, split, fingerprint).
    Rerunning the same call after an interruption resumes; a finished datastore is returned as is unless
    ``append=True``, which adds ``documents`` as a new source.
    """
    key = (key or KeySpec()).normalized(num_layers(model))
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    manifest_path, progress_path = out / "manifest.json", out / "progress.json"
    ident = model_identity(model, tokenizer)
    source = dict(source or {})
    config = {
        "key": {"role": key.role, "layer": key.layer},
        "window": window,
        "min_context": min_context,
        "batch_size": batch_size,
        "source": source,
        "model_fingerprint": ident["model"]["fingerprint"],
    }

    if progress_path.exists():
        state = json.loads(progress_path.read_text())
        if state["config"] != config:
            raise MemlmError(
                f"{out} holds an interrupted build with different settings ({state['config']}); "
                "rerun it with the same settings to resume, or use a new folder"
            )
        base = state["base"]
    elif manifest_path.exists():
        existing = Datastore.open(out)
        if not append:
            print(f"datastore {out} already built ({len(existing)} entries); nothing to do", file=sys.stderr)
            return existing
        existing.check_compatible(model, tokenizer, key)
        if window != existing.manifest["window"] or min_context != existing.manifest["min_context"]:
            raise MemlmError("append with the datastore's own window and min_context")
        base = {"count": len(existing), "manifest": existing.manifest}
        for stale in (existing.index_path, meta_path(existing.index_path)):
            stale.unlink(missing_ok=True)  # the index no longer covers every entry
        state = {"config": config, "base": base, "windows_done": 0, "count": base["count"], "seconds": 0.0}
        atomic_write_json(progress_path, state)
    else:
        if any((out / f"{name}.bin").exists() for name in FILES):
            raise MemlmError(f"{out} holds datastore files but no manifest or progress file; use an empty folder")
        base = {"count": 0, "manifest": None}
        state = {"config": config, "base": base, "windows_done": 0, "count": 0, "seconds": 0.0}
        atomic_write_json(progress_path, state)

    dim = key_dim(model, key)
    # a shard (memlm.sharded.ShardDocuments) brings its own windows: those of the one-process build for its targets
    custom = hasattr(documents, "memlm_windows")
    n_total = documents.memlm_count_targets(tokenizer) if custom else count_targets(documents, tokenizer)
    if n_total == 0:
        progress_path.unlink(missing_ok=True)
        raise MemlmError(f"corpus {source.get('corpus', '')} has no tokens to store; give it some text")

    # Truncate anything written after the last recorded batch (a crash between data and progress writes).
    count = int(state["count"])
    handles = {}
    for name, dtype in FILES.items():
        f = out / f"{name}.bin"
        width = dim if name == "keys" else 1
        f.touch()
        os.truncate(f, count * width * np.dtype(dtype).itemsize)
        handles[name] = open(f, "ab")

    if custom:
        windows = documents.memlm_windows(tokenizer, window, min_context)
    else:
        windows = sliding_windows(tokenize_documents(documents, tokenizer), window, min_context)
    skip = int(state["windows_done"])
    done_targets = count - base["count"]
    bar = tqdm(
        total=n_total,
        initial=done_targets,
        unit="tok",
        desc=f"datastore {out.name}",
        disable=not progress,
        dynamic_ncols=True,
    )
    t0 = time.perf_counter()
    seconds0 = float(state["seconds"])

    def remaining():
        for w in windows:
            if w.index >= skip:
                yield w

    try:
        for outputs in forward_windows(model, batched(remaining(), batch_size), [key], with_logprobs=False):
            for o in outputs:
                rows = slice(o.window.score_from, len(o.window.input_ids))
                handles["keys"].write(o.keys[key].astype(np.float16).tobytes())
                handles["values"].write(o.targets.astype(np.int32).tobytes())
                handles["doc_hash"].write(o.window.doc_hash[rows].astype(np.int64).tobytes())
                handles["offset"].write(o.window.offset[rows].astype(np.int32).tobytes())
                count += len(o.targets)
                bar.update(len(o.targets))
            for h in handles.values():
                h.flush()
                os.fsync(h.fileno())
            state.update(
                windows_done=outputs[-1].window.index + 1,
                count=count,
                seconds=seconds0 + time.perf_counter() - t0,
            )
            atomic_write_json(progress_path, state)
    finally:
        bar.close()
        for h in handles.values():
            h.close()

    files = {}
    for name, dtype in FILES.items():
        f = out / f"{name}.bin"
        files[name] = {"dtype": dtype, "sha256": _sha256(f, f.stat().st_size)}
    prev = base["manifest"]
    sources = (prev["sources"] if prev else []) + [{**source, "targets": count - base["count"]}]
    manifest = {
        "format_version": FORMAT_VERSION,
        "memlm_version": __version__,
        **ident,
        "key": {"role": key.role, "layer": key.layer, "dim": dim, "describe": key.describe()},
        "count": count,
        "dtypes": dict(FILES),
        "files": files,
        "window": window,
        "min_context": min_context,
        "stride": window - min_context,
        "sources": sources,
        "build_seconds": (prev["build_seconds"] if prev else 0.0) + float(state["seconds"]),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    atomic_write_json(manifest_path, manifest)
    progress_path.unlink()
    return Datastore.open(out)
