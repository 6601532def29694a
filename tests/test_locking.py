"""One writer per folder: the flock-based folder lock (memlm.io.locking)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from memlm.errors import MemlmError
from memlm.io.locking import LOCK_NAME, folder_lock, lock_holder

SRC = str(Path(__file__).resolve().parents[1] / "src")

HOLD = """
import sys, time
from memlm.io.locking import folder_lock
with folder_lock(sys.argv[1]):
    print("locked", flush=True)
    sys.stdin.readline()
"""


def _holder(folder):
    env = {**os.environ, "PYTHONPATH": SRC}
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(folder), "--some-command"],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_second_writer_is_refused_with_the_holder_named(tmp_path):
    proc = _holder(tmp_path / "f")
    try:
        info = lock_holder(tmp_path / "f")
        assert info["pid"] == proc.pid and "--some-command" in info["command"]
        with pytest.raises(MemlmError) as e, folder_lock(tmp_path / "f", "build a datastore"):
            pass
        msg = str(e.value)
        assert f"pid {proc.pid}" in msg and "--some-command" in msg and info["started"] in msg
        assert "build a datastore" in msg and "\n" not in msg
    finally:
        proc.communicate("\n", timeout=30)
    assert not (tmp_path / "f" / LOCK_NAME).exists()
    with folder_lock(tmp_path / "f"):  # free again
        assert lock_holder(tmp_path / "f")["pid"] == os.getpid()
    assert not (tmp_path / "f" / LOCK_NAME).exists()


def test_lock_of_a_killed_holder_is_taken_over(tmp_path):
    proc = _holder(tmp_path)
    proc.kill()
    proc.wait()
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == proc.pid  # stale file left behind
    with folder_lock(tmp_path):
        assert lock_holder(tmp_path)["pid"] == os.getpid()


def test_reentrant_in_one_process_and_released_on_error(tmp_path):
    with folder_lock(tmp_path), folder_lock(tmp_path / "."):
        assert (tmp_path / LOCK_NAME).exists()
    assert not (tmp_path / LOCK_NAME).exists()
    with pytest.raises(RuntimeError), folder_lock(tmp_path):
        raise RuntimeError("boom")
    proc = _holder(tmp_path)  # another process can take it now
    proc.communicate("\n", timeout=30)


RACE = """
import os, sys, time
from pathlib import Path
from memlm.errors import MemlmError
from memlm.io.locking import folder_lock
folder = Path(sys.argv[1]); marker = folder / "inside"
done = 0
while done < 40:
    try:
        with folder_lock(folder):
            if marker.exists():
                print("BOTH INSIDE", flush=True); sys.exit(1)
            marker.touch(); time.sleep(0.001); marker.unlink()
            done += 1
    except MemlmError:
        pass
print("ok", flush=True)
"""


def test_mutual_exclusion_under_contention(tmp_path):
    """Writers that take and release (unlink) the lock in a tight loop are never inside together: the
    unlink-while-locked race is handled (a writer that locked a removed file retries on the new one)."""
    env = {**os.environ, "PYTHONPATH": SRC}
    procs = [
        subprocess.Popen([sys.executable, "-c", RACE, str(tmp_path)], env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(3)
    ]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    assert all(o.strip() == "ok" for o in outs), outs
    assert not (tmp_path / LOCK_NAME).exists()
