"""``memlm tune --mixture gate`` and ``memlm eval --mixture FIT.json`` (issue 35): the learned mixture of every memory
of a dump, fitted on valid with τ searched, applied to test beside the base LM and the fixed-weight rule tuned on the
same valid dump; its numbers checked against the formulas by hand (P = Σ_i λ_i P_i with the stored gate's weights)."""

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
from memlm.mixing.datastore import DatastoreComponent  # noqa: E402
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


def test_tune_gate_fits_every_memory_and_compares_with_the_rule(tmp_path, capsys):
    """A dump with kNN neighbours, an ∞-gram and the cache: the fit mixes all four; on test the mixture's perplexity
    is the stored gate's by hand, the rule's is tune's own test row, each with its interval and paired differences;
    the small slice is warned about; the gate is the default (no --mixture); --mixture rule writes the rule alone."""
    valid, test = _save(synthetic_dump(0, n=600), tmp_path / "v.npz"), _save(synthetic_dump(1), tmp_path / "t.npz")
    taus = ["1", "3"]
    gate = ["tune", "--valid", valid, "--test", test, "--temperatures", *taus, "--json", str(tmp_path / "g.json")]
    assert main(gate) == 0  # the default form
    err = capsys.readouterr().err
    assert "fitted on 600 tokens (fewer than 4,096)" in err and "12 documents" not in err  # said once, not once per τ
    assert err.count("fewer than 4,096") == 1
    g = json.loads((tmp_path / "g.json").read_text())
    fit = g["mixture"]
    assert fit["fit"]["mixture"]["components"] == ["lm", "knn", "ngram", "cache"]
    assert fit["fit"]["tokens"] == 600 and fit["fit"]["warnings"]
    assert fit["temperature"] in (1.0, 3.0) and fit["k"] == 8 and [s["temperature"] for s in fit["search"]] == [1, 3]
    chosen = max(fit["search"], key=lambda s: s["heldout_loglik"][s["form"]])  # τ by the kept part's likelihood
    assert chosen["temperature"] == fit["temperature"] and chosen["form"] == fit["fit"]["form"]
    res = g["mixture_test"]
    ts = TokenTable.load(test)
    assert res["mixture_ppl"] == pytest.approx(float(np.exp(-_by_hand(g, ts).mean())), rel=1e-9)
    assert res["rule_ppl"] == pytest.approx(g["test"]["knn_ngram_ppl"], rel=1e-9)  # the rule tuned on this valid
    assert res["base_ppl"] == pytest.approx(g["test"]["base_ppl"], rel=1e-12)
    assert set(res["differences"]) == {"rule_ppl vs base_ppl", "mixture_ppl vs base_ppl", "mixture_ppl vs rule_ppl"}
    d = res["differences"]["mixture_ppl vs rule_ppl"]
    assert d["relative_change"] == pytest.approx(res["mixture_ppl"] / res["rule_ppl"] - 1, rel=1e-9)
    assert res["intervals"]["mixture_ppl"]["low"] <= res["mixture_ppl"] <= res["intervals"]["mixture_ppl"]["high"]
    rule = ["tune", "--valid", valid, "--test", test, "--temperatures", *taus, "--mixture", "rule", "--json",
            str(tmp_path / "r.json")]  # fmt: skip
    assert main(rule) == 0
    r = json.loads((tmp_path / "r.json").read_text())
    assert "mixture" not in r and r["test"] == g["test"] and r["valid"]["best"] == g["valid"]["best"]


def test_tune_gate_on_a_knn_and_cache_dump_compares_with_the_tuned_cache_rule(tmp_path):
    """Without the ∞-gram the rule is Khandelwal's λ with the cache's λc (Table 1): its test row is the rule's."""
    v, t = synthetic_dump(2, n=400).select(["knn", "cache"]), synthetic_dump(3).select(["knn", "cache"])
    argv = ["tune", "--valid", _save(v, tmp_path / "v.npz"), "--test", _save(t, tmp_path / "t.npz"), "--mixture",
            "gate", "--cache-lambdas", "0", "0.1", "0.2", "--json", str(tmp_path / "g.json")]  # fmt: skip
    assert main(argv) == 0
    g = json.loads((tmp_path / "g.json").read_text())
    assert g["mixture"]["fit"]["mixture"]["components"] == ["lm", "knn", "cache"]
    key = "knn_cache_ppl" if g["valid"]["best"]["cache_lambda"] else "knn_ppl"
    assert g["mixture_test"]["rule_ppl"] == pytest.approx(g["test"][key], rel=1e-6)  # the rule scores in float32


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
    everywhere. The rule tuned on valid (a large λ_sparse) and the gate fitted on the first documents (a large weight
    on the sparse flag) are worse than the LM on test; the guard sees the kept documents disagree and keeps the LM,
    so the learned mixture is no worse than the LM on test."""
    valid = _save(_unrepresentative(0, docs=8, right_in=6), tmp_path / "v.npz")
    test = _save(_unrepresentative(1, docs=4, right_in=0), tmp_path / "t.npz")
    assert main(["tune", "--valid", valid, "--test", test, "--json", str(tmp_path / "g.json")]) == 0  # the default
    g = json.loads((tmp_path / "g.json").read_text())
    fit, res = g["mixture"]["fit"], g["mixture_test"]
    assert fit["heldout_loglik"]["gate"] < fit["heldout_loglik"]["lm"]  # the gate fitted on 6 documents loses there
    assert fit["form"] == "lm" and res["form"] == "lm"
    assert res["rule_ppl"] > 1.05 * res["base_ppl"]  # the tuned λ's hurt on test, by more than 5%
    assert res["mixture_ppl"] <= res["base_ppl"] * (1 + 1e-12)
    err = capsys.readouterr().err
    assert "tokens (fewer than 4,096)" in err and "falls back to the LM alone" in err


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
    argv = ["tune", "--valid", _save(v, tmp_path / "v.npz"), "--mixture", "gate", "--json", str(tmp_path / "g.json")]
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
    tune = ["tune", "--valid", str(tmp_path / "valid.npz"), "--test", str(tmp_path / "test.npz"), "--mixture", "gate",
            "--temperatures", "1", "5", "--allow-overlap", "--json", fit]  # fmt: skip
    assert main(tune) == 0
    g = json.loads(Path(fit).read_text())
    res, _ = _eval(tiny_lm_dir, tmp_path, "again", 42, [*mem, "--mixture", fit])
    # the same tokens as tune's test dump: the same mixture perplexity, recorded with the fit
    assert res["mixture_ppl"] == pytest.approx(g["mixture_test"]["mixture_ppl"], rel=1e-6)
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
    (1 - λ_A - λ_B) p_LM + λ_A p_A + λ_B p_B by hand, knn2_ppl is B alone's kNN-LM; tune --mixture gate fits lm,
    knn, knn2 and eval --mixture applies it to the same two datastores (and refuses one)."""
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
    tune = ["tune", "--valid", str(tmp_path / "ab.npz"), "--test", str(tmp_path / "ab-test.npz"), "--mixture",
            "gate", "--temperatures", "1", "5", "--allow-overlap", "--json", fit]  # fmt: skip
    assert main(tune) == 0
    g = json.loads(Path(fit).read_text())
    assert g["mixture"]["fit"]["mixture"]["components"] == ["lm", "knn", "knn2"]
    # the rule: the first datastore's λ, τ by tune's grid, then B's beside it (the best of the grid, by hand)
    from memlm.core.tuning import DEFAULT_LAMBDAS

    best = g["valid"]["best"]
    lam, tau = best["lambda"], best["temperature"]

    def knn_p(ts, scores, values, t):
        return np.exp(memory_logprob(scores, values, ts.targets, t).numpy().astype(np.float64))

    v = TokenTable.load(tmp_path / "ab.npz")
    p_lm = np.exp(v.lm_logprob.astype(np.float64))
    p_a = knn_p(v, v.columns["knn"]["scores"], v.columns["knn"]["values"], tau)
    grid = {(l2, t2): float(np.exp(-np.log((1 - lam - l2) * p_lm + lam * p_a + l2 * knn_p(
        v, v.columns["knn2"]["scores"], v.columns["knn2"]["values"], t2)).mean()))
        for l2 in DEFAULT_LAMBDAS for t2 in (1.0, 5.0) if lam + l2 < 1}  # fmt: skip
    l2, t2 = min(grid, key=grid.get)
    assert best["datastores"] == [{"component": "knn2", "lambda": l2, "temperature": t2,
                                   "ppl": pytest.approx(grid[(l2, t2)], rel=1e-9)}]  # fmt: skip
    assert g["test"]["lambdas"] == [lam, l2] and g["test"]["temperatures"] == [tau, t2]
    assert g["mixture_test"]["rule_ppl"] == pytest.approx(g["test"]["multi_knn_ppl"], rel=1e-9)
    again, _ = _eval(tiny_lm_dir, tmp_path, "ab-again", 44, [*both, "--mixture", fit])
    assert again["mixture_ppl"] == pytest.approx(g["mixture_test"]["mixture_ppl"], rel=1e-6)
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


def test_tune_weighs_the_cache_beside_the_ngram_rule(tmp_path):
    """memlm tune on a dump with kNN, ∞-gram and cache: λ, τ, λ_sparse, λ_dense as before, then λc, τc with them
    fixed: the best of a NumPy grid of (1 - λ - λ∞ - λc) p_LM + λ p_kNN + λ∞ P∞ + λc p_cache on valid; the test row
    cache_rule_ppl is that formula on test, and tune --mixture gate's rule_ppl is that row (docs/results/mixture.md
    row d)."""
    from memlm.mixing.inputs import mixture_inputs

    valid, test = _save(synthetic_dump(6, n=400), tmp_path / "v.npz"), _save(synthetic_dump(7), tmp_path / "t.npz")
    cache_grid, cache_taus = (0.0, 0.05, 0.1, 0.2), (0.5, 2.0)
    argv = ["tune", "--valid", valid, "--test", test, "--lambdas", "0", "0.1", "0.2", "--temperatures", "1", "3",
            "--ngram-lambdas", "0", "0.1", "0.3", "--cache-lambdas", *map(str, cache_grid), "--cache-temperatures",
            *map(str, cache_taus), "--mixture", "gate", "--json", str(tmp_path / "c.json")]  # fmt: skip
    assert main(argv) == 0
    out = json.loads((tmp_path / "c.json").read_text())
    best = out["valid"]["best"]

    def by_hand(ts, lc, tc):
        p = np.exp(mixture_inputs(ts, best["temperature"], None, tc).logprobs)  # lm, knn, ngram, cache
        lam, lam_inf = (
            best["lambda"],
            np.where(ts.columns["ngram"]["sparse"], best["lambda_sparse"], best["lambda_dense"]),
        )
        mix = (1 - lam - lam_inf - lc) * p[:, 0] + lam * p[:, 1] + lam_inf * p[:, 2] + lc * p[:, 3]
        return float(np.exp(-np.log(mix).mean()))

    v, t = TokenTable.load(valid), TokenTable.load(test)
    grid = {(lc, tc): by_hand(v, lc, tc) for lc in cache_grid for tc in cache_taus}
    lc, tc = min(grid, key=grid.get)
    assert (best["cache_lambda"], best["cache_temperature"]) == (lc, tc) and lc > 0  # the cache helps here
    assert best["cache_ppl"] == pytest.approx(grid[(lc, tc)], rel=1e-9)
    assert out["test"]["cache_rule_ppl"] == pytest.approx(by_hand(t, lc, tc), rel=1e-9)
    assert out["test"]["mixtures"]["cache_rule_ppl"]["components"] == ["lm", "knn", "ngram", "cache"]
    assert "cache_rule_ppl vs knn_ngram_ppl" in out["test"]["differences"]
    assert out["mixture_test"]["rule_ppl"] == pytest.approx(out["test"]["cache_rule_ppl"], rel=1e-9)


def test_tune_with_ngram_tunes_a_second_datastore_beside_the_rule(tmp_path):
    """A dump with two datastores and an ∞-gram: tune finds λ, τ, λ_sparse, λ_dense, then knn2's λ_2, τ_2 beside
    them; tune --mixture gate's rule_ppl on test is (1 - λ - λ_2 - λ∞) p_LM + λ p_kNN + λ_2 p_kNN2 + λ∞ P∞ by hand."""

    def two(seed, n):
        full = synthetic_dump(seed, n=n)
        ts = full.select(["knn"])
        knn = ts.columns["knn"]
        values = np.roll(knn["values"], 1, axis=0)
        scores = np.where(values < 0, -np.inf, knn["scores"] * 0.5).astype(np.float32)  # another datastore's
        ts.add(DatastoreComponent(None, values.shape[1]), {"scores": scores, "values": values})
        ts.add(full.components["ngram"], full.columns["ngram"])
        return ts

    valid, test = _save(two(8, 400), tmp_path / "v.npz"), _save(two(9, 300), tmp_path / "t.npz")
    argv = ["tune", "--valid", valid, "--test", test, "--lambdas", "0", "0.1", "0.2", "0.4", "--temperatures", "1",
            "3", "--ngram-lambdas", "0", "0.1", "0.3", "--mixture", "gate", "--json",
            str(tmp_path / "n.json")]  # fmt: skip
    assert main(argv) == 0
    out = json.loads((tmp_path / "n.json").read_text())
    best = out["valid"]["best"]
    (d,) = best["datastores"]
    assert d["component"] == "knn2" and d["lambda"] in (0, 0.1, 0.2, 0.4) and d["temperature"] in (1, 3)
    t = TokenTable.load(test)
    p = [np.exp(x.astype(np.float64)) for x in (
        t.lm_logprob, t.logprob("knn", temperature=best["temperature"]).numpy(),
        t.logprob("knn2", temperature=d["temperature"]).numpy(),
        t.columns["ngram"]["logprob"])]  # fmt: skip
    lam_inf = np.where(t.columns["ngram"]["sparse"], best["lambda_sparse"], best["lambda_dense"])
    lam, lam2 = best["lambda"], d["lambda"]
    want = np.log((1 - lam - lam2 - lam_inf) * p[0] + lam * p[1] + lam2 * p[2] + lam_inf * p[3])
    assert out["mixture_test"]["rule_ppl"] == pytest.approx(float(np.exp(-want.mean())), rel=1e-9)
