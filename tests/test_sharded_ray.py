"""Sharded datastores on a local Ray cluster (``ray.init(num_cpus=2)``, once for this module): build, search, resume."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import make_toy_docs

ray = pytest.importorskip("ray")

from memlm.knnlm.write import build_sharded, write_datastore  # noqa: E402
from memlm.models.resources import load_causal_lm  # noqa: E402
from memlm.storage.index import exact_search  # noqa: E402
from memlm.storage.sharded import ShardedDatastore, shard_name  # noqa: E402
from memlm.storage.sharded_index import ShardedSearcher, build_sharded_index  # noqa: E402

W, C = 32, 12
SRC = str(Path(__file__).resolve().parents[1] / "src")


@pytest.fixture(scope="module")
def ray_cluster():
    """A local 2-CPU Ray cluster for this module; workers import this checkout's memlm."""
    env = {"env_vars": {"PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")])}}
    ray.init(address="local", num_cpus=2, include_dashboard=False, runtime_env=env, logging_level="ERROR",
             log_to_driver=False)  # fmt: skip
    yield "local"  # memlm.storage.ray_backend.connect reuses the initialised cluster
    ray.shutdown()


@pytest.fixture(scope="module")
def docs():
    return make_toy_docs(24, seed=5)


@pytest.fixture(scope="module")
def built(ray_cluster, tiny_lm_dir, docs, tmp_path_factory):
    """(one-process datastore, Ray-built sharded datastore) from the tiny model saved in a folder."""
    model, tok = load_causal_lm(str(tiny_lm_dir))
    root = tmp_path_factory.mktemp("ray")
    single = write_datastore(model, tok, docs, root / "one", window=W, min_context=C, batch_size=2, progress=False)
    sharded = build_sharded(
        str(tiny_lm_dir), docs, root / "sharded", 2, tokenizer=tok, window=W, min_context=C, batch_size=2,
        ray=ray_cluster, progress=False,
    )  # fmt: skip
    return single, sharded


def test_ray_build_equals_one_process_build(built):
    single, sharded = built
    assert len(sharded.shards) == 2 and len(sharded) == len(single)
    np.testing.assert_array_equal(sharded.values[:], single.values)
    np.testing.assert_array_equal(sharded.doc_hash[:], single.doc_hash)
    np.testing.assert_array_equal(sharded.offset[:], single.offset)
    np.testing.assert_allclose(
        sharded.keys[:].astype(np.float32), np.asarray(single.keys, np.float32), rtol=2e-3, atol=2e-3
    )


def test_ray_actor_search_exact_equals_brute_force(built, ray_cluster):
    single, sharded = built
    build_sharded_index(sharded, factory="Flat", ray=ray_cluster, progress=False)
    rng = np.random.default_rng(0)
    q = (
        np.asarray(single.keys[rng.choice(len(single), 16)], np.float32) + rng.normal(0, 0.1, (16, single.dim))
    ).astype(np.float32)
    ref_s, ref_i = exact_search(single.keys, q, 12, "l2")
    with ShardedSearcher.open(sharded, ray=ray_cluster) as searcher:
        assert searcher.pool is not None and len(searcher.pool.actors) == 2
        sc, ids = searcher.search(q, 12)
    np.testing.assert_array_equal(ids, ref_i)
    np.testing.assert_allclose(sc, ref_s, rtol=1e-4, atol=1e-4)


def test_killed_build_resumes_only_unfinished_shards(tiny_lm_dir, docs, tmp_path, built):
    """SIGKILL a sequential 2-shard build once shard 1 has progress; the rerun keeps shard 0 and resumes shard 1."""
    _, reference = built
    out = tmp_path / "killed"
    script = tmp_path / "build.py"
    script.write_text(
        "import sys\nsys.path.insert(0, sys.argv[1])\nfrom conftest import make_toy_docs\n"
        "from memlm.knnlm.write import build_sharded\n"
        f"build_sharded(sys.argv[2], make_toy_docs(24, seed=5), sys.argv[3], 2, window={W}, min_context={C}, "
        "batch_size=1, progress=False)\n"
    )
    env = {**os.environ, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, str(script), str(Path(__file__).parent), str(tiny_lm_dir), str(out)], env=env
    )
    progress = out / shard_name(1) / "progress.json"
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if progress.exists() and json.loads(progress.read_text())["windows_done"] >= 2:
            break
        time.sleep(0.02)
    if proc.poll() is not None:
        pytest.skip("the build finished before it could be killed")
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert progress.exists() and (out / shard_name(0) / "manifest.json").exists()
    mtime0 = (out / shard_name(0) / "keys.bin").stat().st_mtime_ns
    model, tok = load_causal_lm(str(tiny_lm_dir))
    again = build_sharded(model, make_toy_docs(24, seed=5), out, 2, tokenizer=tok, window=W, min_context=C,
                          batch_size=1, progress=False)  # fmt: skip
    assert (out / shard_name(0) / "keys.bin").stat().st_mtime_ns == mtime0
    assert not progress.exists()
    np.testing.assert_array_equal(again.values[:], reference.values[:])
    np.testing.assert_allclose(again.keys[:].astype(np.float32), reference.keys[:].astype(np.float32), atol=2e-3)
    assert isinstance(ShardedDatastore.open(out), ShardedDatastore)
