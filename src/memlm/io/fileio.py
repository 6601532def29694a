"""Atomic file writes (a reader sees the old file or the new one, never a partial one) and strict JSON.

Temporary files get unique names (``.<name>.<random>.tmp`` beside the target), so two processes writing the same
file never share a temporary file; a failed write removes its temporary file.

Every JSON file memlm writes goes through :func:`dumps_json`: standard JSON that strict parsers accept. Python's
``json`` module would write ``Infinity`` / ``NaN`` for non-finite floats, which is not JSON; here they become ``null``.
What ``null`` means is the field's own business; e.g. ``knn_only_ppl: null`` in ``memlm eval --json`` is an infinite
perplexity: some target never appeared among its retrieved neighbours, so ``p_kNN(target) = 0``.
"""

from __future__ import annotations

import errno
import hashlib
import importlib.util
import json
import math
import os
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np

from memlm.errors import MemlmError

__all__ = [
    "dumps_json",
    "strict_jsonable",
    "atomic_write_bytes",
    "atomic_write_json",
    "disk_full_error",
    "is_disk_full",
    "memlm_home",
    "package_folder",
    "remove_stale_temps",
    "sample_sha256",
    "sha256_file",
    "unique_tmp",
]

_DISK_FULL = {errno.ENOSPC, errno.EDQUOT}


def is_disk_full(err: BaseException) -> bool:
    """True for "no space left on device" and "disk quota exceeded"."""
    return isinstance(err, OSError) and err.errno in _DISK_FULL


def disk_full_error(path: str | os.PathLike[str], resume: bool = True) -> MemlmError:
    """The one-line error for a full disk (or quota) while writing ``path``."""
    how = "rerun the same command to resume" if resume else "rerun the same command"
    return MemlmError(f"disk full while writing {path}: free space and {how}")


def unique_tmp(path: str | os.PathLike[str], suffix: str = ".tmp") -> Path:
    """A fresh, unique temporary name beside ``path`` (``.<name>.<pid>-<random><suffix>``), not created.

    ``suffix`` keeps writers that insist on an extension (``np.savez``: ``.npz``; matplotlib: ``.png``) from
    renaming the file.
    """
    path = Path(path)
    return path.with_name(f".{path.name}.{os.getpid()}-{os.urandom(4).hex()}{suffix}")


# ------------------------------------------------------------------------------------------------ checksums

SAMPLE_BLOCKS = 256
SAMPLE_BLOCK_BYTES = 4096


def sha256_file(path: str | os.PathLike[str], nbytes: int | None = None) -> str:
    """SHA-256 of the first ``nbytes`` bytes of ``path`` (default: all of it), read in 16 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        left = nbytes if nbytes is not None else -1
        while left != 0:
            block = f.read(1 << 24 if left < 0 else min(1 << 24, left))
            if not block:
                break
            h.update(block)
            if left > 0:
                left -= len(block)
    return h.hexdigest()


def sample_sha256(path: str | os.PathLike[str]) -> str:
    """A cheap fingerprint of a file: SHA-256 of its size and of 256 blocks of 4 KiB spread evenly over it.

    A file up to 1 MiB is hashed whole, so any change to it is seen; in a larger file a change is seen when it touches
    a sampled block or the size (a replaced, truncated, extended or overwritten-in-bulk file; not a single flipped
    byte between samples: that takes the full :func:`sha256_file`). Reads at most 1 MiB whatever the file size.
    """
    size = os.path.getsize(path)
    h = hashlib.sha256(f"memlm-sample-v1 {size}\n".encode())
    span = SAMPLE_BLOCKS * SAMPLE_BLOCK_BYTES
    with open(path, "rb") as f:
        if size <= span:
            h.update(f.read())
        else:
            last = size - SAMPLE_BLOCK_BYTES
            for i in range(SAMPLE_BLOCKS):
                f.seek(last * i // (SAMPLE_BLOCKS - 1))
                h.update(f.read(SAMPLE_BLOCK_BYTES))
    return h.hexdigest()


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via a uniquely named temporary file in the same folder, fsync, then ``os.replace``.

    A full disk raises :func:`disk_full_error` (the old file, if any, is untouched).
    """
    path = Path(path)
    name = unique_tmp(path)
    try:
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the mode open() gives, after the umask
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(name, path)
    except BaseException as e:
        try:
            os.unlink(name)
        except OSError:
            pass
        if is_disk_full(e):
            raise disk_full_error(path) from None
        raise


def strict_jsonable(obj: Any) -> Any:
    """``obj`` with non-finite floats (Python or NumPy) replaced by ``None``, NumPy scalars/arrays made Python,
    tuples made lists and dict keys made strings."""
    if isinstance(obj, dict):
        return {str(k): strict_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [strict_jsonable(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return strict_jsonable(obj.tolist())
    if isinstance(obj, np.generic):
        obj = obj.item()
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


def dumps_json(data: Any, indent: int | None = 2, sort_keys: bool = True) -> str:
    """Strict JSON text of ``data`` (see :func:`strict_jsonable`); raises on anything else JSON cannot hold."""
    return json.dumps(strict_jsonable(data), indent=indent, sort_keys=sort_keys, allow_nan=False, ensure_ascii=False)


def atomic_write_json(path: Path, data: Any, sort_keys: bool = True) -> None:
    """``atomic_write_bytes`` of pretty, (by default) key-sorted strict JSON, newline-terminated."""
    atomic_write_bytes(Path(path), (dumps_json(data, sort_keys=sort_keys) + "\n").encode())


STALE_TEMP_S = 3600.0  # temporary folders older than this are left over from a crash


def memlm_home() -> Path:
    """The folder memlm caches into: ``$MEMLM_HOME`` if set, else ``~/.cache/memlm``; created if missing."""
    home = Path(os.environ.get("MEMLM_HOME") or Path.home() / ".cache" / "memlm").expanduser()
    home.mkdir(parents=True, exist_ok=True)
    return home


def remove_stale_temps(parent: Path, stem: str) -> None:
    """Delete temporary folders of conversions that crashed (older than an hour)."""
    now = time.time()
    for old in parent.glob(f".{stem}.tmp-*"):
        try:
            if now - old.stat().st_mtime > STALE_TEMP_S:
                shutil.rmtree(old, ignore_errors=True)
        except OSError:
            pass


def package_folder(module: str) -> Path | None:
    """An installed package's folder, found without importing it (data and model packages may fail on import);
    None when it is not installed."""
    try:
        found = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    locations = list(found.submodule_search_locations or []) if found is not None else []
    return Path(locations[0]) if locations else None
