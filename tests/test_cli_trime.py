"""`memlm trime-eval` / `memlm trime-tune` on the tiny GPT-2 folder: local, long-term and external memory."""

from __future__ import annotations

import json
import math

import pytest
from conftest import make_toy_docs
from test_train_lm import write_jsonl

from memlm.cli import main
from memlm.trime import TrimeScores


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("corpus") / "c.jsonl", make_toy_docs(10))


def _eval(model, corpus, split, out, *extra):
    return main(["trime-eval", "--model", str(model), "--corpus", str(corpus), "--split", split, "--seq-len", "16",
                 "--max-segments", "2", "--local-temperatures", "0.5,1", "--dump", str(out / f"{split}.npz"),
                 "--json", str(out / f"{split}.json"), *extra])  # fmt: skip


def _error_line(capsys) -> str:
    """The one `error: ...` line of a refused command (model-loading progress bars may come before it)."""
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    errors = [line for line in err if "error" in line.lower()]
    assert len(errors) == 1 and err[-1] == errors[0] and errors[0].startswith("error: "), err
    return errors[0]


def test_eval_and_tune(tiny_lm_dir, corpus, tmp_path, capsys):
    for split in ("valid", "test"):
        assert _eval(tiny_lm_dir, corpus, split, tmp_path) == 0
    out = capsys.readouterr().out
    assert "local" in out and "long" in out and "external" not in out
    res = json.loads((tmp_path / "test.json").read_text())
    assert res["tokens"] > 0 and math.isfinite(res["base_ppl"]) and "external" not in res
    assert math.isfinite(res["local"]["ppl"]) and res["long"]["segments"] == 2
    ts = TrimeScores.load(tmp_path / "valid.npz")
    assert ts.max_segments == 2 and ts.local_temperatures == [0.5, 1.0] and ts.ext_scores is None
    assert main(["trime-tune", "--valid", str(tmp_path / "valid.npz"), "--test", str(tmp_path / "test.npz"),
                 "--json", str(tmp_path / "tune.json")]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "best on valid" in out and "applied to test" in out
    tune = json.loads((tmp_path / "tune.json").read_text())
    assert math.isfinite(tune["test"]["base_ppl"]) and math.isfinite(tune["local"]["test"]["ppl"])
    assert tune["long"]["best"]["segments"] in (0, 1, 2) and math.isfinite(tune["long"]["test"]["ppl"])
    # the tuned rows are the best of a brute-force loop over the grid on valid, applied to test
    from memlm.trime.inference import trime_perplexity

    valid, test = TrimeScores.load(tmp_path / "valid.npz"), TrimeScores.load(tmp_path / "test.npz")
    for kind, segments in (("local", (0,)), ("long", (0, 1, 2))):
        runs = [trime_perplexity(valid, s, local_temperature=lt) for s in segments for lt in (0.5, 1.0)]
        best = min(runs, key=lambda r: r["ppl"])
        assert tune[kind]["best"]["ppl"] == pytest.approx(best["ppl"], rel=1e-9)
        assert (tune[kind]["best"]["segments"], tune[kind]["best"]["local_temperature"]) == (
            best["segments"],
            best["local_temperature"],
        )
        on_test = trime_perplexity(test, best["segments"], local_temperature=best["local_temperature"])
        assert tune[kind]["test"]["ppl"] == pytest.approx(on_test["ppl"], rel=1e-9)
    assert main(["trime-tune", "--valid", str(tmp_path / "valid.npz")]) == 0  # valid only
    assert "applied to test" not in capsys.readouterr().out


def test_external_memory_and_refusals(tiny_lm_dir, corpus, tmp_path, capsys):
    build = ["datastore", "build", "--model", str(tiny_lm_dir), "--corpus", str(corpus), "--factory", "Flat",
             "--window", "32", "--min-context", "8"]  # fmt: skip
    assert main([*build, "--key", "ffn_in", "--out", str(tmp_path / "ds")]) == 0
    for split in ("valid", "test"):
        assert _eval(tiny_lm_dir, corpus, split, tmp_path, "--datastore", str(tmp_path / "ds"), "--k", "8") == 0
    assert "external" in capsys.readouterr().out
    res = json.loads((tmp_path / "valid.json").read_text())
    assert math.isfinite(res["external"]["ppl"]) and res["external"]["external"] is True
    assert res["meta"]["k"] == 8
    assert TrimeScores.load(tmp_path / "test.npz").ext_scores.shape[1] == 8
    grid = ["--lambdas", "0,0.25", "--temperatures", "1,2", "--json", str(tmp_path / "tune.json")]
    assert (
        main(["trime-tune", "--valid", str(tmp_path / "valid.npz"), "--test", str(tmp_path / "test.npz"), *grid]) == 0
    )
    assert "external" in capsys.readouterr().out
    tune = json.loads((tmp_path / "tune.json").read_text())
    assert tune["external"]["grid_points"] > 0 and math.isfinite(tune["external"]["test"]["ppl"])
    # valid dump with external memory, test dump without: refused
    (tmp_path / "plain").mkdir()
    assert _eval(tiny_lm_dir, corpus, "test", tmp_path / "plain") == 0
    capsys.readouterr()
    plain = str(tmp_path / "plain" / "test.npz")
    assert main(["trime-tune", "--valid", str(tmp_path / "valid.npz"), "--test", plain]) == 2
    assert "both" in _error_line(capsys)
    # a datastore of `final` keys is not TRIME's g(c)
    assert main([*build, "--key", "final", "--out", str(tmp_path / "final")]) == 0
    capsys.readouterr()
    assert _eval(tiny_lm_dir, corpus, "valid", tmp_path, "--datastore", str(tmp_path / "final")) == 2
    assert "ffn_in" in _error_line(capsys)


def test_eval_overlapping_windows(tiny_lm_dir, corpus, tmp_path, capsys):
    """--context C: App. D's overlapping windows; the same targets as the default segments, the context recorded,
    the plain LM scored with more context (different numbers); a context with no target left is refused."""
    assert _eval(tiny_lm_dir, corpus, "valid", tmp_path) == 0
    plain = TrimeScores.load(tmp_path / "valid.npz")
    (tmp_path / "ov").mkdir()
    assert _eval(tiny_lm_dir, corpus, "valid", tmp_path / "ov", "--context", "8") == 0
    ov = TrimeScores.load(tmp_path / "ov" / "valid.npz")
    assert json.loads((tmp_path / "ov" / "valid.json").read_text())["context"] == 8 == ov.meta["context"]
    assert (ov.targets == plain.targets).all() and not (ov.target_logit == plain.target_logit).all()
    capsys.readouterr()
    assert _eval(tiny_lm_dir, corpus, "valid", tmp_path / "ov", "--context", "15") == 2
    assert "context must be an integer in [0, 14]" in _error_line(capsys)
