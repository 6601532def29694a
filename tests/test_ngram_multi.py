"""Several ∞-gram indexes at once on the CLI (``memlm eval --ngram A --ngram B``, ``memlm tune``): the mixture of
Liu et al. (2024)'s interpolation with one (λ_sparse, λ_dense) pair per reference, checked against NumPy."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("infini_gram")
sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import Doc, gpt2_tokenizer, make_toy_docs  # noqa: E402

from memlm.knnlm.evaluate import TokenScores  # noqa: E402
from memlm.ngram.index import build_ngram_index  # noqa: E402


@pytest.fixture(scope="module")
def two_indexes(tmp_path_factory):
    """Two tiny indexes over different toy corpora (no calibration: eval falls back to 0.1 / 0.03 for each)."""
    tok = gpt2_tokenizer()
    root = tmp_path_factory.mktemp("ng2")
    a_docs = make_toy_docs(60, seed=3) + [Doc("rep", "the old river ran over the park while a bird sang")]
    b_docs = make_toy_docs(25, seed=11) + [Doc("rep", make_toy_docs(8, seed=31)[2].text)]  # holds an eval doc
    a = build_ngram_index(tok, a_docs, root / "a", source={"corpus": "toy-a"}, progress=False)
    b = build_ngram_index(tok, b_docs, root / "b", source={"corpus": "toy-b"}, progress=False)
    return a, b


@pytest.fixture()
def eval_docs(tmp_path):
    docs = tmp_path / "e.jsonl"
    docs.write_text("".join(json.dumps({"id": d.id, "text": d.text}) + "\n" for d in make_toy_docs(8, seed=31)))
    return docs


def _eval(tiny_lm_dir, docs, ngrams, tmp_path, name, extra=()) -> tuple[dict, TokenScores]:
    from memlm.cli import main

    dump, res = tmp_path / f"{name}.npz", tmp_path / f"{name}.json"
    argv = ["eval", "--model", str(tiny_lm_dir), "--corpus", str(docs), "--window", "64", "--min-context", "32",
            "--dtype", "float32", "--dump", str(dump), "--json", str(res), *extra]  # fmt: skip
    for ix in ngrams:
        argv += ["--ngram", str(ix.path)]
    assert main(argv) == 0
    return json.loads(res.read_text()), TokenScores.load(dump)


def _by_hand(ts: TokenScores, weights, lam: float = 0.0, knn: np.ndarray | None = None) -> np.ndarray:
    """log P(target) = log[(1 - λ - Σ_r λ_r) P_LM + λ P_kNN + Σ_r λ_r P∞_r], λ_r = λ_sparse,r where reference r is
    sparse, else λ_dense,r: from the dump's per-reference columns, in float64."""
    cols = [(ts.ngram_logprob, ts.ngram_sparse)]
    extra = ts.ngram_extra_logprob.shape[1]
    cols += [(ts.ngram_extra_logprob[:, j], ts.ngram_extra_sparse[:, j]) for j in range(extra)]
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
    probability and perplexity are Σ λ_i P_i by hand; tune then gives each index its own weights (jointly tuned, no
    worse on valid than either alone) and applies them to the test dump."""
    from memlm.cli import main
    from memlm.ngram.mixture import ngrams_logprob

    a, b = two_indexes
    res, ts = _eval(tiny_lm_dir, eval_docs, [a, b], tmp_path, "ab")
    _, ts_a = _eval(tiny_lm_dir, eval_docs, [a], tmp_path, "a")
    _, ts_b = _eval(tiny_lm_dir, eval_docs, [b], tmp_path, "b")
    # the dump: the first index in ngram_*, the second in the extra column, exactly as each alone
    assert ts.ngram_extra_logprob.shape == (len(ts), 1)
    np.testing.assert_array_equal(ts.ngram_logprob, ts_a.ngram_logprob)
    np.testing.assert_array_equal(ts.ngram_extra_logprob[:, 0], ts_b.ngram_logprob)
    np.testing.assert_array_equal(ts.ngram_extra_sparse[:, 0], ts_b.ngram_sparse)
    np.testing.assert_array_equal(ts.ngram_extra_n[:, 0], ts_b.ngram_n)
    assert [d["ngram_build_id"] for d in ts.meta["ngrams"]] == [a.manifest["build_id"], b.manifest["build_id"]]
    # the result records each memory and its weights (no calibration: the fallback 0.1 / 0.03 each)
    assert [r["ngram"] for r in res["ngrams"]] == [str(a.path), str(b.path)]
    assert all((r["lambda_sparse"], r["lambda_dense"]) == (0.1, 0.03) for r in res["ngrams"])
    assert res["multi_ngram_weights"] == [[0.1, 0.03], [0.1, 0.03]]
    want = _by_hand(ts, res["multi_ngram_weights"])
    assert np.isfinite(want).all() and (ts.ngram_extra_sparse.any() or ts.ngram_sparse.any())
    np.testing.assert_allclose(ngrams_logprob(ts, res["multi_ngram_weights"]).numpy(), want, rtol=1e-6, atol=1e-9)
    assert res["multi_ngram_ppl"] == pytest.approx(float(np.exp(-want.mean())), rel=1e-6)
    # each index alone beside the LM, as one --ngram reports it
    alone_b = json.loads((tmp_path / "b.json").read_text())
    assert res["ngrams"][1]["ngram_ppl"] == pytest.approx(alone_b["ngram_ppl"], rel=1e-12)

    grid = ["0", "0.05", "0.1", "0.2", "0.4"]
    assert main(["tune", "--valid", str(tmp_path / "ab.npz"), "--test", str(tmp_path / "ab.npz"), "--ngram-lambdas",
                 *grid, "--json", str(tmp_path / "t.json")]) == 0  # fmt: skip
    t = json.loads((tmp_path / "t.json").read_text())
    best = t["valid"]["best"]
    assert [r["ngram"] for r in best["ngrams"]] == [str(a.path), str(b.path)]
    weights = best["weights"]
    assert [[r["lambda_sparse"], r["lambda_dense"]] for r in best["ngrams"]] == weights
    by_hand = float(np.exp(-_by_hand(ts, weights).mean()))
    assert best["ppl"] == pytest.approx(by_hand, rel=1e-6)
    assert t["test"]["ngram_ppl"] == pytest.approx(by_hand, rel=1e-6)
    # jointly tuned: no worse than either index alone with its own best pair on the same grid
    g = [float(x) for x in grid]
    for r in range(2):
        alone = min(float(np.exp(-_by_hand(ts, [(x, y) if i == r else (0.0, 0.0) for i in range(2)]).mean()))
                    for x in g for y in g)  # fmt: skip
        assert best["ppl"] <= alone + 1e-9
    # a test dump scored with other indexes is refused
    assert main(["tune", "--valid", str(tmp_path / "ab.npz"), "--test", str(tmp_path / "a.npz")]) != 0


def test_eval_and_tune_with_datastore_and_two_ngram_indexes(tiny_lm, tiny_lm_dir, two_indexes, toy_docs, eval_docs,
                                                            tmp_path):  # fmt: skip
    """LM + kNN + two ∞-grams: weights set apart that sum past 1 are scaled to leave the LM >= 0, the four-way
    mixture equals the formula by hand; tune finds λ, τ and each index's pair."""
    from memlm.cli import main
    from memlm.knnlm.evaluate import memory_logprob
    from memlm.storage.datastore import build_datastore

    model, tok = tiny_lm
    ds = build_datastore(model, tok, toy_docs, tmp_path / "ds", window=64, min_context=32, progress=False)
    ds.build_index(factory="Flat", metric="l2", progress=False)
    extra = ["--datastore", str(ds.path), "--k", "8", "--lambda", "0.5", "--temperature", "1",
             "--ngram-lambda-sparse", "0.9", "--ngram-lambda-dense", "0.2"]  # fmt: skip
    res, ts = _eval(tiny_lm_dir, eval_docs, two_indexes, tmp_path, "kab", extra)
    w = res["knn_multi_ngram_weights"]
    scale = 0.5 * 0.9 / 1.8  # (1 - λ) W / S: the two share what one reference of weight W = 0.9 would get
    assert w["lambda"] == 0.5 and w["weights"] == [pytest.approx([0.9 * scale, 0.2 * scale])] * 2
    knn = memory_logprob(ts.knn_scores, ts.knn_values, ts.targets, 1.0).numpy()
    want = _by_hand(ts, w["weights"], lam=0.5, knn=knn)
    assert np.isfinite(want).all()  # the LM keeps weight 1 - 0.5 - 2 * 0.9 * scale = 0.05
    assert res["knn_multi_ngram_ppl"] == pytest.approx(float(np.exp(-want.mean())), rel=1e-6)
    assert res["multi_ngram_weights"] == [pytest.approx([0.45, 0.1])] * 2  # without the kNN term: W / S = 0.5
    assert res["multi_ngram_ppl"] == pytest.approx(float(np.exp(-_by_hand(ts, [[0.45, 0.1]] * 2).mean())), rel=1e-6)
    assert main(["tune", "--valid", str(tmp_path / "kab.npz"), "--lambdas", "0", "0.3", "--temperatures", "1", "10",
                 "--ngram-lambdas", "0", "0.1", "0.3", "--json", str(tmp_path / "t.json")]) == 0  # fmt: skip
    best = json.loads((tmp_path / "t.json").read_text())["valid"]["best"]
    assert best["lambda"] in (0.0, 0.3) and best["temperature"] in (1.0, 10.0) and len(best["weights"]) == 2
    knn_t = memory_logprob(ts.knn_scores, ts.knn_values, ts.targets, best["temperature"]).numpy()
    by_hand = float(np.exp(-_by_hand(ts, best["weights"], lam=best["lambda"], knn=knn_t).mean()))
    assert best["ppl"] == pytest.approx(by_hand, rel=1e-6)


def test_same_index_twice_is_refused(tiny_lm_dir, two_indexes, eval_docs, capsys):
    from memlm.cli import main

    a, _ = two_indexes
    argv = ["eval", "--model", str(tiny_lm_dir), "--corpus", str(eval_docs), "--ngram", str(a.path), "--ngram",
            str(a.path)]  # fmt: skip
    assert main(argv) != 0
    assert "same index twice" in capsys.readouterr().err
