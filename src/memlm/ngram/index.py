"""``memlm ngram build``: an ∞-gram index (Liu et al. 2024, Sec. 4) over any corpus, with the model's own tokenizer.

The folder holds the ``infini-gram`` engine's files, written by memlm itself (the package's ``indexing.py`` only knows
three tokenizers), plus memlm's manifest::

    tokenized.S   shard S's token ids (uint16 where the vocabulary has < 65,535 ids, else uint32, little-endian):
                  every document is a separator (all bits set: 0xFFFF / 0xFFFFFFFF) followed by its tokens
    offset.S      uint64 byte offset in tokenized.S of each document's separator
    metadata.S    one JSON line per document ({"id": ..., "source": ...}) and metaoff.S its uint64 byte offsets:
                  the engine's document search returns them (provenance)
    table.S       the suffix array: every token position of tokenized.S as a little-endian pointer of
                  ceil(log2(bytes) / 8) bytes, sorted by the suffix it starts; built by the package's
                  ``rust_indexing`` binary (make-part, merge, concat)
    manifest.json tokenizer identity (fingerprint, vocabulary, EOS), token dtype, sources (corpus, split, documents,
                  fingerprint, held-out slice), counts, per-shard sizes, SHA-256 of every file, build time, the
                  calibration once made, and its own checksum (``manifest_sha256``: a hand edit is refused)
    progress.json only while a build is unfinished; .memlm.lock only while a writer holds the folder

A build holds the folder's writer lock (:mod:`memlm.io.locking`). Tokenizing appends documents batch by batch and
records, after an fsync, how many documents and bytes of every file are durable (at a shard split too: the record then
names the first document of the new shard); a build killed at any moment (even ``kill -9``) resumes there (bytes past
the record are truncated, files of a shard opened after it deleted), so a resumed build equals an uninterrupted one
byte for byte (tests/test_ngram_resume.py kills it at every boundary). The suffix array of a shard is built in temporary
folders and moved into place as a whole; a killed sort is redone from its shard's token file, which gives the same
bytes. The manifest is written last. Shards (``shard_tokens``) bound the size of one suffix-array sort; the sort
itself runs in batches that fit ``memory_gb`` (the package's own rule: 8 bytes of RAM per token byte and job).

Documents are separated, never concatenated: a query suffix never spans two documents (its EOS is searched as the
separator, so "start of a document" is a context like any other).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import shutil
import subprocess
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
from memlm.errors import MemlmError
from memlm.io import schema
from memlm.io.fileio import (
    SAMPLE_BLOCK_BYTES,
    SAMPLE_BLOCKS,
    atomic_write_json,
    disk_full_error,
    is_disk_full,
    sample_sha256,
    sha256_file,
)
from memlm.io.locking import folder_lock, lock_holder
from memlm.storage.folder import manifest_digest, refuse_foreign_files, refuse_other_kind, refuse_to_open_other_kind

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "NgramIndex",
    "build_ngram_index",
    "check_memory_gb",
    "check_out",
    "is_own_file",
    "rust_indexing",
    "token_dtype_for",
]

FORMAT, FORMAT_VERSION = "memlm-ngram", 1
MANIFEST, PROGRESS = "manifest.json", "progress.json"
KIND = "∞-gram index"  # how memlm.storage.folder names the artifact
KINDS = ("tokenized", "offset", "metadata", "metaoff", "table")
SHARD_FILE = re.compile(rf"({'|'.join(KINDS)})\.(0|[1-9][0-9]*)")  # the engine's files: <kind>.<shard>
BUILD_TEMP = re.compile(r"\.sa-(parts|merged)\.[0-9]+|\.sa\.[0-9]+\.building")  # a suffix-array sort's own
HACK = 100_000  # bytes each make-part job reads past its range (the package's default lookahead)
MIN_MEMORY_GB = 0.01  # the sort's least memory (check_memory_gb)
FULL_CHECK_BYTES = 1 << 30  # opening hashes the smallest files whole up to 1 GiB in all (docs/reference/guarantees.md)
REBUILD = "rebuild it with `memlm ngram build ... --overwrite` (or delete the folder)"
INSTALL = "the ∞-gram needs the infini-gram package: pip install 'memlm[ngram]' (infini-gram >= 2.6, Python >= 3.11)"

_FILE = schema.Obj(
    required={"sha256": schema.Str(pattern=r"[0-9a-f]{64}"), "bytes": schema.Int(min=0)},
    optional={"sample_sha256": schema.Str(pattern=r"[0-9a-f]{64}")},
)
MANIFEST_SCHEMA = schema.Obj(
    required={
        "format": schema.Str(choices=(FORMAT,)),
        "format_version": schema.Int(),
        "tokenizer": schema.Obj(
            required={"fingerprint": schema.Str(), "vocab_size": schema.Int(min=1), "eos_id": schema.Int(min=0)}
        ),
        "token_dtype": schema.Str(choices=("u16", "u32")),
        "tokens": schema.Int(min=0),
        "documents": schema.Int(min=0),
        "shards": schema.ListOf(
            schema.Obj(
                required={"tokens": schema.Int(min=0), "documents": schema.Int(min=0), "bytes": schema.Int(min=0)}
            ),
            min_len=1,
        ),
        "files": schema.Obj(values=_FILE),
        "sources": schema.ListOf(schema.Obj()),
    },
    optional={"calibration": schema.Opt(schema.Obj()), "manifest_sha256": schema.Str()},
)
PROGRESS_SCHEMA = schema.Obj(
    required={"config": schema.Obj(), "docs_done": schema.Int(min=0), "shards": schema.ListOf(schema.Obj())}
)


def token_dtype_for(vocab_size: int) -> tuple[str, type[np.unsignedinteger]]:
    """``("u16", np.uint16)`` when every id fits below the separator 0xFFFF, else ``("u32", np.uint32)``."""
    return ("u16", np.uint16) if vocab_size < 0xFFFF else ("u32", np.uint32)


def rust_indexing() -> Path:
    """The ``rust_indexing`` binary of the installed ``infini-gram`` package (refused, with the fix, when absent)."""
    spec = importlib.util.find_spec("infini_gram")
    if spec is None or not spec.submodule_search_locations:
        raise MemlmError(INSTALL)
    binary = Path(spec.submodule_search_locations[0]) / "rust_indexing"
    if not binary.is_file():
        raise MemlmError(f"{binary} is missing: reinstall infini-gram; {INSTALL}")
    return binary


def _package_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("infini-gram")
    except Exception:  # noqa: BLE001 - only recorded
        return None


def tokenizer_identity(tokenizer) -> dict[str, Any]:
    """What an index records about its tokenizer; compared whenever it is opened with a model."""
    from memlm.models.resources import tokenizer_fingerprint  # imports torch / transformers

    if tokenizer.eos_token_id is None:
        raise MemlmError("the tokenizer has no EOS token: the ∞-gram index needs one (documents end with it)")
    return {
        "fingerprint": tokenizer_fingerprint(tokenizer),
        "vocab_size": len(tokenizer),
        "eos_id": int(tokenizer.eos_token_id),
        "name": getattr(tokenizer, "name_or_path", None),
    }


def _name(kind: str, shard: int) -> str:
    return f"{kind}.{shard}"


def is_own_file(name: str) -> bool:
    """Whether ``name`` is a file an ∞-gram build writes: its manifest, progress file, ``<kind>.<shard>`` files and
    the sort's temporaries. ``--overwrite`` deletes these and refuses a folder holding anything else
    (``offset.txt``, ``table.csv``, a datastore's ``offset.bin`` are not the index's)."""
    return name in (MANIFEST, PROGRESS) or bool(SHARD_FILE.fullmatch(name) or BUILD_TEMP.fullmatch(name))


# ---------------------------------------------------------------------------------------------------- opening


@dataclass
class NgramIndex:
    """A finished ∞-gram index folder: its manifest (checked) and where its files are."""

    path: Path
    manifest: dict[str, Any]
    integrity: dict[str, Any] | None = None  # what open() checked (_check_contents)

    @property
    def token_dtype(self) -> str:
        return self.manifest["token_dtype"]

    @property
    def dtype(self) -> type[np.unsignedinteger]:
        return np.uint16 if self.token_dtype == "u16" else np.uint32

    @property
    def separator(self) -> int:
        return int(np.iinfo(self.dtype).max)

    @property
    def eos_id(self) -> int:
        return int(self.manifest["tokenizer"]["eos_id"])

    @property
    def num_shards(self) -> int:
        return len(self.manifest["shards"])

    def __len__(self) -> int:
        return int(self.manifest["tokens"])

    @classmethod
    def open(cls, path: str | Path, verify: bool = False) -> NgramIndex:
        """Open a finished index: no unfinished build, the manifest's schema and own checksum, every file's size, and
        the full SHA-256 of its files, smallest first, up to ``FULL_CHECK_BYTES`` in all, the sampled SHA-256 of the
        rest (``verify``: full SHA-256 of every file). ``integrity`` records which (eval reports it)."""
        path = Path(path)
        refuse_to_open_other_kind(path, KIND, "memlm ngram build")
        if (path / PROGRESS).exists():
            holder = lock_holder(path)
            busy = f" (pid {holder.get('pid')} may be building it right now)" if holder else ""
            raise MemlmError(
                f"∞-gram index {path} has an unfinished build ({PROGRESS}){busy}: run the same "
                "`memlm ngram build` command again to resume it"
            )
        mpath = path / MANIFEST
        if not mpath.exists():
            raise MemlmError(f"{path} is not a memlm ∞-gram index (no {MANIFEST}): build one with memlm ngram build")
        manifest = schema.read_json(mpath, MANIFEST_SCHEMA, "∞-gram index manifest", REBUILD)
        if manifest["format_version"] != FORMAT_VERSION:
            raise MemlmError(
                f"{path} is ∞-gram index format {manifest['format_version']}, this memlm reads "
                f"{FORMAT_VERSION}; {REBUILD}"
            )
        if manifest.get("manifest_sha256") != manifest_digest(manifest):
            raise MemlmError(
                f"{mpath} was changed after the build (its content no longer matches its "
                f"manifest_sha256: a hand edit or corruption); restore it or {REBUILD}"
            )
        for name, rec in manifest["files"].items():
            f = path / name
            size = f.stat().st_size if f.exists() else -1
            if size != rec["bytes"]:
                what = "missing" if size < 0 else f"{size} bytes, the manifest says {rec['bytes']}"
                raise MemlmError(f"∞-gram index file {f} is {what} (truncated or corrupt); {REBUILD}")
        index = cls(path, manifest)
        index.integrity = _check_contents(path, manifest["files"], None if verify else FULL_CHECK_BYTES)
        return index

    def check_tokenizer(self, tokenizer) -> None:
        """Refuse a tokenizer other than the one the index was built with (its ids would mean other tokens)."""
        from memlm.models.resources import tokenizer_fingerprint

        rec = self.manifest["tokenizer"]
        fp = tokenizer_fingerprint(tokenizer)
        if fp != rec["fingerprint"]:
            raise MemlmError(
                f"∞-gram index {self.path} was built with another tokenizer ({rec.get('name') or '?'}, fingerprint "
                f"{rec['fingerprint']}, vocab {rec['vocab_size']}) than this model's ({fp}, vocab {len(tokenizer)}): "
                "its token ids would mean other tokens; use a model with that tokenizer, or build an index for this "
                "model with `memlm ngram build --model ...`"
            )

    def record_calibration(self, calibration: dict[str, Any]) -> None:
        """Store the calibration (the mixture fitted on the build's held-out slice) in ``manifest.json`` (resealed)."""
        manifest = json.loads(json.dumps(self.manifest))
        manifest["calibration"] = calibration
        manifest["manifest_sha256"] = manifest_digest(manifest)
        atomic_write_json(self.path / MANIFEST, manifest)
        self.manifest = manifest


def _check_contents(path: Path, files: dict[str, Any], budget: int | None) -> dict[str, Any]:
    """Compare the files' checksums with the manifest's: the full SHA-256 of the smallest files up to ``budget``
    bytes in all (``None``: every file), the sampled one (``fileio.sample_sha256``: the whole of a file up to 1 MiB,
    256 blocks of 4 KiB of a larger one) of the others. Returns what was checked, for the result files."""
    full, sampled, checked = 0, 0, 0
    used = 0
    for name, rec in sorted(files.items(), key=lambda kv: (kv[1]["bytes"], kv[0])):
        f = path / name
        if budget is None or used + rec["bytes"] <= budget or "sample_sha256" not in rec:
            used += rec["bytes"]
            if rec["sha256"] != sha256_file(f):
                raise MemlmError(f"checksum mismatch in {f}: the file is corrupt; {REBUILD}")
            full, checked = full + 1, checked + rec["bytes"]
        else:
            if rec["sample_sha256"] != sample_sha256(f):
                raise MemlmError(
                    f"∞-gram index file {f} is corrupt (its sampled checksum differs from the "
                    f"manifest's; `memlm ngram info --verify {path}` checks every byte); {REBUILD}"
                )
            sampled, checked = sampled + 1, checked + min(rec["bytes"], SAMPLE_BLOCKS * SAMPLE_BLOCK_BYTES)
    total = sum(rec["bytes"] for rec in files.values())
    record = {"check": "sampled" if sampled else "full", "bytes_checked": checked, "bytes": total}
    if sampled:
        record["note"] = (
            f"sampled: {checked:,} of {total:,} bytes checked ({full} of {full + sampled} files in full, the "
            f"{sampled} largest on {SAMPLE_BLOCKS} blocks of {SAMPLE_BLOCK_BYTES} bytes each); run `memlm ngram info "
            f"--verify {path}` for a full check"
        )
    else:
        record["note"] = f"full: SHA-256 of all {full} files ({total:,} bytes) matched the manifest"
    return record


# ---------------------------------------------------------------------------------------------------- building


def check_out(out: Path, overwrite: bool) -> None:
    """Refuse to build in a folder that holds another kind of memlm artifact (a datastore, ...), and with
    ``overwrite`` one that holds any file an ∞-gram build does not write (:func:`is_own_file`): nothing is deleted.
    Also the CLI's check, before the model loads."""
    refuse_other_kind(out, KIND)
    if overwrite:
        refuse_foreign_files(out, KIND, is_own_file)


def check_memory_gb(memory_gb: float) -> None:
    """Refuse a sort memory that is not a finite number >= :data:`MIN_MEMORY_GB` GiB.

    The sort splits a shard into jobs of ``memory / 8`` token bytes (the package's rule: 8 bytes of RAM per byte);
    each job also reads ``HACK`` (100 kB) past its part. At 0 or below no job holds a byte and the split never ends;
    below ``16 * HACK`` bytes a job's look-ahead outweighs its part. ``MIN_MEMORY_GB`` (10 MiB) keeps each part
    >= 13 look-aheads."""
    number = isinstance(memory_gb, int | float) and not isinstance(memory_gb, bool)
    if not number or not math.isfinite(memory_gb) or memory_gb < MIN_MEMORY_GB:
        raise MemlmError(
            f"--memory-gb (memory_gb) must be a finite number >= {MIN_MEMORY_GB:g}: the GiB of RAM the suffix-array "
            f"sort may use (default 4), got {memory_gb!r}"
        )


def build_ngram_index(
    tokenizer,
    documents: Sequence,
    out: str | Path,
    source: dict[str, Any] | None = None,
    shard_tokens: int | None = None,
    memory_gb: float = 4.0,
    cpus: int | None = None,
    overwrite: bool = False,
    progress: bool = True,
    batch_docs: int = 256,
) -> NgramIndex:
    """Tokenize ``documents`` (objects with ``.id`` and ``.text``) with ``tokenizer`` and index them in ``out``.

    A rerun of the same call resumes an interrupted build, or returns the finished index; other settings or another
    corpus are refused with the differences named (``overwrite`` deletes the folder's index first: only its own files,
    :func:`is_own_file`; a folder holding anything else, or another kind of artifact, is refused). ``shard_tokens``
    starts a new shard (a separate suffix array, searched together) once a shard holds that many tokens.
    """
    if shard_tokens is not None and shard_tokens < 1:
        raise MemlmError(f"--shard-tokens must be >= 1, got {shard_tokens}")
    check_memory_gb(memory_gb)
    binary = rust_indexing()
    out = Path(out)
    ident = tokenizer_identity(tokenizer)
    dtype_name, dtype = token_dtype_for(ident["vocab_size"])
    config = {
        "tokenizer": ident["fingerprint"],
        "token_dtype": dtype_name,
        "shard_tokens": shard_tokens,
        "source": dict(source or {}),
    }
    with folder_lock(out, "build an ∞-gram index"):
        check_out(out, overwrite)
        for stale in out.glob(".*.tmp"):
            stale.unlink(missing_ok=True)
        if overwrite:
            for f in out.iterdir():
                if is_own_file(f.name) and f.is_dir():
                    shutil.rmtree(f)
                elif is_own_file(f.name):
                    f.unlink()
        if (out / PROGRESS).exists():
            state = schema.read_json(
                out / PROGRESS,
                PROGRESS_SCHEMA,
                "∞-gram build progress file",
                "delete the folder or rerun with --overwrite",
            )
            if state["config"] != config:
                diff = [
                    f"{k} {state['config'].get(k)} -> {v}" for k, v in config.items() if state["config"].get(k) != v
                ]
                raise MemlmError(
                    f"{out} holds an interrupted ∞-gram build with other settings ({'; '.join(diff)}): "
                    "rerun it with its settings to resume, use a new --out, or --overwrite"
                )
        elif (out / MANIFEST).exists():
            index = NgramIndex.open(out)
            old = index.manifest.get("build_config")
            if old != config:
                diff = [f"{k} {(old or {}).get(k)} -> {v}" for k, v in config.items() if (old or {}).get(k) != v]
                raise MemlmError(
                    f"{out} already holds an ∞-gram index built with other settings ({'; '.join(diff)}): "
                    "use a new --out, or --overwrite to replace it"
                )
            print(f"∞-gram index {out} already built ({len(index):,} tokens); nothing to do", file=sys.stderr)
            return index
        else:
            if any(SHARD_FILE.fullmatch(f.name) for f in out.iterdir()):
                raise MemlmError(
                    f"{out} holds ∞-gram files but no manifest or progress file; use an empty folder or --overwrite"
                )
            state = {"config": config, "docs_done": 0, "shards": [], "seconds": 0.0}
            atomic_write_json(out / PROGRESS, state)
        t0 = time.perf_counter()
        seconds0 = float(state.get("seconds", 0.0))
        try:
            _tokenize(tokenizer, documents, out, state, dtype, shard_tokens, progress, batch_docs, t0, seconds0)
            for s, shard in enumerate(state["shards"]):
                if not shard.get("sorted"):
                    _suffix_array(binary, out, s, np.dtype(dtype).itemsize, memory_gb, cpus, progress)
                    shard["sorted"] = True
                    state["seconds"] = seconds0 + time.perf_counter() - t0
                    atomic_write_json(out / PROGRESS, state)
        except OSError as e:
            if is_disk_full(e):
                raise disk_full_error(out) from None
            raise
        return _publish(out, state, ident, dtype_name, config, seconds0 + time.perf_counter() - t0)


def _tokenize(tokenizer, documents, out, state, dtype, shard_tokens, progress, batch_docs, t0, seconds0) -> None:
    """Append every document not yet recorded to the token, offset and metadata files (resumable, see the module)."""
    sep = np.array([np.iinfo(dtype).max], dtype=dtype).tobytes()
    width = np.dtype(dtype).itemsize
    shards = state["shards"]
    handles: dict[str, Any] = {}

    def open_shard(s: int) -> None:
        for h in handles.values():
            h.close()
        handles.clear()
        rec = shards[s]
        for kind in ("tokenized", "offset", "metadata", "metaoff"):
            f = out / _name(kind, s)
            f.touch()
            if f.stat().st_size < rec[kind]:
                raise MemlmError(
                    f"{f} is {f.stat().st_size} bytes, shorter than the {rec[kind]} its build recorded as written: "
                    f"the unfinished build's files were changed; delete the folder (or rerun with --overwrite)"
                )
            os.truncate(f, rec[kind])  # drop what a killed writer wrote after its last record
            handles[kind] = open(f, "ab")

    def commit() -> None:
        for h in handles.values():
            h.flush()
            os.fsync(h.fileno())
        state["seconds"] = seconds0 + time.perf_counter() - t0
        atomic_write_json(out / PROGRESS, state)

    start = int(state["docs_done"])
    _drop_unrecorded_shards(out, len(shards))
    if start >= len(documents) and shards:
        return
    if not shards:
        shards.append({"tokenized": 0, "offset": 0, "metadata": 0, "metaoff": 0, "tokens": 0, "documents": 0})
    open_shard(len(shards) - 1)
    bar = tqdm(
        total=len(documents),
        initial=start,
        unit="doc",
        desc=f"∞-gram tokenize {out.name}",
        disable=not progress,
        dynamic_ncols=True,
    )
    try:
        with bar:
            for b in range(start, len(documents), batch_docs):
                batch = documents[b : b + batch_docs]
                encoded = tokenizer([d.text for d in batch], add_special_tokens=False)["input_ids"]
                for i, (doc, ids) in enumerate(zip(batch, encoded, strict=True)):
                    rec = shards[-1]
                    if shard_tokens is not None and rec["tokens"] and rec["tokens"] + len(ids) > shard_tokens:
                        state["docs_done"] = b + i  # the shards recorded hold exactly the documents before this one
                        commit()
                        shards.append(
                            {"tokenized": 0, "offset": 0, "metadata": 0, "metaoff": 0, "tokens": 0, "documents": 0}
                        )
                        open_shard(len(shards) - 1)
                        rec = shards[-1]
                    arr = np.asarray(ids, dtype=np.int64)
                    if len(arr) and (arr.min() < 0 or arr.max() >= np.iinfo(dtype).max):
                        raise MemlmError(
                            f"document {doc.id} has token ids outside [0, {np.iinfo(dtype).max}): the "
                            "tokenizer does not match its vocabulary size"
                        )
                    data = sep + arr.astype(dtype).tobytes()
                    handles["offset"].write(np.array([rec["tokenized"]], dtype=np.uint64).tobytes())
                    handles["tokenized"].write(data)
                    line = (json.dumps({"id": str(doc.id)}, ensure_ascii=False) + "\n").encode()
                    handles["metaoff"].write(np.array([rec["metadata"]], dtype=np.uint64).tobytes())
                    handles["metadata"].write(line)
                    rec["tokenized"] += len(data)
                    rec["offset"] += 8
                    rec["metadata"] += len(line)
                    rec["metaoff"] += 8
                    rec["tokens"] += len(data) // width
                    rec["documents"] += 1
                state["docs_done"] = b + len(batch)
                commit()
                bar.update(len(batch))
    finally:
        for h in handles.values():
            h.close()
    if not shards or shards[0]["documents"] == 0:
        (out / PROGRESS).unlink(missing_ok=True)
        raise MemlmError("the corpus has no documents to index; give it some text")


def _drop_unrecorded_shards(out: Path, recorded: int) -> None:
    """Delete the files of shards past the ``recorded`` ones: a build killed just after it opened a new shard, before
    the next progress record, leaves them (the resumed build writes that shard again from its first document)."""
    for f in out.iterdir():
        match = SHARD_FILE.fullmatch(f.name)
        if match and int(match.group(2)) >= recorded:
            f.unlink()


def _run(cmd: list[str], what: str) -> subprocess.Popen:
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _wait(procs: list[subprocess.Popen], what: str) -> None:
    errors = []
    for p in procs:
        _, err = p.communicate()
        if p.returncode != 0:
            errors.append((err or "").strip().splitlines()[-1:] or [f"exit status {p.returncode}"])
    if errors:
        raise MemlmError(
            f"the suffix-array builder failed in {what} ({errors[0][0][:200]}); free disk space or "
            "memory and rerun the same command"
        )


def _suffix_array(
    binary: Path, out: Path, s: int, width: int, memory_gb: float, cpus: int | None, progress: bool
) -> None:
    """``table.s`` from ``tokenized.s`` with the package's ``rust_indexing`` (the steps of its ``indexing.py``)."""
    data = out / _name("tokenized", s)
    size = data.stat().st_size
    ratio = max(1, math.ceil(math.log2(max(size, 2)) / 8))  # bytes per pointer
    cpus = max(1, cpus or os.cpu_count() or 1)
    parallel = cpus if size >= 4 * HACK * cpus else 1
    batches = 1
    mem = int(memory_gb * 1024**3)
    while batches * (mem // 8) < size:
        batches *= 2
    jobs = batches * parallel
    step = size // jobs
    step += (-step) % width  # whole tokens per part
    parts, merged = out / f".sa-parts.{s}", out / f".sa-merged.{s}"
    for d in (parts, merged):
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir()
    t0 = time.perf_counter()
    common = ["--ratio", str(ratio), "--token-width", str(width)]
    for b in range(0, jobs, parallel):
        procs = []
        for i in range(b, min(b + parallel, jobs)):
            lo, hi = i * step, min((i + 1) * step + HACK, size) if i < jobs - 1 else size
            if lo >= size:
                continue
            procs.append(
                _run(
                    [
                        str(binary),
                        "make-part",
                        "--data-file",
                        str(data),
                        "--parts-dir",
                        str(parts),
                        "--start-byte",
                        str(lo),
                        "--end-byte",
                        str(hi),
                        *common,
                    ],
                    "make-part",
                )
            )
        _wait(procs, f"make-part of shard {s}")
    _wait(
        [
            _run(
                [
                    str(binary),
                    "merge",
                    "--data-file",
                    str(data),
                    "--parts-dir",
                    str(parts),
                    "--merged-dir",
                    str(merged),
                    "--num-threads",
                    str(cpus),
                    "--hacksize",
                    str(HACK),
                    *common,
                ],
                "merge",
            )
        ],
        f"merge of shard {s}",
    )
    tmp = out / f".sa.{s}.building"
    _wait(
        [
            _run(
                [
                    str(binary),
                    "concat",
                    "--data-file",
                    str(data),
                    "--merged-dir",
                    str(merged),
                    "--merged-file",
                    str(tmp),
                    "--num-threads",
                    str(len(list(merged.iterdir()))),
                    *common,
                ],
                "concat",
            )
        ],
        f"concat of shard {s}",
    )  # merge writes fewer pieces than threads for small parts: concat reads them all
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    if tmp.stat().st_size != (size // width) * ratio:
        raise MemlmError(
            f"the suffix-array builder wrote {tmp.stat().st_size} bytes for shard {s}, expected "
            f"{(size // width) * ratio}; rerun the same command"
        )
    os.replace(tmp, out / _name("table", s))
    shutil.rmtree(parts, ignore_errors=True)
    shutil.rmtree(merged, ignore_errors=True)
    if progress:
        print(
            f"∞-gram suffix array of shard {s}: {size // width:,} positions, {ratio}-byte pointers "
            f"({time.perf_counter() - t0:.1f} s)",
            file=sys.stderr,
        )


def _publish(
    out: Path, state: dict[str, Any], ident: dict[str, Any], dtype_name: str, config: dict[str, Any], seconds: float
) -> NgramIndex:
    """Checksums of every file, the manifest (sealed, written atomically), the progress file removed."""
    files = {}
    for s in range(len(state["shards"])):
        for kind in KINDS:
            f = out / _name(kind, s)
            files[f.name] = {"bytes": f.stat().st_size, "sha256": sha256_file(f), "sample_sha256": sample_sha256(f)}
    shards = [
        {"tokens": r["tokens"] - r["documents"], "documents": r["documents"], "bytes": r["tokenized"]}
        for r in state["shards"]
    ]
    tokens = sum(r["tokens"] for r in shards)
    total_bytes = sum(v["bytes"] for v in files.values())
    source = config["source"]
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "memlm_version": __version__,
        "infini_gram_version": _package_version(),
        "tokenizer": ident,
        "token_dtype": dtype_name,
        "separator": int(np.iinfo(np.uint16 if dtype_name == "u16" else np.uint32).max),
        "tokens": tokens,
        "documents": sum(r["documents"] for r in shards),
        "shards": shards,
        "bytes": total_bytes,
        "bytes_per_token": total_bytes / max(tokens, 1),
        "files": files,
        "sources": [source],
        "build_config": config,
        "build_seconds": seconds,
        "build_id": uuid.uuid4().hex,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    manifest["manifest_sha256"] = manifest_digest(manifest)
    schema.check(manifest, MANIFEST_SCHEMA, out / MANIFEST, "∞-gram index manifest", REBUILD)
    atomic_write_json(out / MANIFEST, manifest)
    (out / PROGRESS).unlink(missing_ok=True)
    return NgramIndex.open(out)
