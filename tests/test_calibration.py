"""Self-calibrating datastores: the held-out slice, the λ/τ tuned on it, and their use by eval / generate / lm-eval."""

import json

import numpy as np
import pytest
from conftest import gpt2_tokenizer, make_toy_docs
from test_reliability import memlm

from memlm.knnlm.calibration import holdout_split, knn_parameters
from memlm.windows import doc_hash


def test_holdout_split_is_deterministic_disjoint_and_sized():
    tok = gpt2_tokenizer()
    docs = make_toy_docs(200, seed=5)
    kept, held, info = holdout_split(docs, tok, fraction=0.05, min_tokens=100)
    assert {d.id for d in kept}.isdisjoint({d.id for d in held}) and len(kept) + len(held) == len(docs)
    assert [d.id for d in kept] == [d.id for d in docs if d.id not in {h.id for h in held}]  # corpus order kept
    n = [len(tok(d.text, add_special_tokens=False)["input_ids"]) for d in docs]
    total, taken = sum(n), sum(len(tok(d.text, add_special_tokens=False)["input_ids"]) for d in held)
    assert info["tokens"] == taken and info["corpus_tokens"] == total
    assert taken >= 0.05 * total and taken <= 0.2 * total  # at least the fraction, never over the cap
    # the same documents in another order give the same slice (it depends on ids and texts, not positions)
    _, held2, info2 = holdout_split(list(reversed(docs)), tok, fraction=0.05, min_tokens=100)
    assert {d.id for d in held2} == {d.id for d in held} and info2["ids_sha256"] == info["ids_sha256"]
    # min_tokens dominates a small fraction
    _, held3, info3 = holdout_split(docs, tok, fraction=0.001, min_tokens=300)
    assert info3["tokens"] >= 300 and len(held3) < len(held) + 50


def test_holdout_split_edge_cases():
    tok = gpt2_tokenizer()
    docs = make_toy_docs(10, seed=1)
    assert holdout_split(docs, tok, fraction=0.0)[1] == []
    assert holdout_split(docs[:1], tok)[1] == []
    kept, held, _ = holdout_split(docs[:2], tok, fraction=0.5, min_tokens=10_000)
    assert len(kept) >= 1  # never everything


class _Fake:
    def __init__(self, manifest, n, path="ds"):
        self.manifest, self._n, self.path = manifest, n, path

    def __len__(self):
        return self._n


def test_knn_parameters_precedence(capsys):
    cal = {"lambda": 0.1, "temperature": 3.0, "k": 8, "tokens": 500, "count": 10, "base_ppl": 9.0, "knn_ppl": 8.0}
    ds = _Fake({"calibration": cal}, 10)
    assert knn_parameters(ds)[:2] == (0.1, 3.0)
    assert "calibrated on 500 held-out tokens" in capsys.readouterr().err
    assert knn_parameters(ds, lam=0.5)[:2] == (0.5, 3.0)  # a given value wins, the other comes from the calibration
    assert knn_parameters(ds, 0.5, 2.0)[:2] == (0.5, 2.0)
    assert knn_parameters(_Fake({}, 10))[:2] == (0.25, 1.0)  # no calibration: the fallback, said so
    assert "fallback" in capsys.readouterr().err
    assert knn_parameters(_Fake({"calibration": cal}, 11))[:2] == (0.25, 1.0)  # stale (another entry count)


@pytest.fixture(scope="module")
def built(tmp_path_factory, tiny_lm_dir):
    root = tmp_path_factory.mktemp("cal")
    docs = make_toy_docs(80, seed=7)
    (root / "train.jsonl").write_text("".join(json.dumps({"id": d.id, "text": d.text}) + "\n" for d in docs))
    (root / "test").mkdir()
    for d in docs[:4]:
        (root / "test" / f"{d.id}.txt").write_text(d.text)
    ds = root / "ds"
    args = ["--model", str(tiny_lm_dir), "--corpus", str(root / "train.jsonl"), "--out", str(ds)]
    r = memlm("datastore", "build", *args, "--window", "32", "--min-context", "8", "--holdout", "0.1",
              "--calibration-k", "16")  # fmt: skip
    assert r.returncode == 0, r.stderr
    return root, ds, docs, r


def test_build_holds_out_and_calibrates(built):
    root, ds, docs, r = built
    manifest = json.loads((ds / "manifest.json").read_text())
    holdout, cal = manifest["sources"][0]["holdout"], manifest["calibration"]
    assert holdout["documents"] > 0 and holdout["tokens"] >= 0.1 * holdout["corpus_tokens"]
    assert f"calibrated: λ={cal['lambda']:g}, τ={cal['temperature']:g}" in r.stderr
    assert cal["count"] == manifest["count"] and cal["k"] == 16 and cal["tokens"] > 0
    # the held-out documents are not in the datastore; every other document is
    from memlm.datastore import Datastore

    stored = set(np.unique(np.asarray(Datastore.open(ds).doc_hash)).tolist())
    tok = gpt2_tokenizer()
    _, held, _ = holdout_split(docs, tok, fraction=0.1)
    assert {d.id for d in held} and not stored & {doc_hash(d.id, d.text) for d in held}
    assert stored == {doc_hash(d.id, d.text) for d in docs if d.id not in {h.id for h in held}}
    # rerunning the build changes nothing and does not recalibrate
    model_dir = r.args[r.args.index("--model") + 1]
    r2 = memlm("datastore", "build", "--model", model_dir, "--corpus", str(root / "train.jsonl"), "--out", str(ds),
               "--window", "32", "--min-context", "8", "--holdout", "0.1", "--calibration-k", "16")  # fmt: skip
    assert r2.returncode == 0, r2.stderr
    assert "calibration already recorded" in r2.stderr


def test_eval_without_flags_uses_the_calibration(built, tmp_path):
    root, ds, _, _ = built
    cal = json.loads((ds / "manifest.json").read_text())["calibration"]
    common = ["eval", "--corpus", str(root / "test"), "--datastore", str(ds), "--k", "16", "--window", "32",
              "--min-context", "8"]  # fmt: skip
    r = memlm(*common, "--json", str(tmp_path / "a.json"))
    assert r.returncode == 0, r.stderr
    assert f"kNN-LM parameters: λ={cal['lambda']:g}, τ={cal['temperature']:g}: calibrated on" in r.stderr
    res = json.loads((tmp_path / "a.json").read_text())
    assert (res["lambda"], res["temperature"]) == (cal["lambda"], cal["temperature"])
    assert "held-out" in res["parameters_from"]
    # flags override the calibration
    r = memlm(*common, "--lambda", "0.6", "--temperature", "7", "--json", str(tmp_path / "b.json"))
    assert r.returncode == 0, r.stderr
    res = json.loads((tmp_path / "b.json").read_text())
    assert (res["lambda"], res["temperature"]) == (0.6, 7.0) and res["parameters_from"] == "given"


def test_calibration_is_the_best_grid_point_on_the_held_out_slice(built, tiny_lm):
    """Recompute the held-out dump independently: the recorded (λ, τ) is its grid argmin, not the kept text's."""
    from memlm.datastore import Datastore
    from memlm.knnlm.evaluate import DEFAULT_LAMBDAS, DEFAULT_TEMPERATURES, add_neighbours, lm_scores, perplexities

    root, ds_path, docs, _ = built
    model, tok = tiny_lm
    ds = Datastore.open(ds_path)
    cal = ds.manifest["calibration"]
    _, held, _ = holdout_split(docs, tok, fraction=0.1)
    ts, q, _ = lm_scores(model, tok, held, [ds.key_spec], window=32, min_context=8, progress=False)
    add_neighbours(ts, q[ds.key_spec], ds, k=16, progress=False)
    assert len(ts) == cal["tokens"]
    ppl = {(lam, t): perplexities(ts, lam=lam, temperature=t)["knn_ppl"] for lam in DEFAULT_LAMBDAS
           for t in DEFAULT_TEMPERATURES}  # fmt: skip
    best = min(ppl.values())
    assert ppl[(cal["lambda"], cal["temperature"])] == pytest.approx(best, rel=1e-6)
    assert cal["knn_ppl"] == pytest.approx(best, rel=1e-6)


def test_sharded_build_is_calibrated_too(tmp_path, tiny_lm_dir):
    """`--shards N` holds out the same slice, calibrates on the merged shards and records it in shards.json."""
    docs = make_toy_docs(60, seed=11)
    corpus = tmp_path / "train.jsonl"
    corpus.write_text("".join(json.dumps({"id": d.id, "text": d.text}) + "\n" for d in docs))
    out = tmp_path / "sharded"
    args = ["--model", str(tiny_lm_dir), "--corpus", str(corpus), "--out", str(out), "--window", "32"]
    r = memlm("datastore", "build", *args, "--min-context", "8", "--shards", "2", "--holdout", "0.1",
              "--calibration-k", "8")  # fmt: skip
    assert r.returncode == 0, r.stderr
    from memlm.sharded import open_datastore

    ds = open_datastore(out)
    cal = ds.manifest["calibration"]
    assert cal["count"] == len(ds) and cal["k"] == 8
    assert json.loads((out / "shards.json").read_text())["calibration"] == cal
    assert knn_parameters(ds, announce=False)[:2] == (cal["lambda"], cal["temperature"])
