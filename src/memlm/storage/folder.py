"""The self-describing folder format that datastores and phrase indexes share: a manifest over append-only arrays.

A folder of this format holds (the names are the format's, identical in every folder)::

    manifest.json   what the folder holds; ``count`` rows, the ``dtypes`` and ``files`` checksums of its arrays and
                    its own checksum ``manifest_sha256``; written last, so a folder with a manifest and no progress
                    file is complete
    <name>.bin      one raw C-order array per declared name: ``[count, dim]`` for the format's one wide array (keys,
                    token vectors), ``[count]`` for the others (shape and dtype in the manifest, never typed by a user)
    progress.json   only while a build is unfinished: its settings and the number of rows durably written
    .memlm.lock     only while a process writes (:mod:`memlm.io.locking`)

:class:`FolderFormat` declares one such format (its arrays, the schemas of its manifest and progress file, the words
its messages use) and does everything that is the same for every format:

* **writing** (:meth:`FolderFormat.writing`, :class:`AppendWriter`): the folder's writer lock is held; rows are
  appended to every array batch by batch; :meth:`AppendWriter.commit` flushes and fsyncs every array *before* it
  replaces ``progress.json`` atomically with the new row count, so the count never exceeds what is on disk. A writer
  killed at any moment (even ``kill -9``) resumes from the recorded count: bytes written past it are truncated when
  the next writer opens the arrays, so no row is lost or duplicated. A full disk is one :class:`MemlmError` naming
  the file it happened on.
* **sealing** (:meth:`FolderFormat.publish`): the full and sampled SHA-256 of every array (:mod:`memlm.io.fileio`),
  then the manifest's own checksum (SHA-256 of its canonical JSON without ``manifest_sha256``), then the manifest
  is written atomically and the progress file removed.
* **replacing** (:func:`refuse_other_kind`, :func:`refuse_foreign_files`): a build never writes into a folder that
  holds another kind of memlm artifact (a datastore, an ∞-gram index, a phrase index, a sharded datastore: told apart
  by their manifest or progress file), and ``overwrite`` deletes only the files of its own kind, by their fixed
  names: a folder that holds anything else is refused, naming those files, and nothing is deleted.
* **opening** (:meth:`FolderFormat.read_manifest`, :meth:`FolderFormat.open_arrays`): an unfinished build, a
  missing, malformed (schema), hand-edited (checksum) manifest, or an array file that is missing, of the wrong size
  or whose sampled checksum differs is refused with one error naming the file and the fix; ``verify=True`` also
  compares the full SHA-256 of every array. Checksums a manifest does not record (older folders) are not checked.
  Arrays are opened as read-only memory maps.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from memlm.errors import MemlmError, option
from memlm.io import schema
from memlm.io.fileio import (
    atomic_write_json,
    disk_full_error,
    is_disk_full,
    sample_sha256,
    sha256_file,
    strict_jsonable,
)
from memlm.io.locking import LOCK_NAME, folder_lock, lock_holder

__all__ = [
    "MANIFEST",
    "PROGRESS",
    "AppendWriter",
    "FolderFormat",
    "artifact_kind",
    "manifest_digest",
    "refuse_foreign_files",
    "refuse_other_kind",
    "refuse_to_open_other_kind",
]

MANIFEST = "manifest.json"
PROGRESS = "progress.json"
INDEX_FILES = ("index.faiss", "index.faiss.json")  # a folder's FAISS index and its sidecar (memlm.storage.index)


#: the ``format`` field of the manifests (or of ``shards.json``) that name their kind; a datastore's manifest has no
#: ``format`` field and is known by its ``key`` and ``count``
FORMAT_KINDS = {
    "memlm-ngram": "∞-gram index",
    "memlm-npm-phrase-index": "phrase index",
    "memlm-sharded-datastore": "sharded datastore",
}
#: fields only one kind's progress file has
PROGRESS_KINDS = {"docs_done": "∞-gram index", "windows_done": "datastore", "blocks_done": "phrase index"}
UNKNOWN, DAMAGED = "unknown", "damaged"


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_bytes())
    except (OSError, ValueError):
        return None


def artifact_kind(folder: str | os.PathLike[str]) -> str | None:
    """The kind of memlm artifact ``folder`` holds, by its ``shards.json``, ``manifest.json`` or ``progress.json``:
    ``"datastore"``, ``"∞-gram index"``, ``"phrase index"``, ``"sharded datastore"``; ``"unknown"`` for a manifest or
    JSON object memlm cannot tell (another tool's?), ``"damaged"`` for one that is no JSON object (a damaged file of
    memlm's: memlm writes only objects); ``None`` when there is none of them."""
    folder = Path(folder)
    if (folder / "shards.json").is_file():
        return "sharded datastore"
    for name, kinds in ((MANIFEST, None), (PROGRESS, PROGRESS_KINDS)):
        if not (folder / name).exists():
            continue
        raw = _read_json(folder / name)
        if not isinstance(raw, dict):
            return DAMAGED
        if kinds is not None:
            return next((kind for field, kind in kinds.items() if field in raw), UNKNOWN)
        if "format" in raw:
            return FORMAT_KINDS.get(str(raw["format"]), UNKNOWN)
        return "datastore" if "key" in raw and "count" in raw else UNKNOWN
    return None


def _article(kind: str) -> str:
    return f"an {kind}" if kind[0] in "aeiou∞" else f"a {kind}"


def refuse_other_kind(folder: str | os.PathLike[str], kind: str) -> None:
    """Refuse to build ``kind`` in a folder that holds another kind of memlm artifact (nothing is changed)."""
    other = artifact_kind(folder)
    if other not in (None, UNKNOWN, DAMAGED, kind):
        raise MemlmError(
            f"{folder} holds {_article(other)}, not {_article(kind)}: {_article(kind)} is never written over it "
            f"({option('--overwrite')} replaces only {_article(kind)}); nothing was changed: use an empty or new "
            f"{option('--out')}"
        )


def refuse_to_open_other_kind(folder: str | os.PathLike[str], kind: str, builder: str) -> None:
    """Opening ``kind``: a folder holding a datastore, an ∞-gram index or a phrase index of another kind is named as
    what it is (instead of a schema error advising a rebuild over it)."""
    other = artifact_kind(folder)
    if other != kind and other in ("datastore", "∞-gram index", "phrase index"):
        raise MemlmError(f"{folder} holds {_article(other)}, not {_article(kind)}: give {_article(kind)}'s folder "
                         f"(build one with {builder})")  # fmt: skip


def refuse_foreign_files(folder: str | os.PathLike[str], kind: str, own: Callable[[str], bool]) -> None:
    """Before an overwrite deletes anything: refuse, naming them, the files of ``folder`` that are not ``kind``'s own
    (``own(name)``; the writer lock and temporary ``.*.tmp`` files are everyone's), and another kind of artifact.

    A manifest or progress file that is a JSON object memlm cannot tell is taken as ``kind``'s only when the folder
    also holds other files of ``kind``; alone, it may be another tool's and is refused. One that is no JSON object
    at all is a damaged file of memlm's (what ``--overwrite`` is advised for)."""
    folder = Path(folder)
    if not folder.is_dir():
        return
    refuse_other_kind(folder, kind)
    names = sorted(p.name for p in folder.iterdir() if p.name != LOCK_NAME and not _is_tmp(p.name))
    foreign = [n for n in names if not own(n)]
    if artifact_kind(folder) == UNKNOWN and not any(own(n) for n in names if n not in (MANIFEST, PROGRESS)):
        foreign = sorted({*foreign, *(n for n in (MANIFEST, PROGRESS) if n in names)})
    if foreign:
        shown = ", ".join(foreign[:20]) + (f" and {len(foreign) - 20} more" if len(foreign) > 20 else "")
        raise MemlmError(
            f"{folder} holds files that are not part of {_article(kind)}: {shown}; {option('--overwrite')} replaces "
            f"only {_article(kind)}'s own files, so nothing was deleted: move those files away, or use an empty or "
            f"new {option('--out')}"
        )


def _is_tmp(name: str) -> bool:
    return name.startswith(".") and name.endswith(".tmp")


def manifest_digest(manifest: Mapping[str, Any]) -> str:
    """SHA-256 of the manifest's content (every field but ``manifest_sha256`` itself), canonical JSON."""
    body = {k: v for k, v in strict_jsonable(dict(manifest)).items() if k != "manifest_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


@dataclass(frozen=True)
class FolderFormat:
    """One folder format: its arrays and how its messages name it (see the module docstring).

    ``arrays`` maps each array's name to its dtype (file ``<name>.bin``); ``wide`` is the one array with ``dim``
    values per row, whose ``dim`` is the manifest field at ``dim_field``. ``kind`` names the folder in messages
    ("datastore"), ``title`` with its article ("a memlm datastore"); ``builder`` is what builds one, ``fix`` how to
    recover from a broken folder, ``verify_command`` (optional) the command that checks every byte. ``format_name``
    (optional): the value of the manifest's ``format`` field, checked before its schema. ``extra_files``: other
    files of the folder that an overwrite removes.
    """

    kind: str
    title: str
    arrays: Mapping[str, str]
    wide: str
    dim_field: tuple[str, ...]
    format_version: int
    manifest_schema: schema.Schema
    progress_schema: schema.Schema
    builder: str
    fix: str
    progress_fix: str
    resume: str
    verify_command: str | None = None
    format_name: str | None = None
    extra_files: tuple[str, ...] = ()

    # ------------------------------------------------------------------------------------------------ layout

    def file(self, folder: Path, name: str) -> Path:
        return Path(folder) / f"{name}.bin"

    def shape(self, name: str, count: int, dim: int) -> tuple[int, ...]:
        return (count, dim) if name == self.wide else (count,)

    def nbytes(self, name: str, count: int, dim: int) -> int:
        return int(np.prod(self.shape(name, count, dim))) * np.dtype(self.arrays[name]).itemsize

    def dim(self, manifest: Mapping[str, Any]) -> int:
        value: Any = manifest
        for key in self.dim_field:
            value = value[key]
        return int(value)

    def array(self, folder: Path, name: str, count: int, dim: int) -> np.ndarray:
        """``<name>.bin`` as a read-only memory map of ``count`` rows (an empty array when ``count`` is 0)."""
        shape, dtype = self.shape(name, count, dim), self.arrays[name]
        if not count:
            return np.zeros(shape, dtype)
        return np.memmap(self.file(folder, name), dtype=dtype, mode="r", shape=shape)

    @staticmethod
    def progress_path(folder: Path) -> Path:
        return Path(folder) / PROGRESS

    @staticmethod
    def is_complete(folder: Path) -> bool:
        """A manifest and no unfinished build."""
        return (Path(folder) / MANIFEST).is_file() and not (Path(folder) / PROGRESS).exists()

    def has_stray_arrays(self, folder: Path) -> bool:
        return any(self.file(folder, name).exists() for name in self.arrays)

    def own_files(self) -> tuple[str, ...]:
        """The names of every file a folder of this format may hold (what an overwrite deletes)."""
        return (*(f"{n}.bin" for n in self.arrays), MANIFEST, PROGRESS, *INDEX_FILES, *self.extra_files)

    # ------------------------------------------------------------------------------------------------ writing

    @contextmanager
    def writing(self, folder: Path, what: str, overwrite: bool = False) -> Iterator[Path]:
        """Hold ``folder``'s writer lock; refuse a folder holding another kind of artifact (:func:`refuse_other_kind`);
        remove temporary files of a killed writer and, with ``overwrite``, every file of the format (arrays, manifest,
        progress file, index, ``extra_files``), after refusing any other file (:func:`refuse_foreign_files`)."""
        folder = Path(folder)
        with folder_lock(folder, what):
            self.check_out(folder, overwrite)
            for stale in folder.glob(".*.tmp"):
                stale.unlink(missing_ok=True)  # temporary files of a killed writer (we hold the lock: none is in use)
            if overwrite:
                for name in self.own_files():
                    (folder / name).unlink(missing_ok=True)
            yield folder

    def check_out(self, folder: Path, overwrite: bool) -> None:
        """Refuse to write in ``folder`` when it holds another kind of artifact, or (``overwrite``) any file that is not
        this format's (:meth:`own_files`): before anything is deleted (also the CLI's check, before a model loads)."""
        refuse_other_kind(folder, self.kind)
        if overwrite:
            refuse_foreign_files(folder, self.kind, set(self.own_files()).__contains__)

    def read_progress(self, folder: Path) -> dict[str, Any]:
        return schema.read_json(self.progress_path(folder), self.progress_schema, f"{self.kind} build progress file",
                                self.progress_fix)  # fmt: skip

    def start(self, folder: Path, state: dict[str, Any]) -> None:
        """Record a new (or appending) build: ``state`` (with ``count``, the rows already there) in the progress
        file. Refuses array files that belong to no manifest or build."""
        if int(state["count"]) == 0 and self.has_stray_arrays(folder):
            raise MemlmError(
                f"{folder} holds {self.kind} files but no manifest or progress file; use an empty folder or "
                f"{option('--overwrite')}"
            )
        atomic_write_json(self.progress_path(folder), state)

    def appender(self, folder: Path, dim: int, state: dict[str, Any]) -> AppendWriter:
        """An :class:`AppendWriter` continuing the build whose progress is ``state``."""
        return AppendWriter(self, Path(folder), dim, state)

    def checksums(self, folder: Path) -> dict[str, dict[str, str]]:
        """The manifest's ``files``: dtype, full and sampled SHA-256 of every array file."""
        out = {}
        for name, dtype in self.arrays.items():
            f = self.file(folder, name)
            out[name] = {"dtype": dtype, "sha256": sha256_file(f), "sample_sha256": sample_sha256(f)}
        return out

    @staticmethod
    def seal(manifest: dict[str, Any]) -> dict[str, Any]:
        """Set the manifest's own checksum (after every other field is final)."""
        manifest["manifest_sha256"] = manifest_digest(manifest)
        return manifest

    def publish(self, folder: Path, manifest: dict[str, Any]) -> dict[str, Any]:
        """Finish a build: the arrays' checksums (unless ``manifest`` has its ``files``), the manifest's own, the
        manifest written atomically, the progress file removed. Returns the sealed manifest."""
        if "files" not in manifest:
            manifest["files"] = self.checksums(folder)
        manifest["dtypes"] = dict(self.arrays)
        atomic_write_json(Path(folder) / MANIFEST, self.seal(manifest))
        self.progress_path(folder).unlink(missing_ok=True)
        return manifest

    def rewrite_manifest(self, folder: Path, manifest: dict[str, Any]) -> dict[str, Any]:
        """Replace the manifest of a finished folder by ``manifest`` (resealed, schema-checked), arrays untouched."""
        self.seal(manifest)
        path = Path(folder) / MANIFEST
        schema.check(manifest, self.manifest_schema, path, f"{self.kind} manifest", self.fix)
        atomic_write_json(path, manifest)
        return manifest

    # ------------------------------------------------------------------------------------------------ opening

    def refuse_unfinished(self, folder: Path) -> None:
        if self.progress_path(folder).exists():
            holder = lock_holder(folder)
            busy = f" (pid {holder.get('pid')} may be building it right now)" if holder else ""
            raise MemlmError(f"{self.kind} {folder} has an unfinished build ({PROGRESS}){busy}: {self.resume}")

    def read_manifest(self, folder: Path) -> dict[str, Any]:
        """The manifest of a finished folder: no unfinished build, its format and schema, its own checksum (when
        recorded) and its dtypes checked."""
        folder = Path(folder)
        path = folder / MANIFEST
        refuse_to_open_other_kind(folder, self.kind, self.builder)
        self.refuse_unfinished(folder)
        if not path.exists():
            raise MemlmError(f"{folder} is not {self.title} (no {MANIFEST}): build one with {self.builder}")
        if self.format_name is not None:
            try:
                raw = json.loads(path.read_bytes())
            except (OSError, ValueError):
                raw = None  # the schema check below says what is wrong
            if isinstance(raw, dict) and (
                raw.get("format") != self.format_name or raw.get("format_version") != self.format_version
            ):
                raise MemlmError(
                    f"{path} is not the manifest of a version-{self.format_version} {self.kind} "
                    f"(format {raw.get('format')} v{raw.get('format_version')}); {self.fix}"
                )
        manifest = schema.read_json(path, self.manifest_schema, f"{self.kind} manifest", self.fix)
        if manifest["format_version"] != self.format_version:
            raise MemlmError(
                f"{folder} has {self.kind} format {manifest.get('format_version')}, this memlm reads "
                f"{self.format_version}"
            )
        if "manifest_sha256" in manifest and manifest["manifest_sha256"] != manifest_digest(manifest):
            raise MemlmError(
                f"{path} was changed after the build (its content no longer matches its manifest_sha256: "
                f"a hand edit or corruption); restore the original manifest or {self.fix}"
            )
        if "dtypes" in manifest and manifest["dtypes"] != dict(self.arrays):
            raise MemlmError(f"{path} lists dtypes {manifest['dtypes']}, memlm writes {dict(self.arrays)}; {self.fix}")
        return manifest

    def open_arrays(self, folder: Path, manifest: Mapping[str, Any], verify: bool = False) -> dict[str, np.ndarray]:
        """Every array as a read-only memory map, after its size (and the checksums the manifest records: sampled
        always, full with ``verify``) matched the manifest."""
        folder = Path(folder)
        n, d = int(manifest["count"]), self.dim(manifest)
        arrays = {}
        for name in self.arrays:
            f = self.file(folder, name)
            expected = self.nbytes(name, n, d)
            size = f.stat().st_size if f.exists() else -1
            if size != expected:
                what = "missing" if size < 0 else f"{size} bytes, the manifest says {expected}"
                raise MemlmError(
                    f"{self.kind} file {f} is {what} (truncated or corrupt); "
                    f"rebuild the {self.kind} with {self.builder}"
                )
            recorded = manifest["files"][name]
            if "sample_sha256" in recorded and recorded["sample_sha256"] != sample_sha256(f):
                check = f"; `{self.verify_command} {folder}` checks every byte" if self.verify_command else ""
                raise MemlmError(
                    f"{self.kind} file {f} is corrupt (its sampled checksum differs from the manifest's{check}); "
                    f"{self.fix}"
                )
            if verify and recorded["sha256"] != sha256_file(f, expected):
                raise MemlmError(f"checksum mismatch in {f}: the file is corrupt; rebuild the {self.kind}")
            arrays[name] = self.array(folder, name, n, d)
        return arrays


class AppendWriter:
    """Appends rows to every array of a folder being built; a context manager (module docstring).

    Opening truncates every array to ``state["count"]`` rows (the rows a crashed writer wrote after its last
    :meth:`commit` are dropped). :meth:`append` writes one batch of rows to every array; :meth:`commit` makes them
    durable, then records ``count`` (and the caller's own progress fields) in the progress file. On leaving, a full
    disk becomes :func:`memlm.io.fileio.disk_full_error` naming the file being written.
    """

    def __init__(self, fmt: FolderFormat, folder: Path, dim: int, state: dict[str, Any]):
        self.fmt, self.folder, self.dim, self.state = fmt, folder, dim, state
        self.count = int(state["count"])
        self.current = fmt.progress_path(folder)  # the file being written (for the disk-full message)
        self._handles: dict[str, Any] = {}

    def __enter__(self) -> AppendWriter:
        try:
            for name in self.fmt.arrays:
                self.current = f = self.fmt.file(self.folder, name)
                f.touch()
                os.truncate(f, self.fmt.nbytes(name, self.count, self.dim))  # drop bytes past the recorded count
                self._handles[name] = open(f, "ab")
        except BaseException as e:
            self.__exit__(type(e), e, e.__traceback__)
            raise
        return self

    def append(self, **columns: Any) -> int:
        """Write one batch of rows: an array per declared name, each with the same number of rows (``[rows, dim]``
        for the wide array). Returns the number of rows."""
        rows = None
        for name, dtype in self.fmt.arrays.items():
            data = np.ascontiguousarray(columns[name], dtype=dtype)
            row = self.fmt.shape(name, 0, self.dim)[1:]
            if data.shape[1:] != row or (rows is not None and len(data) != rows):
                raise ValueError(f"{name} has shape {data.shape}, expected {rows or 'N'} rows of shape {row}")
            rows = len(data)
            self.current = self.fmt.file(self.folder, name)
            self._handles[name].write(data.tobytes())
        self.count += rows or 0
        return rows or 0

    def commit(self, **progress: Any) -> None:
        """Flush and fsync every array, then record ``count`` and ``progress`` in the progress file (atomically)."""
        for name, h in self._handles.items():
            self.current = self.fmt.file(self.folder, name)
            h.flush()
            os.fsync(h.fileno())
        self.state.update(count=self.count, **progress)
        self.current = self.fmt.progress_path(self.folder)
        atomic_write_json(self.current, self.state)

    def __exit__(self, exc_type, exc, tb) -> None:
        for h in self._handles.values():
            try:
                h.close()
            except OSError:
                pass  # flushing a full disk again: the rerun truncates to the recorded count anyway
        self._handles.clear()
        if isinstance(exc, OSError) and is_disk_full(exc):
            raise disk_full_error(self.current) from None


def advise_random(array: Any) -> int:
    """Tell the kernel that ``array``'s memory-mapped pages will be read at scattered rows (``MADV_RANDOM``).

    Exact rescoring (``--scores exact``) reads the keys of the retrieved ids: rows spread over the whole file. With the
    default advice each page fault also reads ahead the following pages, which is wasted I/O; when the keys do not
    fit in the memory given to the process, that read-ahead evicts pages still needed and the reads thrash. With
    ``MADV_RANDOM`` a fault reads just its page. ``array`` is an ``np.memmap``, anything with ``parts`` (a sharded
    datastore's arrays) or something else (left alone). Returns how many mappings were advised (0 where the
    platform has no ``madvise``).
    """
    import mmap

    parts = getattr(array, "parts", None)
    if parts is not None:
        return sum(advise_random(p) for p in parts)
    mapping = getattr(array, "_mmap", None)  # np.memmap keeps its mmap.mmap here
    if mapping is None or not hasattr(mapping, "madvise") or not hasattr(mmap, "MADV_RANDOM"):
        return 0
    mapping.madvise(mmap.MADV_RANDOM)
    return 1


def is_ngram_index(item: Any) -> bool:
    """An ∞-gram index: an open NgramMemory / NgramIndex (by name: no infini-gram import) or such a folder."""
    if type(item).__name__ in ("NgramMemory", "NgramIndex"):
        return True
    if isinstance(item, str | Path):
        return artifact_kind(item) == "∞-gram index"
    return False
