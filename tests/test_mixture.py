"""The learned mixture (memlm.core.mixture) against brute-force NumPy transcriptions of its equations:

    P_t = sum_i λ_ti p_ti,   λ_t = softmax(W z_t + b)  (row 0 = 0),   EM: λ_i = mean_t λ_i p_ti / P_t

and the special cases that memlm computes today by other roads (Khandelwal's λ, the cache's weight, infini-gram's
λ_sparse / λ_dense)."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import torch

from memlm.core.distribution import log_weights_from_logits, mix, mix_posterior, perplexity
from memlm.core.mixture import (
    FitOptions,
    Mixture,
    MixtureFit,
    fit_constant,
    fit_guarded,
    gate_objective,
    kept_apart,
    rule_mixture,
    sparse_state_features,
)
from memlm.errors import MemlmError
from memlm.knnlm.cache import CacheComponent
from memlm.knnlm.evaluate import perplexities
from memlm.knnlm.table import TokenTable
from memlm.mixing.datastore import DatastoreComponent
from memlm.mixing.dump import rule_logprob
from memlm.mixing.inputs import mixture_inputs
from memlm.ngram.step import NgramComponent

# ------------------------------------------------------------------------------------------------ NumPy references


def np_loglik(lam: np.ndarray, logp: np.ndarray) -> np.ndarray:
    """Mean log-likelihood of constant weights: mean_t log sum_i λ_i p_ti, for λ [C] or a grid [G, C]."""
    with np.errstate(divide="ignore"):  # a grid point with λ_LM = 0 gives some token probability 0
        return np.log(np.exp(logp) @ np.atleast_2d(lam).T).mean(0)


def np_gate_nll(W: np.ndarray, b: np.ndarray, logp: np.ndarray, z: np.ndarray, l2: float) -> float:
    """-mean_t log sum_i softmax(W z_t + b)_i p_ti + l2/2 ||W||^2."""
    a = z @ W.T + b
    lam = np.exp(a - a.max(1, keepdims=True))
    lam /= lam.sum(1, keepdims=True)
    return float(-np.log((lam * np.exp(logp)).sum(1)).mean() + 0.5 * l2 * (W**2).sum())


def random_logp(rng, n: int, c: int, zero_share: float = 0.3) -> np.ndarray:
    """An LM column that is finite everywhere and memory columns with some zeros (-inf)."""
    logp = np.log(rng.uniform(1e-3, 1.0, (n, c)))
    logp[:, 1:][rng.random((n, c - 1)) < zero_share] = -np.inf
    return logp


# -------------------------------------------------------------------------------------- core.distribution additions


def test_log_weights_and_posterior_match_numpy():
    rng = np.random.default_rng(0)
    a = rng.normal(size=(50, 4)) * 3
    ref = a - np.log(np.exp(a).sum(1, keepdims=True))
    assert np.allclose(log_weights_from_logits(torch.from_numpy(a)).numpy(), ref, atol=1e-12)
    logp = random_logp(rng, 50, 4)
    log_w = ref.copy()
    log_w[:5, 2] = -np.inf  # weight 0: left out whatever p holds, even NaN
    log_w[:5] -= np.log(np.exp(log_w[:5]).sum(1, keepdims=True))  # the other weights renormalised to sum to 1
    logp_nan = logp.copy()
    logp_nan[:5, 2] = np.nan
    total, post = mix_posterior(torch.from_numpy(logp_nan).T, torch.from_numpy(log_w).T)
    post = post.T
    w = np.exp(log_w)
    p = np.exp(logp)
    p[:5, 2] = 0.0
    P = (w * p).sum(1)
    assert np.allclose(total.numpy(), np.log(P), atol=1e-12)
    with np.errstate(divide="ignore"):
        assert np.allclose(post.exp().numpy(), w * p / P[:, None], atol=1e-12)
    # a token where every weighted component gives 0: P = 0, no posterior mass, no NaN
    total, post = mix_posterior(torch.tensor([[-np.inf], [-np.inf]]), torch.tensor([[0.0], [-np.inf]]))
    assert total.item() == -np.inf and torch.isneginf(post).all()


# ------------------------------------------------------------------------------------------------------------ EM


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_em_fixed_point_is_the_grid_maximum_two_components(seed):
    rng = np.random.default_rng(seed)
    logp = random_logp(rng, 400, 2)
    lam, iters, converged = fit_constant(logp, tol=1e-13)
    assert converged and np.isclose(lam.sum(), 1.0)
    grid = np.linspace(0.0, 1.0, 20_001)
    ll = np_loglik(np.stack([1 - grid, grid], 1), logp)
    em = np_loglik(lam, logp)[0]
    assert em >= ll.max() - 1e-12  # EM is the maximum: no grid point beats it
    assert abs(lam[1] - grid[ll.argmax()]) <= 2 * (grid[1] - grid[0]) + 1e-9


@pytest.mark.parametrize("seed", [0, 1])
def test_em_fixed_point_is_the_grid_maximum_three_components(seed):
    rng = np.random.default_rng(10 + seed)
    logp = random_logp(rng, 300, 3)
    lam, _, converged = fit_constant(logp, tol=1e-13)
    assert converged
    step = 1 / 300
    pts = np.array([(i, j, 300 - i - j) for i in range(301) for j in range(301 - i)], dtype=float) * step
    ll = np_loglik(pts, logp)
    em = np_loglik(lam, logp)[0]
    assert em >= ll.max() - 1e-12
    assert np.abs(lam - pts[ll.argmax()]).max() <= 3 * step


def test_em_finds_a_weight_of_zero_for_a_memory_that_never_helps():
    """Boundary optimum: a memory whose p is a fixed fraction of the LM's can only lower the likelihood (λ = 0)."""
    rng = np.random.default_rng(3)
    lm = np.log(rng.uniform(0.1, 1.0, 500))
    lam, _, converged = fit_constant(np.stack([lm, lm + np.log(0.5)], 1), tol=1e-12)
    assert converged and lam[1] < 1e-9


# ------------------------------------------------------------------------------------------------------ the gate


@pytest.mark.parametrize("c,f", [(2, 1), (3, 4)])
def test_gate_gradient_matches_central_differences(c, f):
    rng = np.random.default_rng(c * 10 + f)
    n, l2 = 200, 0.05
    logp = random_logp(rng, n, c)
    z = rng.normal(size=(n, f))
    theta = rng.normal(size=(c - 1) * (f + 1))

    def unpack(t):
        W = np.vstack([np.zeros(f), t[: (c - 1) * f].reshape(c - 1, f)])
        return W, np.concatenate([[0.0], t[(c - 1) * f :]])

    value, grad = gate_objective(torch.from_numpy(theta), torch.from_numpy(logp), torch.from_numpy(z), l2)
    assert np.isclose(float(value), np_gate_nll(*unpack(theta), logp, z, l2), rtol=1e-12)
    h = 1e-6
    fd = np.array([(np_gate_nll(*unpack(theta + h * e), logp, z, l2) - np_gate_nll(*unpack(theta - h * e), logp, z, l2))
                   / (2 * h) for e in np.eye(len(theta))])  # fmt: skip
    assert np.allclose(grad.numpy(), fd, rtol=1e-6, atol=1e-8)


def test_a_gate_with_w_zero_is_the_constant_mixture():
    rng = np.random.default_rng(4)
    logp = random_logp(rng, 100, 3)
    feats = rng.normal(size=(100, 2))
    const = Mixture.constant(("lm", "a", "b"), [0.5, 0.3, 0.2], ("x", "y"))
    gate = Mixture(("lm", "a", "b"), ("x", "y"), np.zeros((3, 2)), const.b, feats.mean(0), feats.std(0), "gate")
    ref = np.log(np.exp(logp) @ np.array([0.5, 0.3, 0.2]))
    assert np.allclose(gate.logprob(logp, feats).numpy(), ref, atol=1e-12)
    assert np.allclose(const.logprob(logp, feats).numpy(), ref, atol=1e-12)


# ------------------------------------------------------------------------------------- today's formulas reproduced


def synthetic_dump(seed: int = 0, n: int = 300, vocab: int = 12, k: int = 8, refs: int = 1) -> TokenTable:
    """A dump with every memory memlm scores: kNN neighbours, the cache, ∞-gram references."""
    rng = np.random.default_rng(seed)
    targets = rng.integers(0, vocab, n)
    lm = np.log(rng.dirichlet(np.ones(vocab), n))
    knn_scores = -np.sort(rng.uniform(0, 10, (n, k)), 1).astype(np.float32)
    knn_values = rng.integers(0, vocab, (n, k)).astype(np.int32)
    knn_values[:5, 3:] = -1  # fewer than k neighbours
    knn_scores[:5, 3:] = -np.inf
    cache_scores = -np.sort(rng.uniform(0, 5, (n, k)), 1).astype(np.float32)
    cache_values = rng.integers(0, vocab, (n, k))
    cache_values[::50] = -1  # a document's first token: an empty cache
    cache_scores[::50] = -np.inf
    ng = {"logprob": [], "n": [], "count": [], "sparse": []}
    for _ in range(refs):
        sparse = rng.random(n) < 0.4
        p = np.where(sparse, np.where(rng.random(n) < 0.6, 1.0, 0.0), rng.uniform(0, 1, n) * (rng.random(n) < 0.7))
        with np.errstate(divide="ignore"):
            ng["logprob"].append(np.log(p).astype(np.float32))
        ng["n"].append(rng.integers(1, 20, n).astype(np.int32))
        ng["count"].append(rng.integers(1, 1000, n))
        ng["sparse"].append(sparse)
    table = TokenTable(
        targets=targets.astype(np.int64),
        lm_logprob=lm[np.arange(n), targets].astype(np.float32),
        doc_index=(np.arange(n) // 50).astype(np.int32),
        lm_entropy=(-(np.exp(lm) * lm).sum(1)).astype(np.float32),
        lm_max_logprob=lm.max(1).astype(np.float32),
    )
    table.add(DatastoreComponent(None, k), {"scores": knn_scores, "values": knn_values})
    for r in range(refs):
        table.add(NgramComponent(None), {f: v[r] for f, v in ng.items()})
    table.add(CacheComponent(), {"scores": cache_scores, "values": cache_values})
    return table


def test_constant_mixture_is_khandelwals_interpolation():
    ts = synthetic_dump(1).select(["knn"])
    lam, tau = 0.3, 2.0
    inp = mixture_inputs(ts, temperature=tau)
    assert inp.components == ("lm", "knn")
    mixture = Mixture.constant(inp.components, [1 - lam, lam], inp.feature_names)
    got = mixture.logprob(inp.logprobs, inp.features)
    lm, knn = torch.from_numpy(inp.logprobs[:, 0]), torch.from_numpy(inp.logprobs[:, 1])
    assert torch.allclose(got, mix([lm, knn], weights=[1 - lam, lam]), rtol=0, atol=1e-12)
    assert np.isclose(perplexity(got), perplexities(ts, lam=lam, temperature=tau)["knn_ppl"], rtol=1e-6)


def test_constant_mixture_is_the_kNN_plus_cache_mixture():
    ts = synthetic_dump(2)
    ts = ts.select(["knn", "cache"])
    lam, tau, lam_c, tau_c = 0.25, 3.0, 0.1, 0.5
    inp = mixture_inputs(ts, temperature=tau, cache_temperature=tau_c)
    assert inp.components == ("lm", "knn", "cache")
    got = Mixture.constant(inp.components, [1 - lam - lam_c, lam, lam_c], inp.feature_names).logprob(
        inp.logprobs, inp.features
    )
    cols = [torch.from_numpy(inp.logprobs[:, i]) for i in range(3)]
    assert torch.allclose(got, mix(cols, weights=[1 - lam - lam_c, lam, lam_c]), rtol=0, atol=1e-12)
    today = perplexities(ts, lam=lam, temperature=tau, cache_lambda=lam_c, cache_temperature=tau_c)["knn_cache_ppl"]
    assert np.isclose(perplexity(got), today, rtol=1e-6)


def sparse_flag_gate(components, feature_names, w_sparse, w_dense) -> Mixture:
    """A gate on the sparse flag alone giving weights ``w_sparse`` where the flag is 1, ``w_dense`` where it is 0:
    with raw features (mean 0, std 1), a_i = W_i s + b_i and a_i - a_0 = log(w_i / w_0), so b_i = log(w_dense,i /
    w_dense,0) and W_i = log(w_sparse,i / w_sparse,0) - b_i."""
    f = len(feature_names)
    col = feature_names.index("ngram_sparse")
    b = np.log(np.asarray(w_dense)) - np.log(w_dense[0])
    W = np.zeros((len(components), f))
    W[:, col] = np.log(np.asarray(w_sparse)) - np.log(w_sparse[0]) - b
    return Mixture(components, feature_names, W, b, np.zeros(f), np.ones(f), "gate")


def test_a_gate_on_the_sparse_flag_is_infinigrams_two_lambdas():
    ts = synthetic_dump(3).select(["ngram"])
    ls, ld = 0.6, 0.07
    inp = mixture_inputs(ts)
    assert inp.components == ("lm", "ngram")
    mix = sparse_flag_gate(inp.components, inp.feature_names, [1 - ls, ls], [1 - ld, ld])
    got = mix.logprob(inp.logprobs, inp.features)
    lam_inf = np.where(ts.columns["ngram"]["sparse"], ls, ld)  # Liu et al. 2024, Sec. 5, in NumPy
    want = np.log((1 - lam_inf) * np.exp(inp.logprobs[:, 0]) + lam_inf * np.exp(inp.logprobs[:, 1]))
    assert np.allclose(got.numpy(), want, rtol=0, atol=1e-12)
    lam = mix.log_weights(inp.features).exp()[:, 1].numpy()
    assert np.allclose(lam, np.where(ts.columns["ngram"]["sparse"], ls, ld), rtol=0, atol=1e-15)
    assert np.isclose(perplexity(got), perplexity(rule_logprob(ts, {"ngram": (ls, ld)})), rtol=1e-6)


def test_a_gate_on_the_sparse_flag_is_the_three_way_kNN_and_ngram_mixture():
    ts = synthetic_dump(4).select(["knn", "ngram"])
    lam, tau, ls, ld = 0.2, 2.0, 0.5, 0.05
    inp = mixture_inputs(ts, temperature=tau)
    assert inp.components == ("lm", "knn", "ngram")
    mix = sparse_flag_gate(inp.components, inp.feature_names, [1 - lam - ls, lam, ls], [1 - lam - ld, lam, ld])
    got = mix.logprob(inp.logprobs, inp.features)
    p = np.exp(inp.logprobs)  # lm, knn, ngram
    lam_inf = np.where(ts.columns["ngram"]["sparse"], ls, ld)  # (1 - λ - λ∞) p_LM + λ p_kNN + λ∞ P∞, in NumPy
    want = np.log((1 - lam - lam_inf) * p[:, 0] + lam * p[:, 1] + lam_inf * p[:, 2])
    assert np.allclose(got.numpy(), want, rtol=0, atol=1e-12)
    today = perplexity(rule_logprob(ts, {"knn": lam, "ngram": (ls, ld)}, tau))
    assert np.isclose(perplexity(got), today, rtol=1e-6)


# --------------------------------------------------------------------------------------------------- the features


def test_mixture_inputs_features_match_numpy():
    ts = synthetic_dump(5, refs=2)
    tau, k = 2.5, 6
    inp = mixture_inputs(ts, temperature=tau, k=k, cache_temperature=0.5)
    assert inp.components == ("lm", "knn", "ngram", "ngram2", "cache")
    col = {name: inp.features[:, i] for i, name in enumerate(inp.feature_names)}
    s, v = ts.columns["knn"]["scores"][:, :k].astype(np.float64), ts.columns["knn"]["values"][:, :k]
    valid = v >= 0
    e = np.where(valid, np.exp(s / tau), 0.0)
    assert np.allclose(col["knn_top_score"], s[:, 0])
    assert np.allclose(col["knn_logsumexp"], np.log(e.sum(1)), rtol=1e-6, atol=1e-6)  # float32 scores
    assert np.allclose(col["knn_top_value_share"], (e * (v == v[:, :1])).sum(1) / e.sum(1), rtol=1e-6, atol=1e-6)
    hit = (e * (v == ts.targets[:, None])).sum(1) / e.sum(1)
    with np.errstate(divide="ignore"):
        assert np.allclose(inp.logprobs[:, 1], np.log(hit), atol=1e-6)
        assert np.array_equal(np.isinf(inp.logprobs[:, 1]), hit == 0)
    assert np.array_equal(col["ngram_sparse"], ts.columns["ngram"]["sparse"].astype(float))
    assert np.allclose(col["ngram_log_n"], np.log(1 + ts.columns["ngram"]["n"]))
    assert np.allclose(col["ngram2_log_count"], np.log(1 + ts.columns["ngram2"]["count"]))
    assert np.array_equal(inp.logprobs[:, 3], ts.columns["ngram2"]["logprob"].astype(np.float64))
    empty = ts.columns["cache"]["values"][:, 0] < 0
    assert np.array_equal(col["cache_empty"], empty.astype(float))
    assert np.allclose(col["cache_top_score"], np.where(empty, 0.0, ts.columns["cache"]["scores"][:, 0]))
    assert np.isfinite(inp.features).all()
    assert np.isneginf(inp.logprobs[empty, 4]).all()


# ------------------------------------------------------------------------------------------------ the guarded fit


def gate_world(seed: int, n: int, docs: int, informative: bool = True, spurious: int = 0):
    """Two components; the memory is right (p = 0.9) where the feature is > 0 and nearly useless elsewhere."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=n)
    lm = np.log(rng.uniform(0.05, 0.6, n))
    good = x > 0 if informative else rng.random(n) < 0.5
    mem = np.where(good, np.log(0.9), np.log(rng.uniform(1e-4, 1e-2, n)))
    feats = np.column_stack([x, rng.normal(size=(n, spurious))]) if spurious else x[:, None]
    names = ("x", *(f"noise{i}" for i in range(spurious)))
    return np.stack([lm, mem], 1), feats, np.repeat(np.arange(docs), n // docs), names


def test_the_guard_picks_the_gate_when_a_feature_tells_the_components_apart():
    logp, feats, doc, names = gate_world(0, 6000, 30)
    fit = fit_guarded(logp, feats, doc, ("lm", "mem"), names)
    h = fit.heldout_loglik
    assert fit.form == "gate" and h["gate"] > h["constant"] > h["lm"]
    assert fit.tokens == 6000 and fit.kept_tokens == 8 * 200 and fit.fit_tokens == 22 * 200 and not fit.warnings
    assert fit.split == "documents" and fit.mixture.W[1, 0] > 1  # more weight on the memory where x > 0


def test_the_guard_falls_back_when_the_gate_overfits_a_tiny_slice():
    """120 tokens, 30 spurious features and almost no L2: the gate fits noise on the fit part and loses on the kept
    part, so the constant mixture (or the LM) is kept."""
    for seed in range(5):
        logp, feats, doc, names = gate_world(seed, 120, 12, informative=False, spurious=30)
        fit = fit_guarded(logp, feats[:, 1:], doc, ("lm", "mem"), names[1:], FitOptions(l2=1e-8))
        assert fit.form != "gate", fit.heldout_loglik
        assert fit.heldout_loglik["gate"] < fit.heldout_loglik["constant"]
        assert fit.warnings and "120 tokens" in fit.warnings[0]


def test_the_guard_falls_back_to_the_lm_on_an_unrepresentative_slice():
    """The memory helps on the documents fitted and gives the target 0 on the kept ones: the LM alone is kept."""
    rng = np.random.default_rng(7)
    n, docs = 4000, 20
    doc = np.repeat(np.arange(docs), n // docs)
    lm = np.log(rng.uniform(0.05, 0.6, n))
    mem = np.where(doc < 15, np.log(0.9), -np.inf)
    fit = fit_guarded(np.stack([lm, mem], 1), rng.normal(size=(n, 2)), doc, ("lm", "mem"), ("a", "b"))
    assert fit.form == "lm" and fit.heldout_loglik["constant"] < fit.heldout_loglik["lm"]
    assert np.allclose(fit.mixture.logprob(np.stack([lm, mem], 1), np.zeros((n, 2))).numpy(), lm)


@pytest.mark.parametrize("seed", range(8))
def test_the_chosen_form_never_loses_to_the_lm_on_the_kept_part(seed):
    rng = np.random.default_rng(100 + seed)
    n = int(rng.integers(50, 2000))
    logp = random_logp(rng, n, 3, zero_share=float(rng.uniform(0.1, 0.95)))
    feats = rng.normal(size=(n, 3))
    doc = np.sort(rng.integers(0, int(rng.integers(1, 30)), n))
    fit = fit_guarded(logp, feats, doc, ("lm", "a", "b"), ("f1", "f2", "f3"), FitOptions(l2=1e-6))
    h = fit.heldout_loglik
    expected = "lm"
    if h["constant"] > h["lm"]:
        expected = "gate" if h["gate"] > h["constant"] else "constant"
    assert fit.form == expected and h[fit.form] >= h["lm"]
    ll = fit.mixture.logprob(logp, feats).mean().item()
    assert ll >= logp[:, 0].mean() - 1e-9  # refitted on the whole slice by maximum likelihood: never below the LM


def test_kept_apart_takes_the_last_documents_or_the_last_tokens():
    doc = np.repeat(np.arange(8), 10)
    mask, how = kept_apart(doc, 0.25)
    assert how == "documents" and np.array_equal(mask, doc >= 6)
    mask, how = kept_apart(np.zeros(20, int), 0.25)
    assert how == "tokens" and np.array_equal(mask, np.arange(20) >= 15)


def test_a_small_slice_warns_in_the_result_and_the_log(caplog):
    logp, feats, doc, names = gate_world(1, 900, 1)
    with caplog.at_level(logging.WARNING, logger="memlm.core.mixture"):
        fit = fit_guarded(logp, feats, doc, ("lm", "mem"), names)
    assert fit.split == "tokens" and fit.tokens == 900 and fit.documents == 1
    assert len(fit.warnings) == 1 and "900 tokens (fewer than 4,096) and 1 documents (fewer than 8)" in fit.warnings[0]
    assert fit.warnings[0] in caplog.text


def test_fit_and_mixture_round_trip_through_json():
    logp, feats, doc, names = gate_world(2, 2000, 10)
    fit = fit_guarded(logp, feats, doc, ("lm", "mem"), names)
    again = MixtureFit.from_dict(json.loads(json.dumps(fit.to_dict())))
    assert again.to_dict() == fit.to_dict()
    assert torch.equal(again.mixture.logprob(logp, feats), fit.mixture.logprob(logp, feats))
    lm_only = Mixture.constant(("lm", "mem"), [1.0, 0.0], ("x",))
    back = Mixture.from_dict(json.loads(json.dumps(lm_only.to_dict())))
    assert back.form == "lm" and back.to_dict()["b"] == [0.0, None]
    assert torch.equal(back.logprob(logp, feats), torch.from_numpy(logp[:, 0]))


# ------------------------------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    "change,match",
    [
        (lambda lp, f, d: (lp[:, :1], f, d), r"logprobs must be \[tokens, 2\]"),
        (lambda lp, f, d: (lp, f[:, :0], d), r"features must be \[tokens, 1\]"),
        (lambda lp, f, d: (lp[:0], f[:0], d[:0]), "no tokens"),
        (lambda lp, f, d: (np.where(np.arange(len(lp))[:, None] == 3, np.nan, lp), f, d), "NaN"),
        (lambda lp, f, d: (lp, np.where(np.arange(len(f))[:, None] == 3, np.inf, f), d), "features hold NaN or inf"),
        (lambda lp, f, d: (np.column_stack([lp[:, 0], np.full(len(lp), -np.inf)]), f, d), "'mem' gives every token"),
        (lambda lp, f, d: (np.column_stack([np.full(len(lp), -np.inf), lp[:, 1]]), f, d), "the LM must be finite"),
        (lambda lp, f, d: (lp + 1.0, f, d), "log-probabilities"),
        (lambda lp, f, d: (lp, f, d[:-1]), "doc_index must give one document per token"),
    ],
)
def test_bad_input_is_one_clear_error(change, match):
    logp, feats, doc, names = gate_world(3, 100, 5)
    lp, f, d = change(logp, feats, doc)
    with pytest.raises(MemlmError, match=match):
        fit_guarded(lp, f, d, ("lm", "mem"), names)


def test_bad_mixtures_are_refused():
    with pytest.raises(MemlmError, match="summing to 1"):
        Mixture.constant(("lm", "a"), [0.5, 0.6])
    with pytest.raises(MemlmError, match="LM's weight"):
        Mixture.constant(("lm", "a"), [0.0, 1.0])
    with pytest.raises(MemlmError, match="row 0"):
        Mixture(("lm", "a"), ("x",), np.ones((2, 1)), np.zeros(2), np.zeros(1), np.ones(1))
    with pytest.raises(MemlmError, match="not a stored mixture"):
        Mixture.from_dict({"form": "gate"})
    with pytest.raises(MemlmError, match="features must be finite"):
        Mixture.constant(("lm", "a"), [0.5, 0.5], ("x",)).log_weights(np.zeros((3, 2)))


# ----------------------------------------------------------------- the fixed-weight rule as a Mixture, mixed by name


def np_rule(lm, memories, fixed, pairs):
    """Liu et al. (2024, Sec. 5) with a kNN term (Khandelwal et al. Eq. 3) and several references, per token, in
    plain NumPy: P = (1 - Λ - Σ_r λ_r(c)) p_LM + Σ_j λ_j p_j + Σ_r λ_r(c) P∞_r, λ_r(c) = λ_sparse,r if sparse_r."""
    p = np.exp(lm)
    w_lm = 1.0 - sum(fixed.values())
    out = 0.0
    for name, w in fixed.items():
        out = out + w * np.exp(memories[name][0])
    for name, (ls, ld) in pairs.items():
        logp, sparse = memories[name]
        lam = np.where(sparse, ls, ld)
        w_lm = w_lm - lam
        out = out + lam * np.exp(logp)
    with np.errstate(divide="ignore"):
        return np.log(w_lm * p + out)


@pytest.mark.parametrize("refs", [1, 2, 3])
def test_rule_mixture_is_the_papers_rule_for_any_number_of_references(refs):
    rng = np.random.default_rng(refs)
    n = 400
    logp = random_logp(rng, n, 2 + refs)
    names = ["ngram"] + [f"ngram{r + 1}" for r in range(1, refs)]
    comps = ("lm", "knn", *names)
    flags = {c: rng.random(n) < 0.4 for c in names}
    pairs = {c: (float(rng.uniform(0.05, 0.3)), float(rng.uniform(0, 0.1))) for c in names}
    pairs[names[0]] = (0.4, 0.0)  # a weight 0 in the dense state only
    fixed = {"knn": 0.15}
    mix = rule_mixture(comps, {**fixed, **pairs})
    assert mix.form == "rule"
    by_name = {c: torch.from_numpy(logp[:, i]) for i, c in enumerate(comps)}
    got = mix.mix(by_name, sparse_state_features(flags)).numpy()
    want = np_rule(logp[:, 0], {c: (logp[:, i], flags.get(c)) for i, c in enumerate(comps)}, fixed, pairs)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)
    # the order the memories come in does not matter: they are mixed by name
    shuffled = dict(reversed(list(by_name.items())))
    np.testing.assert_allclose(mix.mix(shuffled, sparse_state_features(flags)).numpy(), got, rtol=0, atol=0)


def test_rule_mixture_scales_weights_calibrated_apart_so_the_lm_keeps_its_share():
    # Λ = 0.3, S = 0.8 + 0.4 > 0.7: both pairs scaled by (1 - 0.3) * 0.8 / 1.2
    mix = rule_mixture(("lm", "knn", "ngram", "ngram2"), {"knn": 0.3, "ngram": (0.8, 0.1), "ngram2": (0.4, 0.2)})
    flags = {"ngram": np.array([1, 1, 0, 0], bool), "ngram2": np.array([1, 0, 1, 0], bool)}
    lam = mix.log_weights(mix.features_of(sparse_state_features(flags), 4)).exp().numpy()
    s = 0.7 * 0.8 / 1.2
    want_ng = np.array([0.8, 0.8, 0.1, 0.1]) * s
    want_ng2 = np.array([0.4, 0.2, 0.4, 0.2]) * s
    np.testing.assert_allclose(lam[:, 2], want_ng, atol=1e-15)
    np.testing.assert_allclose(lam[:, 3], want_ng2, atol=1e-15)
    np.testing.assert_allclose(lam[:, 1], 0.3, atol=1e-15)
    np.testing.assert_allclose(lam[:, 0], 1 - 0.3 - want_ng - want_ng2, atol=1e-15)
    with pytest.raises(MemlmError, match="LM's weight would be <= 0"):
        rule_mixture(("lm", "knn", "cache"), {"knn": 0.7, "cache": 0.4})
    with pytest.raises(MemlmError, match="not memories of this mixture"):
        rule_mixture(("lm", "knn"), {"ngram": (0.1, 0.1)})


def test_rule_mixture_constant_weights_are_khandelwals_lambda_and_the_cache():
    rng = np.random.default_rng(7)
    logp = random_logp(rng, 300, 3)
    mix = rule_mixture(("lm", "knn", "cache"), {"knn": 0.25, "cache": 0.1})
    assert mix.form == "constant"
    got = mix.mix({"lm": torch.from_numpy(logp[:, 0]), "knn": torch.from_numpy(logp[:, 1]),
                   "cache": torch.from_numpy(logp[:, 2])})  # fmt: skip
    with np.errstate(divide="ignore"):
        want = np.log(0.65 * np.exp(logp[:, 0]) + 0.25 * np.exp(logp[:, 1]) + 0.1 * np.exp(logp[:, 2]))
    np.testing.assert_allclose(got.numpy(), want, rtol=0, atol=1e-12)
    # λ = 1: the memory alone, to float precision (the LM keeps e^-700)
    alone = rule_mixture(("lm", "knn"), {"knn": 1.0}).mix({"lm": torch.from_numpy(logp[:, 0]),
                                                           "knn": torch.from_numpy(logp[:, 1])})  # fmt: skip
    finite = np.isfinite(logp[:, 1])
    np.testing.assert_allclose(alone.numpy()[finite], logp[finite, 1], rtol=0, atol=1e-12)


def test_mixing_whole_distributions_is_the_rule_at_every_word():
    rng = np.random.default_rng(3)
    rows, vocab = 5, 50
    dists = {}
    for c in ("lm", "knn", "ngram"):
        x = rng.random((rows, vocab))
        if c != "lm":
            x[rng.random((rows, vocab)) < 0.5] = 0.0
        dists[c] = x / x.sum(1, keepdims=True)
    flags = {"ngram": np.array([1, 0, 1, 0, 0], bool)}
    mix = rule_mixture(("lm", "knn", "ngram"), {"knn": 0.2, "ngram": (0.5, 0.05)})
    with np.errstate(divide="ignore"):
        got = mix.mix({c: torch.from_numpy(np.log(d)).float() for c, d in dists.items()},
                      sparse_state_features(flags))  # fmt: skip
    assert got.shape == (rows, vocab) and got.dtype == torch.float32
    lam = np.where(flags["ngram"], 0.5, 0.05)[:, None]
    want = (0.8 - lam) * dists["lm"] + 0.2 * dists["knn"] + lam * dists["ngram"]
    np.testing.assert_allclose(got.exp().numpy(), want, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(got.exp().sum(1).numpy(), 1.0, atol=1e-5)


def test_mixing_by_name_refuses_other_memories_or_missing_features():
    mix = rule_mixture(("lm", "ngram"), {"ngram": (0.3, 0.1)})
    lp = torch.zeros(3)
    with pytest.raises(MemlmError, match="the memories gave lm, knn"):
        mix.mix({"lm": lp, "knn": lp}, sparse_state_features({"ngram": np.ones(3, bool)}))
    with pytest.raises(MemlmError, match="needs the features sparse_state"):
        mix.mix({"lm": lp, "ngram": lp}, {})
