"""``memlm demo`` end to end on a tiny random LM and stand-in corpora (the path ``run_demo`` takes): the forward work it
records is what went through the model (windows overlap by min_context, blocks do not), the counts it plans without
running are the ones it runs, and a rerun re-tunes from its cache without loading the model."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from conftest import make_toy_docs  # noqa: E402

CFG = {"model": "tiny", "dtype": "float32", "datastore_tokens": 1_200, "eval_tokens": 400, "valid_tokens": 300,
       "window": 32, "min_context": 8, "batch_size": 4, "k": 8, "ngram_tokens": None}  # fmt: skip


def _corpora(monkeypatch, demo) -> None:
    import memlm.data.corpora as corpora

    seeds = {("wiki", "train"): 1, ("wiki", "valid"): 2, ("wiki", "test"): 3, ("news", "train"): 4,
             ("news", "valid"): 5, ("news", "test"): 6}  # fmt: skip

    def load(name, split="test"):
        return make_toy_docs(120 if split == "train" else 40, seed=seeds[(name, split)])

    monkeypatch.setattr(demo, "load_documents", load)
    monkeypatch.setattr(corpora, "load_documents", load)


def test_demo_runs_and_records_its_forward_work(monkeypatch, tmp_path, tiny_lm):
    pytest.importorskip("infini_gram")
    import memlm.experiments.demo as demo

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
    assert totals["datastores"] + totals["scoring"] == sum(through_model)
    # overlapping windows: a split's first window forwards one token it does not score, each later one min_context
    scoring = [w for w in result["work"] if w.get("head")]
    assert totals["scoring"] - totals["scored"] == sum(1 + (w["windows"] - 1) * cfg.min_context for w in scoring)
    run = {w["phase"]: w for w in result["work"]}
    for r in result["rows"]:  # a row's tokens are the scored tokens of its test split
        assert r["tokens"] == run[f"score {r['eval'].split()[0]}/test"]["targets"]
    # what planned_work counts without running is what the run did
    for w in demo.planned_work(cfg, tok):
        for key in ("forward_tokens", "targets", "windows", "search_pairs"):
            if key in w:
                assert run[w["phase"]][key] == w[key], (w["phase"], key)
    # in blocks each scored token is forwarded once, the first token of each block only as context
    blocks = [w for w in demo.planned_work(dataclasses.replace(cfg, eval_blocks=True), tok) if w.get("head")]
    assert sum(w["forward_tokens"] - w["targets"] for w in blocks) == sum(w["windows"] for w in blocks)
    assert sum(w["forward_tokens"] for w in blocks) < totals["scoring"]
    assert [(r["eval"], r["datastore"].split()[0]) for r in result["rows"]] == [
        ("wiki test", "wiki"), ("news test", "wiki"), ("news test", "news")]  # fmt: skip
    for r in result["rows"]:
        assert {"base_ppl", "knn_ppl", "ngram_ppl", "knn_ngram_ppl", "mixture_ppl", "oracle_ppl"} <= set(r)
    # a rerun: everything cached, the model is not loaded, the rows are the same
    monkeypatch.setattr(demo, "load_causal_lm", lambda *a, **k: pytest.fail("the rerun loaded the model"))
    again = demo._run_demo(cfg, tmp_path)
    assert [{k: r[k] for k in demo.SYSTEMS} for r in again["rows"]] == [
        {k: r[k] for k in demo.SYSTEMS} for r in result["rows"]
    ]
    assert not any(again["forward_tokens"].values())
    # dumps gone, datastores kept: only the scoring runs, and only it is recorded
    for dump in tmp_path.glob("*.npz"):
        dump.unlink()
    monkeypatch.setattr(demo, "load_causal_lm", lambda name, dtype: (model, tok))
    through_model.clear()
    handle = model.register_forward_pre_hook(count, with_kwargs=True)
    try:
        third = demo._run_demo(cfg, tmp_path)
    finally:
        handle.remove()
    assert third["forward_tokens"]["datastores"] == 0
    assert third["forward_tokens"]["scoring"] == sum(through_model) == totals["scoring"]
