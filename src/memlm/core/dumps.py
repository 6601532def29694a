"""One per-token dump format for every method: an ``.npz`` of named per-token arrays plus a JSON ``meta``.

A dump holds what every later question about an evaluation needs without a new forward pass or search: the targets,
the LM's scores and, per memory, the ``(scores, values)`` of its retrieved entries (``-inf`` / ``-1`` in empty
slots). TRIME's :class:`memlm.trime.inference.TrimeScores` is such a dump: it declares its arrays (name -> number
of dimensions), which are required, and which ``(scores, values)`` pairs must come together with equal shapes. The
kNN-LM's per-token table (:class:`memlm.knnlm.table.TokenTable`) names its arrays by component and reads them with
:func:`read_npz_dump`. ``meta`` records how the dump was made (model, corpus, windows and the
:class:`memlm.core.config.RetrievalConfig` of its memory), so a result file can always say what produced it.

Writes are atomic (a uniquely named temporary file, then ``os.replace``); reading checks every array's presence,
rank and length, the pairs' shapes and the meta JSON, and names the command that rewrites a bad dump.
"""

from __future__ import annotations

import dataclasses
import json
import os
import zipfile
import zlib
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import numpy as np

from memlm.errors import MemlmError
from memlm.io.fileio import dumps_json, unique_tmp

__all__ = ["TokenDump", "read_npz_dump"]

_D = TypeVar("_D", bound="TokenDump")


_DUMP_KINDS = {"lm_logprob": "a kNN-LM dump (memlm eval --dump)", "mem_all": "a TRIME dump (memlm trime-eval --dump)"}


def read_npz_dump(
    path: str | Path, what: str, required: dict[str, int], optional: dict[str, int] | None, hint: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The arrays and meta dict of a score dump (``.npz``), checked: readable (not truncated), every ``required``
    array present with its number of dimensions (``required[name]``; ``optional`` None: every other array is read,
    of any rank from 1), every array with the same first dimension,
    numeric (or boolean), and ``meta`` a JSON object. A dump of the other kind (kNN-LM vs TRIME) is named as such.

    Raises :class:`MemlmError` naming the file and ``hint`` (how to rewrite it).
    """
    arrays: dict[str, Any] = {}
    try:
        with np.load(path, allow_pickle=False) as z:
            files = set(z.files)
            missing = [k for k in required if k not in files]
            if missing:
                other = next((desc for key, desc in _DUMP_KINDS.items() if key in files and key not in required), None)
                found = f"it is {other}" if other else f"it lacks {', '.join(missing)}"
                raise MemlmError(f"{path} is not {what}: {found}; {hint}")
            others = sorted(files - {"meta"}) if optional is None else optional
            for k in (*required, *others):
                if k in files:
                    arrays[k] = z[k]
            meta = json.loads(str(z["meta"])) if "meta" in files else {}
    except MemlmError:
        raise
    except (OSError, ValueError, KeyError, EOFError, TypeError, zipfile.BadZipFile, zlib.error) as e:
        reason = " ".join(str(e).split())[:200] or type(e).__name__
        raise MemlmError(f"cannot read {what} {path} ({reason}): the file is truncated or not a dump; {hint}") from e
    if not isinstance(meta, dict):
        raise MemlmError(f"{what} {path} has a malformed meta record (not a JSON object); {hint}")
    n = None
    for k, a in arrays.items():
        ndim = required.get(k, (optional or {}).get(k))
        if a.dtype.kind not in "biuf" or (a.ndim != ndim if ndim is not None else a.ndim < 1):
            want = ndim or "1 or more"
            raise MemlmError(f"{what} {path}: array {k} is {a.dtype} with {a.ndim} dimensions, not {want}; {hint}")
        if n is None:
            n = a.shape[0]
        elif a.shape[0] != n:
            raise MemlmError(f"{what} {path}: array {k} has {a.shape[0]} rows, not {n} as the others; {hint}")
    return arrays, meta


class TokenDump:
    """Base of the per-token dumps (a dataclass subclass declares its array fields and a ``meta`` dict).

    Class attributes a subclass sets: ``KIND`` (what it is, for errors), ``REQUIRED`` and ``OPTIONAL`` (array name ->
    number of dimensions), ``PAIRS`` (``(scores, values)`` names that come together) and ``HINT`` (the command that
    rewrites a dump, ``{path}`` filled in).
    """

    KIND: ClassVar[str] = "a per-token dump"
    REQUIRED: ClassVar[dict[str, int]] = {}
    OPTIONAL: ClassVar[dict[str, int]] = {}
    PAIRS: ClassVar[tuple[tuple[str, str], ...]] = ()
    HINT: ClassVar[str] = "rerun the command that wrote {path}"
    meta: dict[str, Any]

    def __len__(self) -> int:
        return len(getattr(self, next(iter(self.REQUIRED))))

    def arrays(self) -> dict[str, np.ndarray]:
        """The dump's arrays by name (absent optional ones left out)."""
        names = [*self.REQUIRED, *self.OPTIONAL]
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}

    def save(self, path: str | Path) -> None:
        """Write an ``.npz`` atomically (``meta`` goes in as JSON; non-finite numbers as null)."""
        path = Path(path)
        tmp = unique_tmp(path, ".tmp.npz")
        np.savez(tmp, meta=np.array(dumps_json(self.meta, indent=None)), **self.arrays())
        os.replace(tmp, path)

    def check(self, path: str | Path) -> None:
        """Refuse a dump whose arrays do not fit together (subclasses add their own rules)."""
        for scores, values in self.PAIRS:
            s, v = getattr(self, scores), getattr(self, values)
            if (s is None) != (v is None) or (s is not None and s.shape != v.shape):
                raise MemlmError(f"{self.KIND} {path}: {scores} and {values} do not match; {self.hint(path)}")

    @classmethod
    def hint(cls, path: str | Path) -> str:
        return cls.HINT.format(path=path)

    @classmethod
    def load(cls: type[_D], path: str | Path) -> _D:
        """Read a dump written by :meth:`save`, checked (one clear error naming the file and the fix)."""
        arrays, meta = read_npz_dump(path, cls.KIND, cls.REQUIRED, cls.OPTIONAL, cls.hint(path))
        names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        dump = cls(meta=meta, **{k: v for k, v in arrays.items() if k in names})
        dump.check(path)
        return dump
