"""``memlm tune`` and ``memlm eval --mixture FIT.json``: the mixture of every memory of a dump fitted on valid by the
one fitter (the rule by EM, or the guarded mixture), τ searched, applied to test; its numbers checked against the
formulas by hand (P = Σ_i λ_i P_i with the stored fit's weights)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import make_toy_docs  # noqa: E402
from test_mixture import synthetic_dump  # noqa: E402

from memlm.cli import main  # noqa: E402
from memlm.errors import MemlmError  # noqa: E402
from memlm.knnlm.table import TokenTable  # noqa: E402
from memlm.mixing.dump import DumpMixture, rule_logprob  # noqa: E402


def _save(ts: TokenTable, path: Path) -> str:
    ts.save(path)
    return str(path)


def _by_hand(fit: dict, ts: TokenTable) -> np.ndarray:
    """log Σ_i λ_ti p_ti with λ_t = softmax(W (φ_t - mean) / std + b) from the stored fit, in NumPy float64."""
    from memlm.mixing.inputs import mixture_inputs

    rec = fit["mixture"]
    inp = mixture_inputs(ts, rec["temperature"] or 1.0, rec["k"], rec["cache_temperature"] or 1.0)
    m = rec["fit"]["mixture"]
    assert list(inp.components) == m["components"] and list(inp.feature_names) == m["feature_names"]
    z = (inp.features - np.asarray(m["feature_mean"])) / np.asarray(m["feature_std"])
    b = np.asarray([-np.inf if x is None else x for x in m["b"]])
    a = z @ np.asarray(m["W"]).T + b
    lam = np.exp(a - a.max(1, keepdims=True))
    lam /= lam.sum(1, keepdims=True)
    with np.errstate(divide="ignore"):
        return np.log((lam * np.exp(inp.logprobs)).sum(1))


def _rule_by_hand(fit: dict, ts: TokenTable) -> tuple[np.ndarray, np.ndarray]:
    """``(p [N, C], λ [N, C])`` of a stored rule fit: each component's probability of the target and its weight in
    the token's sparse state of the ∞-gram (one constant weight vector per state), in NumPy float64."""
    from memlm.mixing.inputs import mixture_inputs

    rec = fit["mixture"]
    p = np.exp(mixture_inputs(ts, rec["temperature"] or 1.0, rec["k"], rec["cache_temperature"] or 1.0).logprobs)
    m = rec["fit"]["mixture"]
    sparse = np.asarray(ts.columns["ngram"]["sparse"], dtype=bool)
    assert m["feature_names"] == ["sparse_state:ngram=0", "sparse_state:ngram=1"]
    onehot = np.stack([~sparse, sparse], 1).astype(np.float64)
    a = onehot @ np.asarray(m["W"]).T + np.asarray([-np.inf if x is None else x for x in m["b"]])
    lam = np.exp(a - a.max(1, keepdims=True))
    return p, lam / lam.sum(1, keepdims=True)


def test_tune_fits_the_rule_by_em_and_the_guarded_mixture(tmp_path, capsys):
    """A dump with kNN neighbours, an ∞-gram and the cache: ``memlm tune`` (the rule, the default) fits one weight
    vector per sparse state of the ∞-gram by EM at each τ and keeps the most likely τ: on valid each weight is its
    component's mean posterior in its state (EM's fixed point, the maximum), on test the perplexity is the rule's
    formula by hand, and ``best`` summarises it (the ∞-gram's λ_sparse / λ_dense); --mixture guarded fits the gate's
    form, its test perplexity the stored fit's by hand; the small slice is warned about once."""
    valid, test = _save(synthetic_dump(0, n=600), tmp_path / "v.npz"), _save(synthetic_dump(1), tmp_path / "t.npz")
    argv = ["tune", "--valid", valid, "--test", test, "--temperatures", "1", "3", "--cache-temperatures", "0.5", "2"]
    assert main([*argv, "--json", str(tmp_path / "r.json")]) == 0  # the default form: the rule
    err = capsys.readouterr().err
    assert "fitted on 600 tokens (fewer than 4,096)" in err and err.count("fewer than 4,096") == 1
    r = json.loads((tmp_path / "r.json").read_text())
    best, fit = r["best"], r["mixture"]
    assert best["form"] == "rule" and fit["fit"]["mixture"]["components"] == ["lm", "knn", "ngram", "cache"]
    assert [(x["temperature"], x["cache_temperature"]) for x in fit["search"]] == [(1, 0.5), (1, 2), (3, 0.5), (3, 2)]
    chosen = max(fit["search"], key=lambda x: x["heldout_loglik"]["rule"])  # τ, τc by the likelihood on valid
    assert (chosen["temperature"], chosen["cache_temperature"]) == (best["temperature"], best["cache_temperature"])
    v, t = TokenTable.load(valid), TokenTable.load(test)
    p, lam = _rule_by_hand(r, v)
    post = lam * p / (lam * p).sum(1, keepdims=True)
    sparse = np.asarray(v.columns["ngram"]["sparse"], dtype=bool)
    for state in (sparse, ~sparse):  # EM's fixed point in each state: λ_i = mean posterior of component i
        np.testing.assert_allclose(post[state].mean(0), lam[state][0], atol=1e-6)
    assert best["ngram_sparse"] == pytest.approx(lam[sparse][0, 2]) and best["ngram_dense"] == pytest.approx(
        lam[~sparse][0, 2])  # fmt: skip
    assert r["valid"]["mixture_ppl"] == pytest.approx(float(np.exp(-np.log((lam * p).sum(1)).mean())), rel=1e-9)
    p, lam = _rule_by_hand(r, t)
    assert r["test"]["mixture_ppl"] == pytest.approx(float(np.exp(-np.log((lam * p).sum(1)).mean())), rel=1e-9)
    assert set(r["test"]["differences"]) == {"mixture_ppl vs base_ppl"}
    assert main([*argv, "--mixture", "guarded", "--json", str(tmp_path / "g.json")]) == 0
    g = json.loads((tmp_path / "g.json").read_text())
    assert g["best"]["form"] == g["mixture"]["fit"]["form"] in ("lm", "constant", "gate")
    chosen = max(g["mixture"]["search"], key=lambda x: x["heldout_loglik"][x["form"]])  # by the kept part's
    assert chosen["temperature"] == g["mixture"]["temperature"]
    assert g["test"]["mixture_ppl"] == pytest.approx(float(np.exp(-_by_hand(g, t).mean())), rel=1e-9)
    res = g["test"]
    assert res["intervals"]["mixture_ppl"]["low"] <= res["mixture_ppl"] <= res["intervals"]["mixture_ppl"]["high"]


def _unrepresentative(seed: int, docs: int, right_in: int, n_per_doc: int = 80) -> TokenTable:
    """LM p ~ U(0.05, 0.6); the ∞-gram sparse on 40% of tokens, its estimate right (P∞ = 1) in the first
    ``right_in`` documents and wrong (P∞ = 0) in the others; dense: P∞ = 0.02."""
    ts = synthetic_dump(seed, n=docs * n_per_doc)
    n = len(ts)
    rng = np.random.default_rng(seed + 100)
    ts.lm_logprob = np.log(rng.uniform(0.05, 0.6, n)).astype(np.float32)
    ts.doc_index = (np.arange(n) // n_per_doc).astype(np.int32)
    ts.columns["ngram"]["sparse"] = rng.random(n) < 0.4
    right = ts.doc_index < right_in
    with np.errstate(divide="ignore"):
        p = np.where(ts.columns["ngram"]["sparse"], np.log(right.astype(float)), np.log(0.02))
    ts.columns["ngram"]["logprob"] = p.astype(np.float32)
    return ts.select(["ngram"])


def test_a_gate_fitted_where_it_overfits_ends_no_worse_than_the_lm_on_test(tmp_path, capsys):
    """Valid: the ∞-gram's sparse estimates are right in 6 of 8 documents, wrong in the last 2; test: wrong
    everywhere. The rule fitted on valid (a large λ_sparse) and the gate fitted on the first documents (a large weight
    on the sparse flag) are worse than the LM on test; the guard sees the kept documents disagree and keeps the LM,
    so the guarded mixture is no worse than the LM on test."""
    valid = _save(_unrepresentative(0, docs=8, right_in=6), tmp_path / "v.npz")
    test = _save(_unrepresentative(1, docs=4, right_in=0), tmp_path / "t.npz")
    argv = ["tune", "--valid", valid, "--test", test, "--json"]
    assert main([*argv, str(tmp_path / "g.json"), "--mixture", "guarded"]) == 0
    g = json.loads((tmp_path / "g.json").read_text())
    fit, res = g["mixture"]["fit"], g["test"]
    assert fit["heldout_loglik"]["gate"] < fit["heldout_loglik"]["lm"]  # the gate fitted on 6 documents loses there
    assert fit["form"] == "lm" and g["best"]["form"] == "lm"
    assert res["mixture_ppl"] <= res["base_ppl"] * (1 + 1e-12)
    assert "tokens (fewer than 4,096)" in capsys.readouterr().err
    assert main([*argv, str(tmp_path / "r.json")]) == 0  # the rule (the default)
    rule = json.loads((tmp_path / "r.json").read_text())["test"]
    assert rule["mixture_ppl"] > 1.05 * rule["base_ppl"]  # the fitted λ's hurt on test, by more than 5%


def test_rule_logprob_is_each_rules_formula():
    """rule_logprob against the formulas by hand: (1-λ-λc) p_LM + λ p_kNN + λc p_cache; (1-λ-λ∞) p_LM + λ p_kNN +
    λ∞ P∞ with λ∞ = λ_sparse where sparse, else λ_dense; all four at once (one rule, no special case)."""
    from memlm.mixing.inputs import mixture_inputs

    ts = synthetic_dump(4)
    lam, tau, lc, tc, ls, ld = 0.2, 2.0, 0.1, 0.5, 0.4, 0.05
    p = np.exp(mixture_inputs(ts, tau, None, tc).logprobs)  # lm, knn, ngram, cache
    got = rule_logprob(ts, {"knn": lam, "cache": lc}, tau, None, tc).numpy()
    assert np.allclose(got, np.log((1 - lam - lc) * p[:, 0] + lam * p[:, 1] + lc * p[:, 3]), atol=1e-12)
    lam_ng = np.where(ts.columns["ngram"]["sparse"], ls, ld)
    got = rule_logprob(ts, {"knn": lam, "ngram": (ls, ld)}, tau).numpy()
    assert np.allclose(got, np.log((1 - lam - lam_ng) * p[:, 0] + lam * p[:, 1] + lam_ng * p[:, 2]), atol=1e-12)
    got = rule_logprob(ts, {"knn": lam, "ngram": (ls, ld), "cache": lc}, tau, None, tc).numpy()
    want = (1 - lam - lam_ng - lc) * p[:, 0] + lam * p[:, 1] + lam_ng * p[:, 2] + lc * p[:, 3]
    assert np.allclose(got, np.log(want), atol=1e-12)
    with pytest.raises(MemlmError, match="this dump has no knn2"):
        rule_logprob(ts, {"knn2": lam})


def test_a_stored_fit_refuses_other_memories(tmp_path):
    v = synthetic_dump(5, n=400)
    argv = ["tune", "--valid", _save(v, tmp_path / "v.npz"), "--mixture", "guarded", "--json",
            str(tmp_path / "g.json")]  # fmt: skip
    assert main(argv) == 0
    dm = DumpMixture.from_dict(json.loads((tmp_path / "g.json").read_text()))
    assert dm.mixture.components == ("lm", "knn", "ngram", "cache")
    other = synthetic_dump(6).select(["knn", "ngram"])
    with pytest.raises(Exception, match="fitted on components lm, knn, ngram, cache .* gives lm, knn, ngram"):
        dm.logprob(other)
    assert torch.isfinite(dm.logprob(synthetic_dump(6))).all()
    with pytest.raises(Exception, match="holds no fitted mixture"):
        DumpMixture.from_dict({"valid": {}}, "x.json")


# ------------------------------------------------------------------------------- memlm eval --mixture, end to end


@pytest.fixture(scope="module")
def memories(tmp_path_factory, tiny_lm):
    """A datastore of the tiny LM (exact index) and an ∞-gram index over the toy documents."""
    pytest.importorskip("infini_gram")
    from conftest import gpt2_tokenizer

    from memlm.knnlm.write import write_datastore
    from memlm.ngram.index import build_ngram_index

    model, tok = tiny_lm
    root = tmp_path_factory.mktemp("mix")
    store = write_datastore(model, tok, make_toy_docs(), root / "ds", window=64, min_context=32, progress=False)
    store.build_index(factory="Flat", metric="l2", progress=False)
    index = build_ngram_index(gpt2_tokenizer(), make_toy_docs(60, seed=3), root / "ix", source={"corpus": "toy-a"},
                              progress=False)  # fmt: skip
    return store, index


def _eval(tiny_lm_dir, tmp_path, name, seed, extra) -> tuple[dict, str]:
    docs = tmp_path / f"{name}.jsonl"
    docs.write_text("".join(json.dumps({"id": d.id, "text": d.text}) + "\n" for d in make_toy_docs(12, seed=seed)))
    dump, res = tmp_path / f"{name}.npz", tmp_path / f"{name}.json"
    argv = ["eval", "--model", str(tiny_lm_dir), "--corpus", str(docs), "--window", "64", "--min-context", "32",
            "--dtype", "float32", "--search", "exact", "--k", "16", "--dump", str(dump), "--json", str(res),
            "--allow-overlap", *extra]  # fmt: skip
    assert main(argv) == 0
    return json.loads(res.read_text()), str(docs)


def test_eval_applies_the_tuned_mixture_and_refuses_other_memories(tiny_lm_dir, memories, tmp_path, capsys):
    store, index = memories
    mem = ["--memory", str(store.path), "--memory", str(index.path), "--lambda", "0.25", "--temperature", "5"]
    _eval(tiny_lm_dir, tmp_path, "valid", 41, mem)
    _, test_docs = _eval(tiny_lm_dir, tmp_path, "test", 42, mem)
    fit = str(tmp_path / "fit.json")
    tune = ["tune", "--valid", str(tmp_path / "valid.npz"), "--test", str(tmp_path / "test.npz"), "--mixture",
            "guarded", "--temperatures", "1", "5", "--allow-overlap", "--json", fit]  # fmt: skip
    assert main(tune) == 0
    g = json.loads(Path(fit).read_text())
    res, _ = _eval(tiny_lm_dir, tmp_path, "again", 42, [*mem, "--mixture", fit])
    # the same tokens as tune's test dump: the same mixture perplexity, recorded with the fit
    assert res["mixture_ppl"] == pytest.approx(g["test"]["mixture_ppl"], rel=1e-6)
    assert res["mixture"]["fit"] == g["mixture"]["fit"] and res["mixture_form"] == g["mixture"]["fit"]["form"]
    for ref in ("base_ppl", "knn_ppl", "ngram_ppl", "knn_ngram_ppl"):
        d = res["differences"][f"mixture_ppl vs {ref}"]
        assert d["relative_change"] == pytest.approx(res["mixture_ppl"] / res[ref] - 1, rel=1e-6), ref
    assert "mixture_ppl" in res["intervals"] and "knn_ppl vs base_ppl" in res["differences"]  # eval's own rows kept
    # each fixed-weight row records the rule it was mixed by: re-mixing the dump by it gives the row's perplexity
    from memlm.core.distribution import perplexity
    from memlm.core.mixture import Mixture

    again = TokenTable.load(tmp_path / "again.npz")
    assert set(res["mixtures"]) == {"knn_ppl", "ngram_ppl", "knn_ngram_ppl"}
    for key, record in res["mixtures"].items():
        assert record["form"] == "rule" or key == "knn_ppl"
        assert perplexity(rule_logprob(again, Mixture.from_dict(record), 5.0)) == pytest.approx(res[key], rel=1e-9)
    assert "mixture_ppl" in capsys.readouterr().out
    # other memories: one clear error before the model loads
    argv = ["eval", "--model", str(tiny_lm_dir), "--corpus", test_docs, "--memory", str(index.path), "--mixture", fit]
    assert main(argv) == 2
    assert "mixes lm, knn, ngram, this eval gives lm, ngram" in capsys.readouterr().err
    argv = ["eval", "--model", str(tiny_lm_dir), "--corpus", test_docs, "--mixture", str(tmp_path / "valid.json")]
    assert main(argv) == 2
    assert "holds no fitted mixture" in capsys.readouterr().err


def test_eval_mixes_two_datastores_by_one_rule_and_the_gate_takes_both(tiny_lm_dir, tiny_lm, memories, tmp_path,
                                                                        capsys):  # fmt: skip
    """eval --memory A --memory B: B's neighbours are what B alone scores (component knn2); multi_knn_ppl is
    (1 - λ_A - λ_B) p_LM + λ_A p_A + λ_B p_B by hand, knn2_ppl is B alone's kNN-LM; tune fits lm, knn, knn2 (the rule:
    both λ's together by EM at one τ) and eval --mixture applies it to the same two datastores (and refuses one)."""
    from memlm.knnlm.write import write_datastore
    from memlm.mixing.inputs import memory_logprob

    model, tok = tiny_lm
    a, _ = memories
    b = write_datastore(model, tok, make_toy_docs(8, seed=77), tmp_path / "ds-b", window=64, min_context=32,
                        progress=False)  # fmt: skip
    b.build_index(factory="Flat", metric="l2", progress=False)
    both = ["--memory", str(a.path), "--memory", str(b.path), "--lambda", "0.2", "--temperature", "5"]
    res, _ = _eval(tiny_lm_dir, tmp_path, "ab", 43, both)
    alone_b, _ = _eval(tiny_lm_dir, tmp_path, "b", 43, ["--memory", str(b.path), "--lambda", "0.2",
                                                         "--temperature", "5"])  # fmt: skip
    ts, ts_b = TokenTable.load(tmp_path / "ab.npz"), TokenTable.load(tmp_path / "b.npz")
    assert ts.names() == ("knn", "knn2") and ts.columns["knn2"]["scores"].shape == (len(ts), 16)
    np.testing.assert_array_equal(ts.columns["knn2"]["scores"], ts_b.columns["knn"]["scores"])
    np.testing.assert_array_equal(ts.columns["knn2"]["values"], ts_b.columns["knn"]["values"])
    p = [np.exp(ts.lm_logprob.astype(np.float64))] + [
        np.exp(memory_logprob(s, v, ts.targets, 5.0).numpy().astype(np.float64))
        for s, v in ((ts.columns[c]["scores"], ts.columns[c]["values"]) for c in ("knn", "knn2"))
    ]
    want = np.log(0.6 * p[0] + 0.2 * p[1] + 0.2 * p[2])
    assert res["multi_knn_ppl"] == pytest.approx(float(np.exp(-want.mean())), rel=1e-9)
    assert res["knn2_ppl"] == pytest.approx(alone_b["knn_ppl"], rel=1e-9)
    assert res["mixtures"]["multi_knn_ppl"]["components"] == ["lm", "knn", "knn2"]
    assert [d["lambda"] for d in res["datastores"]] == [0.2, 0.2] and res["temperatures"] == [5.0, 5.0]
    assert res["memories"] == f"knn:{a.path}?k=16&temperature=5.0;knn:{b.path}?k=16&temperature=5.0"
    assert "multi_knn_ppl vs base_ppl" in res["differences"]
    _eval(tiny_lm_dir, tmp_path, "ab-test", 44, both)
    fit = str(tmp_path / "fit2.json")
    tune = ["tune", "--valid", str(tmp_path / "ab.npz"), "--test", str(tmp_path / "ab-test.npz"),
            "--temperatures", "1", "5", "--allow-overlap", "--json", fit]  # fmt: skip
    assert main(tune) == 0
    g = json.loads(Path(fit).read_text())
    assert g["mixture"]["fit"]["mixture"]["components"] == ["lm", "knn", "knn2"]
    # the rule: (1 - λ_A - λ_B) p_LM + λ_A p_A + λ_B p_B at the fitted weights and τ, by hand on test
    best = g["best"]
    t = TokenTable.load(tmp_path / "ab-test.npz")
    q = [np.exp(t.lm_logprob.astype(np.float64))] + [
        np.exp(memory_logprob(t.columns[c]["scores"], t.columns[c]["values"], t.targets, best["temperature"]).numpy())
        for c in ("knn", "knn2")
    ]  # fmt: skip
    want = np.log((1 - best["knn"] - best["knn2"]) * q[0] + best["knn"] * q[1] + best["knn2"] * q[2])
    assert g["test"]["mixture_ppl"] == pytest.approx(float(np.exp(-want.mean())), rel=1e-7)  # memory_logprob: float32
    again, _ = _eval(tiny_lm_dir, tmp_path, "ab-again", 44, [*both, "--mixture", fit])
    assert again["mixture_ppl"] == pytest.approx(g["test"]["mixture_ppl"], rel=1e-6)
    d = again["differences"]["mixture_ppl vs multi_knn_ppl"]
    assert d["relative_change"] == pytest.approx(again["mixture_ppl"] / again["multi_knn_ppl"] - 1, rel=1e-6)
    capsys.readouterr()
    one = ["--memory", str(a.path), "--lambda", "0.2", "--temperature", "5", "--mixture", fit]
    argv = ["eval", "--model", str(tiny_lm_dir), "--corpus", str(tmp_path / "ab.jsonl"), *one]
    assert main(argv) == 2
    assert "mixes lm, knn, knn2, this eval gives lm, knn" in capsys.readouterr().err


def test_score_tokens_takes_every_memory_as_one_list(tiny_lm, memories, tmp_path):
    """memories=[A, ∞-gram, B] scores components knn, ngram, knn2 in one forward pass: each memory's columns are what
    it scores alone, and B's neighbours are B's own search."""
    from memlm.knnlm.scoring import score_tokens
    from memlm.ngram.memory import NgramMemory

    model, tok = tiny_lm
    a, index = memories
    b = a.__class__.open(a.path)  # the same datastore opened twice: two memories, one list
    docs = make_toy_docs(3, seed=45)
    opts = {"k": 8, "window": 64, "min_context": 32, "search": "exact", "progress": False}
    one = score_tokens(model, tok, docs, memories=[a, NgramMemory(index), b], **opts)
    assert one.names() == ("knn", "ngram", "knn2")
    alone = {
        "knn": score_tokens(model, tok, docs, a, **opts),
        "ngram": score_tokens(model, tok, docs, [NgramMemory(index)], **opts),
    }
    for name, ts in alone.items():
        for f, v in ts.columns[name].items():
            np.testing.assert_array_equal(one.columns[name][f], v, err_msg=f"{name}/{f}")
    for f in ("scores", "values"):  # B is A: the same neighbours
        np.testing.assert_array_equal(one.columns["knn2"][f], one.columns["knn"][f])
    assert [one.meta["components"][n]["datastore"] for n in one.names("knn")] == [str(a.path), str(a.path)]
    with pytest.raises(MemlmError, match="one datastore"):
        score_tokens(model, tok, docs, memories=[a, b], pointer_min=4, **opts)
