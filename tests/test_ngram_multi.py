"""Several ∞-gram indexes at once (``memlm eval --ngram A --ngram B``, ``memlm generate|lm-eval --memory A --memory
B``, ``memlm tune``, ``MemlmLM(memories="ngram:A;ngram:B")``): the mixture of Liu et al. (2024)'s interpolation with
one (λ_sparse, λ_dense) pair per reference, checked against NumPy (P∞ of each reference from a scan of its tokens,
p_kNN from an exact search: Khandelwal et al. Eq. 2)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("infini_gram")
sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import Doc, gpt2_tokenizer, make_toy_docs  # noqa: E402
from test_ngram import Brute, _brute_p_inf, _ids  # noqa: E402

from memlm.knnlm.table import TokenTable  # noqa: E402
from memlm.ngram.index import build_ngram_index  # noqa: E402


def _corpora() -> tuple[list[Doc], list[Doc]]:
    a_docs = make_toy_docs(60, seed=3) + [Doc("rep", "the old river ran over the park while a bird sang")]
    b_docs = make_toy_docs(25, seed=11) + [Doc("rep", make_toy_docs(8, seed=31)[2].text)]  # holds an eval doc
    return a_docs, b_docs


@pytest.fixture(scope="module")
def two_indexes(tmp_path_factory):
    """Two tiny indexes over different toy corpora (no calibration: eval falls back to 0.1 / 0.03 for each)."""
    tok = gpt2_tokenizer()
    root = tmp_path_factory.mktemp("ng2")
    a_docs, b_docs = _corpora()
    a = build_ngram_index(tok, a_docs, root / "a", source={"corpus": "toy-a"}, progress=False)
    b = build_ngram_index(tok, b_docs, root / "b", source={"corpus": "toy-b"}, progress=False)
    return a, b


@pytest.fixture(scope="module")
def ds(tmp_path_factory, tiny_lm):
    """A datastore of the tiny LM over the toy documents, on an exact (flat L2) index."""
    from memlm.knnlm.write import write_datastore

    model, tok = tiny_lm
    store = write_datastore(model, tok, make_toy_docs(), tmp_path_factory.mktemp("ds") / "ds", window=64,
                            min_context=32, progress=False)  # fmt: skip
    store.build_index(factory="Flat", metric="l2", progress=False)
    return store


@pytest.fixture()
def eval_docs(tmp_path):
    docs = tmp_path / "e.jsonl"
    docs.write_text("".join(json.dumps({"id": d.id, "text": d.text}) + "\n" for d in make_toy_docs(8, seed=31)))
    return docs


def _eval(tiny_lm_dir, docs, ngrams, tmp_path, name, extra=()) -> tuple[dict, TokenTable]:
    from memlm.cli import main

    dump, res = tmp_path / f"{name}.npz", tmp_path / f"{name}.json"
    # --allow-overlap: index b holds one evaluated document on purpose (long matches, sparse estimates)
    argv = ["eval", "--model", str(tiny_lm_dir), "--corpus", str(docs), "--window", "64", "--min-context", "32",
            "--dtype", "float32", "--dump", str(dump), "--json", str(res), "--allow-overlap", *extra]  # fmt: skip
    for ix in ngrams:
        argv += ["--memory", str(ix.path)]
    assert main(argv) == 0
    return json.loads(res.read_text()), TokenTable.load(dump)


def _by_hand(ts: TokenTable, weights, lam: float = 0.0, knn: np.ndarray | None = None) -> np.ndarray:
    """log P(target) = log[(1 - λ - Σ_r λ_r) P_LM + λ P_kNN + Σ_r λ_r P∞_r], λ_r = λ_sparse,r where reference r is
    sparse, else λ_dense,r: from the dump's per-reference columns, in float64."""
    cols = [(ts.columns[name]["logprob"], ts.columns[name]["sparse"]) for name in ts.names("ngram")]
    p_lm = np.exp(ts.lm_logprob.astype(np.float64))
    lam_r = [np.where(sp, w[0], w[1]) for (_, sp), w in zip(cols, weights, strict=True)]
    p = (1.0 - lam - sum(lam_r)) * p_lm
    if knn is not None:
        p = p + lam * np.exp(knn.astype(np.float64))
    for (lp, _), lr in zip(cols, lam_r, strict=True):
        p = p + lr * np.exp(lp.astype(np.float64))
    return np.log(p)


def test_eval_and_tune_with_two_ngram_indexes(tiny_lm_dir, two_indexes, eval_docs, tmp_path):
    """eval --ngram A --ngram B: each reference's column is what that index alone dumps; the mixture's per-token
    probability and perplexity are Σ λ_i P_i by hand; tune then fits the rule over both (EM per joint sparse state,
    no worse on valid than either alone) and applies it to the test dump."""
    from memlm.cli import main
    from memlm.mixing.dump import rule_logprob

    a, b = two_indexes
    res, ts = _eval(tiny_lm_dir, eval_docs, [a, b], tmp_path, "ab")
    _, ts_a = _eval(tiny_lm_dir, eval_docs, [a], tmp_path, "a")
    _, ts_b = _eval(tiny_lm_dir, eval_docs, [b], tmp_path, "b")
    # the table: the first index as component ngram, the second as ngram2, exactly as each alone
    assert ts.names() == ("ngram", "ngram2")
    for f in ("logprob", "sparse", "n", "count"):
        np.testing.assert_array_equal(ts.columns["ngram"][f], ts_a.columns["ngram"][f])
        np.testing.assert_array_equal(ts.columns["ngram2"][f], ts_b.columns["ngram"][f])
    described = [ts.meta["components"][n]["ngram_build_id"] for n in ts.names()]
    assert described == [a.manifest["build_id"], b.manifest["build_id"]]
    # the result records each memory and its weights (no calibration: the fallback 0.1 / 0.03 each)
    assert [r["ngram"] for r in res["ngrams"]] == [str(a.path), str(b.path)]
    assert all((r["lambda_sparse"], r["lambda_dense"]) == (0.1, 0.03) for r in res["ngrams"])
    assert res["multi_ngram_weights"] == [[0.1, 0.03], [0.1, 0.03]]
    want = _by_hand(ts, res["multi_ngram_weights"])
    assert np.isfinite(want).all() and (ts.columns["ngram2"]["sparse"].any() or ts.columns["ngram"]["sparse"].any())
    weights = dict(zip(("ngram", "ngram2"), res["multi_ngram_weights"], strict=True))
    np.testing.assert_allclose(rule_logprob(ts, weights).numpy(), want, rtol=1e-6, atol=1e-9)
    assert res["multi_ngram_ppl"] == pytest.approx(float(np.exp(-want.mean())), rel=1e-6)
    # each index alone beside the LM, as one --ngram reports it
    alone_b = json.loads((tmp_path / "b.json").read_text())
    assert res["ngrams"][1]["ngram_ppl"] == pytest.approx(alone_b["ngram_ppl"], rel=1e-12)

    assert main(["tune", "--allow-overlap", "--valid", str(tmp_path / "ab.npz"), "--test", str(tmp_path / "ab.npz"),
                 "--json", str(tmp_path / "t.json")]) == 0  # fmt: skip
    t = json.loads((tmp_path / "t.json").read_text())
    best = t["best"]
    assert {"ngram_sparse", "ngram_dense", "ngram2_sparse", "ngram2_dense"} <= set(best)
    assert t["test"]["mixture_ppl"] == pytest.approx(best["ppl"], rel=1e-9) == pytest.approx(t["valid"]["mixture_ppl"])
    g = (0.0, 0.05, 0.1, 0.2, 0.4)
    for r in range(2):  # fitted together: no worse than either index alone with its own best pair on a grid
        alone = min(float(np.exp(-_by_hand(ts, [(x, y) if i == r else (0.0, 0.0) for i in range(2)]).mean()))
                    for x in g for y in g)  # fmt: skip
        assert best["ppl"] <= alone * (1 + 1e-6)
    # a test dump scored with other indexes is refused
    assert (
        main(["tune", "--allow-overlap", "--valid", str(tmp_path / "ab.npz"), "--test", str(tmp_path / "a.npz")]) != 0
    )


def test_eval_and_tune_with_datastore_and_two_ngram_indexes(tiny_lm_dir, two_indexes, ds, eval_docs, tmp_path):
    """LM + kNN + two ∞-grams: weights set apart that sum past 1 are scaled to leave the LM >= 0, the four-way
    mixture equals the formula by hand; tune fits λ, τ and each index's pair."""
    from memlm.cli import main
    from memlm.mixing.inputs import memory_logprob

    extra = ["--memory", str(ds.path), "--k", "8", "--lambda", "0.5", "--temperature", "1",
             "--ngram-lambda-sparse", "0.9", "--ngram-lambda-dense", "0.2"]  # fmt: skip
    res, ts = _eval(tiny_lm_dir, eval_docs, two_indexes, tmp_path, "kab", extra)
    w = res["knn_multi_ngram_weights"]
    scale = 0.5 * 0.9 / 1.8  # (1 - λ) W / S: the two share what one reference of weight W = 0.9 would get
    assert w["lambda"] == 0.5 and w["weights"] == [pytest.approx([0.9 * scale, 0.2 * scale])] * 2
    knn = memory_logprob(ts.columns["knn"]["scores"], ts.columns["knn"]["values"], ts.targets, 1.0).numpy()
    want = _by_hand(ts, w["weights"], lam=0.5, knn=knn)
    assert np.isfinite(want).all()  # the LM keeps weight 1 - 0.5 - 2 * 0.9 * scale = 0.05
    assert res["knn_multi_ngram_ppl"] == pytest.approx(float(np.exp(-want.mean())), rel=1e-6)
    assert res["multi_ngram_weights"] == [pytest.approx([0.45, 0.1])] * 2  # without the kNN term: W / S = 0.5
    assert res["multi_ngram_ppl"] == pytest.approx(float(np.exp(-_by_hand(ts, [[0.45, 0.1]] * 2).mean())), rel=1e-6)
    # the combined rows' intervals and paired differences, beside the kNN-LM's
    for system, ref in (("multi_ngram_ppl", "base_ppl"), ("knn_multi_ngram_ppl", "base_ppl"),
                        ("knn_multi_ngram_ppl", "knn_ppl"), ("knn_ppl", "base_ppl")):  # fmt: skip
        assert res["differences"][f"{system} vs {ref}"]["relative_change"] == pytest.approx(
            res[system] / res[ref] - 1, rel=1e-6)  # fmt: skip
        assert res["intervals"][system]["ppl"] == pytest.approx(res[system], rel=1e-9)
    assert main(["tune", "--allow-overlap", "--valid", str(tmp_path / "kab.npz"), "--temperatures", "1", "10",
                 "--json", str(tmp_path / "t.json")]) == 0  # fmt: skip
    t = json.loads((tmp_path / "t.json").read_text())
    best = t["best"]
    assert best["temperature"] in (1.0, 10.0) and {"knn", "ngram_sparse", "ngram2_dense"} <= set(best)
    assert t["mixture"]["fit"]["mixture"]["components"] == ["lm", "knn", "ngram", "ngram2"]
    assert best["ppl"] == pytest.approx(t["valid"]["mixture_ppl"], rel=1e-9) and best["ppl"] <= res["base_ppl"] * (
        1 + 1e-9
    )


def test_same_index_twice_is_refused(tiny_lm_dir, two_indexes, eval_docs, capsys):
    from memlm.cli import main

    a, _ = two_indexes
    argv = ["eval", "--model", str(tiny_lm_dir), "--corpus", str(eval_docs), "--memory", str(a.path), "--memory",
            str(a.path)]  # fmt: skip
    assert main(argv) != 0
    assert "same index twice" in capsys.readouterr().err


# ------------------------------------------------------------------------ generate and lm-eval with two indexes


def _p_knn(model, ds, seqs: list[list[int]], k: int, tau: float) -> np.ndarray:
    """p_kNN(. | seq) [rows, V] at the last position of each (equal-length) row: Khandelwal et al.'s Eq. 2 over an
    exact NumPy search (negative squared L2 distance, the k nearest, softmax of distance / τ)."""
    from memlm.models.keys import KeyCapture

    with torch.no_grad(), KeyCapture(model, [ds.key_spec]) as cap:
        model(input_ids=torch.tensor(seqs))
        queries = cap.keys_by_spec[ds.key_spec][:, -1].double().numpy()
    keys, values = np.asarray(ds.keys, dtype=np.float64), np.asarray(ds.values)
    out = np.zeros((len(seqs), model.config.vocab_size))
    for i, q in enumerate(queries):
        d = -((keys - q) ** 2).sum(1)
        top = np.argsort(-d, kind="stable")[:k]
        w = np.exp((d[top] - d[top].max()) / tau)
        np.add.at(out[i], values[top], w / w.sum())
    return out


def _mixture(p_lm, context, brutes, weights, lam=0.0, p_knn=None) -> tuple[np.ndarray, list[bool]]:
    """(1 - λ - Σ_r λ_r) p_LM + λ p_kNN + Σ_r λ_r P∞_r over the vocabulary, λ_r = λ_sparse,r where reference r's
    P∞ (a scan of its tokens) is sparse after ``context``, else λ_dense,r; and each reference's sparse flag."""
    refs = [_brute_p_inf(b, list(context), len(p_lm)) for b in brutes]
    lam_r = [w[0] if sparse else w[1] for (_, sparse), w in zip(refs, weights, strict=True)]
    p = (1.0 - lam - sum(lam_r)) * p_lm
    if p_knn is not None:
        p = p + lam * p_knn
    for (p_inf, _), lr in zip(refs, lam_r, strict=True):
        p = p + lr * p_inf
    return p, [sparse for _, sparse in refs]


def test_generation_step_with_two_indexes_is_the_mixture_by_hand(tiny_lm, two_indexes, ds):
    """One generation step, three rows, two ∞-gram references each at its own (λ_sparse, λ_dense): alone beside the
    LM and with the kNN term, every row's distribution is the mixture computed by hand. Fails on the old code (no
    processor for several indexes)."""
    from memlm.knnlm.generate import MixtureLogitsProcessor

    model, tok = tiny_lm
    brutes = [Brute(tok, docs) for docs in _corpora()]
    b_rep = _corpora()[1][-1].text  # a document of B only: long matches there
    rows = [
        _ids(tok, "the old river ran over the"),
        _ids(tok, b_rep)[:6],
        _ids(tok, "a bird sang in the dog"),
    ]
    assert len({len(r) for r in rows}) == 1
    ws, lam, k, tau = [(0.5, 0.2), (0.3, 0.1)], 0.15, 8, 2.0
    indexes = ";".join(f"ngram:{ix.path}" for ix in two_indexes)
    weights = ";".join(f"{n}={s}/{d}" for n, (s, d) in zip(("ngram", "ngram2"), ws, strict=True))
    proc = MixtureLogitsProcessor(None, indexes, weights)
    ids = torch.tensor(rows)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[:, -1]
        alone = torch.exp(proc(ids, logits).double()).numpy()
        memories = f"knn:{ds.path}?k={k}&temperature={tau};{indexes}"
        with MixtureLogitsProcessor(model, memories, f"knn={lam};{weights}") as knn_proc:
            both = torch.exp(knn_proc(ids, model(input_ids=ids).logits[:, -1]).double()).numpy()
    p_lm = torch.softmax(logits.double(), -1).numpy()
    p_knn = _p_knn(model, ds, rows, k, tau)
    flags = []
    for i, row in enumerate(rows):
        want, sparse = _mixture(p_lm[i], row, brutes, ws)
        np.testing.assert_allclose(alone[i], want, rtol=1e-4, atol=1e-7)
        want3, _ = _mixture(p_lm[i], row, brutes, ws, lam=lam, p_knn=p_knn[i])
        np.testing.assert_allclose(both[i], want3, rtol=1e-4, atol=1e-7)
        flags += sparse
    assert True in flags and False in flags  # both weights of the pairs are exercised
    assert proc.components[0].steps == proc.components[1].steps == len(rows)  # each reference searched at each step


def _greedy_by_hand(model, prompt, steps, brutes, weights, lam=0.0, ds=None, k=8, tau=1.0) -> list[int]:
    seq = list(prompt)
    for _ in range(steps):
        with torch.no_grad():
            p_lm = torch.softmax(model(input_ids=torch.tensor([seq])).logits[0, -1].double(), -1).numpy()
        p_knn = None if ds is None else _p_knn(model, ds, [seq], k, tau)[0]
        p, _ = _mixture(p_lm, seq, brutes, weights, lam, p_knn)
        seq.append(int(p.argmax()))
    return seq[len(prompt) :]


def test_cli_generate_with_two_indexes(tiny_lm, tiny_lm_dir, two_indexes, ds, capsys):
    """`memlm generate --memory A --memory B` (with per-index weights; alone and with a datastore, where weights that
    sum past 1 are shared as memlm eval shares them): greedy decoding picks the argmax of the mixture by hand at every
    step, and --show-sources lists each token's suffix in each index."""
    from memlm.cli import main

    model, tok = tiny_lm
    brutes = [Brute(tok, docs) for docs in _corpora()]
    a, b = two_indexes
    prompt = "the old river"
    base = ["generate", "--model", str(tiny_lm_dir), "--memory", str(a.path), "--memory", str(b.path), "--prompt",
            prompt, "--max-new-tokens", "4", "--greedy", "--show-sources", "1", "--dtype", "float32"]  # fmt: skip
    assert main([*base, "--ngram-lambda-sparse", "0.5", "0.3", "--ngram-lambda-dense", "0.2", "0.1"]) == 0
    out = capsys.readouterr().out
    want = _greedy_by_hand(model, _ids(tok, prompt), 4, brutes, [(0.5, 0.2), (0.3, 0.1)])
    assert out.startswith(prompt + tok.decode(want) + "\n")
    lines = out.splitlines()[-8:]  # two lines per generated token, one per index
    assert [line.split("] ")[0].split("[")[-1] for line in lines] == ["1:a", "2:b"] * 4
    assert all("occurrences" in line for line in lines)
    # with the kNN term: λ 0.5 + Σ_r max(λ_sparse,r, λ_dense,r) = 1.5 > 1, so the pairs are scaled by (1 - λ) W / S
    argv = [*base, "--memory", f"{ds.path}?k=8", "--lambda", "0.5", "--temperature", "2",
            "--ngram-lambda-sparse", "0.9", "0.6", "--ngram-lambda-dense", "0.2", "0.1"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    scale = (1 - 0.5) * 0.9 / (0.9 + 0.6)
    weights = [(0.9 * scale, 0.2 * scale), (0.6 * scale, 0.1 * scale)]
    want = _greedy_by_hand(model, _ids(tok, prompt), 4, brutes, weights, lam=0.5, ds=ds, k=8, tau=2.0)
    assert out.startswith(prompt + tok.decode(want))
    assert "[2:b] suffix" in out
    # a weight per index must come once for all or once per index
    assert main([*base, "--ngram-lambda-sparse", "0.1", "0.2", "0.3"]) != 0
    assert "3 values for 2" in capsys.readouterr().err


def test_lm_eval_adapter_with_two_indexes_equals_by_hand(tiny_lm, tiny_lm_dir, two_indexes, ds):
    """MemlmLM with two ∞-gram memories and a pair of weights per index: every rolling log-probability, and a
    loglikelihood request with the datastore too (its greedy flag from the mixed distribution), equal the mixture by
    hand; lm_eval's string form (``memories=ngram:A;ngram:B,mixture=ngram=a/b;ngram2=c/d`` through
    ``create_from_arg_string``) gives the same model."""
    pytest.importorskip("lm_eval")
    from memlm.lmeval.model import MemlmLM

    model, tok = tiny_lm
    brutes = [Brute(tok, docs) for docs in _corpora()]
    a, b = two_indexes
    ws = [(0.6, 0.3), (0.2, 0.1)]
    weights = "ngram=0.6/0.3;ngram2=0.2/0.1"
    lm = MemlmLM(model=model, tokenizer=tok, memories=[str(a.path), str(b.path)], mixture=weights, window=64,
                 min_context=32)  # fmt: skip
    assert lm.memory_settings["memories"] == f"ngram:{a.path}?k=1000;ngram:{b.path}?k=1000"
    tokens = _ids(tok, "the old river ran over the park while the cat sat on a mat")
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([[lm.prefix_token_id, *tokens]])).logits[0].double()
    p_lm = torch.softmax(logits, -1).numpy()
    want = [math.log(_mixture(p_lm[t], tokens[:t], brutes, ws)[0][tokens[t]]) for t in range(len(tokens))]
    got = lm.rolling_token_logprobs(tokens)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    as_string = MemlmLM(model=model, tokenizer=tok, memories=f"ngram:{a.path};ngram:{b.path}", mixture=weights,
                        window=64, min_context=32)  # fmt: skip
    assert as_string.memory_settings == lm.memory_settings
    np.testing.assert_array_equal(as_string.rolling_token_logprobs(tokens), got)
    from_args = MemlmLM.create_from_arg_string(  # what lm_eval does with --model_args
        f"model={tiny_lm_dir},memories={a.path};{b.path},mixture={weights},window=64,min_context=32,dtype=float32"
    )
    assert from_args.memory_settings == lm.memory_settings

    # loglikelihood with the datastore: (1 - λ - Σ λ_r) p_LM + λ p_kNN + Σ λ_r P∞_r (0.1 + 0.8 <= 1: as given)
    lam, k, tau = 0.1, 8, 2.0
    lm3 = MemlmLM(model=model, tokenizer=tok, memories=[f"{ds.path}?k={k}&temperature={tau}", a.path, b.path],
                  mixture=f"knn={lam};{weights}", window=64, min_context=32)  # fmt: skip
    ctx, cont = _ids(tok, "the old river"), _ids(tok, " ran over the park")
    ((ll, greedy),) = lm3._loglikelihood_tokens([(("a", "b"), ctx, cont)])
    seq = ctx + cont
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([seq])).logits[0].double()
    total, all_greedy = 0.0, True
    for pos in range(len(ctx) - 1, len(seq) - 1):
        p_knn = _p_knn(model, ds, [seq[: pos + 1]], k, tau)[0]
        p, _ = _mixture(torch.softmax(logits[pos], -1).numpy(), seq[: pos + 1], brutes, ws, lam, p_knn)
        total += math.log(p[seq[pos + 1]])
        all_greedy &= int(p.argmax()) == seq[pos + 1]
    assert ll == pytest.approx(total, rel=1e-5) and greedy == all_greedy


def test_cli_lm_eval_with_two_indexes(tiny_lm, tiny_lm_dir, two_indexes, tmp_path, monkeypatch):
    """`memlm lm-eval --memory A --memory B` with a weight per index: the record names both indexes and the word
    perplexity is the one MemlmLM with the same memories and weights gives (itself checked by hand above)."""
    pytest.importorskip("lm_eval")
    import re

    from lm_eval.api.instance import Instance
    from lm_eval.tasks.wikitext.preprocess_wikitext import wikitext_detokenizer

    from memlm.cli import main
    from memlm.data.corpora import load_documents
    from memlm.lmeval.model import MemlmLM

    a, b = two_indexes
    out = tmp_path / "r.json"
    args = ["lm-eval", "--model", str(tiny_lm_dir), "--tasks", "memlm_wikitext2", "--window", "256", "--min-context",
            "64", "--samples", '{"memlm_wikitext2": [14]}', "--out", str(out), "--memory", str(a.path), "--memory",
            str(b.path), "--ngram-lambda-sparse", "0.5", "0.2", "--ngram-lambda-dense", "0.1"]  # fmt: skip
    monkeypatch.chdir(tmp_path)
    assert main(args) == 0
    record = json.loads(out.read_text())
    assert record["memlm"]["memories"] == f"ngram:{a.path}?k=1000;ngram:{b.path}?k=1000"
    model, tok = tiny_lm
    lm = MemlmLM(model=model, tokenizer=tok, memories=[a.path, b.path], mixture="ngram=0.5/0.1;ngram2=0.2/0.1",
                 window=256, min_context=64)  # fmt: skip
    assert lm.memory_settings["mixture"] == record["memlm"]["mixture"]
    page = load_documents("wikitext2", "test")[14].text
    text = wikitext_detokenizer({"page": page})
    (ll,) = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)])
    words = len(re.split(r"\s+", page))
    got = record["results"]["memlm_wikitext2"]["word_perplexity,none"]
    assert got == pytest.approx(math.exp(-ll / words), rel=1e-6)


def test_wrap_with_two_indexes_generates_the_mixture_by_hand(tiny_lm, two_indexes, ds):
    """``memlm.wrap(model, "knn:DS;ngram:A;ngram:B", weights)``: greedy ``generate`` picks the argmax of
    λ p_kNN + Σ_r λ_r P∞_r + rest · p_LM by hand at every step (weights scaled as ``memlm generate`` scales them), and
    a list of one index gives what the spec string of it gives."""
    import memlm

    model, tok = tiny_lm
    brutes = [Brute(tok, docs) for docs in _corpora()]
    a, b = two_indexes
    prompt = _ids(tok, "the old river")
    knn = f"knn:{ds.path}?k=8&temperature=2"
    knn_lm = memlm.wrap(model, f"{knn};ngram:{a.path};ngram:{b.path}", "knn=0.5;ngram=0.9/0.2;ngram2=0.6/0.1")
    out = knn_lm.generate(torch.tensor([prompt]), max_new_tokens=4, do_sample=False)[0, len(prompt) :].tolist()
    scale = (1 - 0.5) * 0.9 / (0.9 + 0.6)
    weights = [(0.9 * scale, 0.2 * scale), (0.6 * scale, 0.1 * scale)]
    assert out == _greedy_by_hand(model, prompt, 4, brutes, weights, lam=0.5, ds=ds, k=8, tau=2.0)
    one = memlm.wrap(model, [knn, a.path], "knn=0.5;ngram=0.3/0.1")
    same = memlm.wrap(model, f"{knn};{a.path}", "knn=0.5;ngram=0.3/0.1")
    gen = [m.generate(torch.tensor([prompt]), max_new_tokens=4, do_sample=False) for m in (one, same)]
    assert torch.equal(gen[0], gen[1])
