"""`memlm analyze`: the Xu et al. 2023 grid on a tiny model writes every table and figure, resumes, and is coherent."""

import json

import numpy as np
import pytest
from conftest import make_toy_docs
from test_train_lm import write_jsonl

from memlm.cli import main
from memlm.errors import MemlmError
from memlm.experiments.xu2023_analysis import (
    AnalysisSpec,
    approx_factory,
    gain_explained,
    interpolation_row,
    run_analysis,
)
from memlm.knnlm.write import write_datastore
from memlm.models.keys import KeySpec


def _dump(out, prefix):
    """The one neighbour dump whose name starts with prefix (names end with a hash of their settings)."""
    (path,) = (out / "nb").glob(f"{prefix}-*.npz")
    return path


def _refuse(name):
    raise ValueError(f"non-standard JSON constant {name}")


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_lm, tiny_lm_dir):
    tmp = tmp_path_factory.mktemp("analysis")
    model, tok = tiny_lm
    docs = make_toy_docs(60, seed=1)
    kw = dict(window=32, min_context=8, batch_size=4, progress=False)
    att = write_datastore(model, tok, docs, tmp / "att", key=KeySpec("ffn_in"), **kw)
    ffn = write_datastore(model, tok, docs, tmp / "ffn", key=KeySpec("final"), **kw)
    held = write_jsonl(tmp / "held.jsonl", make_toy_docs(8, seed=2))
    spec = AnalysisSpec(
        model=str(tiny_lm_dir),
        datastores={"att": str(att.path), "ffn": str(ffn.path)},
        valid=str(held),
        test=str(held),
        window=32,
        min_context=8,
        dtype="float32",
        k=16,
        factory="IVF4,PQ4x4",
        fractions=(0.5, 1.0),
        temperatures=(0.5, 1.0, 2.0),
        learned_n=(1, 2),
        learned_steps=30,
        learned_batch=64,
    )
    return tmp, spec


@pytest.fixture(scope="module")
def grid(setup):
    """``(out, results)``: the whole grid of ``setup``'s spec, run once for the tests that read its results."""
    tmp, spec = setup
    return tmp / "out", run_analysis(spec, tmp / "out", progress=False, log=lambda m: None)


#: The datastores a test trains or searches: the attention one in the default run, both in ``pytest -m slow``.
ROLES = pytest.mark.parametrize("roles", [("att",), pytest.param(("att", "ffn"), marks=pytest.mark.slow)])


def _only(spec: AnalysisSpec, roles: tuple[str, ...]) -> AnalysisSpec:
    import dataclasses

    return dataclasses.replace(spec, datastores={r: spec.datastores[r] for r in roles})


def test_grid_tables_figures_and_resume(setup, grid, monkeypatch):
    _, spec = setup
    out, res = grid
    base = res["base"]["test_ppl"]
    assert len(res["table1"]) == 4 and len(res["approx"]) == 2 * 3 and len(res["learned"]) == 2 * 2
    assert len(res["temperature"]) == 2 * 3 * 3
    for row in res["table1"] + res["approx"] + res["temperature"] + res["learned"]:
        # valid == test here, so the tuned λ can only help, and the per-token oracle is a lower bound
        assert row["interp_ppl"] <= base + 1e-6
        assert row["oracle_ppl"] <= row["interp_ppl"] + 1e-6
    # exact search with exact scores finds at least as close neighbours as the IVF-PQ index
    # rank by rank, the exact top-k scores dominate the exact scores of the index's candidates
    from memlm.knnlm.table import TokenTable

    real = TokenTable.load(_dump(out, "att-l2-f1-exact-exact-test"))
    faiss_real = TokenTable.load(_dump(out, "att-l2-f1-index-exact-test"))
    assert (real.columns["knn"]["scores"] >= faiss_real.columns["knn"]["scores"] - 1e-3).all()
    assert (
        real.columns["knn"]["scores"] > faiss_real.columns["knn"]["scores"] + 1e-3
    ).any()  # and the approximate index misses some
    # the row's recall is the dump's: the fraction of targets among their k neighbours
    rows = {(r["fraction"], r["setting"]): r for r in res["approx"]}
    found = (real.columns["knn"]["values"] == real.targets[:, None]).any(1).mean()
    assert rows[(1.0, "real mask, real score")]["target_in_neighbours"] == pytest.approx(found)
    saved = json.loads((out / "analysis.json").read_text(), parse_constant=_refuse)  # strict JSON: no Infinity/NaN
    assert saved["base"]["test_tokens"] == res["base"]["test_tokens"]
    text = (out / "tables.md").read_text()
    for title in ("Table 1", "Table 2", "Table 3", "Fig. 5", "paper Interp."):
        assert title in text
    for fig in ("fig_datastore_ratio.png", "fig_learned_n.png", "fig_temperature.png"):
        assert (out / fig).stat().st_size > 1000
    # rerunning resumes from the dumps: no forward pass, no search, no training
    import memlm.knnlm.evaluate

    def boom(*a, **k):
        raise AssertionError("recomputed")

    monkeypatch.setattr(memlm.knnlm.evaluate, "lm_scores", boom)
    monkeypatch.setattr("memlm.experiments.xu2023_analysis.add_neighbours", boom)
    monkeypatch.setattr("memlm.xu2023.generalized.train_learned_wds", boom)
    again = run_analysis(spec, out, progress=False, log=lambda m: None)
    assert again["table1"] == res["table1"] and again["learned"] == res["learned"]


def test_exact_mask_dump_matches_bruteforce(setup, grid):
    _, spec = setup
    from memlm.knnlm.table import TokenTable
    from memlm.storage.datastore import Datastore

    out, _ = grid
    ts = TokenTable.load(_dump(out, "att-l2-f1-exact-exact-test"))
    q = np.load(out / "queries-test-att.npy")
    ds = Datastore.open(spec.datastores["att"])
    keys = np.asarray(ds.keys, dtype=np.float32)
    d2 = ((q[:5, None, :] - keys[None]) ** 2).sum(-1)
    top = np.sort(-d2, axis=1)[:, ::-1][:, : spec.k]
    np.testing.assert_allclose(ts.columns["knn"]["scores"][:5], top, rtol=1e-4, atol=1e-3)


def test_helpers_and_errors(setup):
    tmp, spec = setup
    assert approx_factory(1_000_000, 1024) == "IVF1024,PQ64"
    assert approx_factory(500_000, 576) == "IVF1024,PQ36"
    assert approx_factory(25_000, 384) == "IVF256,PQ24"
    assert approx_factory(10**9, 1024) == "IVF4096,PQ64"
    assert gain_explained(21.75, 20.353, 19.095) == pytest.approx(0.526, abs=1e-3)
    import torch

    lm = torch.log(torch.tensor([0.5, 0.1, 0.2]))
    mem = torch.log(torch.tensor([0.1, 0.9, 0.2]))
    row = interpolation_row(lm, mem, lm, mem, lambdas=(0.0, 0.5, 1.0))
    assert row["lambda"] == 0.5 and row["oracle_ppl"] <= row["interp_ppl"] <= row["base_ppl"]
    with pytest.raises(MemlmError, match="ffn_in keys"):
        run_analysis(
            AnalysisSpec(model=spec.model, datastores={"att": spec.datastores["ffn"]}), tmp / "x", progress=False
        )
    with pytest.raises(MemlmError, match="unknown h_ds role"):
        run_analysis(AnalysisSpec(model=spec.model, datastores={"mlp": spec.datastores["ffn"]}), tmp / "y")


def test_cli_analyze(setup, capsys):
    tmp, spec = setup
    args = ["analyze", "--model", spec.model, "--datastore-att", spec.datastores["att"], "--dtype", "float32"]
    args += ["--valid-corpus", spec.valid, "--test-corpus", spec.test, "--window", "32", "--min-context", "8"]
    args += ["--k", "8", "--factory", "IVF4,Flat", "--fractions", "1", "--fig5-temperatures", "1,2"]
    args += ["--skip", "learned"]
    assert main([*args, "--out", str(tmp / "cli")]) == 0
    out = capsys.readouterr().out
    assert "Table 1" in out and "Table 3" in out and "Table 2" not in out


@ROLES
def test_rerun_with_other_settings_does_not_reuse_caches(setup, roles):
    """A rerun in the same --out with another k, nprobe, learned steps and lr gives what a fresh run gives."""
    import dataclasses

    tmp, spec = setup
    small = dataclasses.replace(
        _only(spec, roles), fractions=(1.0,), temperatures=(1.0,), learned_n=(1,), skip=("approx", "temperature")
    )
    quiet = {"progress": False, "log": lambda m: None}
    out = tmp / f"rerun-{len(roles)}"
    first = run_analysis(small, out, **quiet)
    other = dataclasses.replace(small, k=8, nprobe=1, learned_steps=5, learned_lr=1e-2)
    again = run_analysis(other, out, **quiet)
    fresh = run_analysis(other, tmp / f"fresh-{len(roles)}", **quiet)
    assert again["table1"] == fresh["table1"] != first["table1"]
    drop = {"train_seconds"}
    strip = [{k: v for k, v in r.items() if k not in drop} for r in again["learned"]]
    assert strip == [{k: v for k, v in r.items() if k not in drop} for r in fresh["learned"]]
    assert (
        again["learned"][0]["train_steps"] == 5
        and again["learned"][0]["train_loss"] != first["learned"][0]["train_loss"]
    )
    # both runs' dumps are kept side by side, each with the settings that made it
    from memlm.knnlm.table import TokenTable

    dumps = sorted((out / "nb").glob("att-l2-f1-index-index-test-*.npz"))
    assert len(dumps) == 2
    made = {
        (TokenTable.load(d).meta["cache_settings"]["k"], TokenTable.load(d).meta["components"]["knn"]["nprobe"])
        for d in dumps
    }
    assert made == {(16, 32), (8, 1)}


def test_tau1_twins_and_fig5_best_tau_on_valid(grid):
    """Every Table 1 / 3 row carries its τ = 1 twin (λ tuned on valid), equal to the Fig. 5 sweep's τ = 1 row where
    the sweep covers it; the report's Fig. 5 "best τ" is the valid argmin, not the test one."""
    from memlm.experiments.xu2023_analysis import tau1_row, tau1_tables

    out, res = grid
    for r in res["table1"] + res["approx"]:
        assert r["tau1"]["temperature"] == 1.0 and r["tau1"]["valid_ppl"] >= r["valid_ppl"] - 1e-9
        sweep = [t for t in res["temperature"] if all(t[k] == r[k] for k in ("h_ds", "sim", "fraction", "setting"))]
        at1 = [t for t in sweep if t["temperature"] == 1.0]
        if at1:
            assert r["tau1"]["interp_ppl"] == pytest.approx(at1[0]["interp_ppl"], rel=1e-9)
            without = {k: v for k, v in r.items() if k != "tau1"}
            assert tau1_row(res, without)["interp_ppl"] == pytest.approx(at1[0]["interp_ppl"], rel=1e-9)
    assert "Table 1 at τ = 1" in tau1_tables(res) and "not run" not in tau1_tables(res)
    text = (out / "tables.md").read_text().split("### Temperature (Fig. 5)")[1].split("###")[0]
    for f, setting in {(t["fraction"], t["setting"]) for t in res["temperature"]}:
        sweep = [t for t in res["temperature"] if (t["fraction"], t["setting"]) == (f, setting)]
        best = min(sweep, key=lambda t: t["valid_ppl"])
        assert f"| {f:.0%} | {setting} | {best['temperature']:.1f} | {best['interp_ppl']:.3f} |" in text


@ROLES
def test_learned_patience_trains_to_the_plateau(setup, roles):
    """--learned-patience: each W_ds trains until its valid memory-only loss stops improving, past the one epoch a
    fixed budget stops at; the row reports the kept (best) step, where it stopped and the curve."""
    import dataclasses

    tmp, spec = setup
    plateau = dataclasses.replace(
        _only(spec, roles), fractions=(1.0,), temperatures=(1.0,), learned_n=(1,), learned_steps=3000, learned_lr=0.1,
        learned_patience=2, learned_log_every=5, skip=("table1", "approx", "temperature"),
    )  # fmt: skip
    quiet = {"progress": False, "log": lambda m: None}
    res = run_analysis(plateau, tmp / f"plateau-{len(roles)}", **quiet)
    fixed = run_analysis(dataclasses.replace(plateau, learned_patience=None), tmp / f"plateau-{len(roles)}", **quiet)
    assert [row["h_ds"] for row in res["learned"]] == list(roles)
    for row, one in zip(res["learned"], fixed["learned"], strict=True):
        steps = [e["step"] for e in row["curve"]]
        assert steps[0] == 0 and steps[-1] == row["stopped_at"] < 3000  # stopped by the plateau, not the budget
        assert row["stopped_at"] - row["train_steps"] == 10  # patience 2 x 5 updates after the kept step
        best = next(e["valid_ppl"] for e in row["curve"] if e["step"] == row["train_steps"])
        assert best <= min(e["valid_ppl"] for e in row["curve"]) * 1.01 and row["train_steps"] > 0
        # the fixed budget stops after one epoch of the toy datastore (a few dozen updates), before the plateau
        assert one["train_steps"] < row["train_steps"] and "curve" not in one
        assert one["memory_ppl"] != row["memory_ppl"]
