"""Memories from one spec string, FAISS-factory style: the command line, lm-eval's ``--model_args`` and result files
all read and write it::

    knn:ds/wiki?k=1024&temperature=0.9;ngram:idx/wt2;cache

Memories are separated by ``;``; each is ``kind:path?option=value&...`` (``cache`` has no path). Kinds:

=========  ======================================================  ==============================================
``knn``    a datastore folder, plain or sharded (its own index)     ``k``, ``temperature``, ``nprobe``, ``search``,
                                                                    ``scores``, ``ray`` (a sharded datastore's
                                                                    Ray cluster: ``local`` or its address)
``ngram``  an ∞-gram index folder (Liu et al. 2024)                 ``k`` (distinct next tokens at a step), ``max_n``
``cache``  the continuous cache (Grave et al. 2017)                 ``k``, ``max_len``, ``metric``, ``temperature``
=========  ======================================================  ==============================================

A folder without a kind is a datastore or an ∞-gram index by what it holds. Unset, ``k`` is
:data:`memlm.core.config.DEFAULT_K` on every path, and a datastore's τ is its calibrated one (else 1). A user's own
kind is registered with :func:`register_kind` (a function ``(path, options) -> Component``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlencode

from memlm.core.config import DEFAULT_K
from memlm.core.memory import Memory
from memlm.errors import MemlmError
from memlm.mixing.component import Component
from memlm.mixing.datastore import DatastoreComponent
from memlm.retrieval import as_memory
from memlm.storage.datastore import DatastoreBase
from memlm.storage.folder import is_ngram_index

__all__ = ["KINDS", "datastore_component", "memory_spec", "open_memories", "parse_spec", "register_kind"]

Opener = Callable[[str | None, dict[str, str]], Component]


def _number(options: dict[str, str], name: str, kind: type, default: Any) -> Any:
    """Option ``name`` as a positive (finite) ``kind``, or ``default`` when it is not given."""
    if name not in options:
        return default
    text = options.pop(name)
    try:
        value = kind(text)
    except ValueError:
        value = None
    if value is None or not value > 0 or value == float("inf"):
        raise MemlmError(f"memory option {name} must be a positive {kind.__name__}, got {text!r}")
    return value


def _knn(path: str | None, options: dict[str, str]) -> Component:
    from memlm.retrieval import DatastoreMemory
    from memlm.storage.sharded import open_datastore

    if not path:
        raise MemlmError("a knn memory needs its datastore folder: knn:PATH")
    datastore = open_datastore(path, ray=options.pop("ray", None) or None)
    k = _number(options, "k", int, DEFAULT_K)
    nprobe = _number(options, "nprobe", int, 32)
    temperature = _number(options, "temperature", float, None)
    memory = DatastoreMemory(datastore, options.pop("search", "index"), options.pop("scores", "index"), nprobe)
    return datastore_component(memory, k, temperature)


def datastore_component(memory: Any, k: int = DEFAULT_K, temperature: float | None = None) -> DatastoreComponent:
    """A dense memory searched for its ``k`` best entries at τ = ``temperature``, else its datastore's calibrated τ
    (:func:`memlm.knnlm.calibration.knn_parameters`; 1 without one)."""
    from memlm.knnlm.calibration import knn_parameters

    setting = {"k": k, "nprobe": getattr(memory, "nprobe", 32), "search": "index"}
    _, tau, _ = knn_parameters(memory, 0.0, temperature, announce=False, setting=setting)
    return DatastoreComponent(memory, k, tau)


def _ngram(path: str | None, options: dict[str, str]) -> Component:
    from memlm.ngram.memory import NgramMemory
    from memlm.ngram.step import NgramComponent

    if not path:
        raise MemlmError("an ngram memory needs its ∞-gram index folder: ngram:PATH")
    memory = NgramMemory(path, max_n=_number(options, "max_n", int, None))
    return NgramComponent(memory, _number(options, "k", int, 1000))


def _cache(path: str | None, options: dict[str, str]) -> Component:
    from memlm.knnlm.cache import CacheComponent

    if path:
        raise MemlmError(f"the cache reads the evaluated text itself: write cache, not cache:{path}")
    return CacheComponent(_number(options, "k", int, 256), _number(options, "max_len", int, 2048),
                          options.pop("metric", "ip"), _number(options, "temperature", float, 1.0))  # fmt: skip


KINDS: dict[str, Opener] = {"knn": _knn, "ngram": _ngram, "cache": _cache}
"""Memory kinds by name: a function ``(path or None, options) -> Component`` that pops the options it reads."""


def register_kind(kind: str, opener: Opener) -> None:
    """Make ``kind:PATH?options`` open a user's own memory with ``opener(path, options)``."""
    if not kind.isidentifier() or kind == "lm":
        raise MemlmError(f"a memory kind is a name like 'knn' (not 'lm'), got {kind!r}")
    KINDS[kind] = opener


def parse_spec(spec: str) -> list[tuple[str, str | None, dict[str, str]]]:
    """``(kind, path, options)`` of each memory of a spec string (module docstring); a path without a kind gets
    its kind from what the folder holds."""
    out = []
    for part in (p.strip() for p in spec.split(";")):
        if not part:
            continue
        head, _, query = part.partition("?")
        kind, sep, path = head.partition(":")
        if not sep:
            if kind in KINDS and kind == "cache":
                kind, path = "cache", ""
            else:
                kind, path = ("ngram" if is_ngram_index(head) else "knn"), head
        if kind not in KINDS:
            raise MemlmError(f"unknown memory kind {kind!r} in {part!r}: use one of {', '.join(KINDS)} "
                             "(or register your own with memlm.knnlm.memories.register_kind)")  # fmt: skip
        out.append((kind, path or None, dict(parse_qsl(query, keep_blank_values=True, strict_parsing=False))))
    return out


def _open_one(item: Any) -> list[Component]:
    """One item of a memories list as components."""
    if isinstance(item, Component):
        return [item]
    if isinstance(item, str) and (";" in item or "?" in item or item.split(":", 1)[0] in KINDS):
        found = []
        for kind, path, options in parse_spec(item):
            found.append(KINDS[kind](path, options))
            if options:
                raise MemlmError(f"unknown option(s) {', '.join(options)} for a {kind} memory in {item!r}")
        return found
    if isinstance(item, str | Path):
        return _open_one(f"{'ngram' if is_ngram_index(item) else 'knn'}:{item}")
    if is_ngram_index(item):
        from memlm.ngram.memory import NgramMemory
        from memlm.ngram.step import NgramComponent

        return [NgramComponent(item if isinstance(item, NgramMemory) else NgramMemory(item))]
    if isinstance(item, DatastoreBase | Memory):
        return [datastore_component(as_memory(item))]
    raise MemlmError(f"memories holds a {type(item).__name__}: give a memory spec string (knn:PATH;ngram:PATH), "
                     "folders, open datastores or ∞-gram indexes, or components")  # fmt: skip


def open_memories(memories: str | Path | Sequence[Any] | None) -> list[Component]:
    """Every memory as a component, in order: a spec string (module docstring), a folder, or a list of spec
    strings, folders, open datastores (plain or sharded) and ∞-gram indexes, memories with a ``key_spec``, and
    components (kept as they are)."""
    if memories is None:
        return []
    items = [memories] if isinstance(memories, str | Path) or not isinstance(memories, Sequence) else memories
    return [c for item in items for c in _open_one(item)]


def memory_spec(components: Sequence[Component]) -> str:
    """The spec string of ``components`` (written into result files): each one's kind, path and settings."""
    parts = []
    for c in components:
        d: Mapping[str, Any] = c.describe()
        path = d.get("datastore") or d.get("ngram") or d.get("path")
        keep = {k: d[k] for k in ("k", "temperature", "max_len") if d.get(k) is not None}
        if d.get("ngram_max_n") is not None:
            keep["max_n"] = d["ngram_max_n"]
        head = c.kind if c.kind == "cache" or not path else f"{c.kind}:{path}"
        parts.append(head + (f"?{urlencode(keep)}" if keep else ""))
    return ";".join(parts)
