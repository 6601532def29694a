"""Fixed weights as a :class:`memlm.core.mixture.Mixture`: the one way a consumer (generation, ``memlm.wrap``,
lm-eval) is given weights by hand. The fixed-weight rule (:func:`memlm.core.mixture.rule_mixture`)::

    λ_0(c) = 1 - Σ_j λ_j - Σ_r λ_r(c),     λ_r(c) = λ_sparse,r if P∞_r(· | c) is sparse else λ_dense,r

a constant λ_j for a datastore or the cache (Khandelwal et al. 2020, Eq. 3; Grave et al. 2017c), a pair
``(λ_sparse, λ_dense)`` for an ∞-gram index (Liu et al. 2024, Sec. 5). Components are named by
:func:`memlm.mixing.component.component_names` (``knn``, ``knn2``, ``ngram``, ``cache``).

As a string (the command line, lm-eval's ``--model_args``): ``knn=0.25;ngram=0.5/0.1`` (``;`` between components,
``/`` between an ∞-gram's λ_sparse and λ_dense).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from memlm.core.mixture import Mixture, rule_mixture
from memlm.errors import MemlmError
from memlm.mixing.component import component_names

__all__ = ["Weight", "fixed_mixture", "is_weights", "parse_weights", "weights_text"]

Weight = float | tuple[float, float]
"""One memory's fixed weight: λ, or an ∞-gram's ``(λ_sparse, λ_dense)``."""


def fixed_mixture(components: Sequence[Any], weights: Mapping[str, Weight]) -> Mixture:
    """The fixed-weight rule over the LM and ``components`` (memories, in order) with ``weights`` by component name
    (missing: 0), e.g. ``fixed_mixture(memories, {"knn": 0.25, "ngram": (0.5, 0.1)})``."""
    return rule_mixture(component_names(components), weights)


def parse_weights(text: str) -> dict[str, Weight]:
    """``knn=0.25;ngram=0.5/0.1`` as ``{"knn": 0.25, "ngram": (0.5, 0.1)}`` (module docstring)."""
    out: dict[str, Weight] = {}
    for part in (p.strip() for p in text.split(";")):
        if not part:
            continue
        name, sep, value = part.partition("=")
        try:
            numbers = tuple(float(v) for v in value.split("/"))
        except ValueError:
            numbers = ()
        if not sep or not name.strip() or len(numbers) not in (1, 2):
            raise MemlmError(f"weights {text!r}: write each memory's as name=λ or name=λ_sparse/λ_dense, separated "
                             "by ';' (knn=0.25;ngram=0.5/0.1)")  # fmt: skip
        out[name.strip()] = numbers[0] if len(numbers) == 1 else (numbers[0], numbers[1])
    return out


def weights_text(weights: Mapping[str, Weight]) -> str:
    """The weights string of ``weights`` (the inverse of :func:`parse_weights`)."""
    return ";".join(f"{n}={'/'.join(f'{x:g}' for x in w) if isinstance(w, tuple) else f'{w:g}'}"
                    for n, w in weights.items())  # fmt: skip


def is_weights(text: Any) -> bool:
    """Whether ``text`` is a weights string (``name=...``), not the path of a fit."""
    return isinstance(text, str) and "=" in text
