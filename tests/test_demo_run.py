"""``memlm demo`` end to end on a tiny random LM and stand-in corpora (the path ``run_demo`` takes): the memories carry
their build-time calibration, every column is the mixture ``memlm eval`` applies with no weights, the forward work it
records is what went through the model and what it plans without running, and a rerun mixes from its cache without
loading the model."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from conftest import make_toy_docs  # noqa: E402

CFG = {"model": "tiny", "dtype": "float32", "datastore_tokens": 600, "holdout_tokens": 300, "test_tokens": 400,
       "doc_tokens": 64, "window": 32, "min_context": 8, "batch_size": 4, "k": 8, "ngram_tokens": None}  # fmt: skip


def _corpora(monkeypatch, demo) -> None:
    import memlm.data.corpora as corpora

    seeds = {("wiki", "train"): 1, ("wiki", "test"): 3, ("imdb", "train"): 4, ("imdb", "test"): 6}

    def load(name, split="test"):
        return make_toy_docs(120 if split == "train" else 40, seed=seeds[(name, split)])

    monkeypatch.setattr(demo, "load_documents", load)
    monkeypatch.setattr(corpora, "load_documents", load)


def test_demo_runs_from_the_stored_fits_and_records_its_forward_work(monkeypatch, tmp_path, tiny_lm, capsys):
    pytest.importorskip("infini_gram")
    import memlm.experiments.demo as demo
    from memlm.knnlm.calibration import stored_mixture

    model, tok = tiny_lm
    _corpora(monkeypatch, demo)
    monkeypatch.setattr(demo, "load_causal_lm", lambda name, dtype: (model, tok))
    through_model = []

    def count(module, args, kwargs):
        through_model.append(int(kwargs["attention_mask"].sum()))  # positions run, padding excluded

    handle = model.register_forward_pre_hook(count, with_kwargs=True)
    try:
        cfg = demo.DemoConfig(**CFG)
        result = demo._run_demo(cfg, tmp_path)
    finally:
        handle.remove()
    totals = result["forward_tokens"]
    assert totals["datastores"] + totals["scoring"] == sum(through_model)  # no pass beyond those recorded
    run = {w["phase"]: w for w in result["work"]}
    for w in demo.planned_work(cfg, tok):  # what planned_work counts without running is what the run did
        for key in ("forward_tokens", "targets", "windows"):
            assert run[w["phase"]][key] == w[key], (w["phase"], key)
    assert [(r["eval"], r["memory"]) for r in result["rows"]] == [
        ("wiki test", "wiki"), ("imdb test", "wiki"), ("imdb test", "imdb")]  # fmt: skip
    for r in result["rows"]:
        assert r["tokens"] == run[f"score {r['eval'].split()[0]}/test"]["targets"]
        assert {"base_ppl", *demo.SYSTEMS} <= set(r)
        # each column's mixture is the stored one: the memory's own fit for kNN-LM and ∞-gram
        ds = demo.Datastore.open(tmp_path / f"{r['memory']}-datastore")
        assert r["mixtures"]["knn_ppl"]["fit"] == stored_mixture(ds).to_dict()["fit"]
        assert "calibration" in r["mixtures"]["knn_ppl"]["origin"]
    assert set(result["swap"]) == {*demo.SYSTEMS, "bootstrap"}
    out = capsys.readouterr().out
    assert "swapping the wiki memories for the imdb ones" in out and "mixtures (what memlm eval applies" in out
    assert (tmp_path / "ppl_vs_lambda.png").exists()
    # a rerun: everything cached, the model is not loaded, the rows are the same
    monkeypatch.setattr(demo, "load_causal_lm", lambda *a, **k: pytest.fail("the rerun loaded the model"))
    again = demo._run_demo(cfg, tmp_path)
    assert [{k: r[k] for k in demo.SYSTEMS} for r in again["rows"]] == [
        {k: r[k] for k in demo.SYSTEMS} for r in result["rows"]
    ]
    assert not any(again["forward_tokens"].values())
    # test dumps gone, memories kept: only the test splits are scored again
    for dump in tmp_path.glob("*-test-*.npz"):
        dump.unlink()
    monkeypatch.setattr(demo, "load_causal_lm", lambda name, dtype: (model, tok))
    third = demo._run_demo(cfg, tmp_path)
    assert third["forward_tokens"]["datastores"] == 0
    assert third["forward_tokens"]["scoring"] == sum(w["forward_tokens"] for w in result["work"]
                                                      if w["phase"].startswith("score"))  # fmt: skip
