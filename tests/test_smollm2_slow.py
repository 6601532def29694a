"""Slow checks on the real SmolLM2-135M (run with `pytest -m slow`; benchmarks run them, CI does not)."""

import json

import numpy as np
import pytest
import torch
from conftest import Doc

from memlm.core.distribution import mix
from memlm.data.corpora import load_documents
from memlm.data.windows import limit_documents
from memlm.errors import MemlmError
from memlm.knnlm.scoring import score_tokens
from memlm.knnlm.write import write_datastore
from memlm.mixing.inputs import memory_logprob
from memlm.models.resources import load_causal_lm
from memlm.storage.index import build_index

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2():
    try:
        return load_causal_lm("smollm2-135m", dtype="bfloat16")
    except MemlmError as e:  # package not installed
        pytest.skip(str(e))


def test_rare_fact_in_datastore_raises_probability_for_a_paraphrase(tmp_path, smollm2):
    model, tok = smollm2
    fact = Doc(
        "fact",
        "The small town of Vrelk is famous for its annual festival of glass lanterns, held each "
        "winter by the Ostrava river.",
    )
    docs = [*limit_documents(load_documents("wiki", "train"), tok, 20_000), fact]
    ds = write_datastore(model, tok, docs, tmp_path / "ds", window=256, min_context=64, progress=False)
    build_index(ds.keys, ds.index_path, factory="Flat", progress=False)
    probe = Doc("probe", "Every winter, the town of Vrelk holds a famous festival of glass lanterns")
    ts = score_tokens(model, tok, [probe], ds, k=32, window=256, min_context=1, progress=False)
    lantern = tok(" lanterns", add_special_tokens=False)["input_ids"][0]
    pos = int(np.flatnonzero(ts.targets == lantern)[0])
    knn = memory_logprob(ts.columns["knn"]["scores"], ts.columns["knn"]["values"], ts.targets, temperature=10.0)
    mixed = mix([torch.from_numpy(ts.lm_logprob), knn], weights=[0.75, 0.25])
    assert mixed[pos] > ts.lm_logprob[pos] + 0.1, (float(mixed[pos].exp()), float(np.exp(ts.lm_logprob[pos])))


def test_quick_demo_writes_table_and_plot(tmp_path, capsys):
    from memlm.experiments.demo import _view, run_demo
    from memlm.knnlm.table import TokenTable
    from memlm.mixing.dump import DumpMixture

    result = run_demo(out=tmp_path, quick=True)
    assert [(r["eval"], r["memory"]) for r in result["rows"]] == [
        ("wiki test", "wiki"), ("imdb test", "wiki"), ("imdb test", "imdb")]  # fmt: skip
    out = next(tmp_path.glob("quick-*"))
    for r in result["rows"]:
        # each column recomputed from the row's test dump with the mixture it records (the memories' stored fits)
        d = TokenTable.load(out / f"{r['eval'].split()[0]}-test-{r['memory']}.npz")
        assert r["base_ppl"] == pytest.approx(np.exp(-d.lm_logprob.astype(np.float64).mean()), rel=1e-6)
        for key, record in r["mixtures"].items():
            lp = DumpMixture.from_dict(record).logprob(_view(d, key)).numpy()
            assert r[key] == pytest.approx(np.exp(-lp.mean()), rel=1e-6)
    swap = result["swap"]["knn_ngram_ppl"]
    assert swap["high"] < 0  # the imdb memories beat the wiki ones on imdb test, the interval clear of 0
    assert (out / "ppl_vs_lambda.png").stat().st_size > 10_000
    assert json.loads((out / "results.json").read_text())["rows"]
    assert "kNN-LM" in capsys.readouterr().out
