"""One schema check per metadata file format, used wherever memlm reads that format.

A metadata file that is not what memlm wrote (random bytes, ``{}``, ``[]``, a field of the wrong type, a truncated
file, a hand edit) is reported as one :class:`MemlmError` naming the file, the first problem found and the fix; never
as a ``KeyError`` or ``TypeError`` traceback deep inside a command.

A schema is a small tree of checkers: :class:`Int`, :class:`Num`, :class:`Str`, :class:`Bool`, :class:`Opt` (``None``
or the inner schema), :class:`ListOf`, :class:`Obj` (required and optional keys; unknown keys are allowed, so newer
files with extra fields still read) and :class:`AnyValue`. :func:`read_json` reads, parses and checks a file in one
call; :func:`check` checks data already in memory.

The formats, and where they are read:

* ``DATASTORE_MANIFEST``: a datastore's ``manifest.json`` (:meth:`memlm.storage.datastore.Datastore.open`, the index
  identity check of :func:`memlm.storage.index.load_index`).
* ``CALIBRATION``: the ``calibration`` record of a datastore's manifest (and of a sharded one's ``shards.json``).
* ``DATASTORE_PROGRESS``: a datastore's ``progress.json`` (resuming :func:`memlm.knnlm.write.write_datastore`).
* ``INDEX_META``: ``index.faiss.json`` beside a FAISS index
  (:func:`memlm.storage.index.read_index_meta`, ``load_index``).
* ``PHRASE_MANIFEST``, ``PHRASE_PROGRESS``, ``PHRASE_DOCS``: an NPM phrase index's ``manifest.json``,
  ``progress.json`` and ``docs.json`` (:mod:`memlm.npm.phrase_index`).
* ``TRAIN_RUN``: a training run's ``run.json`` (:func:`memlm.training.loop.check_run_identity`) and ``TRAIN_STATE``: the
  dict inside a checkpoint's ``training_state.pt`` (resuming :func:`memlm.training.loop.train`).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from memlm.errors import MemlmError

__all__ = [
    "AnyValue",
    "Bool",
    "CALIBRATION",
    "DATASTORE_MANIFEST",
    "DATASTORE_PROGRESS",
    "INDEX_META",
    "Int",
    "ListOf",
    "Num",
    "Obj",
    "Opt",
    "PHRASE_DOCS",
    "PHRASE_MANIFEST",
    "PHRASE_PROGRESS",
    "Str",
    "TRAIN_RUN",
    "TRAIN_STATE",
    "check",
    "read_json",
]


class SchemaError(Exception):
    """Internal: where (a dotted path) and what is wrong; turned into a MemlmError by :func:`check`."""

    def __init__(self, where: str, what: str):
        super().__init__(f"{where or 'the top level'}: {what}")


def _show(value: Any) -> str:
    text = json.dumps(value, default=str) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


class Schema:
    def check(self, value: Any, where: str) -> None:  # pragma: no cover - interface
        raise NotImplementedError


@dataclass(frozen=True)
class AnyValue(Schema):
    def check(self, value: Any, where: str) -> None:
        return None


@dataclass(frozen=True)
class Int(Schema):
    """An integer (not a bool) in ``[min, max]``."""

    min: int | None = None
    max: int | None = None

    def check(self, value: Any, where: str) -> None:
        if isinstance(value, bool) or not isinstance(value, int):
            raise SchemaError(where, f"expected an integer, got {_show(value)}")
        if self.min is not None and value < self.min:
            raise SchemaError(where, f"expected an integer >= {self.min}, got {value}")
        if self.max is not None and value > self.max:
            raise SchemaError(where, f"expected an integer <= {self.max}, got {value}")


@dataclass(frozen=True)
class Num(Schema):
    """A finite number (int or float, not a bool) >= ``min``, <= ``max`` and > ``above`` (each when given)."""

    min: float | None = None
    max: float | None = None
    above: float | None = None

    def check(self, value: Any, where: str) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise SchemaError(where, f"expected a finite number, got {_show(value)}")
        if self.min is not None and value < self.min:
            raise SchemaError(where, f"expected a number >= {self.min}, got {value}")
        if self.max is not None and value > self.max:
            raise SchemaError(where, f"expected a number <= {self.max}, got {value}")
        if self.above is not None and value <= self.above:
            raise SchemaError(where, f"expected a number > {self.above}, got {value}")


@dataclass(frozen=True)
class Str(Schema):
    """A string; ``pattern`` (a full-match regex) or ``choices`` restrict it."""

    pattern: str | None = None
    choices: tuple[str, ...] | None = None

    def check(self, value: Any, where: str) -> None:
        if not isinstance(value, str):
            raise SchemaError(where, f"expected a string, got {_show(value)}")
        if self.pattern is not None and not re.fullmatch(self.pattern, value):
            raise SchemaError(where, f"malformed value {_show(value)}")
        if self.choices is not None and value not in self.choices:
            raise SchemaError(where, f"expected one of {', '.join(self.choices)}, got {_show(value)}")


@dataclass(frozen=True)
class Bool(Schema):
    def check(self, value: Any, where: str) -> None:
        if not isinstance(value, bool):
            raise SchemaError(where, f"expected true or false, got {_show(value)}")


@dataclass(frozen=True)
class Opt(Schema):
    """``None`` or the inner schema."""

    inner: Schema

    def check(self, value: Any, where: str) -> None:
        if value is not None:
            self.inner.check(value, where)


@dataclass(frozen=True)
class ListOf(Schema):
    inner: Schema
    min_len: int = 0

    def check(self, value: Any, where: str) -> None:
        if not isinstance(value, list):
            raise SchemaError(where, f"expected a list, got {_show(value)}")
        if len(value) < self.min_len:
            raise SchemaError(where, f"expected at least {self.min_len} entries, got {len(value)}")
        for i, v in enumerate(value):
            self.inner.check(v, f"{where}[{i}]")


@dataclass(frozen=True)
class Obj(Schema):
    """A JSON object with ``required`` keys (each checked) and ``optional`` keys (checked when present)."""

    required: Mapping[str, Schema] = field(default_factory=dict)
    optional: Mapping[str, Schema] = field(default_factory=dict)
    values: Schema | None = None  # schema of every value (a dict used as a map)

    def check(self, value: Any, where: str) -> None:
        if not isinstance(value, dict):
            raise SchemaError(where, f"expected an object, got {_show(value)}")
        for key, schema in self.required.items():
            sub = f"{where}.{key}" if where else key
            if key not in value:
                raise SchemaError(sub, "missing")
            schema.check(value[key], sub)
        for key, schema in self.optional.items():
            if key in value:
                schema.check(value[key], f"{where}.{key}" if where else key)
        if self.values is not None:
            for key, v in value.items():
                self.values.check(v, f"{where}.{key}" if where else str(key))


def check(data: Any, schema: Schema, path: str | Path, what: str, fix: str) -> Any:
    """Check ``data`` (read from ``path``) against ``schema``; a mismatch is one MemlmError with ``fix``."""
    try:
        schema.check(data, "")
    except SchemaError as e:
        raise MemlmError(f"{path} is not a valid {what} ({e}); {fix}") from None
    return data


def read_json(path: str | Path, schema: Schema, what: str, fix: str) -> Any:
    """Read and parse ``path`` as JSON and :func:`check` it; unreadable or invalid files are one MemlmError."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise MemlmError(f"{path} is missing; {fix}") from None
    except OSError as e:
        raise MemlmError(f"cannot read {path} ({e.strerror or e}); {fix}") from None
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        reason = "empty file" if not raw.strip() else f"not JSON: {str(e).splitlines()[0][:80]}"
        raise MemlmError(f"{path} is not a valid {what} ({reason}, truncated or corrupt?); {fix}") from None
    return check(data, schema, path, what, fix)


# --------------------------------------------------------------------------------------------------- formats

_HEX64 = Str(pattern=r"[0-9a-f]{64}")
_HEX = Str(pattern=r"[0-9a-f]{8,64}")
_FILE = Obj(required={"dtype": Str(), "sha256": _HEX64}, optional={"sample_sha256": _HEX64, "bytes": Int(min=0)})
_IDENTITY = Obj(
    required={
        "model": Obj(required={"name": Opt(Str()), "fingerprint": _HEX}, optional={"architecture": Str()}),
        "tokenizer": Obj(
            required={"fingerprint": _HEX, "vocab_size": Int(min=1)}, optional={"eos_id": Opt(Int(min=0))}
        ),
    }  # fmt: skip
)

#: a datastore's calibration (memlm.knnlm.calibration): the one mixture fitted on its held-out slice, at a positive
#: temperature τ over k >= 1 neighbours, its rule weight a probability (the fit itself is checked when read)
CALIBRATION = Obj(
    required={
        "k": Int(min=1),
        "tokens": Int(min=1),
        "count": Int(min=0),
        "base_ppl": Num(min=0),
    },
    optional={
        "nprobe": Int(min=1),
        "search": Str(choices=("index", "exact")),
        "scores": Str(choices=("index", "exact")),
        "mixture": Obj(  # each field checked where present; a fit missing one is refused when read (recalibrate)
            optional={
                "temperature": Num(above=0),
                "k": Int(min=1),
                "rule_weights": Obj(optional={"knn": Num(min=0, max=1)}),
            },
        ),
    },
)

#: how a datastore's keys were computed (memlm.models.compute.describe_compute_path), checked on every query
COMPUTE_PATH = Obj(
    required={"dtype": Str(), "attention": Str(), "compile": Str(), "quantize": Str(), "key_error": Num(min=0)},
    optional={"torch": Str(), "threads": Int(min=1), "mkldnn": Bool(), "cpu_capability": Str(), "machine": Str(),
              "cpu_flags": ListOf(Str())},
)  # fmt: skip

DATASTORE_MANIFEST = Obj(
    required={
        "format_version": Int(),
        "model": _IDENTITY.required["model"],
        "tokenizer": _IDENTITY.required["tokenizer"],
        "key": Obj(required={"role": Str(), "layer": Int(), "dim": Int(min=1)}, optional={"describe": Str()}),
        "count": Int(min=0),
        "dtypes": Obj(values=Str()),
        "files": Obj(required={name: _FILE for name in ("keys", "values", "doc_hash", "offset")}),
        "window": Int(min=1),
        "min_context": Int(min=0),
        "sources": ListOf(Obj()),
    },
    optional={
        "build_id": _HEX,
        "values_range": Opt(Obj(required={"min": Int(), "max": Int()})),
        "manifest_sha256": _HEX64,
        "build": Obj(optional={"compute_path": COMPUTE_PATH}),
        "build_seconds": Num(min=0),
        "stride": Int(),
        "subsample": Obj(),
        "calibration": CALIBRATION,
    },
)

DATASTORE_PROGRESS = Obj(
    required={
        "config": Obj(),
        "base": Obj(required={"count": Int(min=0), "manifest": Opt(Obj())}),
        "windows_done": Int(min=0),
        "count": Int(min=0),
        "seconds": Num(min=0),
    }
)

INDEX_META = Obj(
    required={
        "factory": Str(),
        "metric": Str(choices=("l2", "ip")),
        "n": Int(min=0),
        "d": Int(min=1),
    },
    optional={
        "train_size": Int(min=0),
        "seed": Int(),
        "file": Obj(required={"bytes": Int(min=0), "sample_sha256": _HEX64}, optional={"sha256": _HEX64}),
        "source": Opt(Obj(required={"kind": Str(), "count": Int(min=0), "dim": Int(min=1), "sha256": _HEX64})),
    },
)

PHRASE_MANIFEST = Obj(
    required={
        "format": Str(),
        "format_version": Int(),
        "encoder": Obj(required=dict(_IDENTITY.required)),
        "dim": Int(min=1),
        "count": Int(min=0),
        "block_tokens": Int(min=1),
        "n_blocks": Int(min=0),
        "corpus": Obj(required={"fingerprint": Str()}),
        "files": Obj(required={name: _FILE for name in ("vectors", "token_ids", "doc", "position", "block")}),
        "index": Obj(required={"factory": Str(), "metric": Str()}),
    },
    optional={"dtypes": Obj(values=Str()), "manifest_sha256": _HEX64},
)

PHRASE_PROGRESS = Obj(required={"config": Obj(), "blocks_done": Int(min=0), "count": Int(min=0), "seconds": Num(min=0)})

PHRASE_DOCS = Obj(required={"ids": ListOf(Str())}, optional={"hashes": ListOf(Int())})

TRAIN_RUN = Obj(required={"format": Str(choices=("memlm-train-run",)), "identity": Obj()})

TRAIN_STATE = Obj(
    required={
        "step": Int(min=0),
        "epoch": Int(min=0),
        "position": Int(min=0),
        "optimizer": Obj(),
        "scheduler": Obj(),
        "rng": Obj(required={"torch": AnyValue(), "numpy": AnyValue(), "python": AnyValue()}),
        "log": ListOf(Obj()),
        "config": Obj(),
        "signature": Obj(),
    }
)
