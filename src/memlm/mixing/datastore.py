"""A dense datastore as a component of the mixture (Khandelwal et al. 2020): its ``k`` best entries for the query
of its key, and the kNN distribution at temperature τ (Eq. 2)::

    p_kNN(w | c) = sum_{(k_i, v_i) in top-k} 1[v_i = w] n_i exp(s(q, k_i) / τ) / sum_j n_j exp(s(q, k_j) / τ)

(``n_i`` the merged count of a pruned datastore's entry, 1 otherwise). Its table columns are the retrieved
``scores``, ``values`` (and ``log_counts``), ``[N, k]`` best first, so τ and any k' <= k can be chosen after one
search; its features (:func:`memlm.mixing.inputs.neighbour_features`) are the top score, the log-sum-exp of the
scores / τ, the top value's share and the empty flag.

Any memory with ``search(queries, k) -> Retrieved`` and a ``key_spec`` serves (a :class:`memlm.retrieval.
DatastoreMemory` over a plain or sharded datastore and any searcher, a user's own).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np
import torch

from memlm.core.distribution import knn_distribution
from memlm.mixing.component import Batch, Component, Step
from memlm.mixing.inputs import memory_logprob, neighbour_features

__all__ = ["DatastoreComponent"]


class DatastoreComponent(Component):
    """A dense memory searched for its ``k`` best entries, mixed at temperature ``temperature``. ``record=True``
    keeps each step's ``(scores, ids)`` ``[rows, k]`` in ``history`` (where a generated token came from)."""

    kind: ClassVar[str] = "knn"

    def __init__(self, memory: Any, k: int, temperature: float = 1.0, record: bool = False) -> None:
        self.memory, self.k, self.temperature, self.record = memory, int(k), float(temperature), record
        self.history: list[tuple[np.ndarray, np.ndarray]] = []

    @classmethod
    def from_description(cls, description: Mapping[str, Any]) -> DatastoreComponent:
        """Its saved columns read at the recorded τ and k (no memory: nothing to search)."""
        return cls(None, int(description.get("k") or 0), float(description.get("temperature") or 1.0))

    @property
    def key_spec(self) -> Any:
        return self.memory.key_spec

    @property
    def datastore(self) -> Any:
        """The datastore searched (where its calibration is stored), or None for another memory."""
        return getattr(self.memory, "datastore", None)

    def score(self, batch: Batch) -> dict[str, np.ndarray]:
        queries = batch.query(self.key_spec)
        if batch.provenance is not None and hasattr(self.memory, "retrieved"):
            r = self.memory.search(queries, self.k, batch.provenance)
        else:
            r = self.memory.search(queries, self.k)
        scores, values, counts = r.tensors()
        out = {"scores": scores.float().cpu().numpy(), "values": values.cpu().numpy().astype(np.int32)}
        if counts is not None:
            out["log_counts"] = counts.float().cpu().numpy()
        return out

    def logprob(self, columns: Mapping[str, np.ndarray], targets: np.ndarray, temperature: float | None = None,
                k: int | None = None) -> torch.Tensor:  # fmt: skip
        tau = self.temperature if temperature is None else temperature
        return memory_logprob(columns["scores"], columns["values"], targets, tau, k,
                              columns.get("log_counts")).double()  # fmt: skip

    def features(self, columns: Mapping[str, np.ndarray], temperature: float | None = None,
                 k: int | None = None) -> dict[str, np.ndarray]:  # fmt: skip
        tau = self.temperature if temperature is None else temperature
        return neighbour_features(np.asarray(columns["scores"]), np.asarray(columns["values"]), tau, k,
                                  columns.get("log_counts"))  # fmt: skip

    def step(self, batch: Batch) -> Step:
        r = self.memory.search(batch.query(self.key_spec), self.k)
        scores, values, counts = r.tensors()
        if self.record:
            self.history.append((scores.cpu().numpy().copy(), torch.as_tensor(r.ids).cpu().numpy().copy()))
        device = batch.device
        dist = knn_distribution(scores.to(device), values.to(device), batch.vocab, self.temperature,
                                None if counts is None else counts.to(device))  # fmt: skip
        np_counts = None if counts is None else counts.cpu().numpy()
        columns = {"scores": scores.cpu().numpy(), "values": values.cpu().numpy()}
        if np_counts is not None:
            columns["log_counts"] = np_counts
        return Step(dist, self.features(columns))

    def check_compatible(self, model: Any, tokenizer: Any) -> None:
        check = getattr(self.memory, "check_compatible", None)
        if check is not None:
            check(model, tokenizer)

    def describe(self) -> dict[str, Any]:
        describe = getattr(self.memory, "describe", None)
        found = (
            describe()
            if describe is not None
            else {}
            if self.memory is None
            else {"memory": type(self.memory).__name__}
        )
        return {"kind": self.kind, **found, "k": self.k, "temperature": self.temperature}
