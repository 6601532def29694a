"""One grid search for the parameters of the paper reproductions that are searched: the Xu et al. (2023) per-row
λ / τ, TRIME's ``M``, τ_local, τ, λ and τ_kNN (Zhong et al. 2022, App. A). The mixtures of the LM and its memories
(the kNN-LM's λ, the ∞-gram's λ_sparse / λ_dense, the cache's λc) are fitted instead (:mod:`memlm.core.mixture`: EM,
L-BFGS; no grid over their weights), and :data:`DEFAULT_TEMPERATURES` is the τ grid they are fitted at.

A tuner is an objective (parameters -> perplexity on a dev dump, computed from stored per-token scores with no new
forward pass or search) and a grid (parameter name -> candidate values). :func:`grid_search` evaluates every point of
the product grid that ``keep`` accepts, in a fixed order, and returns the best point (lowest ``ppl``; the first of
equal ones) and the whole grid, so a report can show how flat the optimum is. Expensive pieces shared by many points
(the memory's log-probabilities at one τ) are the objective's business (``functools.cache`` on a helper).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from memlm.errors import MemlmError

__all__ = ["DEFAULT_LAMBDAS", "DEFAULT_TEMPERATURES", "grid_search"]

# fine near 0, where small LMs with small datastores want λ; the paper's 0.25 and the rest up to 1 too
DEFAULT_LAMBDAS = (
    0.0,
    0.01,
    0.02,
    0.03,
    0.05,
    0.075,
    0.1,
    0.125,
    0.15,
    0.2,
    0.25,
    0.3,
    0.35,
    0.4,
    0.45,
    0.5,
    0.55,
    0.6,
    0.65,
    0.7,
    0.75,
    0.8,
    0.85,
    0.9,
    0.95,
    1.0,
)
# up to 1000: `final` keys (squared distances in the hundreds) had their tuned τ at the old edge, 100
DEFAULT_TEMPERATURES = (0.1, 0.2, 0.5, 1.0, 2.0, 3.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0)


def grid_search(
    objective: Callable[..., float],
    grid: Mapping[str, Sequence[Any]],
    keep: Callable[[dict[str, Any]], bool] | None = None,
) -> dict[str, Any]:
    """Minimise ``objective(**point)`` over the product of ``grid``'s value lists.

    Returns ``{"best": point + {"ppl": value}, "grid": [every evaluated point + {"ppl"}]}``. ``keep(point)`` skips a
    point when it returns False (e.g. λ + λc > 1). A ``nan`` objective never wins.
    """
    if not grid or any(len(v) == 0 for v in grid.values()):
        raise MemlmError(f"nothing to tune: every parameter needs at least one candidate value, got {dict(grid)}")
    names = list(grid)
    points = []
    for combo in itertools.product(*(grid[n] for n in names)):
        point = dict(zip(names, combo, strict=True))
        if keep is not None and not keep(point):
            continue
        points.append({**point, "ppl": float(objective(**point))})
    if not points:
        raise MemlmError("nothing to tune: no point of the grid satisfies its constraints")
    best = min(points, key=lambda p: math.inf if math.isnan(p["ppl"]) else p["ppl"])
    return {"best": best, "grid": points}
