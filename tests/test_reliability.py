"""Reliability: kill -9 during a build and resume; one clear error line (no traceback) for bad input."""

import contextlib
import io
import json
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import traceback
import warnings
from pathlib import Path

import pytest

from memlm.storage.datastore import Datastore

SRC = str(Path(__file__).resolve().parents[1] / "src")


def memlm(*args, check=False, extra_env=None, fresh=False, **kw) -> subprocess.CompletedProcess:
    """``memlm ARGS`` as the command runs it: exit status, standard output and standard error.

    In this process (:func:`memlm.cli.main`, as tests/test_readme.py and tests/test_adversarial.py run it): importing
    torch and transformers again cost each command ~4 CPU-seconds, most of these tests' time. Its standard output and
    error are captured; what the command process would print to standard error is printed there (warnings, log
    records of WARNING and above through a handler like :mod:`logging`'s last resort, a traceback and status 1 for an
    uncaught exception); ``os.environ`` is restored after it. A new process (``python -m memlm.cli``) with ``fresh``,
    ``extra_env`` (variables read when torch or a library is imported, e.g. thread counts) or ``subprocess.run``
    keywords."""
    if fresh or extra_env or kw:
        env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", ""), "HF_HUB_OFFLINE": "1"}
        env.update(extra_env or {})
        env.setdefault("MEMLM_DEFAULT_DTYPE", "float32")  # the CLI tests pin the tiny model's float32 numbers
        return subprocess.run(
            [sys.executable, "-m", "memlm.cli", *args], capture_output=True, text=True, env=env, check=check, **kw
        )
    from memlm.cli import main

    saved = dict(os.environ)
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ.setdefault("MEMLM_DEFAULT_DTYPE", "float32")
    out, err = io.StringIO(), io.StringIO()
    handler = logging.StreamHandler(err)
    handler.setLevel(logging.WARNING)
    logging.getLogger().addHandler(handler)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), warnings.catch_warnings():
            warnings.simplefilter("default")
            warnings.showwarning = lambda m, c, f, n, file=None, line=None: err.write(
                warnings.formatwarning(m, c, f, n, line)
            )
            try:
                code = main([str(a) for a in args])
            except SystemExit as e:  # argparse, or a command's sys.exit
                code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
                if not isinstance(e.code, int | None):
                    print(e.code, file=err)
            except Exception:  # as the interpreter reports an uncaught exception
                traceback.print_exc(file=err)
                code = 1
    finally:
        logging.getLogger().removeHandler(handler)
        os.environ.clear()
        os.environ.update(saved)
    r = subprocess.CompletedProcess(["memlm", *map(str, args)], code, out.getvalue(), err.getvalue())
    if check:
        r.check_returncode()
    return r


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


def _kill_build_at_random_point(seed: int, tmp_path, tiny_lm_dir, corpus_file, built) -> None:
    """Kill a build after a random number of windows (1..total-1) plus a random 0-20 ms, resume, compare."""
    rng = random.Random(seed)
    windows = max(2, Datastore.open(built).manifest["count"] // 12)  # stride = window 16 - min_context 4
    target, delay = rng.randint(1, windows - 1), rng.uniform(0, 0.02)
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
            if json.loads(progress.read_text())["windows_done"] >= target:
                time.sleep(delay)
                break
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.002)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert progress.exists(), "the build finished before it could be killed; make the corpus larger"
    assert not (out / "manifest.json").exists()
    assert json.loads((out / ".memlm.lock").read_text())["pid"] == proc.pid  # the dead writer's lock file is left
    resumed = memlm(*build_args(tiny_lm_dir, corpus_file, out))
    assert resumed.returncode == 0, resumed.stderr  # its stale lock was taken over
    assert not list(out.glob(".*"))  # no lock file, no temporary file left
    a, b = Datastore.open(ref, verify=True), Datastore.open(out, verify=True)
    assert len(a) == len(b)
    assert a.checksum() == b.checksum()


def _kill_index_build_at_random_point(seed: int, tmp_path, built) -> None:
    """Kill ``memlm index build`` after a random delay within the duration of an uninterrupted index build: the index
    is then absent or complete, never partial, and the rerun writes a byte-identical index."""
    ref_dir = tmp_path / "ref"
    shutil.copytree(built, ref_dir)
    t0 = time.time()
    memlm("index", "build", str(ref_dir), "--factory", "IVF8,PQ8", check=True)
    span = time.time() - t0
    ref = (ref_dir / "index.faiss").read_bytes()
    ds = tmp_path / f"ds{seed}"
    shutil.copytree(built, ds)
    env = {**os.environ, "PYTHONPATH": SRC, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "memlm.cli", "index", "build", str(ds), "--factory", "IVF8,PQ8"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    time.sleep(random.Random(seed).uniform(0, span))
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    index = ds / "index.faiss"
    assert not index.exists() or index.read_bytes() == ref, "kill -9 left a partial index"
    r = memlm("index", "build", str(ds), "--factory", "IVF8,PQ8")
    assert r.returncode == 0, r.stderr
    assert index.read_bytes() == ref


def test_sigkill_then_resume_gives_identical_datastore(tmp_path, tiny_lm_dir, corpus_file, built):
    _kill_build_at_random_point(int(os.environ.get("MEMLM_KILL_SEED", "0")), tmp_path, tiny_lm_dir, corpus_file, built)


def test_sigkill_index_build_then_rebuild_gives_identical_index(tmp_path, built):
    _kill_index_build_at_random_point(int(os.environ.get("MEMLM_KILL_SEED", "0")), tmp_path, built)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(1, 11))
def test_sigkill_campaign(seed, tmp_path, tiny_lm_dir, corpus_file, built):
    """The larger campaign (``pytest -m slow -k sigkill_campaign``): more random kill points for both builds."""
    _kill_build_at_random_point(seed, tmp_path, tiny_lm_dir, corpus_file, built)
    _kill_index_build_at_random_point(seed, tmp_path, built)


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
        "missing_datastore": ["eval", "--corpus", str(corpus_file), "--memory", str(tmp_path / "nope")],
        "truncated_keys": ["eval", "--corpus", str(corpus_file), "--memory", str(ds)],
        "other_role": ["eval", "--corpus", str(corpus_file), "--memory", str(ds), "--key", "final"],
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


def _files(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def _wait_for_progress(path, windows, proc, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if json.loads(path.read_text())["windows_done"] >= windows:
                return True
        except (OSError, ValueError, KeyError):
            pass
        if proc.poll() is not None:
            return False
        time.sleep(0.005)
    return False


def test_two_concurrent_builds_one_refused_result_equals_lone_build(tmp_path, tiny_lm_dir, corpus_file, built):
    """A second writer into the same folder exits 2 naming the first (pid, command, start time); the first finishes
    and its datastore is byte-identical to a lone build. The first is paused (SIGSTOP) while the second runs, so the
    two always overlap however fast the machine is."""
    out = tmp_path / "ds"
    env = {**os.environ, "PYTHONPATH": SRC, "HF_HUB_OFFLINE": "1"}
    first = subprocess.Popen(
        [sys.executable, "-m", "memlm.cli", *build_args(tiny_lm_dir, corpus_file, out)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert _wait_for_progress(out / "progress.json", 3, first), "the first build ended before it could be paused"
        first.send_signal(signal.SIGSTOP)
        holder = json.loads((out / ".memlm.lock").read_text())
        assert holder["pid"] == first.pid
        before = _files(out)
        second = memlm(*build_args(tiny_lm_dir, corpus_file, out))
        assert second.returncode == 2, second.stderr
        assert "Traceback" not in second.stderr
        errors = [line for line in second.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1, second.stderr
        assert f"pid {first.pid}" in errors[0] and "datastore build" in errors[0] and holder["started"] in errors[0]
        assert _files(out) == before  # the refused writer changed nothing
    finally:
        first.send_signal(signal.SIGCONT)
    _, err = first.communicate(timeout=300)
    assert first.returncode == 0, err
    assert not (out / ".memlm.lock").exists()  # removed by its holder
    assert _files(out) == _files(built) | {"manifest.json": (out / "manifest.json").read_bytes()}
    a, b = json.loads((built / "manifest.json").read_text()), json.loads((out / "manifest.json").read_text())
    assert a["files"] == b["files"] and a["count"] == b["count"]
