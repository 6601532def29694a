"""The lm-evaluation-harness adapter: scores equal brute-force sums, λ = 0 is the bare LM, rolling equals memlm eval,
sliding windows keep rolling linear, generation stops at `until`, the offline tasks run through simple_evaluate."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch
from conftest import Doc, make_toy_docs
from test_datastore import build

pytest.importorskip("lm_eval")
from lm_eval.api.instance import Instance  # noqa: E402

from memlm.errors import MemlmError  # noqa: E402
from memlm.lmeval.model import MemlmLM  # noqa: E402
from memlm.storage.index import build_index  # noqa: E402


def _req(kind: str, args: tuple, i: int = 0) -> Instance:
    return Instance(request_type=kind, doc={}, arguments=args, idx=i)


@pytest.fixture(scope="module")
def ds(tmp_path_factory, tiny_lm):
    path = tmp_path_factory.mktemp("lmeval-ds")
    store = build(path, tiny_lm, make_toy_docs(40, seed=3), window=48, min_context=16)
    build_index(store.keys, store.index_path, factory="Flat", metric="l2", progress=False)
    return store


def _brute_force_loglik(model, ds, seq: list[int], n_cont: int, lam: float, k: int, tau: float):
    """Sum of log((1-λ) p_LM + λ p_kNN) over the last n_cont tokens, everything recomputed by hand (NumPy)."""
    from memlm.models.keys import KeyCapture

    with torch.no_grad(), KeyCapture(model, [ds.key_spec]) as cap:
        logits = model(input_ids=torch.tensor([seq])).logits[0].double()
        keys = cap.keys_by_spec[ds.key_spec][0].double().numpy()
    all_keys = np.asarray(ds.keys, dtype=np.float64)
    total, greedy = 0.0, True
    for pos in range(len(seq) - 1 - n_cont, len(seq) - 1):
        p_lm = torch.softmax(logits[pos], -1).numpy()
        d = -((all_keys - keys[pos]) ** 2).sum(1)
        top = np.argsort(-d, kind="stable")[:k]
        w = np.exp((d[top] - d[top].max()) / tau)
        w /= w.sum()
        p_knn = np.zeros_like(p_lm)
        np.add.at(p_knn, np.asarray(ds.values)[top], w)
        p = (1 - lam) * p_lm + lam * p_knn
        total += math.log(p[seq[pos + 1]])
        greedy &= int(p.argmax()) == seq[pos + 1]
    return total, greedy


def _knn(store, k: int | None = None, tau: float | None = None) -> str:
    """The memory spec of one datastore at k and τ (unset: the defaults)."""
    options = "&".join(f"{n}={v}" for n, v in (("k", k), ("temperature", tau)) if v is not None)
    return f"knn:{store.path}" + (f"?{options}" if options else "")


def test_loglikelihood_equals_brute_force(tiny_lm, ds):
    model, tok = tiny_lm
    lm = MemlmLM(model=model, tokenizer=tok, memories=_knn(ds, 8, 3.0), mixture="knn=0.4", batch_size=2)
    pairs = [("the cat sat on", " the mat"), ("a dog ran", " in the park and"), ("bird", " sang"), ("", "the old")]
    got = lm.loglikelihood([_req("loglikelihood", p, i) for i, p in enumerate(pairs)])
    for (ctx, cont), (logp, greedy) in zip(pairs, got, strict=True):
        if ctx:
            c, whole = tok.encode(ctx), tok.encode(ctx + cont)
        else:  # empty context: lm_eval conditions on the prefix token (GPT-2 has BOS = EOS)
            c, whole = [tok.bos_token_id], [tok.bos_token_id, *tok.encode(cont)]
        ref, ref_greedy = _brute_force_loglik(model, ds, whole, len(whole) - len(c), 0.4, 8, 3.0)
        assert logp == pytest.approx(ref, rel=1e-4, abs=1e-4)
        assert greedy == ref_greedy
    # the kNN term matters: the bare LM gives other numbers
    bare = MemlmLM(model=model, tokenizer=tok).loglikelihood([_req("loglikelihood", p) for p in pairs])
    assert all(abs(a[0] - b[0]) > 1e-3 for a, b in zip(got, bare, strict=True))


REPLAY_TEXT = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu"


@pytest.fixture(scope="module")
def replay_ds(tmp_path_factory, tiny_lm):
    """One document in one window: a request that starts like it has exactly the datastore's keys."""
    store = build(tmp_path_factory.mktemp("replay"), tiny_lm, [Doc("g", REPLAY_TEXT)], window=64, min_context=1)
    build_index(store.keys, store.index_path, factory="Flat", metric="l2", progress=False)
    return store


def test_greedy_flag_follows_the_interpolated_distribution(tiny_lm, replay_ds):
    model, tok = tiny_lm
    ids = tok.encode(REPLAY_TEXT)
    reqs = [((tok.decode(ids[:6]), tok.decode(ids[6:])), ids[:6], ids[6:])]
    # λ = 1, k = 1: p is the nearest entry's value, here the text's own next token: greedy with probability 1
    lm = MemlmLM(model=model, tokenizer=tok, memories=_knn(replay_ds, 1), mixture="knn=1")
    logp, greedy = lm._loglikelihood_tokens(reqs)[0]
    assert greedy and logp == pytest.approx(0.0, abs=1e-5)
    # the bare random LM neither predicts it greedily nor with probability 1
    logp, greedy = MemlmLM(model=model, tokenizer=tok)._loglikelihood_tokens(reqs)[0]
    assert not greedy and logp < -10


def test_lambda_zero_equals_bare_lm(tiny_lm, ds):
    model, tok = tiny_lm
    pairs = [("the cat sat on", " the mat"), ("over the old", " river")]
    with_ds = MemlmLM(model=model, tokenizer=tok, memories=_knn(ds), mixture="knn=0").loglikelihood(
        [_req("loglikelihood", p) for p in pairs]
    )
    bare = MemlmLM(model=model, tokenizer=tok).loglikelihood([_req("loglikelihood", p) for p in pairs])
    for (ctx, cont), a, b in zip(pairs, with_ds, bare, strict=True):
        whole = tok.encode(ctx + cont)
        n = len(whole) - len(tok.encode(ctx))
        with torch.no_grad():
            lp = torch.log_softmax(model(input_ids=torch.tensor([whole])).logits[0].double(), -1)
        ref = sum(float(lp[p, whole[p + 1]]) for p in range(len(whole) - 1 - n, len(whole) - 1))
        assert a[0] == b[0]  # weight 0 adds exactly nothing
        assert a[0] == pytest.approx(ref, rel=1e-5)
    text = " ".join(d.text for d in make_toy_docs(3, seed=9))
    rolling = [_req("loglikelihood_rolling", (text,))]
    lm0 = MemlmLM(model=model, tokenizer=tok, memories=_knn(ds), mixture="knn=0", window=64, min_context=16)
    assert lm0.loglikelihood_rolling(rolling) == MemlmLM(
        model=model, tokenizer=tok, window=64, min_context=16
    ).loglikelihood_rolling(rolling)


def test_rolling_uses_sliding_windows_not_quadratic(tiny_lm):
    model, tok = tiny_lm
    text = " ".join(d.text for d in make_toy_docs(20, seed=1))
    n = len(tok.encode(text))
    lengths: list[int] = []
    handle = model.register_forward_pre_hook(lambda m, a, kw: lengths.append(kw["input_ids"].numel()), with_kwargs=True)
    try:
        lm = MemlmLM(model=model, tokenizer=tok, window=64, min_context=32, batch_size=1)
        lm.loglikelihood_rolling([_req("loglikelihood_rolling", (text,))])
    finally:
        handle.remove()
    assert max(lengths) <= 64
    # every token is read at most window / stride = 2 times (plus one window)
    assert sum(lengths) <= 2 * (n + 1) + 64
    assert n > model.config.n_positions  # longer than the model can read at once: only windows can score it


def test_generate_until_follows_the_datastore_and_stops(tiny_lm, replay_ds):
    model, tok = tiny_lm
    lm = MemlmLM(model=model, tokenizer=tok, memories=_knn(replay_ds, 1), mixture="knn=1")
    out = lm.generate_until(
        [
            _req("generate_until", ("alpha beta gamma", {"until": [" zeta"], "max_gen_toks": 10})),
            _req("generate_until", ("alpha beta", {"until": ["\n"], "max_gen_toks": 3})),
        ]
    )
    ids = tok.encode(REPLAY_TEXT)
    assert out == [" delta epsilon", tok.decode(ids[2:5])]  # stopped at " zeta"; 3 new tokens
    assert out[1] == " gamma delta e"


def test_bad_arguments(tiny_lm, ds):
    model, tok = tiny_lm
    with pytest.raises(MemlmError, match="weights given for knn, which are not memories of this mixture"):
        MemlmLM(model=model, tokenizer=tok, mixture="knn=0.2")
    with pytest.raises(MemlmError, match="the LM's weight would be <= 0"):
        MemlmLM(model=model, tokenizer=tok, memories=f"{_knn(ds)};cache", mixture="knn=0.8;cache=0.5")
    for old, new in (("datastore", "memories=knn:DIR"), ("lam", "mixture=knn=λ"), ("ngram_lambda_dense", "mixture=")):
        with pytest.raises(MemlmError, match=f"instead of {old}= give {new}"):
            MemlmLM(model=model, tokenizer=tok, **{old: 0.2})
    with pytest.raises(MemlmError, match="unknown MemlmLM argument"):
        MemlmLM(model=model, tokenizer=tok, lamda=0.2)
    with pytest.raises(MemlmError, match="no tokenizer"):
        MemlmLM(model=model)


def test_cli_lm_eval_wikitext2_word_perplexity(tiny_lm, tiny_lm_dir, tmp_path, capfd, monkeypatch):
    """`memlm lm-eval` runs lm_eval.simple_evaluate on a MemlmLM; word perplexity is lm_eval's definition. Run outside
    a git checkout, it prints neither git's `fatal: not a git repository` (lm_eval records a git hash) nor lm_eval's
    hint about its `--metadata` flag, which memlm does not have."""
    import json

    from lm_eval.tasks.wikitext.preprocess_wikitext import wikitext_detokenizer

    from memlm.cli import main
    from memlm.data.corpora import load_documents

    out = tmp_path / "r.json"
    args = ["lm-eval", "--model", str(tiny_lm_dir), "--tasks", "memlm_wikitext2", "--window", "256"]
    args += ["--min-context", "64", "--samples", '{"memlm_wikitext2": [14]}', "--out", str(out)]
    monkeypatch.chdir(tmp_path)  # not a git checkout
    assert main(args) == 0
    record = json.loads(out.read_text())
    got = record["results"]["memlm_wikitext2"]["word_perplexity,none"]
    assert record["memlm"]["window"] == 256 and record["memlm"]["memories"] == ""
    printed = capfd.readouterr()
    assert "word_perplexity" in printed.out
    assert "not a git repository" not in printed.err and "--metadata" not in printed.out + printed.err
    model, tok = tiny_lm
    lm = MemlmLM(model=model, tokenizer=tok, window=256, min_context=64)
    page = load_documents("wikitext2", "test")[14].text
    ll = lm.loglikelihood_rolling([_req("loglikelihood_rolling", (wikitext_detokenizer({"page": page}),))])[0]
    words = len(re.split(r"\s+", page))  # lm_eval counts words on the raw page
    assert got == pytest.approx(math.exp(-ll / words), rel=1e-6)


def test_cli_lm_eval_errors(tiny_lm_dir, capsys):
    from memlm.cli import main

    base = ["lm-eval", "--model", str(tiny_lm_dir)]
    assert main([*base, "--tasks", "memlm_wikitext2", "--samples", "{bad"]) == 2
    assert "--samples is not valid JSON" in capsys.readouterr().err
    assert main([*base, "--tasks", "hellaswag_nope"]) == 2
    assert "unknown lm-eval task" in capsys.readouterr().err
