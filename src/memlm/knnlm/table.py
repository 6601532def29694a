"""The per-token table of a scored corpus: one row per target, the LM's columns and each memory's, keyed by component.

``memlm eval`` scores a corpus once (:func:`memlm.knnlm.scoring.score_tokens`: one forward pass, one search per
memory) and keeps what every later question needs, so that any mixture of the components can be computed again
without a forward pass or a search::

    P(w | c) = sum_i λ_i(c) P_i(w | c),     i = lm, then each memory by name (knn, knn2, ngram, cache, ...)

Columns: ``targets``, ``doc_index``, ``position`` (the target's offset in its document), the LM's ``lm_logprob``,
``lm_entropy`` (H(p_LM(. | c)), nats) and ``lm_max_logprob``, and ``columns[name][field]`` for each memory
(:meth:`memlm.mixing.component.Component.score`: a datastore's ``scores`` / ``values`` / ``log_counts`` ``[N, k]``
best first, an ∞-gram's ``logprob`` / ``count`` / ``n`` / ``sparse``, the cache's ``scores`` / ``values``).
``components[name]`` reads them (:meth:`logprob`, :meth:`features`, :meth:`sparse`): its kind and the settings its
``describe()`` recorded are in ``meta["components"][name]``, so a saved table rebuilds it by kind
(:attr:`memlm.mixing.component.Component.kinds`).

Saved as one ``.npz`` (arrays ``targets``, ``lm_logprob``, ..., ``knn/scores``, ``ngram/logprob``, ...) with the
JSON ``meta``, written atomically (:mod:`memlm.core.dumps`).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from memlm.core.dumps import read_npz_dump
from memlm.errors import MemlmError
from memlm.io.fileio import dumps_json, unique_tmp
from memlm.knnlm.cache import CacheComponent
from memlm.mixing.component import Component, component_names
from memlm.mixing.datastore import DatastoreComponent
from memlm.ngram.step import NgramComponent

__all__ = ["TABLE_FORMAT", "TokenTable"]

TABLE_FORMAT = "memlm per-token table 1"
_SHIPPED = (DatastoreComponent, NgramComponent, CacheComponent)  # registered by kind when defined (imported here)
_ROWS = {"targets": np.int64, "doc_index": np.int32, "lm_logprob": np.float32}
_LM = ("position", "lm_entropy", "lm_max_logprob")
_HINT = "rerun memlm eval --dump {path}"


@dataclass
class TokenTable:
    """One row per scored target (module docstring). ``columns`` and ``components`` share their names, in the order
    the memories were given (:func:`memlm.mixing.component.component_names`)."""

    targets: np.ndarray  # [N] int64
    doc_index: np.ndarray  # [N] int32
    lm_logprob: np.ndarray  # [N] float32
    position: np.ndarray | None = None  # [N] int32
    lm_entropy: np.ndarray | None = None  # [N] float32
    lm_max_logprob: np.ndarray | None = None  # [N] float32
    columns: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)
    components: dict[str, Component] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.meta.setdefault("components", {})

    def __len__(self) -> int:
        return len(self.targets)

    def names(self, kind: str | None = None) -> tuple[str, ...]:
        """The memories' names in order (of one ``kind`` only, when given); ``lm`` is not among them."""
        return tuple(n for n, c in self.components.items() if kind is None or c.kind == kind)

    def add(self, component: Component, columns: Mapping[str, np.ndarray], **record: Any) -> str:
        """Add a memory's columns; its name (the next of its kind) is returned. ``meta["components"][name]`` records
        its ``describe()`` and ``record`` (e.g. where self-matches were dropped, seconds spent)."""
        name = component_names([*self.components.values(), component])[-1]
        for f, v in columns.items():
            if len(v) != len(self):
                raise MemlmError(f"column {name}/{f} has {len(v)} rows, the table {len(self)}")
        self.columns[name] = dict(columns)
        self.components[name] = component
        self.meta.setdefault("components", {})[name] = {**component.describe(), "kind": component.kind, **record}
        return name

    def _component(self, name: str) -> Component:
        if name not in self.components:
            raise MemlmError(f"this table has no {name} (it holds lm, {', '.join(self.names()) or 'no memory'}): "
                             "rerun memlm eval --dump with that memory (--memory)")  # fmt: skip
        return self.components[name]

    def logprob(self, name: str, **settings: Any) -> torch.Tensor:
        """``log P_name(target)`` float64 ``[N]`` (``-inf`` where it gives the target 0): the LM's column, or the
        memory's own :meth:`~memlm.mixing.component.Component.logprob` over its columns at ``settings`` (a
        datastore's ``temperature`` and ``k``)."""
        if name == "lm":
            return torch.from_numpy(np.asarray(self.lm_logprob)).double()
        return self._component(name).logprob(self.columns[name], self.targets, **settings).double()

    def features(self, name: str, **settings: Any) -> dict[str, np.ndarray]:
        """A memory's features float64 ``[N]`` by feature name, unprefixed (its own ``features``)."""
        return self._component(name).features(self.columns[name], **settings)

    def sparse(self, name: str) -> np.ndarray | None:
        """A memory's sparse flag per target (an ∞-gram's), or None."""
        return self._component(name).sparse(self.columns[name])

    def select(self, names: Iterable[str] = (), rename: Mapping[str, str] | None = None) -> TokenTable:
        """A table over the same rows holding only the memories ``names`` (none: the LM alone), each under
        ``rename[name]`` when given (one ∞-gram of several tuned alone as ``ngram``)."""
        rename = dict(rename or {})
        keep = [n for n in self.names() if n in set(names)]
        described = self.meta.get("components", {})
        meta = {**self.meta, "components": {rename.get(n, n): described.get(n, {}) for n in keep}}
        return replace(self, columns={rename.get(n, n): self.columns[n] for n in keep},
                       components={rename.get(n, n): self.components[n] for n in keep}, meta=meta)  # fmt: skip

    def arrays(self) -> dict[str, np.ndarray]:
        """Every array by its name in the file: the per-row ones, then ``<name>/<field>``."""
        out = {n: getattr(self, n) for n in (*_ROWS, *_LM) if getattr(self, n) is not None}
        out.update({f"{name}/{f}": v for name, cols in self.columns.items() for f, v in cols.items()})
        return out

    def save(self, path: str | Path) -> None:
        """Write the ``.npz`` atomically (``meta`` as JSON, with the format and each component's record)."""
        path = Path(path)
        tmp = unique_tmp(path, ".tmp.npz")
        meta = {**self.meta, "format": TABLE_FORMAT, "order": list(self.components)}  # JSON objects lose order
        np.savez(tmp, meta=np.array(dumps_json(meta, indent=None)), **self.arrays())
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | Path) -> TokenTable:
        """Read a table written by :meth:`save`, checked; one MemlmError naming the file and the fix (a dump of an
        older memlm, a truncated file, a component kind no imported class declares)."""
        hint = _HINT.format(path=path)
        arrays, meta = read_npz_dump(path, "a per-token table", dict.fromkeys(_ROWS, 1), None, hint)
        if meta.get("format") != TABLE_FORMAT:
            raise MemlmError(f"{path} was written by an older memlm (a per-kind score dump): {hint}")
        described = meta.get("components") or {}
        order = meta.pop("order", None) or list(described)
        meta["components"] = {name: described[name] for name in order}
        table = cls(**{n: arrays.pop(n) for n in (*_ROWS, *_LM) if n in arrays}, meta=meta)
        for name, record in meta["components"].items():
            kind = record.get("kind")
            if kind not in Component.kinds:
                raise MemlmError(f"{path}: its memory {name} is of kind {kind!r}, which no imported class declares: "
                                 "import the module of that Component before loading")  # fmt: skip
            table.components[name] = Component.kinds[kind].from_description(record)
            table.columns[name] = {k.split("/", 1)[1]: v for k, v in arrays.items() if k.split("/", 1)[0] == name}
        unknown = [k for k in arrays if k.split("/", 1)[0] not in described]
        if unknown:
            raise MemlmError(f"{path}: arrays {', '.join(unknown)} belong to no recorded memory; {hint}")
        return table
