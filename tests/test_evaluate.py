"""Evaluation: perplexity equals HF loss, a rare continuation gets its probability raised, tuning, cache, generation."""

import re

import numpy as np
import pytest
import torch
from conftest import Doc
from test_datastore import build

from memlm.knnlm.cache import CacheComponent, continuous_cache
from memlm.knnlm.evaluate import perplexities
from memlm.knnlm.generate import MixtureLogitsProcessor
from memlm.knnlm.scoring import score_tokens
from memlm.knnlm.table import TokenTable
from memlm.storage.index import build_index


def indexed(tmp_path, tiny_lm, docs, **kw):
    ds = build(tmp_path, tiny_lm, docs, **kw)
    build_index(ds.keys, ds.index_path, factory="Flat", metric="l2", progress=False)
    return ds


def test_base_perplexity_equals_hf_loss(tiny_lm, toy_docs):
    model, tok = tiny_lm
    docs = toy_docs[:4]
    ts = score_tokens(model, tok, docs, window=512, min_context=1, progress=False)
    stream = [t for d in docs for t in tok(d.text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]]
    with torch.no_grad():
        loss = model(input_ids=torch.tensor([stream]), labels=torch.tensor([stream])).loss.item()
    assert len(ts) == len(stream) - 1
    assert perplexities(ts)["base_ppl"] == pytest.approx(np.exp(loss), rel=1e-4)
    # sliding windows: each target's log-prob is that of one forward pass over exactly its window's context
    from test_windows import _brute_force

    ts2 = score_tokens(model, tok, docs, window=32, min_context=16, batch_size=3, progress=False)
    np.testing.assert_array_equal(ts2.targets, ts.targets)
    ref = [_brute_force(model, stream, 0 if t < 32 else (t - 16) // 16 * 16, t)[0] for t in range(1, len(stream))]
    assert len(stream) > 3 * 32
    np.testing.assert_allclose(ts2.lm_logprob, ref, atol=1e-4, rtol=0)
    assert np.abs(ts2.lm_logprob - ts.lm_logprob).max() > 1e-3  # less context than the single window: different


def test_rare_continuation_seen_once_gets_probability_raised(tmp_path, tiny_lm, toy_docs):
    model, tok = tiny_lm
    fact = "the secret capital of Zorblatia is Quenthorpe"
    # the fact is seen once, at the start of the stream; a random-weight LM's keys only match for the same context,
    # so the probe repeats it (the slow SmolLM2 test below checks a paraphrased context)
    ds = indexed(tmp_path, tiny_lm, [Doc("fact", fact), *toy_docs])
    probe = [Doc("probe", fact)]
    ts = score_tokens(model, tok, probe, ds, k=8, window=64, min_context=1, progress=False)
    target_ids = tok(" Quenthorpe", add_special_tokens=False)["input_ids"]
    pos = len(ts) - len(target_ids) - 1  # the first sub-token of " Quenthorpe" (EOS is last)
    assert ts.targets[pos] == target_ids[0]
    lam = 0.25
    from memlm.core.distribution import mix
    from memlm.mixing.inputs import memory_logprob

    knn = memory_logprob(ts.columns["knn"]["scores"], ts.columns["knn"]["values"], ts.targets, 1.0)
    mixed = mix([torch.from_numpy(ts.lm_logprob), knn], weights=[1 - lam, lam])
    assert ts.lm_logprob[pos] < np.log(1e-3)  # the random LM has no idea
    assert mixed[pos].exp() > 0.2  # the datastore remembers it
    assert perplexities(ts, lam=lam)["knn_ppl"] < perplexities(ts)["base_ppl"]


def test_drop_self_matches(tmp_path, tiny_lm, toy_docs):
    model, tok = tiny_lm
    ds = indexed(tmp_path, tiny_lm, toy_docs[:5], window=32, min_context=8)
    kw = {"k": 4, "window": 32, "min_context": 8, "progress": False}
    with_self = score_tokens(model, tok, toy_docs[:5], ds, **kw)
    # the evaluated text is the datastore's: every token finds itself at distance ~0
    assert (with_self.columns["knn"]["scores"][:, 0] > -1e-2).all()
    no_self = score_tokens(model, tok, toy_docs[:5], ds, drop_self_matches=True, **kw)
    assert (no_self.columns["knn"]["scores"][:, 0] < -1e-2).mean() > 0.9
    assert perplexities(no_self, lam=0.5)["knn_ppl"] > perplexities(with_self, lam=0.5)["knn_ppl"]


def test_fit_and_dump_roundtrip(tmp_path, tiny_lm, toy_docs):
    model, tok = tiny_lm
    ds = indexed(tmp_path, tiny_lm, toy_docs[:20])
    ts = score_tokens(model, tok, toy_docs[20:], [ds, CacheComponent()], k=16, window=32, min_context=8, progress=False)
    path = tmp_path / "dump.npz"
    ts.save(path)
    back = TokenTable.load(path)
    np.testing.assert_array_equal(back.columns["knn"]["values"], ts.columns["knn"]["values"])
    assert back.meta["components"]["knn"]["k"] == 16 and back.names() == ("knn", "cache")
    from memlm.mixing.report import fit_summary, fit_table

    dm = fit_table(back, "rule", [1.0, 10.0])  # λ and λc by EM at each τ, the most likely τ kept
    best = fit_summary(dm)
    assert best["temperature"] == max(dm.search, key=lambda s: s["heldout_loglik"]["rule"])["temperature"]
    at = {"temperature": best["temperature"], "cache_temperature": 1.0}
    assert perplexities(back, lam=best["knn"], cache_lambda=best["cache"], **at)["knn_cache_ppl"] == pytest.approx(
        best["ppl"], rel=1e-9)  # fmt: skip
    for lam, lc in ((0.01, 0.01), (0.5, 0.1), (0.1, 0.3)):  # the maximum: no other weights do better
        assert perplexities(back, lam=lam, cache_lambda=lc, **at)["knn_cache_ppl"] >= best["ppl"] * (1 - 1e-9)
    r = perplexities(back, lam=0.5, temperature=10.0, k=4)
    assert r["oracle_ppl"] <= min(r["base_ppl"], r["knn_ppl"]) + 1e-9


def test_continuous_cache_matches_bruteforce():
    rng = np.random.default_rng(0)
    keys = rng.normal(size=(40, 6)).astype(np.float32)
    targets = rng.integers(0, 5, size=40)
    doc = np.repeat([0, 1, 2], [10, 25, 5])
    for metric in ("ip", "l2"):
        sc, vals = continuous_cache(keys, targets, doc, k=4, max_len=8, metric=metric, block=7)
        for n in range(40):
            visible = [m for m in range(40) if m < n and doc[m] == doc[n] and n - m <= 8]
            s = [keys[n] @ keys[m] if metric == "ip" else -((keys[n] - keys[m]) ** 2).sum() for m in visible]
            order = np.argsort(-np.array(s), kind="stable")[:4]
            np.testing.assert_allclose(sc[n, : len(order)], np.array(s)[order], rtol=1e-4, atol=1e-4)
            assert set(vals[n, : len(order)]) == {targets[visible[i]] for i in order} or len(order) == 0
            assert (vals[n, len(order) :] == -1).all()


def test_generation_follows_the_datastore(tmp_path, tiny_lm):
    model, tok = tiny_lm
    text = "alpha beta gamma delta epsilon zeta eta theta"
    ds = indexed(tmp_path, tiny_lm, [Doc("g", text)], window=64, min_context=1)
    ids = tok("alpha beta gamma", return_tensors="pt", add_special_tokens=False)
    with MixtureLogitsProcessor(model, f"knn:{ds.path}?k=1", "knn=1") as knn:
        out = model.generate(
            **ids, logits_processor=[knn], do_sample=False, max_new_tokens=5, pad_token_id=tok.eos_token_id
        )
    expected = tok(text, add_special_tokens=False)["input_ids"][: out.shape[1]]
    assert out[0].tolist() == expected  # λ = 1, k = 1: generation replays the datastore's continuation


def test_bf16_body_gets_float32_head_and_log_softmax(toy_docs):
    """With a bfloat16 body the LM log-probs equal a float32 head + log-softmax on the same bf16 final hidden
    states (the old code read the model's bf16 logits, off by the bf16 rounding of each logit)."""
    from conftest import gpt2_tokenizer, tiny_gpt2

    from memlm.knnlm.evaluate import lm_scores
    from memlm.models.keys import KeySpec

    model, tok = tiny_gpt2(0).to(torch.bfloat16), gpt2_tokenizer()
    with torch.no_grad():
        model.lm_head.weight.mul_(16)  # logits of a few units, as in a trained LM (tied with the input embedding)
    final = KeySpec("final", 1)
    ts, q, _ = lm_scores(model, tok, toy_docs[:3], [final], window=32, min_context=8, batch_size=2, progress=False)
    assert model.lm_head.weight.dtype == torch.bfloat16  # the model is left as it was
    logits = torch.from_numpy(q[final]).double() @ model.lm_head.weight.detach().double().T  # bf16 h, float weights
    ref = torch.log_softmax(logits, -1).gather(-1, torch.from_numpy(ts.targets)[:, None]).squeeze(-1)
    np.testing.assert_allclose(ts.lm_logprob, ref.numpy(), atol=2e-5, rtol=0)
    bf16_ref = torch.log_softmax(logits.bfloat16().double(), -1).gather(-1, torch.from_numpy(ts.targets)[:, None])
    assert (bf16_ref.squeeze(-1) - ref).abs().max() > 1e-3  # what rounding the logits to bf16 costs


# ------------------------------------------------------------------------------ efficient kNN-LM through score_tokens


def test_pipelined_search_equals_searching_after_the_forward_pass(tmp_path, tiny_lm, toy_docs):
    model, tok = tiny_lm
    ds = indexed(tmp_path, tiny_lm, toy_docs[:10])
    probe = toy_docs[2:5]
    plain = score_tokens(model, tok, probe, ds, k=8, window=32, min_context=8, batch_size=2, progress=False)
    piped = score_tokens(model, tok, probe, ds, k=8, window=32, min_context=8, batch_size=2, progress=False,
                         pipeline=True)  # fmt: skip
    np.testing.assert_array_equal(piped.columns["knn"]["values"], plain.columns["knn"]["values"])
    np.testing.assert_array_equal(piped.columns["knn"]["scores"], plain.columns["knn"]["scores"])
    assert piped.meta["retrieval"]["pipeline"] and not plain.meta["retrieval"]["pipeline"]


def test_pointer_reuse_in_eval_skips_searches_and_equals_plain_search_when_it_never_skips(tmp_path, tiny_lm, toy_docs):
    model, tok = tiny_lm
    ds = indexed(tmp_path, tiny_lm, toy_docs[:10])
    probe = toy_docs[:3]  # text that is in the datastore: pointers survive
    kw = dict(k=8, window=32, min_context=8, progress=False)
    plain = score_tokens(model, tok, probe, ds, scores="exact", **kw)  # pointer reuse scores every row exactly
    never = score_tokens(model, tok, probe, ds, pointer_min=9, pointer_rule="replace", **kw)  # 8 < 9: always search
    np.testing.assert_array_equal(
        np.sort(never.columns["knn"]["values"], 1), np.sort(plain.columns["knn"]["values"], 1)
    )
    assert never.columns["knn"]["searched"].all() and never.meta["components"]["knn"]["scores"] == "exact"
    reuse = score_tokens(model, tok, probe, ds, pointer_min=1, **kw)
    searched = reuse.columns["knn"]["searched"]
    assert 0 < searched.mean() < 0.9 and reuse.meta["retrieval"]["pointer_rule"] == "retomaton"
    searched = reuse.columns["knn"]["searched"]
    for got, want in zip(
        reuse.columns["knn"]["values"][searched], plain.columns["knn"]["values"][searched], strict=True
    ):
        assert set(want) <= set(got)  # the search results (and, with the authors' rule, surviving pointers)
    assert perplexities(reuse, lam=0.25)["searched_fraction"] == pytest.approx(searched.mean())


def test_pointer_reuse_with_self_matches_dropped_searches_and_keeps_neighbours(tmp_path, tiny_lm, toy_docs, capsys):
    """Text that is in the datastore, self-matches dropped: the self entry's chain must not count as a survivor.
    The earlier code searched ~2% of the tokens and most rows held nothing after the drop (p_kNN = 0); it also drew
    one empty 'search' progress bar per round. Fails on the earlier code, passes now."""
    model, tok = tiny_lm
    ds = indexed(tmp_path, tiny_lm, toy_docs[:10])
    kw = dict(k=8, window=32, min_context=8, drop_self_matches=True)
    ts = score_tokens(model, tok, toy_docs[:3], ds, pointer_min=1, progress=True, **kw)
    err = capsys.readouterr().err
    assert (ts.columns["knn"]["values"] >= 0).any(1).mean() > 0.95  # every row keeps neighbours other than itself
    assert ts.columns["knn"]["searched"].mean() > 0.2
    assert "pointer search" in err and re.search(r"(?<!pointer )search:", err) is None  # one bar, not one per round


def _np_memory_prob(scores, values, targets, temperature):
    """Eq. 2 in NumPy: softmax(s / τ) over the retrieved entries, summed where the value is the target; 0 if none."""
    s = scores.astype(np.float64) / temperature
    finite = np.isfinite(s)
    m = np.where(finite.any(1), np.where(finite, s, -np.inf).max(1), 0.0)
    w = np.where(finite, np.exp(s - m[:, None]), 0.0)
    z = w.sum(1)
    hit = (w * (values == targets[:, None])).sum(1)
    return np.divide(hit, z, out=np.zeros_like(hit), where=z > 0)


def test_adaptive_gate_in_eval_searches_the_requested_fraction_with_the_gate_lambda(tmp_path, tiny_lm, toy_docs):
    """He et al. (2021) Sec. 4: p = (1 - λ(x)) p_LM + λ(x) p_kNN with λ(x) = sigmoid(g(f(x))), λ = 0 where not searched;
    with the cache p = (1 - λ'_t - λc) p_LM + λ'_t p_kNN + λc p_cache, λ'_t = min(λ(x_t), 1 - λc).

    The gate is a logistic one with hand-set weights (λ from ~0.02 to ~0.98 on these tokens), and every expectation is
    computed in NumPy from those formulas and the dump's raw scores, not with memlm's combiners.
    """
    from memlm.knnlm.adaptive import AdaptiveGate

    model, tok = tiny_lm
    ds = indexed(tmp_path, tiny_lm, toy_docs[:10])
    gate = AdaptiveGate(layers=0)  # λ = sigmoid(w . (f - mean) / std + b)
    # the tiny LM is near uniform (entropy ~10.819, max log p ~ -10.35 +- 0.03): λ varies with confidence and position
    mean, std, w, b = np.array([10.8, -10.35, 2.5]), np.array([1.0, 0.03, 1.0]), np.array([0.5, 1.0, 2.5]), 0.2
    with torch.no_grad():
        gate.mean.copy_(torch.from_numpy(mean)), gate.std.copy_(torch.from_numpy(std))
        gate.mlp[0].weight.copy_(torch.from_numpy(w)[None]), gate.mlp[0].bias.fill_(b)
    gate.save(tmp_path / "gate.npz")
    kw = dict(k=8, window=32, min_context=8, progress=False)
    plain = score_tokens(model, tok, toy_docs[3:5], ds, **kw)
    ts = score_tokens(model, tok, toy_docs[3:5], [ds, CacheComponent()], adaptive=tmp_path / "gate.npz",
                      adaptive_fraction=0.5, **kw)  # fmt: skip
    # the gate's λ from the formula, on the features of the module docstring (entropy, max log p, log(1 + position))
    f = np.stack([ts.lm_entropy, ts.lm_max_logprob, np.log1p(ts.position)], axis=1).astype(np.float64)
    lam = 1.0 / (1.0 + np.exp(-(((f - mean) / std) @ w + b)))
    assert lam.min() < 0.1 and lam.max() > 0.9 and np.unique(lam.round(3)).size > len(lam) // 2  # not a trivial gate
    top = np.argsort(-lam, kind="stable")[: round(0.5 * len(ts))]  # the half with the largest λ is searched
    want_searched = np.zeros(len(ts), bool)
    want_searched[top] = True
    np.testing.assert_array_equal(ts.columns["knn"]["searched"], want_searched)
    np.testing.assert_array_equal(
        ts.columns["knn"]["values"][ts.columns["knn"]["searched"]],
        plain.columns["knn"]["values"][ts.columns["knn"]["searched"]],
    )
    assert (ts.columns["knn"]["values"][~ts.columns["knn"]["searched"]] == -1).all()
    lam_t = np.where(want_searched, lam, 0.0)
    np.testing.assert_allclose(ts.columns["knn"]["lambda"], lam_t, rtol=1e-5, atol=1e-7)

    p_lm = np.exp(ts.lm_logprob.astype(np.float64))
    p_knn = _np_memory_prob(ts.columns["knn"]["scores"], ts.columns["knn"]["values"], ts.targets, 2.0)
    got = perplexities(ts, temperature=2.0)
    want = np.exp(-np.log((1 - lam_t) * p_lm + lam_t * p_knn).mean())
    assert got["knn_ppl"] == pytest.approx(want, rel=1e-5)
    assert got["lambda"] == "adaptive" and got["searched_fraction"] == want_searched.mean()

    lc = 0.3
    p_cache = _np_memory_prob(ts.columns["cache"]["scores"], ts.columns["cache"]["values"], ts.targets, 1.5)
    assert 0 < p_cache.mean() and (lam_t > 1 - lc).any()  # the cache matters and the cap on λ_t is exercised
    capped = np.minimum(lam_t, 1 - lc)
    want = np.exp(-np.log((1 - capped - lc) * p_lm + capped * p_knn + lc * p_cache).mean())
    got = perplexities(ts, temperature=2.0, cache_lambda=lc, cache_temperature=1.5)
    assert got["knn_cache_ppl"] == pytest.approx(want, rel=1e-5) and "lm_cache_ppl" not in got


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/smaps"), reason="needs Linux /proc/self/smaps")
def test_exact_rescoring_advises_random_reads_of_the_keys(tmp_path, tiny_lm, toy_docs):
    """DatastoreMemory(scores='exact') marks the keys' memory map MADV_RANDOM (smaps flag 'rr'): rescoring reads the
    keys of scattered ids, where read-ahead only wastes I/O (and thrashes when the keys exceed the memory given)."""
    from test_folder import _vm_flags

    from memlm.retrieval import DatastoreMemory

    ds = indexed(tmp_path, tiny_lm, toy_docs)
    keys_file = ds.path / "keys.bin"
    DatastoreMemory(ds, scores="index")
    assert _vm_flags(keys_file) and not any(" rr" in f for f in _vm_flags(keys_file))
    DatastoreMemory(ds, scores="exact")
    assert all(" rr" in f for f in _vm_flags(keys_file))
