"""Xu et al. 2023 Eq. 4 / Eq. 5 and the learned W_ds (Sec. 4.1 / 4.2) against brute-force NumPy references."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from memlm.core.distribution import knn_distribution, knn_target_logprob, mix
from memlm.errors import MemlmError
from memlm.storage.index import exact_search
from memlm.xu2023.generalized import (
    LearnedWds,
    datastore_logprobs,
    datastore_target_logprob,
    eq5_logprobs,
    eq5_target_logprob,
    load_learned_wds,
    mask_to_k,
    save_learned_wds,
    similarity,
    train_learned_wds,
)

V, D, N = 10, 8, 30


def reference_eq5(lm_logits, queries, keys, values, vocab, lam, k, metric, temperature):
    """Brute force: score every entry, keep the top k, exp(score / T), sum per value, normalise, interpolate."""
    out = np.zeros((len(queries), vocab))
    for qi, q in enumerate(queries):
        sims = np.array([q @ key if metric == "ip" else -((q - key) ** 2).sum() for key in keys])
        keep = np.argsort(-sims, kind="stable")[: min(k, len(keys))]
        mem = np.zeros(vocab)
        for i in keep:
            mem[values[i]] += np.exp((sims[i] - sims[keep].max()) / temperature)
        mem /= mem.sum()
        lm = np.exp(lm_logits[qi] - lm_logits[qi].max())
        lm /= lm.sum()
        out[qi] = (1 - lam) * lm + lam * mem
    return out


def problem(seed: int = 0, q: int = 7):
    rng = np.random.default_rng(seed)
    keys = rng.normal(size=(N, D))
    values = rng.integers(0, 6, size=N)  # values 6..9 never stored: p_mem = 0 there
    queries = rng.normal(size=(q, D))
    lm_logits = rng.normal(size=(q, V)) * 2
    return lm_logits, queries, keys, values


def t32(x):
    return torch.tensor(x, dtype=torch.float32)


# ------------------------------------------------------------------------------------------ Eq. 4 / Eq. 5


@pytest.mark.parametrize("metric", ["ip", "l2"])
@pytest.mark.parametrize("temperature", [0.5, 2.0])
@pytest.mark.parametrize("lam", [0.25, 0.9])
@pytest.mark.parametrize("k", [N, 100, 5])  # k >= N is Eq. 4 (the full datastore); k = 5 masks to the top 5
def test_eq5_matches_bruteforce(metric, temperature, lam, k):
    lm_logits, queries, keys, values = problem()
    ref = reference_eq5(lm_logits, queries, keys, values, V, lam, k, metric, temperature)
    got = eq5_logprobs(t32(lm_logits), t32(queries), t32(keys), torch.tensor(values), lam, k, temperature, metric)
    assert got.dtype == torch.float32 and got.shape == (7, V)
    np.testing.assert_allclose(got.exp().numpy(), ref, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(got.exp().sum(-1).numpy(), 1.0, atol=1e-5)
    targets = torch.arange(7) % V
    tl = eq5_target_logprob(
        t32(lm_logits), t32(queries), t32(keys), torch.tensor(values), targets, lam, k, temperature, metric
    )
    np.testing.assert_allclose(tl.numpy(), got.gather(-1, targets[:, None])[:, 0].numpy(), atol=1e-6)


def test_eq5_leading_dims_and_lambda_edges():
    lm_logits, queries, keys, values = problem(q=6)
    lm, h = t32(lm_logits).reshape(2, 3, V), t32(queries).reshape(2, 3, D)
    got = eq5_logprobs(lm, h, t32(keys), torch.tensor(values), 0.5, 5)
    flat = eq5_logprobs(t32(lm_logits), t32(queries), t32(keys), torch.tensor(values), 0.5, 5)
    np.testing.assert_allclose(got.reshape(6, V).numpy(), flat.numpy(), atol=1e-6)
    lm_only = eq5_logprobs(lm, h, t32(keys), torch.tensor(values), 0.0, 5)
    np.testing.assert_allclose(lm_only.numpy(), torch.log_softmax(lm, -1).numpy(), atol=1e-6)
    mem_only = eq5_logprobs(lm, h, t32(keys), torch.tensor(values), 1.0, 5)
    assert torch.isinf(mem_only[..., 6:]).all()  # values never stored get log 0


def test_tiny_probabilities_do_not_underflow():
    h = torch.tensor([[1.0, 0.0]])
    W = torch.tensor([[10.0, 0.0], [0.0, 0.0], [-10.0, 0.0]])
    lp = datastore_logprobs(h, W, torch.tensor([0, 1, 2]), 3, k=3, temperature=0.05, metric="ip")
    # scores / T = 200, 0, -200: p(2) = e^-400 / (1 + e^-200 + e^-400), far below float32's smallest number
    np.testing.assert_allclose(lp[0].numpy(), [0.0, -200.0, -400.0], atol=1e-4)
    tl = datastore_target_logprob(h, W, torch.tensor([0, 1, 2]), torch.tensor([2]), k=3, temperature=0.05, metric="ip")
    assert tl.item() == pytest.approx(-400.0, abs=1e-4)


@pytest.mark.parametrize("metric", ["ip", "l2"])
def test_similarity_and_mask_to_k(metric):
    _, queries, keys, _ = problem()
    s = similarity(t32(queries), t32(keys), metric).numpy()
    ref = queries @ keys.T if metric == "ip" else -((queries[:, None] - keys[None]) ** 2).sum(-1)
    np.testing.assert_allclose(s, ref, rtol=1e-5, atol=1e-4)
    masked = mask_to_k(torch.tensor(s), 4).numpy()
    assert (np.isfinite(masked).sum(1) == 4).all()
    kept = np.sort(np.where(np.isfinite(masked), masked, -np.inf), 1)[:, -4:]
    np.testing.assert_array_equal(kept, np.sort(s, 1)[:, -4:])
    assert torch.equal(mask_to_k(torch.tensor(s), N), torch.tensor(s))  # k >= N keeps everything (Eq. 4)
    with pytest.raises(MemlmError, match="k must be"):
        mask_to_k(torch.tensor(s), 0)


@pytest.mark.parametrize("metric", ["ip", "l2"])
@pytest.mark.parametrize("k", [4, N])
def test_consistent_with_knn_module(metric, k):
    """The dense Eq. 5 gives the same numbers as index.exact_search + knn.knn_* (the path used at scale)."""
    lm_logits, queries, keys, values = problem(seed=3)
    sc, ids = exact_search(keys.astype(np.float32), queries.astype(np.float32), k, metric)
    sc, vals = torch.tensor(sc), torch.tensor(values[ids])
    targets = torch.tensor([0, 1, 2, 3, 4, 5, 9])
    T = 1.5
    old = knn_target_logprob(sc, vals, targets, T)
    new = datastore_target_logprob(t32(queries), t32(keys), torch.tensor(values), targets, k, T, metric)
    np.testing.assert_allclose(new.numpy(), old.numpy(), atol=1e-5)
    dist_old = knn_distribution(sc, vals, V, T)
    dist_new = datastore_logprobs(t32(queries), t32(keys), torch.tensor(values), V, k, T, metric)
    np.testing.assert_allclose(dist_new.exp().numpy(), dist_old.exp().numpy(), atol=1e-6)
    mixed_old = mix([torch.log_softmax(t32(lm_logits), -1), dist_old], weights=[0.7, 0.3])
    mixed_new = eq5_logprobs(t32(lm_logits), t32(queries), t32(keys), torch.tensor(values), 0.3, k, T, metric)
    np.testing.assert_allclose(mixed_new.numpy(), mixed_old.numpy(), atol=1e-5)


def test_eq5_errors():
    lm_logits, queries, keys, values = problem()
    args = (t32(lm_logits), t32(queries), t32(keys))
    with pytest.raises(MemlmError, match="token ids"):
        eq5_logprobs(*args, torch.tensor(values + 5), 0.5, 5)  # 10 >= V
    with pytest.raises(MemlmError, match="token ids"):
        eq5_logprobs(*args, torch.tensor(values - 1), 0.5, 5)
    with pytest.raises(MemlmError, match="dimension"):
        eq5_logprobs(t32(lm_logits), t32(queries[:, :4]), t32(keys), torch.tensor(values), 0.5, 5)
    with pytest.raises(MemlmError, match="unknown similarity metric"):
        eq5_logprobs(*args, torch.tensor(values), 0.5, 5, metric="cos")
    with pytest.raises(MemlmError, match="temperature"):
        eq5_logprobs(*args, torch.tensor(values), 0.5, 5, temperature=0.0)
    with pytest.raises(MemlmError, match="mixture weights must be >= 0 and sum to 1"):
        eq5_logprobs(*args, torch.tensor(values), 1.5, 5)


# ------------------------------------------------------------------------------------------- learned W_ds


def test_learned_wds_with_tied_weights_reproduces_gpt2():
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100, n_positions=64)
    lm = GPT2LMHeadModel(cfg).eval()
    ids = torch.randint(0, 100, (2, 12))
    with torch.no_grad():
        out = lm(ids, output_hidden_states=True)
        wds = LearnedWds(100, 32, n=1, metric="ip", init=lm.lm_head.weight)
        got = wds.log_probs(out.hidden_states[-1])  # GPT-2's last hidden state is after ln_f
        ref = torch.log_softmax(out.logits.float(), -1)
        np.testing.assert_allclose(got.numpy(), ref.numpy(), atol=1e-5)
        tl = wds.target_logprob(out.hidden_states[-1], ids)
        np.testing.assert_allclose(tl.numpy(), ref.gather(-1, ids[..., None])[..., 0].numpy(), atol=1e-5)
    assert wds.weight.data_ptr() != lm.lm_head.weight.data_ptr()  # a copy: training it leaves the LM alone


@pytest.mark.parametrize("metric", ["ip", "l2"])
@pytest.mark.parametrize("n", [1, 3])
def test_learned_wds_matches_bruteforce(metric, n):
    wds = LearnedWds(V, D, n=n, metric=metric, seed=1)
    with torch.no_grad():
        wds.weight.mul_(50)  # spread the logits
        h = torch.randn(2, 5, D, generator=torch.Generator().manual_seed(2))
        for T in (1.0, 0.7):
            got = wds.log_probs(h, T)
            assert got.shape == (2, 5, V)
            np.testing.assert_allclose(torch.logsumexp(got, -1).numpy(), 0.0, atol=1e-5)
            W, hq = wds.weight.double().numpy(), h.double().numpy().reshape(-1, D)
            sims = hq @ W.T if metric == "ip" else -((hq[:, None] - W[None]) ** 2).sum(-1)
            p = np.exp((sims - sims.max(1, keepdims=True)) / T)
            p /= p.sum(1, keepdims=True)
            ref = np.zeros((len(hq), V))
            for r in range(n * V):
                ref[:, r % V] += p[:, r]
            np.testing.assert_allclose(got.exp().numpy().reshape(-1, V), ref, rtol=1e-4, atol=1e-7)
            # the learned matrix is Eq. 5's W_ds with M = r % V and k = n V
            eq5 = datastore_logprobs(h, wds.weight, wds.values, V, k=n * V, temperature=T, metric=metric)
            np.testing.assert_allclose(got.numpy(), eq5.numpy(), atol=1e-5)
            targets = torch.randint(0, V, (2, 5), generator=torch.Generator().manual_seed(3))
            tl = wds.target_logprob(h, targets, T)
            np.testing.assert_allclose(tl.numpy(), got.gather(-1, targets[..., None])[..., 0].numpy(), atol=1e-5)


def test_learned_wds_init_copies():
    base = torch.randn(V, D)
    one = LearnedWds(V, D, n=1, init=base)
    assert torch.equal(one.weight.data, base)
    three = LearnedWds(V, D, n=3, init=base, seed=5)
    assert torch.equal(three.weight.data[:V], base)
    assert not torch.equal(three.weight.data[V : 2 * V], base)  # noise breaks the symmetry of the copies
    assert torch.allclose(three.weight.data[V:].reshape(2, V, D), base.expand(2, V, D), atol=0.2)
    full = torch.randn(3 * V, D)
    assert torch.equal(LearnedWds(V, D, n=3, init=full).weight.data, full)
    a, b = LearnedWds(V, D, n=2, seed=7), LearnedWds(V, D, n=2, seed=7)
    assert torch.equal(a.weight, b.weight) and a.weight.std().item() == pytest.approx(0.02, rel=0.3)


def clusters(n_points: int, seed: int, antipodal: bool = False):
    """Keys from 8 Gaussian clusters; each cluster's word is its id % 4 (two clusters per word).

    ``antipodal=True`` puts a word's two clusters at ``c`` and ``-c``: no single embedding scores both highly by
    inner product, but two embeddings per word (n = 2, Sec. 4.2) can.
    """
    rng = np.random.default_rng(0)
    centers = rng.normal(size=(8, 16)) * 2.5
    if antipodal:
        centers[4:] = -centers[:4]
    rng = np.random.default_rng(seed)
    c = rng.integers(0, 8, size=n_points)
    keys = (centers[c] + rng.normal(size=(n_points, 16)) * 0.5).astype(np.float32)
    return keys, (c % 4).astype(np.int32)


def test_train_learned_wds_learns_clusters():
    keys, values = clusters(3000, seed=1)
    valid = clusters(300, seed=2)
    model, log = train_learned_wds(
        keys,
        values,
        vocab_size=6,
        epochs=20,
        batch_size=32,
        lr=1e-2,
        max_steps=200,
        dtype="float32",
        valid=valid,
        progress=False,
        log_every=100,
        device="cpu",
    )
    assert [e["step"] for e in log] == [0, 100, 200]
    assert log[0]["loss"] == pytest.approx(math.log(6), abs=0.5)  # ~uniform at init
    assert log[-1]["loss"] < 0.2 * log[0]["loss"]
    assert log[-1]["valid_ppl"] < 0.5 * log[0]["valid_ppl"] and log[-1]["valid_ppl"] < 1.5
    assert log[-1]["valid_loss"] == pytest.approx(math.log(log[-1]["valid_ppl"]))
    assert not model.training and model.weight.shape == (6, 16)
    # the log is JSON-able
    assert all(isinstance(v, int | float) for e in log for v in e.values())


def test_more_embeddings_per_word_increase_capacity():
    keys, values = clusters(3000, seed=1, antipodal=True)
    valid = clusters(300, seed=2, antipodal=True)
    kw = dict(
        epochs=20,
        batch_size=32,
        lr=3e-2,
        max_steps=100,
        dtype="float32",
        valid=valid,
        progress=False,
        log_every=100,
        device="cpu",
    )
    m1, log1 = train_learned_wds(keys, values, 4, n=1, **kw)
    m2, log2 = train_learned_wds(keys, values, 4, n=2, **kw)
    assert m2.weight.shape == (8, 16)
    assert log2[-1]["valid_ppl"] < 1.2  # two embeddings per word: both clusters of each word are scored highly
    assert log1[-1]["valid_ppl"] > 3.0  # one embedding per word: no better than uniform over the 4 words


def test_train_from_float16_memmap_with_bfloat16(tmp_path):
    keys, values = clusters(1000, seed=1)
    mm = np.memmap(tmp_path / "keys.bin", dtype=np.float16, mode="w+", shape=keys.shape)
    mm[:] = keys
    mm.flush()
    ro = np.memmap(tmp_path / "keys.bin", dtype=np.float16, mode="r", shape=keys.shape)
    model, log = train_learned_wds(
        ro,
        values,
        4,
        n=2,
        epochs=3,
        batch_size=50,
        lr=1e-2,
        max_steps=40,
        dtype="bfloat16",
        progress=False,
        log_every=20,
        device="cpu",
    )
    assert [e["step"] for e in log] == [0, 20, 40]
    assert all(math.isfinite(e["loss"]) for e in log) and log[-1]["loss"] < log[0]["loss"]
    again, log_again = train_learned_wds(
        ro,
        values,
        4,
        n=2,
        epochs=3,
        batch_size=50,
        lr=1e-2,
        max_steps=40,
        dtype="bfloat16",
        progress=False,
        log_every=20,
        device="cpu",
    )
    assert torch.equal(model.weight, again.weight) and log == log_again  # seeded: reproducible


def test_epochs_bound_steps():
    keys, values = clusters(100, seed=1)
    _, log = train_learned_wds(keys, values, 4, epochs=2, batch_size=30, progress=False, device="cpu")
    assert [e["step"] for e in log] == [0, 8]  # ceil(100 / 30) = 4 steps per epoch
    assert log[-1]["epoch"] == 1


def _valid_loss(model, keys, values):
    with torch.no_grad():
        lp = model.target_logprob(torch.from_numpy(keys), torch.from_numpy(values.astype(np.int64)))
    return float(-lp.double().mean())


def test_patience_stops_at_the_plateau_and_keeps_the_best_weights():
    """Early stopping: training ends once the validation loss has not improved for `patience` log points, and the
    returned weights are those of the best log point, not the last."""
    keys, values = clusters(2000, seed=1)
    kw = dict(epochs=100, batch_size=32, lr=3e-2, dtype="float32", progress=False, log_every=10, device="cpu")
    # validation pairs whose labels contradict the training pairs: every update makes them worse -> best = step 0
    vk, vv = clusters(300, seed=2)
    model, log = train_learned_wds(keys, values, 4, valid=(vk, (vv + 1) % 4), patience=3, **kw)
    assert [e["step"] for e in log] == [0, 10, 20, 30] and all(e["best_step"] == 0 for e in log)
    assert log[1]["valid_loss"] > log[0]["valid_loss"]
    assert torch.equal(model.weight, LearnedWds(4, 16, seed=0).weight)  # the initial weights are restored
    # learnable validation pairs: stops long before the 6,300-step budget, at the best validation loss seen
    valid = clusters(300, seed=2)
    seen: list[list[int]] = []  # on_log sees the curve grow one entry at a time (a stopped run keeps it)
    model, log = train_learned_wds(
        keys,
        values,
        4,
        valid=valid,
        patience=3,
        max_steps=6300,
        on_log=lambda c: seen.append([e["step"] for e in c]),
        **kw,
    )
    assert seen == [[e["step"] for e in log[: i + 1]] for i in range(len(log))]
    assert log[-1]["step"] < 6300 and log[-1]["step"] - log[-1]["best_step"] == 30
    best = next(e["valid_loss"] for e in log if e["step"] == log[-1]["best_step"])
    assert _valid_loss(model, *valid) == pytest.approx(best, abs=1e-6) and log[-1]["valid_loss"] != best
    assert best <= min(e["valid_loss"] for e in log) + 1e-3 and best < 0.5 * log[0]["valid_loss"]
    with pytest.raises(MemlmError, match="needs valid"):
        train_learned_wds(keys, values, 4, patience=3, **kw)
    with pytest.raises(MemlmError, match="patience must be a positive integer"):
        train_learned_wds(keys, values, 4, valid=valid, patience=0, **kw)


def test_save_load_roundtrip(tmp_path):
    wds = LearnedWds(V, D, n=2, metric="l2", seed=3)
    path = save_learned_wds(wds, tmp_path / "sub" / "wds.safetensors")
    assert path.is_file() and not list(path.parent.glob("*.tmp"))
    back = load_learned_wds(path)
    assert back.config == wds.config == {"vocab_size": V, "dim": D, "n": 2, "metric": "l2"}
    assert torch.equal(back.weight, wds.weight)
    h = torch.randn(3, D)
    with torch.no_grad():
        np.testing.assert_array_equal(back.log_probs(h).numpy(), wds.log_probs(h).numpy())
    with pytest.raises(MemlmError, match="no learned W_ds"):
        load_learned_wds(tmp_path / "missing.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(MemlmError, match="not a learned W_ds"):
        load_learned_wds(tmp_path / "junk.safetensors")


def test_learned_wds_errors():
    keys, values = clusters(50, seed=1)
    kw = dict(progress=False, device="cpu")
    with pytest.raises(MemlmError, match="different lengths"):
        train_learned_wds(keys, values[:-1], 4, **kw)
    with pytest.raises(MemlmError, match="empty"):
        train_learned_wds(keys[:0], values[:0], 4, **kw)
    with pytest.raises(MemlmError, match=r"token ids in \[0, 3\)"):
        train_learned_wds(keys, values, 3, **kw)
    with pytest.raises(MemlmError, match="token ids"):
        train_learned_wds(keys, values - 1, 4, **kw)
    with pytest.raises(MemlmError, match="init has shape"):
        train_learned_wds(keys, values, 4, init=torch.zeros(4, 8), **kw)
    with pytest.raises(MemlmError, match="init has shape"):
        LearnedWds(4, 16, n=2, init=torch.zeros(5, 16))
    with pytest.raises(MemlmError, match="n must be"):
        train_learned_wds(keys, values, 4, n=0, **kw)
    with pytest.raises(MemlmError, match="n must be"):
        LearnedWds(4, 16, n=0)
    with pytest.raises(MemlmError, match="unknown similarity metric"):
        train_learned_wds(keys, values, 4, metric="cosine", **kw)
    with pytest.raises(MemlmError, match="unknown similarity metric"):
        LearnedWds(4, 16, metric="cosine")
    with pytest.raises(MemlmError, match="unknown dtype"):
        train_learned_wds(keys, values, 4, dtype="float16", **kw)
    with pytest.raises(MemlmError, match="validation keys have dimension"):
        train_learned_wds(keys, values, 4, valid=(keys[:, :8], values), **kw)
    with pytest.raises(MemlmError, match="dimension"):
        LearnedWds(4, 16).log_probs(torch.zeros(2, 8))


def test_l2_similarity_under_bf16_autocast_is_float32():
    """-||h - w||^2 expanded as 2 h.w - |h|^2 - |w|^2 cancels: with bf16 dot products (what autocast gave before)
    the distances of nearby vectors of norm ~24 came out wrong by whole units; computed in float32 they match."""
    g = torch.Generator().manual_seed(0)
    W = 3 * torch.randn(50, 64, generator=g)
    h = W[:20] + 0.05 * torch.randn(20, 64, generator=g)  # each query near one row: small distances, large norms
    exact = -((h.double()[:, None] - W.double()[None]) ** 2).sum(-1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = similarity(h, W, "l2")
        bf16_dots = h @ W.T  # what the matmul gives under autocast
    assert bf16_dots.dtype == torch.bfloat16
    bf16_l2 = (2 * bf16_dots.float() - (h * h).sum(-1, keepdim=True) - (W * W).sum(-1)).clamp(max=0)
    assert (bf16_l2.double() - exact).abs().max() > 1.0  # the old arithmetic: errors of whole units
    np.testing.assert_allclose(got.double().numpy(), exact.numpy(), atol=2e-2, rtol=1e-5)
    near = exact.diagonal()  # distances ~0.16 of each query to its own row
    np.testing.assert_allclose(got.diagonal().double().numpy(), near.numpy(), atol=2e-2)


def test_score_in_chunks_equals_target_logprob():
    """LearnedWds.score: the target log-probabilities of a float16 array, chunk by chunk, equal one float32 call."""
    keys, values = clusters(50, seed=3)
    wds = LearnedWds(4, 16, n=2, seed=1)
    full = wds.target_logprob(torch.from_numpy(keys.astype(np.float16).astype(np.float32)), torch.from_numpy(values))
    got = wds.score(keys.astype(np.float16), values, chunk=7)
    assert got.shape == (50,)
    torch.testing.assert_close(got, full.detach(), rtol=0, atol=1e-6)
