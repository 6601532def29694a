"""Reliability: kill -9 during a build and resume; one clear error line (no traceback) for bad input."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from memlm.datastore import Datastore

SRC = str(Path(__file__).resolve().parents[1] / "src")


def memlm(*args, check=False, **kw):
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", ""), "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, "-m", "memlm.cli", *args], capture_output=True, text=True, env=env, check=check, **kw
    )


@pytest.fixture(scope="module")
def corpus_file(tmp_path_factory):
    from conftest import make_toy_docs

    path = tmp_path_factory.mktemp("corpus") / "corpus.jsonl"
    path.write_text("".join(json.dumps({"id": d.id, "text": d.text}) + "\n" for d in make_toy_docs(40)))
    return path


@pytest.fixture(scope="module")
def built(tmp_path_factory, tiny_lm_dir, corpus_file):
    """A datastore built uninterrupted through the CLI (the reference for the resume test)."""
    out = tmp_path_factory.mktemp("built") / "ds"
    memlm(*build_args(tiny_lm_dir, corpus_file, out), check=True)
    return out


def build_args(model_dir, corpus, out):
    return [
        "datastore",
        "build",
        "--model",
        str(model_dir),
        "--corpus",
        str(corpus),
        "--out",
        str(out),
        "--window",
        "16",
        "--min-context",
        "4",
        "--batch-size",
        "1",
        "--no-index",
    ]


def test_sigkill_then_resume_gives_identical_datastore(tmp_path, tiny_lm_dir, corpus_file, built):
    ref = built
    out = tmp_path / "killed"
    env = {**os.environ, "PYTHONPATH": SRC, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "memlm.cli", *build_args(tiny_lm_dir, corpus_file, out)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    progress = out / "progress.json"
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            if json.loads(progress.read_text())["windows_done"] >= 10:
                break
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert progress.exists(), "the build finished before it could be killed; make the corpus larger"
    assert not (out / "manifest.json").exists()
    resumed = memlm(*build_args(tiny_lm_dir, corpus_file, out))
    assert resumed.returncode == 0, resumed.stderr
    a, b = Datastore.open(ref, verify=True), Datastore.open(out, verify=True)
    assert len(a) == len(b)
    assert a.checksum() == b.checksum()


@pytest.mark.parametrize(
    "case",
    ["empty_corpus", "unknown_model", "bad_factory", "missing_datastore", "truncated_keys", "other_role"],
)
def test_bad_input_gives_one_clear_error_line(case, tmp_path, tiny_lm_dir, corpus_file, built):
    empty = tmp_path / "empty.txt"
    empty.write_text("   \n")
    ds = tmp_path / "ds"
    shutil.copytree(built, ds)
    args = {
        "empty_corpus": build_args(tiny_lm_dir, empty, tmp_path / "x"),
        "unknown_model": build_args("no-such-model-xyz", corpus_file, tmp_path / "x"),
        "bad_factory": ["index", "build", str(ds), "--factory", "IVF4096,PQ63"],
        "missing_datastore": ["eval", "--corpus", str(corpus_file), "--datastore", str(tmp_path / "nope")],
        "truncated_keys": ["eval", "--corpus", str(corpus_file), "--datastore", str(ds)],
        "other_role": ["eval", "--corpus", str(corpus_file), "--datastore", str(ds), "--key", "final"],
    }[case]
    if case == "truncated_keys":
        keys = ds / "keys.bin"
        keys.write_bytes(keys.read_bytes()[:-64])
    r = memlm(*args)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, r.stderr
    expected = {
        "empty_corpus": "no text",
        "unknown_model": "no-such-model-xyz",
        "bad_factory": "IVF4096,PQ63",
        "missing_datastore": "does not exist",
        "truncated_keys": "truncated",
        "other_role": "final",
    }[case]
    assert expected in errors[0]
