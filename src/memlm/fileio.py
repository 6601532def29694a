"""Atomic file writes: a reader sees the old file or the new one, never a partial one."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__ = ["atomic_write_json", "atomic_write_bytes"]


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via a temporary file in the same folder, fsync, then ``os.replace``."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def atomic_write_json(path: Path, data: dict[str, Any]) -> None:
    """``atomic_write_bytes`` of pretty, key-sorted JSON."""
    atomic_write_bytes(Path(path), json.dumps(data, indent=2, sort_keys=True).encode())
