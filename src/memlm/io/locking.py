"""One writer per folder: an exclusive ``fcntl.flock`` on ``<folder>/.memlm.lock``.

Every memlm command that writes a datastore, an index, a phrase index, a training run or a demo folder holds this
lock for as long as it writes. A second writer does not wait: it gets a :class:`MemlmError` naming the holder
(pid, host, start time, command line), which the CLI prints as one ``error:`` line (exit status 2).

The lock file holds the holder's description as JSON. The lock itself is the kernel's ``flock`` on the open file,
not the file's existence: when the holder dies (even by ``kill -9``) the kernel releases it, and the next writer
takes over the folder at once (a build then resumes from its ``progress.json``). A writer removes the lock file when
it is done, while still holding the lock; a process that opened the old file before it was removed notices (the path
no longer names the file it locked) and retries on a new one, so two writers can never both believe they hold it.

The lock is re-entrant within one process (a ``datastore build`` that also builds the index, the demo that builds
datastores in its own folder): nested :func:`folder_lock` calls on the same folder share one ``flock``.
Readers (eval, generate, ``datastore info``) take no lock: every file a reader opens is replaced atomically.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shlex
import socket
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from memlm.errors import MemlmError

__all__ = ["LOCK_NAME", "folder_lock", "lock_holder"]

LOCK_NAME = ".memlm.lock"

_held: dict[str, list[int]] = {}  # realpath -> [fd, depth]
_guard = threading.Lock()


def _describe_self() -> dict[str, Any]:
    return {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": shlex.join(sys.argv) if sys.argv and sys.argv[0] else f"python (pid {os.getpid()})",
    }


def _read_info(fd: int) -> dict[str, Any] | None:
    try:
        raw = os.pread(fd, 65536, 0)
        info = json.loads(raw.decode("utf-8"))
        return info if isinstance(info, dict) else None
    except (OSError, ValueError):
        return None


def lock_holder(folder: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The description in ``folder``'s lock file (pid, host, started, command), or ``None``; for messages only."""
    try:
        fd = os.open(Path(folder) / LOCK_NAME, os.O_RDONLY)
    except OSError:
        return None
    try:
        return _read_info(fd)
    finally:
        os.close(fd)


def _holder_text(info: dict[str, Any] | None) -> str:
    if not info:
        return "another process (it has not written its details yet)"
    return (
        f"pid {info.get('pid', '?')} on {info.get('host', '?')}, started {info.get('started', '?')}: "
        f"{info.get('command', '?')}"
    )


@contextmanager
def folder_lock(folder: str | os.PathLike[str], what: str = "write") -> Iterator[None]:
    """Hold the exclusive writer lock of ``folder`` (created if missing) for the ``with`` block.

    Raises :class:`MemlmError` at once if another process holds it. ``what`` names the operation in the message.
    """
    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise MemlmError(f"cannot create folder {folder} ({e.strerror or e}); choose a writable place") from None
    key = os.path.realpath(folder)
    with _guard:
        if key in _held:
            _held[key][1] += 1
            nested = True
        else:
            nested = False
    if nested:
        try:
            yield
        finally:
            with _guard:
                _held[key][1] -= 1
        return

    path = folder / LOCK_NAME
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise MemlmError(
                f"cannot create the lock file {path} ({e.strerror or e}); check the folder is writable"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            info = _read_info(fd)
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise MemlmError(
                    f"cannot {what} in {folder}: another memlm process is writing there ({_holder_text(info)}); "
                    "wait for it to finish (rerun the same command afterwards to resume or reuse its result), "
                    "or use another folder"
                ) from None
            raise MemlmError(f"cannot lock {path} ({e.strerror or e}); use a local, writable folder") from None
        try:
            same = os.path.samestat(os.fstat(fd), os.stat(path))
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)  # the previous holder removed the file after we opened it: lock the new one
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(_describe_self()).encode(), 0)
    except OSError:
        pass  # the description is only for messages; the flock is what excludes other writers
    with _guard:
        _held[key] = [fd, 1]
    try:
        yield
    finally:
        with _guard:
            _held.pop(key, None)
        try:
            os.unlink(path)
        except OSError:
            pass
        os.close(fd)
