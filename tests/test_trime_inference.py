"""TRIME inference (Zhong et al. 2022, App. A): local / long / external memory vs brute-force NumPy loops, tuning."""

import math

import numpy as np
import pytest
import torch
from conftest import make_toy_docs, tiny_gpt2
from test_datastore import build
from transformers import AutoModelForCausalLM, GPT2Config

from memlm.errors import MemlmError
from memlm.models.keys import KeyCapture, KeySpec
from memlm.storage.index import build_index
from memlm.trime import (
    TrimeScores,
    score_trime,
    trime_log_distribution,
    trime_logprob,
    trime_perplexity,
    trime_target_logprobs,
    tune_trime_inference,
)
from memlm.trime.batching import segment_documents

SEQ = 12  # tokens per forward row -> 11 targets per full segment


@pytest.fixture(scope="module")
def small_lm():
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=64)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():  # large keys so the memory term matters against the logits
        for p in model.parameters():
            p.mul_(3.0)
    return model


def token_docs(seed=0, lengths=(40, 7, 58, 25)):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 8, size=n).astype(np.int64) for n in lengths]  # few values: many memory hits


def direct_segments(model, docs, seq_len=SEQ):
    """Each segment alone through the model: (doc, logits [n, V], g [n, D], targets [n]) in float64, in order."""
    out = []
    for s in segment_documents(docs, seq_len - 1):
        if len(s.targets) == 0:
            continue
        with KeyCapture(model, KeySpec("ffn_in", -1)) as cap, torch.no_grad():
            logits = model(input_ids=torch.from_numpy(s.inputs)[None]).logits[0]
            g = cap.keys[0]
        out.append((s.doc_index, logits.double().numpy(), g.double().numpy(), s.targets))
    return out


def brute_logprobs(segs, m_prev, temp=1.0):
    """log[(e^{l_w} + Σ_{j<t or j in M prev segs, y_j=w} e^{q.k/(√d τ)}) / (Σ_v e^{l_v} + Σ_j e^{q.k/(√d τ)})]."""
    res = []
    for i, (doc, logits, g, y) in enumerate(segs):
        prev = [segs[p] for p in range(max(0, i - m_prev), i) if segs[p][0] == doc] if m_prev else []
        d = g.shape[1]
        for t in range(len(y)):
            num = math.exp(logits[t, y[t]])
            den = np.exp(logits[t]).sum()
            entries = [(g[j], y[j]) for j in range(t)]
            entries += [(pg[j], py[j]) for _, _, pg, py in prev for j in range(len(py))]
            for k, v in entries:
                e = math.exp(float(g[t] @ k) / math.sqrt(d) / temp)
                den += e
                num += e if v == y[t] else 0.0
            res.append(math.log(num / den))
    return np.array(res)


@pytest.fixture(scope="module")
def dump(small_lm):
    return score_trime(small_lm, None, token_docs(), SEQ, max_segments=3, local_temperatures=(1.0, 0.5), batch_size=3)


@pytest.fixture(scope="module")
def segs(small_lm):
    return direct_segments(small_lm, token_docs())


def test_no_memory_is_the_plain_lm(dump, segs):
    lp = trime_target_logprobs(dump, segments=None).numpy()
    ref = np.concatenate(
        [torch.log_softmax(torch.from_numpy(lg), -1).numpy()[np.arange(len(y)), y] for _, lg, _, y in segs]
    )
    assert len(dump) == len(ref) == sum(len(d) - 1 for d in token_docs())
    np.testing.assert_allclose(lp, ref, atol=1e-4)
    out = trime_perplexity(dump, segments=None)
    assert out["ppl"] == pytest.approx(out["base_ppl"]) == pytest.approx(math.exp(-ref.mean()), rel=1e-5)


def test_local_memory_equals_bruteforce(dump, segs):
    np.testing.assert_allclose(trime_target_logprobs(dump, segments=0).numpy(), brute_logprobs(segs, 0), atol=1e-4)
    np.testing.assert_allclose(
        trime_target_logprobs(dump, segments=0, local_temperature=0.5).numpy(),
        brute_logprobs(segs, 0, temp=0.5),
        atol=1e-4,
    )
    # the same as the training objective (loss.trime_logprob) with the local visibility, one segment at a time
    lp = []
    for _, lg, g, y in segs:
        n = len(y)
        yt = torch.from_numpy(y)
        gt = torch.from_numpy(g)
        vis = torch.ones(n, n, dtype=torch.bool).tril(-1)
        lp.append(trime_logprob(torch.from_numpy(lg), gt, gt, yt, vis, yt).numpy())
    np.testing.assert_allclose(trime_target_logprobs(dump, segments=0).numpy(), np.concatenate(lp), atol=1e-4)
    # memory changes the numbers (the test is not vacuous)
    assert not np.allclose(trime_target_logprobs(dump, segments=0).numpy(), trime_target_logprobs(dump, None).numpy())


@pytest.mark.parametrize("m", [1, 2, 3])
def test_long_memory_equals_bruteforce(dump, segs, m):
    lp = trime_target_logprobs(dump, segments=m).numpy()
    np.testing.assert_allclose(lp, brute_logprobs(segs, m), atol=1e-4)
    # the first segment of each document has no long memory: equal to local only there
    first = dump.segment_index == 0
    np.testing.assert_allclose(lp[first], trime_target_logprobs(dump, segments=0).numpy()[first], atol=1e-6)
    assert not np.allclose(lp, trime_target_logprobs(dump, segments=0).numpy())


def test_fifo_and_batching_do_not_change_results(small_lm, dump):
    other = score_trime(small_lm, None, token_docs(), SEQ, max_segments=2, batch_size=1)
    for m in (None, 0, 1, 2):
        np.testing.assert_allclose(
            trime_target_logprobs(other, segments=m).numpy(),
            trime_target_logprobs(dump, segments=m).numpy(),
            rtol=2e-6,  # float32 sums in another order (batch 1 vs batched): ~1e-6 relative on this CPU
            atol=1e-5,
        )
    with pytest.raises(MemlmError, match="max_segments >= 3"):
        trime_target_logprobs(other, segments=3)
    with pytest.raises(MemlmError, match="local_temperature"):
        trime_target_logprobs(other, segments=0, local_temperature=0.5)
    with pytest.raises(MemlmError, match="no external memory"):
        trime_target_logprobs(other, segments=0, lam=0.5)
    with pytest.raises(MemlmError, match="context"):
        score_trime(small_lm, None, token_docs(), 65)


# ----------------------------------------------------------------------- overlapping windows (App. D protocol)


def _forward_prefix(model, tokens):
    """logits [n, V] and g [n, D] (float64) of ``tokens`` alone through the model."""
    with KeyCapture(model, KeySpec("ffn_in", -1)) as cap, torch.no_grad():
        logits = model(input_ids=torch.from_numpy(np.asarray(tokens))[None]).logits[0]
        g = cap.keys[0]
    return logits.double().numpy(), g.double().numpy()


def brute_overlapping(model, docs, span, context, m_prev, temp=1.0):
    """TRIME App. D written out per target: target p of a document is scored in the window that owns it (the first
    window owns p <= span, window i >= 1 owns (span + (i-1) S, span + i S], S = span - context) and is computed from
    that window's tokens a..p-1 (a = its first owned target - 1 - context); memory = every earlier position of the
    window (local) + the owned targets p' <= a of the m_prev previous windows, their g from their own windows;
    ``m_prev=None``: no memory (the plain LM on the window)."""
    out = []
    step = span - context
    for doc in docs:
        n = len(doc)
        owner = lambda p: 0 if p <= span else (p - span - 1) // step + 1  # noqa: E731
        start = lambda i: 0 if i == 0 else span + (i - 1) * step - context  # noqa: E731
        entries = {}  # window -> [(g, value, p)] of its owned targets
        for p in range(1, n):
            w, a = owner(p), start(owner(p))
            logits, g = _forward_prefix(model, doc[a:p])
            entries.setdefault(w, []).append((g[-1], int(doc[p]), p))
        for p in range(1, n):
            w, a = owner(p), start(owner(p))
            logits, g = _forward_prefix(model, doc[a:p])
            q, y, d = g[-1], int(doc[p]), g.shape[1]
            mem = [] if m_prev is None else [(g[j - a], int(doc[j + 1])) for j in range(a, p - 1)]  # a..p-2
            for prev in range(max(0, w - m_prev), w) if m_prev else []:
                mem += [(k, v) for k, v, pp in entries[prev] if pp <= a]
            num, den = math.exp(logits[-1, y]), np.exp(logits[-1]).sum()
            for k, v in mem:
                e = math.exp(float(q @ k) / math.sqrt(d) / temp)
                den += e
                num += e if v == y else 0.0
            out.append(math.log(num / den))
    return np.array(out)


def test_evaluation_windows_cover_every_target_once_with_context():
    from memlm.trime.inference import evaluation_windows

    docs = token_docs()
    for span, context in ((11, 0), (11, 5), (11, 10), (4, 1)):
        wins = evaluation_windows(docs, span, context)
        for d, doc in enumerate(docs):
            mine = [w for w in wins if w.doc_index == d]
            scored = np.concatenate([w.scored_positions for w in mine])
            np.testing.assert_array_equal(scored, np.arange(1, len(doc)))  # each target once, in order
            for w in mine:
                assert len(w.inputs) <= span and np.array_equal(w.tokens, doc[w.start : w.start + len(w.tokens)])
                assert w.score_from == (0 if w.index == 0 else context)  # C tokens of context after window 0
                np.testing.assert_array_equal(w.targets[w.score_from :], doc[w.scored_positions])
    # context 0: the training segments
    same = [(s.doc_index, s.start, s.tokens.tolist()) for s in segment_documents(docs, 11) if len(s.targets)]
    assert [(w.doc_index, w.start, w.tokens.tolist()) for w in evaluation_windows(docs, 11, 0)] == same
    with pytest.raises(MemlmError, match="context must be an integer in"):
        evaluation_windows(docs, 11, 11)


@pytest.mark.parametrize("context", [5, 9])
def test_overlapping_windows_equal_bruteforce(small_lm, context):
    docs = token_docs(lengths=(30, 7, 26))
    ov = score_trime(small_lm, None, docs, SEQ, max_segments=2, batch_size=3, context=context)
    assert ov.meta["context"] == context
    np.testing.assert_array_equal(ov.targets, np.concatenate([d[1:] for d in docs]))
    for m in (None, 0, 1, 2):
        lp = trime_target_logprobs(ov, segments=m).numpy()
        np.testing.assert_allclose(lp, brute_overlapping(small_lm, docs, SEQ - 1, context, m), atol=1e-4)
    assert not np.allclose(trime_target_logprobs(ov, segments=1).numpy(), trime_target_logprobs(ov, 0).numpy())
    one = score_trime(small_lm, None, docs, SEQ, max_segments=2, batch_size=1, context=context)
    np.testing.assert_allclose(one.mem_all, ov.mem_all, atol=1e-5)
    # more context than the non-overlapping segments: the plain LM scores change for targets after window 0
    plain = score_trime(small_lm, None, docs, SEQ, max_segments=2, batch_size=3)
    assert not np.allclose(plain.target_logit, ov.target_logit)


def test_dump_roundtrip(tmp_path, dump):
    dump.save(tmp_path / "d.npz")
    again = TrimeScores.load(tmp_path / "d.npz")
    assert again.meta == dump.meta and again.max_segments == 3
    assert trime_perplexity(again, segments=2) == trime_perplexity(dump, segments=2)


# ------------------------------------------------------------------------------------------------- external memory


@pytest.fixture(scope="module")
def ext_setup(tmp_path_factory, tiny_lm):
    tmp = tmp_path_factory.mktemp("trime-ext")
    ds = build(tmp, tiny_lm, make_toy_docs(12, seed=3), window=32, min_context=8)
    build_index(ds.keys, ds.index_path, factory="Flat", metric="l2", progress=False)
    return ds


def test_external_memory_equals_bruteforce(tiny_lm, ext_setup):
    model, tok = tiny_lm
    ds = ext_setup
    docs = make_toy_docs(3, seed=7)
    k, tau, tau_knn, lam = 8, 0.5, 2.0, 0.3
    ts = score_trime(model, tok, docs, 16, max_segments=1, datastore=ds, k=k, batch_size=4)
    assert ts.ext_scores.shape == (len(ts), k) and ts.meta["datastore_entries"] == len(ds)
    from memlm.trime.training import tokenize_for_trime

    segs = direct_segments(model, tokenize_for_trime(docs, tok), seq_len=16)
    keys = ds.keys.astype(np.float64)
    d = keys.shape[1]
    got_joint = trime_target_logprobs(ts, segments=0, temperature=tau).numpy()
    got_mix = trime_target_logprobs(ts, segments=0, temperature=tau, lam=lam, knn_temperature=tau_knn).numpy()
    joint, mix, i = [], [], 0
    for _, logits, g, y in segs:
        for t in range(len(y)):
            dist = ((keys - g[t]) ** 2).sum(1)
            top = np.argsort(dist, kind="stable")[:k]  # the Flat L2 index's top-k
            sims = keys[top] @ g[t] / math.sqrt(d)
            vals = ds.values[top]
            num = math.exp(logits[t, y[t]]) + np.exp(sims[vals == y[t]] / tau).sum()
            den = np.exp(logits[t]).sum() + np.exp(sims / tau).sum()
            for j in range(t):  # local memory
                e = math.exp(float(g[t] @ g[j]) / math.sqrt(d))
                den += e
                num += e if y[j] == y[t] else 0.0
            pj = num / den
            w = np.exp(sims / tau_knn - (sims / tau_knn).max())
            pk = w[vals == y[t]].sum() / w.sum()
            joint.append(math.log(pj))
            mix.append(math.log((1 - lam) * pj + lam * pk))
            np.testing.assert_allclose(np.sort(ts.ext_scores[i]), np.sort(sims), rtol=1e-3, atol=1e-3)
            i += 1
    np.testing.assert_allclose(got_joint, joint, atol=1e-3)
    np.testing.assert_allclose(got_mix, mix, atol=1e-3)
    # exact search over the stored keys gives the same neighbours as the Flat index
    ts2 = score_trime(model, tok, docs, 16, max_segments=0, datastore=ds, k=k, search="exact")
    np.testing.assert_allclose(trime_target_logprobs(ts2, 0, tau, lam).numpy(), trime_target_logprobs(ts, 0, tau, lam))


def test_full_distribution_normalises_and_matches_target(tiny_lm, ext_setup):
    model, tok = tiny_lm
    ds = ext_setup
    docs = make_toy_docs(1, seed=7)
    ts = score_trime(model, tok, docs, 16, max_segments=0, datastore=ds, k=8)
    from memlm.trime.training import tokenize_for_trime

    _, logits, g, y = direct_segments(model, tokenize_for_trime(docs, tok), seq_len=16)[0]
    t = 6
    d = g.shape[1]
    mem_scores = torch.from_numpy(g[:t] @ g[t] / math.sqrt(d))
    mem_values = torch.from_numpy(y[:t])
    ext_s, ext_v = torch.from_numpy(ts.ext_scores[t]), torch.from_numpy(ts.ext_values[t].astype(np.int64))
    for lam in (0.0, 0.4):
        logp = trime_log_distribution(
            torch.from_numpy(logits[t]), mem_scores, mem_values, ext_s, ext_v, 0.7, lam, knn_temperature=1.5
        )
        assert logp.shape == (logits.shape[1],)
        assert float(logp.exp().sum()) == pytest.approx(1.0, abs=1e-9)
        per_token = trime_target_logprobs(ts, 0, 0.7, lam, knn_temperature=1.5)[t]
        assert float(logp[y[t]]) == pytest.approx(float(per_token), abs=1e-4)


@pytest.mark.parametrize("context", [3, 7])
def test_stream_windows_are_the_knnlm_evaluation_windows(tiny_lm, ext_setup, context):
    """--stream --context C scores the targets of memlm eval --window SEQ --min-context C+1 from the same contexts,
    so a TRIME row and a kNN-LM row share one protocol."""
    from memlm.knnlm.evaluate import lm_scores

    model, tok = tiny_lm
    docs = make_toy_docs(6, seed=11)
    ts = score_trime(model, tok, docs, 16, max_segments=2, batch_size=3, context=context, stream=True)
    ref, _, prov = lm_scores(model, tok, docs, window=16, min_context=context + 1, batch_size=2, progress=False)
    assert ts.meta["stream"] is True and len(ts) == len(ref) > 100
    np.testing.assert_array_equal(ts.targets, ref.targets)
    np.testing.assert_allclose(trime_target_logprobs(ts, None).numpy(), ref.lm_logprob, atol=1e-4)
    # per document (the default) the first token of every document is no target and no context crosses documents
    per_doc = score_trime(model, tok, docs, 16, max_segments=2, batch_size=3, context=context)
    assert len(per_doc) == len(ref) - (len(docs) - 1)
    # the long-term memory crosses documents in a stream: lag 1 reaches back over a document boundary
    assert np.isfinite(ts.mem_all[:, :, 1]).sum() > np.isfinite(per_doc.mem_all[:, :, 1]).sum()
    # self-matches: each stream target's (document hash, offset) is the one memlm eval records for it
    from memlm.trime.inference import token_provenance
    from memlm.trime.training import tokenize_for_trime

    ((h, o),) = token_provenance(docs, tokenize_for_trime(docs, tok), stream=True)
    np.testing.assert_array_equal(h[1:], prov["doc_hash"])
    np.testing.assert_array_equal(o[1:], prov["offset"])
    # retrieving every entry (exact search, k = N), dropping self-matches removes exactly the entry whose
    # (document hash, offset) is the target's own, for every target of every document of the stream
    ds = ext_setup
    own = make_toy_docs(12, seed=3)[:4]  # documents the datastore was built from
    kw = dict(max_segments=0, datastore=ds, k=len(ds), search="exact", batch_size=3, context=context, stream=True)
    dropped = score_trime(model, tok, own, 16, drop_self_matches=True, **kw)
    kept = score_trime(model, tok, own, 16, **kw)
    ((h, o),) = token_provenance(own, tokenize_for_trime(own, tok), stream=True)
    in_ds = set(zip(np.asarray(ds.doc_hash).tolist(), np.asarray(ds.offset).tolist(), strict=True))
    own_entry = np.array([(a, b) in in_ds for a, b in zip(h[1:].tolist(), o[1:].tolist(), strict=True)])
    assert own_entry.sum() > 50 and len(set(h[1:][own_entry].tolist())) == len(own)  # every document has some
    removed = np.isfinite(kept.ext_scores).sum(1) - np.isfinite(dropped.ext_scores).sum(1)
    np.testing.assert_array_equal(removed, own_entry.astype(int))


def test_refuses_incompatible_datastore(ext_setup, tiny_lm, tmp_path):
    model, tok = tiny_lm
    with pytest.raises(MemlmError, match="built with model"):
        score_trime(tiny_gpt2(seed=1), tok, make_toy_docs(1), 16, datastore=ext_setup, k=4)
    final = build(tmp_path, tiny_lm, make_toy_docs(3), name="final", key=KeySpec("final"))
    with pytest.raises(MemlmError, match="keys"):
        score_trime(model, tok, make_toy_docs(1), 16, datastore=final, k=4)


# ------------------------------------------------------------------------------------------------- tuning


def constructed_dump(n=200, seed=0):
    """Lag 1 holds the target, lag 2 only wrong values; the retrieved entries (too weak to matter in the joint
    softmax) all hold the target for 90% of the tokens, so the extra interpolation (λ > 0) pays."""
    rng = np.random.default_rng(seed)
    ninf = -np.inf
    mem_all = np.full((n, 1, 4), ninf, np.float32)
    mem_hit = np.full((n, 1, 4), ninf, np.float32)
    mem_all[:, 0, 0], mem_hit[:, 0, 0] = 1.0, 0.0
    mem_all[:, 0, 1], mem_hit[:, 0, 1] = 1.0, 1.0
    mem_all[:, 0, 2] = 6.0
    mem_all[:, 0, 3], mem_hit[:, 0, 3] = 2.0, 2.0
    good = rng.random(n) < 0.9
    targets = np.full(n, 3, np.int64)
    ext_values = np.where(good[:, None], 3, 4).astype(np.int32).repeat(4, 1)
    ext_scores = rng.normal(-10.0, 1.0, (n, 4)).astype(np.float32)
    return TrimeScores(
        targets=targets,
        doc_index=np.zeros(n, np.int32),
        segment_index=np.zeros(n, np.int32),
        target_logit=np.zeros(n, np.float32),
        logit_lse=np.full(n, 3.0, np.float32),
        mem_all=mem_all,
        mem_hit=mem_hit,
        ext_scores=ext_scores,
        ext_values=ext_values,
        meta={"local_temperatures": [1.0]},
    )


def test_tuning_picks_the_best_grid_point():
    valid, test = constructed_dump(seed=0), constructed_dump(seed=1)
    segs, temps, lams = (None, 0, 1, 2, 3), (0.5, 1.0, 4.0), (0.0, 0.25, 0.5)
    res = tune_trime_inference(valid, segments=segs, temperatures=temps, lambdas=lams, test=test)
    assert len(res["grid"]) == len(segs) * len(temps) * len(lams)
    brute = {(s, t, lam): trime_perplexity(valid, s, t, lam)["ppl"] for s in segs for t in temps for lam in lams}
    best = min(brute, key=brute.get)
    b = res["best"]
    assert (b["segments"], b["temperature"], b["lambda"]) == best
    assert b["ppl"] == pytest.approx(brute[best])
    assert b["segments"] == 1  # lag 1 helps, lag 2 hurts: the constructed optimum
    assert b["lambda"] > 0  # the constructed optimum: p_kNN is right for 90% of the tokens
    assert res["test"]["ppl"] == pytest.approx(trime_perplexity(test, 1, b["temperature"], b["lambda"])["ppl"])
    # knn temperatures enlarge the grid only where λ > 0
    res2 = tune_trime_inference(valid, segments=(1,), temperatures=(1.0,), lambdas=(0.0, 0.5), knn_temperatures=(1, 2))
    assert len(res2["grid"]) == 3
    with pytest.raises(MemlmError, match="fits the dump"):
        tune_trime_inference(valid, segments=(5,))
