"""benchmarks/papers/trime/trime_report.py: seeds summarised as mean ± sample sd, App. D rows,
ablations."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks" / "papers" / "trime"))

import trime_report  # noqa: E402


def _run(runs: Path, name: str, valid: float, base: float, local: float, appd: bool = False) -> None:
    (runs / name).mkdir(parents=True)
    log = {"config": {"batch_size": 2, "grad_accum": 1, "seq_len": 4}, "log": [{"valid_ppl": valid}]}
    (runs / name / "log.json").write_text(json.dumps(log))
    tuned = {"test": {"base_ppl": base, "tokens": 10}, "local": {"test": {"ppl": local}, "best": {"segments": 0}}}
    for folder in [f"eval-{name}"] + ([f"eval-{name}-appd"] if appd else []):
        (runs / folder).mkdir()
        (runs / folder / "tuned.json").write_text(json.dumps(tuned))
        scored = {"context": 127 if "appd" in folder else 0, "stream": True}
        (runs / folder / "test.json").write_text(json.dumps(scored))


def test_seeds_are_summarised_with_sample_sd_and_missing_ablations_come_from_the_summary(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    for suffix, base in (("", 10.0), ("-s1", 12.0), ("-s2", 17.0)):
        _run(runs, "trimelm" + suffix, valid=base + 1, base=base, local=base - 1, appd=suffix == "")
    _run(runs, "trimelm-ext-detach", valid=5.0, base=4.0, local=3.0)
    previous = {
        "models": {
            "trimelm": {"training": {"final_valid_ppl": 11.0}, "test": {"base": 10.5, "local": {"ppl": 9.0}}},
            "trimelm-ext-p0": {"training": {"final_valid_ppl": 7.0}, "test": {"base": 6.0}},
        }
    }
    for suffix, ppl in (("", 200.0), ("-s2", 220.0)):  # kNN-LM rows of two vanilla seeds (memlm tune's JSON)
        (runs / f"eval-vanilla{suffix}-knnlm").mkdir()
        test = {"base_ppl": 400.0, "knn_ppl": ppl, "lambda": 0.5}
        (runs / f"eval-vanilla{suffix}-knnlm" / "knnlm.json").write_text(json.dumps({"test": test}))
        # LM + kNN + cache: knn_cache_ppl, cache_ppl in files written before (both are read)
        test = {**test, ("knn_cache_ppl" if suffix else "cache_ppl"): ppl - 20}
        (runs / f"eval-vanilla{suffix}-knnlm" / "knnlm-cache.json").write_text(json.dumps({"test": test}))
    res = trime_report.collect_seeds(runs, previous)
    knn = res["knnlm"]["knnlm"]["stats"]
    assert knn["values"] == [200.0, 220.0] and knn["sd"] == pytest.approx(200**0.5)
    assert res["knnlm"]["knnlm-cache"]["stats"]["mean"] == pytest.approx(190.0)  # with the cache
    st = res["seeds"]["trimelm"]["stats"]["test_none"]
    assert st["n"] == 3 and st["mean"] == pytest.approx(13.0)
    assert st["sd"] == pytest.approx(((9 + 1 + 16) / 2) ** 0.5)  # sample sd (n - 1), not population sd
    assert (st["min"], st["max"]) == (10.0, 17.0)
    assert res["seeds"]["trimelm"]["stats"]["test_own_memory"]["mean"] == pytest.approx(12.0)
    assert res["seed0_vs_summary"]["trimelm"]["test_none"] == {"now": 10.0, "summary": 10.5}
    assert res["appd"]["trimelm"]["test"]["local"]["ppl"] == 9.0
    assert (res["appd"]["trimelm"]["context"], res["appd"]["trimelm"]["stream"]) == (127, True)  # as it was scored
    assert res["ablations"]["trimelm-ext-detach"]["source"] == "summary-seeds-ablations.json"
    assert res["ablations"]["trimelm-ext-p0"]["source"].startswith("summary.json")
    assert "trimelm-ext-p05" not in res["ablations"]  # neither rerun nor in the summary: no row
    # the tables come out the same from the JSON (string keys) as from the collected dict
    md = trime_report.tables_seeds(res)
    assert md == trime_report.tables_seeds(json.loads(json.dumps(res)))
    assert "13.00 ± 3.61 (10.00-17.00)" in md
    assert "| Vanilla LM + kNN-LM (own datastore) | test ppl, App. D windows | 200.00 | - | 220.00 |" in md
    assert "| Vanilla LM (CE) |" not in md.split("### App. D")[0]  # a model with no run has no seed rows
    assert "| TrimeLM (local memory) | local memory | 10.00 | 9.00 | 10.00 | 9.00 |" in md
