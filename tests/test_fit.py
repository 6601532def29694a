"""The one fitter (memlm.core.mixture.fit): each form against a brute-force NumPy maximum-likelihood reference."""

import numpy as np
import pytest

from memlm.core.mixture import fit, fit_rule, sparse_state_features
from memlm.errors import MemlmError


def _two_component_mle(p0: np.ndarray, p1: np.ndarray) -> float:
    """λ maximising mean log((1 - λ) p0 + λ p1), from the stationarity condition
    mean((p1 - p0) / ((1 - λ) p0 + λ p1)) = 0 (decreasing in λ), by bisection."""
    lo, hi = 0.0, 1.0
    for _ in range(200):
        mid = (lo + hi) / 2
        grad = np.mean((p1 - p0) / ((1 - mid) * p0 + mid * p1))
        lo, hi = (mid, hi) if grad > 0 else (lo, mid)
    return (lo + hi) / 2


def _data(seed: int, n: int = 3000):
    rng = np.random.default_rng(seed)
    p0 = rng.uniform(0.01, 0.5, n)
    sparse = rng.random(n) < 0.3
    # the memory is sharp where sparse (it is usually right), vague elsewhere
    p1 = np.where(sparse, rng.uniform(0.3, 1.0, n), rng.uniform(0.0, 0.3, n))
    return p0, p1, sparse


def test_rule_is_the_mle_of_each_sparse_state():
    p0, p1, sparse = _data(0)
    lp = np.log(np.stack([p0, p1], 1))
    flags = sparse_state_features({"ngram": sparse})
    names = tuple(flags)
    feats = np.stack([flags[n].numpy() for n in names], 1)
    mixture = fit_rule(lp, feats, names, ("lm", "ngram"))
    weights = mixture.log_weights(feats).exp().numpy()
    for state in (True, False):
        rows = sparse == state
        want = _two_component_mle(p0[rows], p1[rows])
        assert weights[rows][:, 1] == pytest.approx(want, abs=1e-6)
    assert weights[sparse, 1].mean() > weights[~sparse, 1].mean() + 0.2  # the data makes them differ


def test_constant_is_the_mle_and_guarded_refuses_a_useless_memory():
    p0, p1, _ = _data(1)
    lp = np.log(np.stack([p0, p1], 1))
    doc = np.repeat(np.arange(30), 100)
    found = fit(lp, np.zeros((len(p0), 0)), doc, ("lm", "knn"), (), form="constant")
    assert found.mixture.log_weights(np.zeros((1, 0))).exp()[0, 1].item() == pytest.approx(
        _two_component_mle(p0, p1), abs=1e-6
    )
    useless = np.log(np.stack([p0, np.full_like(p0, 1e-6)], 1))
    assert fit(useless, np.zeros((len(p0), 0)), doc, ("lm", "knn"), (), form="guarded").form == "lm"


def test_unknown_form_is_refused():
    with pytest.raises(MemlmError, match="unknown mixture form"):
        fit(np.zeros((4, 2)), np.zeros((4, 0)), np.arange(4), ("lm", "knn"), (), form="grid")
