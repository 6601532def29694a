"""One step of the mixture over the vocabulary: the LM and every memory's next-token distribution, mixed by one
:class:`memlm.core.mixture.Mixture`. Generation (:class:`memlm.knnlm.generate.MixtureLogitsProcessor`),
``memlm.wrap``'s forward pass (:class:`memlm.knnlm.wrap.KNNLM`) and lm-eval's ``generate_until`` mix through
:class:`StepMixture`::

    P(w | c) = sum_i λ_i(c) P_i(w | c),     λ(c) = softmax(W φ(c) + b),     i = the LM, then each memory

At a step (rows of contexts: a generation step's prompts and beams, a forward pass's positions) each memory, a
:class:`memlm.mixing.component.Component`, gives its log-distribution over the vocabulary ``[rows, V]`` and its
features (:meth:`~memlm.mixing.component.Component.step`), which the mixture reads as ``<name>_<feature>``: the
same features a dump stores (:mod:`memlm.mixing.inputs`: ``knn_top_score``, ``ngram_log_n``, ...). Components are
named by :func:`memlm.mixing.component.component_names` (``lm``, ``knn``, ``knn2``, ``ngram``, ...); the ∞-grams'
sparse flags give the joint sparse state the fixed-weight rule reads
(:func:`~memlm.core.mixture.sparse_state_features`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from memlm.core.mixture import Mixture, sparse_state_features
from memlm.errors import MemlmError
from memlm.mixing.component import Batch, Component, component_names
from memlm.mixing.inputs import lm_features

__all__ = ["StepMixture", "check_components", "load_fit"]


def load_fit(mixture: Any) -> Any:
    """A fitted mixture as given to a consumer: a :class:`memlm.mixing.dump.DumpMixture` or a
    :class:`Mixture` (kept), its record (a dict: ``memlm tune --json`` output, or ``Mixture.to_dict``),
    or the path of such a JSON file; None stays None."""
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


def check_components(mixture: Mixture, components: Sequence[str]) -> None:
    """One MemlmError, naming both, when ``mixture`` mixes other components than ``components`` (the memories
    given): a fit applies only to the memories it was fitted on."""
    if set(mixture.components) == set(components):
        return
    missing_cache = "cache" in mixture.components and "cache" not in components
    cache = " (generation and memlm.wrap have no continuous cache)" if missing_cache else ""
    raise MemlmError(
        f"the mixture was fitted on components {', '.join(mixture.components)}{cache}; these memories give "
        f"{', '.join(components)}: give the memories it was fitted on (each datastore, each ∞-gram index in the "
        "same order), or fit one for these memories with memlm tune"
    )


class StepMixture:
    """The LM and ``components`` (memories, :class:`~memlm.mixing.component.Component`) mixed at every step by
    ``mixture``, refused with one MemlmError when it mixes other components than these."""

    def __init__(self, components: Sequence[Component], mixture: Mixture) -> None:
        self.components = list(components)
        if any(c.kind == "cache" for c in self.components):
            raise MemlmError("the continuous cache scores a corpus (memlm eval --cache, lm-eval's scoring); "
                             "generation and memlm.wrap have none: leave it out of their memories")  # fmt: skip
        names = component_names(self.components)
        self.names = list(names[1:])
        check_components(mixture, names)
        self.mixture = mixture

    @property
    def lm_alone(self) -> bool:
        """Every memory at weight 0 (e.g. λ = 0): the mixture is the LM's distribution."""
        return self.mixture.form == "lm"

    @property
    def key_specs(self) -> list:
        """The hidden states the memories read (each once, in order): what one forward pass must capture."""
        return list(dict.fromkeys(c.key_spec for c in self.components if c.key_spec is not None))

    def of_kind(self, kind: str) -> list[Component]:
        """The memories of one kind, in order."""
        return [c for c in self.components if c.kind == kind]

    def mix(self, lm: torch.Tensor, batch: Batch) -> torch.Tensor:
        """``log P(. | c)`` ``[rows, V]`` from the LM's log-distribution ``lm`` ``[rows, V]``: each memory's step at
        ``batch`` with its features prefixed by its name, the LM's features (:func:`lm_features`) and the
        ∞-grams' joint sparse state, mixed by :meth:`Mixture.mix`."""
        logprobs: dict[str, torch.Tensor] = {"lm": lm}
        features: dict[str, Any] = dict(lm_features(lm))
        sparse: dict[str, np.ndarray] = {}
        for name, component in zip(self.names, self.components, strict=True):
            step = component.step(batch)
            logprobs[name] = step.logprobs.to(lm.device)
            features.update({f"{name}_{f}": v for f, v in step.features.items()})
            if step.sparse is not None:
                sparse[name] = step.sparse
        if sparse:
            features.update(sparse_state_features(sparse))
        return self.mixture.mix(logprobs, features)
