"""The default mixture of several memories (memlm.knnlm.default_mixture): their one-memory fits combined, each memory
at its own odds against the LM, and one memory's fit embedded in the space of all."""

import numpy as np
import pytest

from memlm.core.mixture import Mixture, MixtureFit
from memlm.knnlm.default_mixture import combine
from memlm.mixing.dump import DumpMixture

LM = ("lm_entropy", "lm_max_logprob")


def _fit(kind: str, own: tuple[str, ...], seed: int, b: float) -> DumpMixture:
    rng = np.random.default_rng(seed)
    names = (*LM, *(f"{kind}_{f}" for f in own))
    f = len(names)
    W = np.vstack([np.zeros(f), rng.normal(size=f)])
    m = Mixture(("lm", kind), names, W, np.array([0.0, b]), rng.normal(size=f), rng.uniform(0.5, 2, f), "gate")
    fit = MixtureFit(m, 100, 10, 75, 25, "documents", {}, [0.9, 0.1])
    return DumpMixture(fit, 2.0 if kind == "knn" else None, 16 if kind == "knn" else None)


def _odds(m: Mixture, phi: np.ndarray) -> np.ndarray:
    """log λ_i - log λ_0 of each memory at features ``phi`` (by this mixture's feature names)."""
    lw = m.log_weights(phi).numpy()
    return lw[:, 1:] - lw[:, :1]


def test_each_memory_keeps_its_own_odds_against_the_lm():
    knn = _fit("knn", ("top_score", "logsumexp"), 0, -2.0)
    ngram = _fit("ngram", ("log_n", "sparse"), 1, -3.0)
    both = combine([knn, ngram], ["knn", "ngram2"])
    m = both.mixture
    assert m.components == ("lm", "knn", "ngram2") and m.form == "gate"
    assert m.feature_names == (*LM, "knn_top_score", "knn_logsumexp", "ngram2_log_n", "ngram2_sparse")
    assert (both.temperature, both.k) == (2.0, 16)
    phi = np.random.default_rng(2).normal(size=(50, 6))
    odds = _odds(m, phi)
    np.testing.assert_allclose(odds[:, 0], _odds(knn.mixture, phi[:, :4])[:, 0], rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(odds[:, 1], _odds(ngram.mixture, phi[:, [0, 1, 4, 5]])[:, 0], rtol=1e-10, atol=1e-10)
    # one memory kept: the other at weight 0, the kept one's weights are its own fit's
    alone = combine([knn, ngram], ["knn", "ngram2"], [False, True]).mixture
    w = alone.log_weights(phi).exp().numpy()
    assert (w[:, 1] == 0).all()
    np.testing.assert_allclose(w[:, [0, 2]], ngram.mixture.log_weights(phi[:, [0, 1, 4, 5]]).exp().numpy(),
                               rtol=1e-10, atol=1e-12)  # fmt: skip


def test_paired_gain_is_the_mean_and_its_block_standard_error():
    """D = mean d_t; SE from 512-token blocks: constant blocks of +1 and -1 give D = 0 and SE = sqrt(Σ n_b^2) / N."""
    from memlm.knnlm.default_mixture import paired_gain

    diff = np.r_[np.ones(512), -np.ones(512)]
    gain, se = paired_gain(diff, np.zeros(1024, int))
    assert gain == 0 and se == np.sqrt(2 * 512.0**2) / 1024
    gain, se = paired_gain(np.full(1024, 0.1), np.zeros(1024, int))
    assert gain == pytest.approx(0.1) and se < 1e-15
