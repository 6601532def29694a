"""Eq. 2 / Eq. 3 (Khandelwal et al. 2020) and Eq. 5 (Xu et al. 2023) against a brute-force NumPy reference."""

import numpy as np
import pytest
import torch

from memlm.core.distribution import knn_distribution, knn_target_logprob, mix, mix_posterior
from memlm.errors import MemlmError


def reference_knn(queries, keys, values, vocab, k, metric, temperature, counts=None):
    """Brute force: score every key, keep the top k, count * exp(score / T) normalised, sum the mass per value."""
    counts = np.ones(len(keys)) if counts is None else counts
    out = np.zeros((len(queries), vocab))
    for qi, q in enumerate(queries):
        if metric == "l2":
            s = -((keys - q) ** 2).sum(1)
        else:
            s = keys @ q
        top = np.argsort(-s, kind="stable")[: min(k, len(keys))]
        w = counts[top] * np.exp((s[top] - s[top].max()) / temperature)
        w /= w.sum()
        for j, i in enumerate(top):
            out[qi, values[i]] += w[j]
    return out


def topk_scores(queries, keys, values, k, metric):
    s = -((queries[:, None, :] - keys[None]) ** 2).sum(-1) if metric == "l2" else queries @ keys.T
    order = np.argsort(-s, axis=1, kind="stable")[:, :k]
    sc = np.take_along_axis(s, order, 1)
    vals = values[order]
    if k > len(keys):  # pad like an index does
        pad = k - len(keys)
        sc = np.concatenate([sc, np.full((len(queries), pad), -np.inf)], 1)
        vals = np.concatenate([vals, np.full((len(queries), pad), -1)], 1)
    return torch.tensor(sc), torch.tensor(vals)


@pytest.mark.parametrize("metric", ["l2", "ip"])
@pytest.mark.parametrize("temperature", [0.5, 1.0, 3.0])
@pytest.mark.parametrize("k", [1, 5, 40])  # 40 > datastore size: all entries, padded slots ignored
def test_knn_distribution_matches_bruteforce(metric, temperature, k):
    rng = np.random.default_rng(0)
    keys = rng.normal(size=(30, 8))
    values = rng.integers(0, 6, size=30)  # vocabulary of 10, many repeated values to be summed
    queries = rng.normal(size=(7, 8))
    ref = reference_knn(queries, keys, values, 10, k, metric, temperature)
    sc, vals = topk_scores(queries, keys, values, k, metric)
    got = knn_distribution(sc, vals, 10, temperature).exp().numpy()
    np.testing.assert_allclose(got, ref, atol=1e-6)
    np.testing.assert_allclose(got.sum(1), 1.0, atol=1e-6)
    # the target-only path gives the same numbers, including log 0 = -inf for unretrieved targets
    for target in range(10):
        t = torch.full((7,), target)
        lp = knn_target_logprob(sc, vals, t, temperature).numpy()
        with np.errstate(divide="ignore"):
            np.testing.assert_allclose(lp, np.log(ref[:, target]), atol=1e-6)


@pytest.mark.parametrize("metric", ["l2", "ip"])
@pytest.mark.parametrize("temperature", [0.5, 3.0])
@pytest.mark.parametrize("k", [1, 5, 40])
def test_counts_weigh_entries(metric, temperature, k):
    """A pruned datastore's counts (He et al. 2021 Sec. 5.2): p ∝ sum_{i: v_i = w} c_i exp(s_i / T)."""
    rng = np.random.default_rng(3)
    keys = rng.normal(size=(30, 8))
    values = rng.integers(0, 6, size=30)
    counts = rng.integers(1, 5, size=30).astype(float)
    queries = rng.normal(size=(7, 8))
    ref = reference_knn(queries, keys, values, 10, k, metric, temperature, counts)
    sc, vals = topk_scores(queries, keys, values, k, metric)
    sim = -((queries[:, None] - keys[None]) ** 2).sum(-1) if metric == "l2" else queries @ keys.T
    order = np.argsort(-sim, axis=1, kind="stable")[:, :k]  # the rows topk_scores kept
    logc = np.log(counts[order])
    if k > len(keys):
        logc = np.concatenate([logc, np.full((len(queries), k - len(keys)), 123.0)], 1)  # garbage in empty slots
    logc = torch.tensor(logc)
    got = knn_distribution(sc, vals, 10, temperature, log_counts=logc).exp().numpy()
    np.testing.assert_allclose(got, ref, atol=1e-6)
    for target in range(10):
        lp = knn_target_logprob(sc, vals, torch.full((7,), target), temperature, log_counts=logc).numpy()
        with np.errstate(divide="ignore"):
            np.testing.assert_allclose(lp, np.log(ref[:, target]), atol=1e-6)
    # all counts 1 is the unweighted formula
    ones = knn_distribution(sc, vals, 10, temperature, log_counts=torch.zeros_like(sc))
    np.testing.assert_allclose(ones.exp().numpy(), knn_distribution(sc, vals, 10, temperature).exp().numpy())
    with pytest.raises(MemlmError, match="log_counts"):
        knn_distribution(sc, vals, 10, temperature, log_counts=logc[:1])


def test_repeated_values_are_summed():
    sc = torch.tensor([[0.0, 0.0, 0.0, 0.0]])
    vals = torch.tensor([[3, 3, 3, 1]])
    p = knn_target_logprob(sc, vals, torch.tensor([3])).exp().item()
    assert p == pytest.approx(0.75)


def test_interpolation_matches_linear_mixture():
    rng = np.random.default_rng(1)
    p_lm = rng.dirichlet(np.ones(5), size=4)
    p_knn = rng.dirichlet(np.ones(5), size=4)
    p_knn[0, 2] = 0.0  # a target the memory never retrieved
    for lam in (0.0, 0.25, 1.0):
        with np.errstate(divide="ignore"):
            got = mix([torch.tensor(np.log(p_lm)), torch.tensor(np.log(p_knn))], weights=[1 - lam, lam]).exp().numpy()
        np.testing.assert_allclose(got, (1 - lam) * p_lm + lam * p_knn, atol=1e-7)


def test_mix_every_broadcasting_form_against_the_paper_in_probability_space():
    """p = sum_j w_j p_j (Khandelwal et al. 2020 Eq. 2: p = λ p_kNN + (1 - λ) p_LM; Liu et al. 2024's ∞-gram; the
    learned mixture), in probability space with NumPy, against mix() for each weight form: constant, per token, per
    row of a distribution over the vocabulary, a grid of weightings. -inf inputs: a component with p = 0 adds nothing,
    a component of weight 0 adds nothing whatever it holds (NaN, -inf), and no mass at all gives -inf."""
    rng = np.random.default_rng(7)
    n, v = 6, 5
    p = rng.dirichlet(np.ones(v), size=(3, n))  # three components' distributions [3, N, V]
    p[1, 0, :] = 0.0  # memory 1 retrieved nothing at row 0: p = 0 everywhere
    p[1, 1, 2] = 0.0  # and gives value 2 probability 0 at row 1
    with np.errstate(divide="ignore"):
        lp = np.log(p)

    def t(x):
        return torch.from_numpy(np.asarray(x, dtype=np.float64))

    # constant weights per component
    w = np.array([0.6, 0.3, 0.1])
    want = np.einsum("j,jnv->nv", w, p)
    np.testing.assert_allclose(mix(list(t(lp)), weights=list(w)).exp().numpy(), want, rtol=1e-12, atol=1e-300)
    np.testing.assert_allclose(mix(t(lp), t(np.log(w))).exp().numpy(), want, rtol=1e-12)  # log space, [C, ...] tensor
    # per-token weights [N] on per-token log-probabilities [N] (the target's column)
    lam = rng.uniform(0, 1, n)
    lam[2], lam[3] = 0.0, 1.0
    wt = np.stack([(1 - lam) * 0.9, lam * 0.9, np.full(n, 0.1)])  # [3, N]
    with np.errstate(divide="ignore"):
        got = mix([t(lp[j, :, 2]) for j in range(3)], t(np.log(wt))).exp().numpy()
    np.testing.assert_allclose(got, (wt * p[:, :, 2]).sum(0), rtol=1e-12)
    # one weight row per context on distributions over the vocabulary: weights [N, 1] beside log p [N, V]
    got = mix([t(lp[j]) for j in range(3)], weights=[t(wt[j])[:, None] for j in range(3)]).exp().numpy()
    np.testing.assert_allclose(got, np.einsum("jn,jnv->nv", wt, p), rtol=1e-12)
    np.testing.assert_allclose(got.sum(-1)[2:], 1.0, rtol=1e-12)  # still a distribution where every p_j is one
    # a grid of G weightings [G, 1] beside log p [N]: [G, N] out
    grid = np.array([[1.0, 0.0, 0.0], [0.5, 0.5, 0.0], [0.2, 0.3, 0.5], [0.0, 1.0, 0.0]])  # [G, 3]
    got = mix([t(lp[j, :, 2]) for j in range(3)], weights=[t(grid[:, j])[:, None] for j in range(3)]).exp().numpy()
    assert got.shape == (len(grid), n)
    np.testing.assert_allclose(got, grid @ p[:, :, 2], rtol=1e-12)
    # -inf: weight 1 on a component with p = 0 gives -inf; weight 0 ignores NaN and -inf exactly
    only_mem = mix([t(lp[0]), t(lp[1])], weights=[0.0, 1.0])
    assert torch.isneginf(only_mem[0]).all() and only_mem[1, 2] == -np.inf
    garbage = t(lp[1]).clone()
    garbage[3] = float("nan")
    lm_only = mix([t(lp[0]), garbage], weights=[1.0, 0.0])
    assert torch.equal(lm_only, t(lp[0]))  # exactly the LM, bit for bit
    assert torch.isneginf(mix([t([-np.inf]), t([-np.inf])], weights=[0.5, 0.5])).all()
    # dtype: float32 in, float32 out (weights rounded to it); float64 when a component is float64
    lp32 = [torch.from_numpy(lp[j, :, 0]).float() for j in range(2)]
    assert mix(lp32, weights=[0.7, 0.3]).dtype == torch.float32
    assert mix([lp32[0], lp32[1].double()], weights=[0.7, 0.3]).dtype == torch.float64


def test_mix_posterior_is_bayes_rule():
    """r_j = w_j p_j / sum_i w_i p_i (EM's responsibilities, Dempster et al. 1977), with NumPy; P = 0 gives r = 0."""
    rng = np.random.default_rng(8)
    p = rng.dirichlet(np.ones(4), size=(3,))[:, :3].T  # [3 components, 3 tokens] of target probabilities
    p[2, 0] = 0.0
    w = np.array([[0.5], [0.5], [0.0]]) * np.ones((3, 3)) + np.array([[0.0], [-0.2], [0.2]])  # [C, N]
    with np.errstate(divide="ignore"):
        log_p, log_w = torch.from_numpy(np.log(p)), torch.from_numpy(np.log(w))
    total, post = mix_posterior(log_p, log_w)
    np.testing.assert_allclose(total.exp().numpy(), (w * p).sum(0), rtol=1e-12)
    np.testing.assert_allclose(post.exp().numpy(), w * p / (w * p).sum(0), rtol=1e-12)
    assert torch.equal(total, mix(log_p, log_w))  # the same numbers
    total, post = mix_posterior(torch.tensor([[-np.inf], [-np.inf]]), torch.tensor([[0.0], [-np.inf]]))
    assert total.item() == -np.inf and torch.isneginf(post).all()


def test_mixture_of_three_and_bad_weights():
    lps = [torch.log(torch.tensor(p)) for p in ([0.2, 0.8], [0.5, 0.5], [1.0, 0.0])]
    got = mix(lps, weights=[0.5, 0.3, 0.2]).exp()
    np.testing.assert_allclose(got.numpy(), [0.5 * 0.2 + 0.3 * 0.5 + 0.2, 0.5 * 0.8 + 0.3 * 0.5], atol=1e-7)
    with pytest.raises(MemlmError, match="sum to 1"):
        mix(lps, weights=[0.5, 0.5, 0.5])
    with pytest.raises(MemlmError, match="sum to 1"):  # probability-space weights passed as log-weights
        mix(lps, [0.5, 0.3, 0.2])
    with pytest.raises(MemlmError, match="once"):
        mix(lps, [0.0, -np.inf, -np.inf], weights=[1.0, 0.0, 0.0])
    with pytest.raises(MemlmError, match="one weight per component"):
        mix(lps, weights=[0.5, 0.5])


def test_empty_row_has_no_mass_and_bad_inputs():
    sc = torch.tensor([[-np.inf, -np.inf]])
    vals = torch.tensor([[-1, -1]])
    assert knn_target_logprob(sc, vals, torch.tensor([0])).item() == -np.inf
    with pytest.raises(MemlmError):
        knn_target_logprob(sc, vals, torch.tensor([0]), temperature=0)
    with pytest.raises(MemlmError, match="tokenizer"):
        knn_distribution(torch.zeros(1, 2), torch.tensor([[0, 99]]), vocab_size=10)


def test_distribution_of_no_retrieved_entry_is_all_minus_inf():
    from memlm.core.distribution import value_logsumexp

    empty = torch.zeros(2, 0)
    assert torch.equal(value_logsumexp(empty, torch.zeros(2, 0, dtype=torch.long), 5), torch.full((2, 5), -np.inf))
    assert torch.isneginf(knn_distribution(empty, torch.zeros(2, 0, dtype=torch.long), 5)).all()


def test_perplexity_beyond_float64_is_inf_and_written_null():
    """A mean log-probability below -log(float64 max) ~ -709.78 used to raise OverflowError.

    Reached with λ = 1 at a small τ: the target is retrieved (so p_kNN > 0) but 10 score units behind the best entry,
    so at τ = 0.01 its log-probability is about -1000. The perplexity is then inf, which result files write as null.
    """
    from memlm.core.distribution import perplexity
    from memlm.io.fileio import dumps_json

    scores = torch.tensor([[0.0, -10.0]] * 3)
    values = torch.tensor([[1, 0]] * 3)
    lp = knn_target_logprob(scores, values, torch.tensor([0, 0, 0]), temperature=0.01)
    assert torch.isfinite(lp).all() and (lp < -709.8).all()
    assert perplexity(mix([torch.full((3,), -2.0), lp], weights=[0.0, 1.0])) == float("inf")
    assert perplexity(torch.tensor([-709.0])) == pytest.approx(np.exp(709.0))  # still finite just inside the range
    assert perplexity(torch.tensor([])) != perplexity(torch.tensor([]))  # nan for no tokens
    assert '"knn_ppl": null' in dumps_json({"knn_ppl": perplexity(lp)})


def test_value_logsumexp_gradient_of_a_value_with_no_finite_mass_is_zero_not_nan():
    """A -inf entry (probability 0) whose value has no finite entry gave a NaN gradient.

    Reference from the definition: d/dx_i log sum_{j: v_j = v} exp(x_j) = softmax within value v; an entry that carries
    no mass (-inf) gets gradient 0, whatever its value; the function itself stays -inf for such a value.
    """
    from memlm.core.distribution import value_logsumexp

    ninf = float("-inf")
    logw = torch.tensor([[0.5, ninf, 1.0, -0.3], [ninf, ninf, 2.0, 0.1]], dtype=torch.float64, requires_grad=True)
    values = torch.tensor([[0, 1, 0, 2], [1, 1, 0, 2]])
    out = value_logsumexp(logw, values, 3)
    assert torch.isneginf(out[:, 1]).all()  # value 1 has no finite entry in either row
    out[torch.isfinite(out)].sum().backward()
    grad = logw.grad.numpy()
    assert np.isfinite(grad).all()
    x = logw.detach().numpy()
    want = np.zeros_like(x)
    for r in range(2):
        for v in range(3):
            m = (values[r].numpy() == v) & np.isfinite(x[r])
            if m.any():
                want[r, m] = np.exp(x[r, m]) / np.exp(x[r, m]).sum()
    np.testing.assert_allclose(grad, want, atol=1e-12)
    # and through knn_distribution (Eq. 2) with a -inf score (a padded / skipped neighbour)
    sc = torch.tensor([[0.2, ninf, -1.0]], requires_grad=True)
    d = knn_distribution(sc, torch.tensor([[3, 1, 3]]), vocab_size=5, temperature=0.5)
    d[torch.isfinite(d)].sum().backward()
    assert torch.isfinite(sc.grad).all() and sc.grad[0, 1] == 0


def test_mix_per_token_weights_against_numpy_and_bad_weights():
    """log sum_j w_j(t) p_j(t) (Eq. 3 / Khandelwal et al. Table 1 with per-token weights); weight 0 ignores garbage."""
    rng = np.random.default_rng(0)
    p = rng.dirichlet(np.ones(3), size=6).T  # three components' target probabilities at 6 tokens
    lam = np.array([0.0, 0.2, 0.5, 0.7, 0.9, 0.0])
    w = [1 - lam - 0.1, lam, np.full(6, 0.1)]
    w[0][-1], w[1][-1] = 0.9, 0.0
    lps = [torch.from_numpy(np.log(x)) for x in p]
    lps[1][0] = float("nan")  # a skipped token's p_kNN: weight 0 there
    got = mix(lps, weights=[torch.from_numpy(w[0]), torch.from_numpy(w[1]), 0.1])
    want = np.log(w[0] * p[0] + np.where(lam > 0, w[1] * p[1], 0) + 0.1 * p[2])
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-12)
    with pytest.raises(MemlmError, match="sum to 1"):
        mix(lps, weights=[torch.from_numpy(1 - lam), torch.from_numpy(lam), 0.1])


def test_mix_grid_of_weights_against_numpy_and_bad_weights():
    """log sum_j w_j[g] p_j for every weighting g of a grid (the ∞-gram weight's tuning grid, Liu et al. 2024, beside
    Eq. 3's λ): NumPy's mixture per row; a weight of 0 ignores -inf and nan; weights off the simplex are refused."""
    rng = np.random.default_rng(3)
    p = rng.dirichlet(np.ones(3), size=7).T  # three components' target probabilities at 7 tokens
    ws = np.array([0.0, 0.01, 0.2, 0.5, 0.8])  # the swept weight of the second component; the third keeps 0.1
    rows = [list(0.9 - ws), list(ws), [0.1] * len(ws)]
    lps = [torch.from_numpy(np.log(x)) for x in p]
    lps[1][0], lps[1][1] = float("-inf"), float("nan")  # a target P∞ never saw, a garbage entry: weight 0 at g = 0
    got = mix(lps, weights=[torch.tensor(r, dtype=torch.float64)[:, None] for r in rows]).numpy()
    assert got.shape == (len(ws), 7)
    for g, w in enumerate(ws):
        second = np.where(w > 0, w * p[1], 0.0)
        second[0] = 0.0  # log p = -inf: no mass at any weight
        second[1] = 0.0 if w == 0 else np.nan  # garbage: ignored at weight 0, nan once weighted
        want = np.log((0.9 - w) * p[0] + second + 0.1 * p[2])
        np.testing.assert_allclose(got[g], want, rtol=1e-12)
        np.testing.assert_allclose(got[g][2:], mix(lps, weights=[0.9 - w, w, 0.1]).numpy()[2:], rtol=1e-12)
    with pytest.raises(MemlmError, match="sum to 1"):
        mix(lps, weights=[torch.tensor(1 - ws)[:, None], torch.tensor(ws)[:, None], 0.1])
    with pytest.raises(MemlmError, match="sum to 1"):
        mix(lps, weights=[torch.tensor([1.2]), torch.tensor([-0.2]), torch.tensor([0.0])])


def test_joint_distribution_against_numpy():
    """TRIME Eq. 5 as a full distribution: (exp(E_w f) + sum_{x_j = w} exp(s_j / τ)) / Z over the vocabulary."""
    from memlm.core.distribution import joint_distribution, value_logsumexp

    rng = np.random.default_rng(1)
    logits, s, v = rng.normal(size=(2, 5)), rng.normal(size=(2, 4)), np.array([[0, 3, 3, -1], [1, 1, 1, 1]])
    num = np.exp(logits) + np.stack([np.bincount(v[r][v[r] >= 0], np.exp(s[r] / 0.5)[v[r] >= 0], 5) for r in range(2)])
    want = np.log(num / num.sum(1, keepdims=True))
    mass = value_logsumexp(torch.from_numpy(s) / 0.5, torch.from_numpy(v), 5)
    np.testing.assert_allclose(joint_distribution(torch.from_numpy(logits), [mass]).numpy(), want, rtol=1e-12)
    np.testing.assert_allclose(joint_distribution(torch.from_numpy(logits), []).numpy(),
                               torch.log_softmax(torch.from_numpy(logits), -1).numpy(), rtol=1e-12)  # fmt: skip
