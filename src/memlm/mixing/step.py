"""One step of the mixture over the vocabulary: the LM and every memory's next-token distribution, mixed by one
:class:`memlm.core.mixture.Mixture`. Generation (:class:`memlm.knnlm.generate.MixtureLogitsProcessor`)
and ``memlm.wrap``'s forward pass (:class:`memlm.knnlm.wrap.KNNLM`) both mix through :class:`StepMixture`::

    P(w | c) = sum_i λ_i(c) P_i(w | c),     λ(c) = softmax(W φ(c) + b),     i = the LM, then each memory

At a step (rows of contexts: a generation step's prompts and beams, a forward pass's positions) each memory gives its
component's log-distribution over the vocabulary ``[rows, V]`` and its features by name, the same features a dump
stores (:mod:`memlm.mixing.inputs`):

* a datastore (plain or sharded, on its own index) or any memory with a ``key_spec`` (:class:`DatastoreStep`): p_kNN
  from its k best entries at temperature τ (Khandelwal et al. 2020, Eq. 2) and
  :func:`~memlm.mixing.inputs.retrieval_features`;
* an ∞-gram index (:class:`memlm.ngram.generate.NgramStep`): P∞ of the longest matching suffix (Liu et al. 2024,
  Sec. 3) and :func:`~memlm.mixing.inputs.ngram_features` (effective n, suffix count, sparse flag).

Components are named as in a dump: ``lm``, then ``knn``, ``knn2``, ... (datastores), then ``ngram``, ``ngram2``, ...
(∞-gram indexes), each kind in the order given. Without a fitted mixture the memories' own weights (each datastore's
λ, each index's (λ_sparse, λ_dense): given, else calibrated) are the fixed-weight rule
(:func:`memlm.core.mixture.rule_mixture`, switched by :func:`~memlm.core.mixture.sparse_state_features`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from memlm.core.distribution import knn_distribution
from memlm.core.mixture import Mixture, rule_mixture, sparse_state_features
from memlm.errors import MemlmError
from memlm.mixing.inputs import component_name, lm_features, retrieval_features

__all__ = [
    "Component",
    "DatastoreStep",
    "StepInputs",
    "StepMixture",
    "check_components",
    "load_fit",
    "step_components",
]


class StepInputs:
    """What the memories read at one step, one row per context: each dense memory's query by key spec
    (``queries[spec]``, ``[rows, D]``) and each row's tokens so far (``contexts``, an ∞-gram's; made on first use by
    ``make_contexts``), the vocabulary size and the device of the LM's distribution."""

    def __init__(self, queries: Mapping[Any, np.ndarray], make_contexts: Callable[[], list[list[int]]], vocab: int,
                 device: torch.device | str = "cpu") -> None:  # fmt: skip
        self.queries, self.vocab, self.device = queries, int(vocab), device
        self._make_contexts = make_contexts
        self._contexts: list[list[int]] | None = None

    @property
    def contexts(self) -> list[list[int]]:
        if self._contexts is None:
            self._contexts = self._make_contexts()
        return self._contexts


class Component(NamedTuple):
    """One memory at a step: ``log P_i(. | c)`` ``[rows, V]``, its features by name (each ``[rows]``), and its sparse
    flag per row (∞-gram indexes; None otherwise)."""

    logprobs: torch.Tensor
    features: dict[str, np.ndarray]
    sparse: np.ndarray | None = None


class DatastoreStep:
    """A dense memory at a step: p_kNN over the vocabulary from its ``k`` best entries at temperature ``temperature``
    (Eq. 2) and its retrieval features; ``lam`` its weight in the fixed-weight rule. ``record=True`` keeps each
    step's ``(scores, ids)`` ``[rows, k]`` in ``history`` (to show where a generated token came from)."""

    kind = "knn"

    def __init__(self, memory, k: int, lam: float, temperature: float, record: bool = False) -> None:
        self.memory, self.k, self.lam, self.temperature, self.record = memory, int(k), float(lam), temperature, record
        self.history: list[tuple[np.ndarray, np.ndarray]] = []

    @property
    def key_spec(self):
        return self.memory.key_spec

    @property
    def datastore(self):
        """The datastore searched (where calibrated λ, τ are recorded), or None for another memory."""
        return getattr(self.memory, "datastore", None)

    @property
    def rule_weight(self) -> float:
        return self.lam

    def component(self, name: str, inputs: StepInputs) -> Component:
        r = self.memory.search(inputs.queries[self.key_spec], self.k)
        scores, values, counts = r.tensors()
        if self.record:
            self.history.append((scores.cpu().numpy().copy(), torch.as_tensor(r.ids).cpu().numpy().copy()))
        device = inputs.device
        dist = knn_distribution(scores.to(device), values.to(device), inputs.vocab, self.temperature,
                                None if counts is None else counts.to(device))  # fmt: skip
        np_counts = None if counts is None else counts.cpu().numpy()
        feats = retrieval_features(name, scores.cpu().numpy(), values.cpu().numpy(), self.temperature, None, np_counts)
        return Component(dist, feats)


def load_fit(mixture: Any) -> Any:
    """A fitted mixture as given to a consumer: a :class:`memlm.mixing.dump.DumpMixture` or a
    :class:`Mixture` (kept), its record (a dict: ``memlm tune --mixture gate --json`` output, or ``Mixture.to_dict``),
    or the path of such a JSON file; None stays None (the fixed-weight rule)."""
    from memlm.mixing.dump import DumpMixture

    if mixture is None or isinstance(mixture, DumpMixture | Mixture):
        return mixture
    where = "mixture="
    if isinstance(mixture, str | Path):
        where = f"mixture {mixture}"
        try:
            mixture = json.loads(Path(mixture).read_text(encoding="utf-8"))
        except (OSError, ValueError) as error:
            raise MemlmError(f"{where}: not a readable JSON file ({error})") from error
    if isinstance(mixture, dict) and "components" in mixture:
        return Mixture.from_dict(mixture)
    return DumpMixture.from_dict(mixture, where)


def step_components(kinds: Sequence[str]) -> tuple[str, ...]:
    """The mixture's components for memories of these kinds (``knn``, ``ngram``; in their steps' order): ``lm``,
    then the r-th memory of a kind :func:`~memlm.mixing.inputs.component_name` (knn, knn2; ngram, ngram2)."""
    counts: dict[str, int] = {}
    names = ["lm"]
    for kind in kinds:
        names.append(component_name(kind, counts.get(kind, 0)))
        counts[kind] = counts.get(kind, 0) + 1
    return tuple(names)


def check_components(mixture: Mixture, components: Sequence[str]) -> None:
    """One MemlmError, naming both, when ``mixture`` mixes other components than ``components`` (the memories
    given): a fit applies only to the memories it was fitted on."""
    if set(mixture.components) == set(components):
        return
    cache = " (generation and memlm.wrap have no continuous cache)" if "cache" in mixture.components else ""
    raise MemlmError(
        f"the mixture was fitted on components {', '.join(mixture.components)}{cache}; these memories give "
        f"{', '.join(components)}: give the memories it was fitted on (each datastore, each ∞-gram index in the "
        "same order), or fit one for these memories with memlm tune --mixture gate"
    )


class StepMixture:
    """The LM and its memories' steps (:func:`memlm.knnlm.generate.memory_steps`) mixed at every step by one
    :class:`Mixture`: ``mixture`` (a fit, refused with one MemlmError when its components are not these memories'),
    else the fixed-weight rule of the steps' own weights (:func:`rule_mixture`)."""

    def __init__(self, steps: Sequence, mixture: Mixture | None = None) -> None:
        self.steps = list(steps)
        components = step_components([s.kind for s in self.steps])
        self.names = list(components[1:])
        if mixture is None:
            mixture = rule_mixture(components, {n: s.rule_weight for n, s in zip(self.names, self.steps, strict=True)})
        check_components(mixture, components)
        self.mixture = mixture

    @property
    def lm_alone(self) -> bool:
        """Every memory at weight 0 (e.g. λ = 0): the mixture is the LM's distribution."""
        return self.mixture.form == "lm"

    def mix(self, lm: torch.Tensor, inputs: StepInputs) -> torch.Tensor:
        """``log P(. | c)`` ``[rows, V]`` from the LM's log-distribution ``lm`` ``[rows, V]``: each memory's component
        and features at ``inputs``, the LM's features (:func:`lm_features`) and the ∞-grams' joint sparse state, mixed
        by :meth:`Mixture.mix`."""
        logprobs: dict[str, torch.Tensor] = {"lm": lm}
        features: dict[str, Any] = dict(lm_features(lm))
        sparse: dict[str, np.ndarray] = {}
        for name, step in zip(self.names, self.steps, strict=True):
            c = step.component(name, inputs)
            logprobs[name] = c.logprobs.to(lm.device)
            features.update(c.features)
            if c.sparse is not None:
                sparse[name] = c.sparse
        if sparse:
            features.update(sparse_state_features(sparse))
        return self.mixture.mix(logprobs, features)
