"""The command line end to end on a tiny model: build -> index -> eval (dump, JSON) -> tune -> generate."""

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import make_toy_docs
from test_reliability import SRC, memlm


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory):
    """A folder corpus: train.jsonl for the datastore, valid/test .txt files to evaluate."""
    root = tmp_path_factory.mktemp("cli-corpus")
    docs = make_toy_docs(60, seed=3)
    (root / "train").mkdir()
    train = docs[10:]  # valid and test are other documents: text the datastore holds is refused (memlm.leakage)
    (root / "train" / "train.jsonl").write_text("".join(json.dumps({"id": d.id, "text": d.text}) + "\n" for d in train))
    for split, part in (("valid", docs[:5]), ("test", docs[5:10])):
        (root / split).mkdir()
        for d in part:
            (root / split / f"{d.id}.txt").write_text(d.text)
    return root


def strict_loads(text: str):
    """json.loads that refuses Infinity / -Infinity / NaN (not JSON)."""

    def refuse(name):
        raise ValueError(f"non-standard JSON constant {name}")

    return json.loads(text, parse_constant=refuse)


def test_json_writer_is_strict(tmp_path):
    from memlm.io.fileio import atomic_write_json

    data = {"a": math.inf, "b": [1.5, -math.inf, math.nan], "c": np.float32("inf"), "d": np.float64(2.0), 3: (1, 2)}
    atomic_write_json(tmp_path / "x.json", data)
    assert strict_loads((tmp_path / "x.json").read_text()) == {
        "a": None,
        "b": [1.5, None, None],
        "c": None,
        "d": 2.0,
        "3": [1, 2],
    }


def test_build_eval_tune_generate(tmp_path, tiny_lm_dir, corpus_dir):
    ds = tmp_path / "ds"
    r = memlm(
        "datastore",
        "build",
        "--model",
        str(tiny_lm_dir),
        "--corpus",
        str(corpus_dir / "train"),
        "--out",
        str(ds),
        "--window",
        "32",
        "--min-context",
        "8",
    )
    assert r.returncode == 0, r.stderr
    assert (ds / "index.faiss").exists() and (ds / "index.faiss.json").exists()
    info = memlm("datastore", "info", str(ds), "--verify")
    assert info.returncode == 0 and "checksums OK" in info.stdout
    r = memlm("index", "build", str(ds), "--factory", "HNSW16", "--metric", "l2")  # rebuild with another index
    assert r.returncode == 0, r.stderr
    assert json.loads((ds / "index.faiss.json").read_text())["factory"] == "HNSW16"

    common = ["--memory", str(ds), "--k", "16", "--window", "32", "--min-context", "8"]  # --model from the folder
    r = memlm("eval", "--corpus", str(corpus_dir / "valid"), *common, "--dump", str(tmp_path / "valid.npz"))
    assert r.returncode == 0, r.stderr
    r = memlm(
        "eval",
        "--corpus",
        str(corpus_dir / "test"),
        *common,
        "--dump",
        str(tmp_path / "test.npz"),
        "--json",
        str(tmp_path / "test.json"),
        "--memory",
        "cache",
        "--search",
        "exact",
        "--scores",
        "exact",
        "--lambda",  # the datastore's calibrated values are the default; the checks below use λ = 0.25, τ = 1
        "0.25",
        "--temperature",
        "1",
    )
    assert r.returncode == 0, r.stderr
    res = strict_loads((tmp_path / "test.json").read_text())
    for key in ("base_ppl", "knn_ppl", "oracle_ppl", "tokens", "lambda", "k", "temperature", "knn_cache_ppl"):
        assert key in res
    assert "cache_ppl" not in res and "knn_cache_ppl" in r.stdout and "(LM + kNN + cache)" in r.stdout
    assert res["k"] == 16 and res["search"] == "exact"
    # the reported perplexities, recomputed with NumPy from the per-token dump (Eq. 2 and 3, λ = 0.25, τ = 1)
    from memlm.knnlm.table import TokenTable

    d = TokenTable.load(tmp_path / "test.npz")
    lm, sc = d.lm_logprob.astype(np.float64), d.columns["knn"]["scores"].astype(np.float64)
    w = np.exp(sc - sc.max(1, keepdims=True))
    with np.errstate(divide="ignore"):
        knn = np.log((w * (d.columns["knn"]["values"] == d.targets[:, None])).sum(1) / w.sum(1))
    assert np.isneginf(knn).any() and np.isfinite(knn).any()  # some targets retrieved, some not
    assert res["tokens"] == len(d) and res["base_ppl"] == pytest.approx(np.exp(-lm.mean()), rel=1e-6)
    assert res["knn_ppl"] == pytest.approx(np.exp(-np.log(0.75 * np.exp(lm) + 0.25 * np.exp(knn)).mean()), rel=1e-5)
    assert res["oracle_ppl"] == pytest.approx(np.exp(-np.maximum(lm, knn).mean()), rel=1e-5)
    # LM + kNN + cache (Khandelwal et al. Table 1) with the default λc = 0.1, τc = 1: p_cache from the dump's cache
    cs = d.columns["cache"]["scores"].astype(np.float64)
    cw = np.exp(cs - np.where(np.isfinite(cs).any(1), cs.max(1), 0.0)[:, None])  # exp(-inf) = 0 for empty slots
    hit = d.columns["cache"]["values"] == d.targets[:, None]
    p_cache = np.divide((cw * hit).sum(1), cw.sum(1), out=np.zeros(len(d)), where=cw.sum(1) > 0)
    mix = 0.65 * np.exp(lm) + 0.25 * np.exp(knn) + 0.1 * p_cache
    assert res["knn_cache_ppl"] == pytest.approx(np.exp(-np.log(mix).mean()), rel=1e-5)
    assert res["target_in_neighbours"] == pytest.approx(np.isfinite(knn).mean())
    # intervals over documents, paired differences (printed and in the JSON), buckets by the frequency of
    # the target among the datastore's values
    assert res["bootstrap"]["documents"] == len(set(d.doc_index.tolist())) >= 2
    for key in ("base_ppl", "knn_ppl", "knn_cache_ppl", "oracle_ppl"):
        assert res["intervals"][key]["low"] <= res[key] <= res["intervals"][key]["high"]
    for system, ref in (("knn_ppl", "base_ppl"), ("knn_cache_ppl", "base_ppl"), ("knn_cache_ppl", "knn_ppl")):
        diff = res["differences"][f"{system} vs {ref}"]
        assert diff["relative_change"] == pytest.approx(res[system] / res[ref] - 1, rel=1e-6)
        assert f"{system} vs {ref}" in r.stdout
    values = np.bincount(np.fromfile(ds / "values.bin", dtype=np.int32), minlength=int(d.targets.max()) + 1)
    rows = res["frequency_buckets"]["knn_ppl"]["rows"]
    assert [row["tokens"] for row in rows] == np.histogram(values[d.targets], [0, 1, 11, 101, 1001, 10001, 100001,
                                                                               np.inf])[0].tolist()  # fmt: skip
    gained = np.log(0.75 * np.exp(lm) + 0.25 * np.exp(knn)) - lm
    assert sum(row.get("nats_gained", 0.0) for row in rows) == pytest.approx(gained.sum(), rel=1e-4, abs=1e-6)

    # k = 1: most targets are never retrieved, so p_kNN = 0 for them and the memory-only perplexity is infinite
    r = memlm(
        "eval",
        "--corpus",
        str(corpus_dir / "test"),
        *common[:2],
        *common[4:],
        "--k",
        "1",
        "--lambda",
        "0.25",
        "--json",
        str(tmp_path / "k1.json"),
    )
    assert r.returncode == 0, r.stderr
    k1 = strict_loads((tmp_path / "k1.json").read_text())
    assert k1["target_in_neighbours"] < 1 and k1["knn_only_ppl"] is None and k1["knn_ppl"] > 0

    r = memlm(
        "tune",
        "--valid",
        str(tmp_path / "valid.npz"),
        "--test",
        str(tmp_path / "test.npz"),
        "--json",
        str(tmp_path / "tuned.json"),
        "--temperatures",
        "1",
        "10",
    )
    assert r.returncode == 0, r.stderr
    tuned = strict_loads((tmp_path / "tuned.json").read_text())
    best = tuned["best"]  # the rule by EM: λ fitted, τ the more likely of the two
    assert best["form"] == "rule" and 0 <= best["knn"] <= 1 and best["temperature"] in (1, 10)
    assert [s["temperature"] for s in tuned["mixture"]["search"]] == [1, 10]
    assert tuned["test"]["mixture_ppl"] > 0 and tuned["valid"]["mixture_ppl"] <= tuned["valid"]["base_ppl"] * (1 + 1e-9)

    r = memlm("generate", "--memory", str(ds), "--prompt", "the cat", "--max-new-tokens", "5")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("the cat")


def test_eval_non_overlapping_blocks_and_refused_zero_context(tmp_path, tiny_lm, tiny_lm_dir, corpus_dir):
    from memlm.data.corpora import load_documents
    from memlm.knnlm.evaluate import lm_scores, perplexities

    model, tok = tiny_lm
    docs = load_documents(str(corpus_dir / "test"), "all")
    for block_start in ("skip", "bos"):
        out = tmp_path / f"{block_start}.json"
        args = ["--corpus", str(corpus_dir / "test"), "--split", "all", "--window", "32", "--stride", "32"]
        r = memlm("eval", "--model", str(tiny_lm_dir), *args, "--block-start", block_start, "--json", str(out))
        assert r.returncode == 0, r.stderr
        res = json.loads(out.read_text())
        ts, _, _ = lm_scores(model, tok, docs, [], 32, None, 4, False, stride=32, block_start=block_start)
        assert res["tokens"] == len(ts) and res["base_ppl"] == pytest.approx(perplexities(ts)["base_ppl"], rel=1e-6)
    r = memlm("eval", "--model", str(tiny_lm_dir), "--corpus", str(corpus_dir / "test"), "--min-context", "0")
    assert r.returncode == 2 and "error:" in r.stderr and "at least one token of context" in r.stderr
    r = memlm(
        "eval",
        "--model",
        str(tiny_lm_dir),
        "--corpus",
        str(corpus_dir / "test"),
        "--window",
        "32",
        "--stride",
        "8",
        "--min-context",
        "8",
    )
    assert r.returncode == 2 and "disagree" in r.stderr


def test_device_option_is_checked(tmp_path, tiny_lm_dir, corpus_dir):
    """``--device`` (eval, datastore build): a name torch does not know is refused by argparse; a GPU this machine
    lacks is one ``error:`` line naming the fix; ``--device cpu`` gives the same numbers as no flag."""
    import torch

    corpus = ["--corpus", str(corpus_dir / "test"), "--split", "all", "--window", "32", "--min-context", "8"]
    r = memlm("eval", "--model", str(tiny_lm_dir), *corpus, "--device", "gpu0")
    assert r.returncode == 2 and "'gpu0' is not a device" in r.stderr
    if not torch.cuda.is_available():
        r = memlm("eval", "--model", str(tiny_lm_dir), *corpus, "--device", "cuda:0")
        assert r.returncode == 2 and "--device cuda:0" in r.stderr and "--device cpu" in r.stderr
        out = tmp_path / "ds"
        r = memlm("datastore", "build", "--model", str(tiny_lm_dir), *corpus, "--out", str(out), "--device", "cuda")
        assert r.returncode == 2 and "CUDA device" in r.stderr and not (out / "manifest.json").exists()
    if not torch.backends.mps.is_available():
        r = memlm("eval", "--model", str(tiny_lm_dir), *corpus, "--device", "mps")
        assert r.returncode == 2 and "no MPS device" in r.stderr
    # One thread and MKL's conditional numerical reproducibility: a float32 forward pass on several threads may sum in
    # another order from one process to the next (seen once in a loaded CI run: 2e-8 relative), and this test is about
    # the flag, not the BLAS. Any change the flag makes (dtype, batch, device) still shows in the last bit. Both evals
    # run in one new process (python -m memlm.cli would start two, each importing torch again).
    deterministic = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "MKL_CBWR": "COMPATIBLE"}
    outs = [tmp_path / "eval0.json", tmp_path / "eval2.json"]
    runs = [["eval", "--model", str(tiny_lm_dir), *corpus, *extra, "--json", str(out)]
            for extra, out in zip(([], ["--device", "CPU"]), outs, strict=True)]  # fmt: skip
    script = "import json, sys\nfrom memlm.cli import main\nsys.exit(max(main(a) for a in json.loads(sys.argv[1])))"
    env = {**os.environ, "PYTHONPATH": SRC, "HF_HUB_OFFLINE": "1", **deterministic}
    r = subprocess.run([sys.executable, "-c", script, json.dumps(runs)], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    results = [json.loads(out.read_text())["base_ppl"] for out in outs]
    assert results[0] == results[1]
