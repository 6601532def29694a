"""benchmarks/speed/vs_knn_transformers.py: the files and layer it hands knn-transformers are memlm's, and (with their
code, ``MEMLM_KNN_TRANSFORMERS=<checkout>``, slow) both sides give the same per-token kNN-LM log-probabilities."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import make_toy_docs
from test_compute_path import tiny_llama
from test_datastore import build

from memlm.models.keys import KeySpec, resolve_key_module
from memlm.storage.index import build_index

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks" / "speed"))

import vs_knn_transformers as harness  # noqa: E402

THEIRS = os.environ.get("MEMLM_KNN_TRANSFORMERS")


def indexed(tmp_path, tiny_lm, docs):
    ds = build(tmp_path, tiny_lm, docs)
    build_index(ds.keys, ds.index_path, factory="Flat", metric="l2", progress=False)
    return ds


def test_llama_entry_is_memlm_ffn_in_of_the_last_layer():
    model = tiny_llama()
    for name, role, kind in (("last_ffn_input", "ffn_in", "pre"), ("last_ffn_output", "block_out", "post")):
        layer_of, capture_input = harness.LLAMA_LAYERS[name]
        module, memlm_kind = resolve_key_module(model, KeySpec(role, -1))
        assert layer_of(model) is module
        assert memlm_kind == kind and capture_input == (kind == "pre")


def test_export_writes_their_memmaps_of_memlm_entries(tmp_path, tiny_lm):
    ds = indexed(tmp_path, tiny_lm, make_toy_docs(6))
    work = tmp_path / "work"
    rec = harness.export_datastore(ds, work, "gpt2")
    n, d = len(ds), ds.dim
    # their knnlm.py: get_dstore_path = f"{dir}/dstore_{model_type}_{size}_{dim}", keys float16 [N, D], vals int32
    # [N, 1]; get_index_path = f"{dir}/index_{model_type}_{size}_{dim}.indexed"
    keys = np.memmap(work / f"dstore_gpt2_{n}_{d}_keys.npy", dtype=np.float16, mode="r", shape=(n, d))
    vals = np.memmap(work / f"dstore_gpt2_{n}_{d}_vals.npy", dtype=np.int32, mode="r", shape=(n, 1))
    assert np.array_equal(keys, np.asarray(ds.keys)) and np.array_equal(vals[:, 0], np.asarray(ds.values))
    assert (work / f"index_gpt2_{n}_{d}.indexed").resolve() == ds.index_path.resolve()
    assert len(rec["written"]) == 2
    assert harness.export_datastore(ds, work, "gpt2")["written"] == []  # the same bytes: kept
    wrong = np.memmap(work / f"dstore_gpt2_{n}_{d}_vals.npy", dtype=np.int32, mode="r+", shape=(n, 1))
    wrong[0] += 1
    wrong.flush()
    del wrong
    assert harness.export_datastore(ds, work, "gpt2")["written"] == [f"dstore_gpt2_{n}_{d}_vals.npy"]


@pytest.mark.slow
@pytest.mark.skipif(not THEIRS, reason="set MEMLM_KNN_TRANSFORMERS to a checkout of neulab/knn-transformers")
def test_their_wrapper_and_memlm_agree_per_token(tmp_path, tiny_lm):
    model, tok = tiny_lm
    ds = indexed(tmp_path, tiny_lm, make_toy_docs(20))
    work = tmp_path / "work"
    harness.export_datastore(ds, work, model.config.model_type)
    args = argparse.Namespace(knn_transformers=THEIRS, work=str(work), datastore=str(ds.path), window=64, stride=32,
                              batch_size=3, pipeline=False)  # fmt: skip
    params = {"k": 16, "nprobe": 1, "lambda": 0.3, "temperature": 5.0}
    docs = make_toy_docs(8, seed=5)
    theirs, a = harness.run_theirs(args, model, tok, docs, params)
    ours, b = harness.run_memlm(args, model, tok, docs, params)
    assert theirs["tokens"] == ours["tokens"] == len(a) == len(b) > 100
    assert np.abs(a - b).max() < 1e-4
    assert abs(ours["ppl"] / theirs["ppl"] - 1) < 1e-5
    assert abs(ours["ppl"] / ours["base_ppl"] - 1) > 1e-3  # the memory changed the scores: not the LM alone
