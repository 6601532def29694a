"""The component protocol: the LM and every memory as one list, mixed by one :class:`memlm.core.mixture.Mixture`::

    P(w | c) = sum_i λ_i(c) P_i(w | c),     i = 0 (the LM), 1 .. m (the memories, in the order given)

A memory is a *component*: anything that, given the contexts of a batch (:class:`Batch`: the hidden-state queries
of the key it reads, the token contexts, the targets when scoring), answers

* at the targets (scoring a corpus, :meth:`Component.score`): its *columns*, arrays ``[N, ...]`` stored in the
  per-token table, from which :meth:`Component.logprob` gives ``log P_i(target)`` ``[N]`` and
  :meth:`Component.features` its retrieval features (each ``[N]``, finite) -- keeping raw columns (a datastore's
  k best scores and values) lets τ and k be chosen after one search;
* over the vocabulary (a generation step, a wrapped forward pass, lm-eval, :meth:`Component.step`):
  ``log P_i(. | c)`` ``[rows, V]`` and the same features (:class:`Step`).

The kinds memlm ships: a dense datastore (plain or sharded, over any searcher:
:class:`memlm.mixing.datastore.DatastoreComponent`), an ∞-gram index (:class:`memlm.ngram.step.NgramComponent`)
and the continuous cache (:class:`memlm.knnlm.cache.CacheComponent`). A user's own memory subclasses
:class:`Component` (docs/ARCHITECTURE.md has one in thirty lines): the defaults read a ``logprob`` column and take
every other column as a feature.

Names are given in one place (:func:`component_names`): ``lm``, then each memory's kind, ``<kind>2``, ``<kind>3``
for further memories of a kind (two datastores: knn, knn2; two ∞-gram indexes: ngram, ngram2).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple

import numpy as np
import torch

from memlm.errors import MemlmError

__all__ = ["Batch", "Component", "Step", "component_name", "component_names"]


@dataclass
class Batch:
    """The contexts of one batch, one row per context, as the components read them.

    ``queries[spec]`` ``[rows, D]``: the hidden-state query of each key spec some component reads (its
    ``key_spec``). ``targets`` ``[rows]``: the next tokens when scoring (None at a generation step).
    ``doc_index`` / ``position`` ``[rows]``: each target's document and offset in it, and ``documents`` each
    document's tokens by index (scoring: an ∞-gram reads a target's whole document before it, whatever window the LM
    read it in). ``contexts``: each row's tokens so far (a generation step; made on first use by ``make_contexts``).
    ``provenance`` (``doc_hash``, ``offset`` per row) lets a datastore drop the scored token itself.
    ``vocab``, ``device``: the LM's distribution's size and device.
    """

    queries: Mapping[Any, np.ndarray] = field(default_factory=dict)
    targets: np.ndarray | None = None
    doc_index: np.ndarray | None = None
    position: np.ndarray | None = None
    documents: Mapping[int, np.ndarray] | None = None
    provenance: Mapping[str, np.ndarray] | None = None
    make_contexts: Callable[[], list[list[int]]] | None = None
    vocab: int = 0
    device: torch.device | str = "cpu"
    _contexts: list[list[int]] | None = field(default=None, repr=False)

    def __len__(self) -> int:
        if self.targets is not None:
            return len(self.targets)
        return len(next(iter(self.queries.values()))) if self.queries else len(self.contexts)

    @property
    def contexts(self) -> list[list[int]]:
        """Each row's tokens so far (a generation step's rows)."""
        if self._contexts is None:
            if self.make_contexts is None:
                raise MemlmError("this batch has no token contexts (a scoring batch: use documents and position)")
            self._contexts = self.make_contexts()
        return self._contexts

    def query(self, spec: Any) -> np.ndarray:
        """The queries of key ``spec`` ``[rows, D]`` (one MemlmError when the batch was made without them)."""
        if spec not in self.queries:
            raise MemlmError(f"this batch has no queries for key {spec}: the model's forward pass must capture it")
        return self.queries[spec]


class Step(NamedTuple):
    """One component over the vocabulary: ``log P_i(. | c)`` ``[rows, V]``, its features by feature name (each
    ``[rows]``, unprefixed)
    and its sparse flag per row (∞-gram indexes, which the fixed-weight rule switches on; None otherwise)."""

    logprobs: torch.Tensor
    features: dict[str, np.ndarray]
    sparse: np.ndarray | None = None


class Component:
    """A memory of the mixture (module docstring). Subclasses set ``kind`` and implement :meth:`score` and
    :meth:`step`; ``key_spec`` (a :class:`memlm.models.keys.KeySpec`) names the hidden state it reads, None when it
    reads tokens only. The defaults of :meth:`logprob` and :meth:`features` read a ``logprob`` column and take every
    other column as a feature: a memory that has nothing to choose after its search needs no more."""

    kind: ClassVar[str] = "memory"
    key_spec: Any = None
    kinds: ClassVar[dict[str, type[Component]]] = {}
    """Each kind's class (the first class to declare it), by which a saved per-token table rebuilds its components
    (:meth:`from_description`)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "kind" in cls.__dict__:
            Component.kinds.setdefault(cls.kind, cls)

    @classmethod
    def from_description(cls, description: Mapping[str, Any]) -> Component:
        """A component that reads saved columns again (:meth:`logprob`, :meth:`features`, :meth:`sparse`), from what
        :meth:`describe` recorded when they were scored; it needs not reopen its memory (default: no settings)."""
        return cls.__new__(cls)

    def score(self, batch: Batch) -> dict[str, np.ndarray]:
        """Its table columns at ``batch.targets`` (each ``[rows, ...]``)."""
        raise NotImplementedError

    def step(self, batch: Batch) -> Step:
        """``log P_i(. | c)`` over the vocabulary for each row of ``batch``, and its features."""
        raise NotImplementedError

    def logprob(self, columns: Mapping[str, np.ndarray], targets: np.ndarray) -> torch.Tensor:
        """``log P_i(target)`` float64 ``[N]`` from its columns (``-inf`` where it gives the target 0)."""
        return torch.as_tensor(np.asarray(columns["logprob"], dtype=np.float64))

    def features(self, columns: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Its features float64 ``[N]`` from its columns (finite), by feature name; the mixture sees them as
        ``<component name>_<feature>``."""
        return {c: np.asarray(v, dtype=np.float64) for c, v in columns.items() if c != "logprob"}

    def sparse(self, columns: Mapping[str, np.ndarray]) -> np.ndarray | None:
        """Its sparse flag per token (the fixed-weight rule's switch; None for a memory without one)."""
        return None

    def check_compatible(self, model: Any, tokenizer: Any) -> None:
        """One MemlmError when this memory was built for another model or tokenizer (default: nothing to check)."""

    def describe(self) -> dict[str, Any]:
        """What this memory is, for result files and the memory spec string."""
        return {"kind": self.kind}


def component_name(kind: str, r: int) -> str:
    """The name of the ``r``-th memory (0-based) of a kind: the kind, then ``<kind>2``, ``<kind>3``, ..."""
    return kind if r == 0 else f"{kind}{r + 1}"


def component_names(components: Sequence[Any]) -> tuple[str, ...]:
    """``lm``, then each memory's name in the order given (:func:`component_name` by kind): the one place names are
    made."""
    counts: dict[str, int] = {}
    names = ["lm"]
    for c in components:
        kind = getattr(c, "kind", None)
        if not isinstance(kind, str) or not kind or kind == "lm":
            raise MemlmError(f"{type(c).__name__} is not a memory component: give it a kind (knn, ngram, cache or "
                             "its own) and score / step methods (memlm.mixing.component.Component)")  # fmt: skip
        names.append(component_name(kind, counts.get(kind, 0)))
        counts[kind] = counts.get(kind, 0) + 1
    return tuple(names)
