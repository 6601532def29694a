"""Atomic file writes (a reader sees the old file or the new one, never a partial one) and strict JSON.

Every JSON file memlm writes goes through :func:`dumps_json`: standard JSON that strict parsers accept. Python's
``json`` module would write ``Infinity`` / ``NaN`` for non-finite floats, which is not JSON; here they become ``null``.
What ``null`` means is the field's own business; e.g. ``knn_only_ppl: null`` in ``memlm eval --json`` is an infinite
perplexity: some target never appeared among its retrieved neighbours, so ``p_kNN(target) = 0``.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["atomic_write_json", "atomic_write_bytes", "dumps_json", "strict_jsonable"]


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via a temporary file in the same folder, fsync, then ``os.replace``."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


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
