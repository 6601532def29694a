"""memlm.models.allocator: glibc's allocator keeps freed activation-sized blocks mapped.

The page-fault checks run in a fresh interpreter: ``mallopt`` settings are per process and the test process itself
has loaded models (which tune it). The pattern is a forward layer's: four 24 MiB buffers written, then all freed, six
times. With glibc's defaults the freed top of the heap (96 MiB) exceeds twice the adapted mmap threshold and is handed
back, so every round touches fresh pages again; tuned, only the first round does.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="the thresholds are glibc's"
)

ROUNDS = """
import ctypes, json, resource
from memlm.models.allocator import allocator_state, tune_allocator
state = tune_allocator() if TUNE else allocator_state()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
faults = []
for _ in range(6):
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    blocks = [libc.malloc(24 << 20) for _ in range(4)]
    for b in blocks:
        libc.memset(b, 1, 24 << 20)
    for b in blocks:
        libc.free(b)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
print(json.dumps({"state": state, "faults": faults}))
"""


def _run(code: str, **env: str) -> dict:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "MEMLM_MALLOC"}
    out = subprocess.run(
        [sys.executable, "-c", code], env={**clean, **env}, check=True, capture_output=True, text=True
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_tuned_allocator_reuses_freed_layer_buffers():
    tuned = _run("TUNE = True\n" + ROUNDS)
    default = _run("TUNE = False\n" + ROUNDS)
    assert tuned["state"]["tuned"] is True
    pages = 4 * (24 << 20) // 4096
    assert sum(default["faults"][1:]) > 4 * pages  # the defaults fault the buffers in again every round
    assert sum(tuned["faults"][1:]) < pages // 10  # tuned: the first round's pages are reused


def test_left_alone_when_asked_or_when_the_user_set_glibc_variables():
    asked = _run("TUNE = True\n" + ROUNDS, MEMLM_MALLOC="default")
    assert asked["state"] == {"tuned": False, "reason": "MEMLM_MALLOC asks for the C library's defaults"}
    assert sum(asked["faults"][1:]) > 4 * 4 * (24 << 20) // 4096
    user = _run("TUNE = True\n" + ROUNDS, MALLOC_TRIM_THRESHOLD_="1000000000")
    assert user["state"]["tuned"] is False and "MALLOC_TRIM_THRESHOLD_" in user["state"]["reason"]


def test_loading_a_model_tunes_the_allocator(tiny_lm_dir, monkeypatch):
    """In this process, its state reset to "not called" (earlier tests loaded models), loading a model tunes it."""
    from memlm.models import allocator
    from memlm.models.resources import load_causal_lm

    for name in [*allocator.USER_VARIABLES, "MEMLM_MALLOC"]:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(allocator, "_state", None)
    assert allocator.allocator_state() == {"tuned": False, "reason": "not called"}
    load_causal_lm(str(tiny_lm_dir), dtype="float32")
    assert allocator.allocator_state()["tuned"] is True
