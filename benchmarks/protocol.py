"""The timing protocol shared by every benchmark under benchmarks/: an idle check before timing, and what
each timed step records (load average before and after, tokens, seconds, peak RSS, the machine: CPU flags, torch,
threads).

The idle wait (``wait_for_idle``: the share of the CPU that was busy over a 5-second sample, from /proc/stat, first
written for benchmarks/speed/bench_efficient.py) and ``idle_check`` with its rules: a timing taken while the
1-minute load average is over ``max_load`` (0.3) or while other processes keep more than ``busy_limit`` (5%) of the CPU
busy is refused (or, with ``force``, recorded as not idle beside the numbers, so nobody reports it as a benchmark).

A script in a subfolder imports it with ``sys.path.insert(0, str(Path(__file__).resolve().parents[N]))`` (N: its depth
under benchmarks/) and ``import protocol``.
"""

from __future__ import annotations

import json
import os
import platform
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = [
    "IDLE_BUSY",
    "IDLE_LOAD",
    "cpu_times",
    "host",
    "idle_check",
    "load_average",
    "machine",
    "peak_rss_mib",
    "save_result",
    "timed",
    "wait_for_idle",
]

IDLE_LOAD = 0.3  # the 1-minute load average above which a timing is not a benchmark
IDLE_BUSY = 0.05  # share of all CPUs busy over the sample (other processes) above which it is not either


def cpu_times() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine since boot, from /proc/stat."""
    hz = os.sysconf("SC_CLK_TCK")
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields[:8]) - idle) / hz, sum(fields[:8]) / hz


def peak_rss_mib() -> float:
    """This process's own peak RSS (VmHWM of /proc/self/status). Not ``getrusage``'s ``ru_maxrss``: on Linux it keeps
    the high-water mark of the parent at fork across exec, so a row started by a parent that had run the setup (and
    grown to ~3.8 GB) reported the parent's peak (the 300k / 100k rows of the efficient kNN-LM rerun)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def wait_for_idle(busy_limit: float, load_limit: float | None, sample: float = 5.0, max_wait: float = 900.0) -> dict:
    """Sleep until the machine is idle: over a ``sample``-second window at most ``busy_limit`` of the CPU was busy
    (and, with ``load_limit``, the 1-minute load average is below it); at most ``max_wait`` s. Returns what was seen.

    The 1-minute load average lags: right after a row it still counts that row's own threads (it decays with a
    one-minute time constant), so a CPU sample is the check that nothing else runs; the load is recorded beside it.
    """
    t0 = time.time()
    while True:
        b0, t0_ = cpu_times()
        time.sleep(sample)
        b1, t1_ = cpu_times()
        busy = (b1 - b0) / max(t1_ - t0_, 1e-9)
        load = os.getloadavg()[0]
        ok = busy <= busy_limit and (load_limit is None or load < load_limit)
        if ok or time.time() - t0 > max_wait:
            return {"busy_before": busy, "load_avg_before": load, "waited_s": time.time() - t0, "idle": ok}


def load_average() -> list[float]:
    """The 1-, 5- and 15-minute load averages (``os.getloadavg``, the numbers of /proc/loadavg)."""
    return list(os.getloadavg())


def _lscpu() -> dict[str, str]:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    return {
        k.strip(): v.strip()
        for k, v in fields.items()
        if k.strip()
        in (
            "Model name",
            "CPU MHz",
            "CPU max MHz",
            "Thread(s) per core",
            "Core(s) per socket",
            "L2 cache",
            "L3 cache",
            "Hypervisor vendor",
        )
    }


def lscpu_flags() -> list[str]:
    """Every flag ``lscpu`` lists (empty where it cannot run): what a result file records of the CPU's features."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    line = next((x for x in out.splitlines() if x.startswith("Flags:")), "Flags:")
    return line.split(":", 1)[1].split()


def host() -> dict[str, Any]:
    """The machine without importing torch or FAISS (for a process whose own peak RSS is measured): CPU model
    (lscpu), cores, the cores this process may use, platform, Python."""
    return {
        "lscpu": _lscpu(),
        "cpus": os.cpu_count(),
        "affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "platform": platform.platform(),
        "python": platform.python_version(),
    }


def machine() -> dict[str, Any]:
    """What ran the benchmark: :func:`host`, the CPU flags that pick a compute path, torch, its threads and kernels
    (oneDNN, CPU capability), FAISS and its threads."""
    import torch

    from memlm.models.cpu import cpu_flags

    try:
        import faiss

        faiss_version, faiss_threads = faiss.__version__, faiss.omp_get_max_threads()
    except ImportError:
        faiss_version = faiss_threads = None
    return {
        **host(),
        "cpu_flags": cpu_flags(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "torch_cpu_capability": str(torch.backends.cpu.get_cpu_capability()),
        "mkldnn": bool(torch.backends.mkldnn.is_available()),
        "quantized_engine": torch.backends.quantized.engine,
        "faiss": faiss_version,
        "faiss_threads": faiss_threads,
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
    }


def add_idle_args(parser: Any) -> None:
    """``--force`` and ``--wait``, the options :func:`idle_check` reads, on a benchmark's argument parser."""
    parser.add_argument("--force", action="store_true", help="time a busy machine (recorded as idle: false)")
    parser.add_argument("--wait", type=float, default=0.0, help="seconds to wait for an idle machine")


def idle_check(
    force: bool, wait: float = 0.0, max_load: float = IDLE_LOAD, busy_limit: float = IDLE_BUSY, sample: float = 5.0
) -> dict:
    """Check that nothing else runs: over ``sample`` s at most ``busy_limit`` of the CPU busy and a 1-minute load
    average under ``max_load``, waiting up to ``wait`` s for it (the load average decays with a one-minute time
    constant: from 8 to 0.3 takes ~3.3 minutes once the machine is quiet). Not idle: exit with the reason, or with
    ``force`` warn and return the record (``idle: False``)."""
    seen = wait_for_idle(busy_limit, max_load, sample=sample, max_wait=wait)
    idle = seen["busy_before"] <= busy_limit and seen["load_avg_before"] < max_load
    seen.update(idle=idle, max_load=max_load, busy_limit=busy_limit)
    if not idle:
        why = (
            f"the machine is not idle: {seen['busy_before']:.0%} of the CPU busy over {sample:g} s (limit "
            f"{busy_limit:.0%}), 1-minute load average {seen['load_avg_before']:.2f} "
            f"(limit {max_load})"
        )
        if not force:
            sys.exit(
                f"{why}: stop what runs (top), wait for the load to fall, or pass --force to record numbers "
                "marked not idle (not a benchmark)"
            )
        print(f"WARNING {why}; --force: timings recorded as not idle", file=sys.stderr, flush=True)
    return seen


def save_result(path: str | Path | None, result: dict[str, Any]) -> None:
    """Write a benchmark's result record to ``path`` (nothing when None): its folder created, the JSON written
    atomically (:func:`memlm.io.fileio.atomic_write_json`) with the keys in the order the script built them."""
    if path is None:
        return
    from memlm.io.fileio import atomic_write_json

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(Path(path), result, sort_keys=False)


def run_child(script: str | Path, argv: list[str], env: dict[str, str], show_stderr: bool = False) -> dict[str, Any]:
    """Run ``python script --child *argv`` (one benchmark row in a fresh process, ``env`` its whole environment) and
    return the JSON object it prints as the last line of its standard output. Its standard error is captured (shown
    in the raised error if it fails) unless ``show_stderr`` passes it through (progress bars into the log)."""
    cmd = [sys.executable, str(script), "--child", *argv]
    stderr = None if show_stderr else subprocess.PIPE
    out = subprocess.run(cmd, env=env, check=True, stdout=subprocess.PIPE, stderr=stderr, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def timed(name: str, fn: Callable[[], dict[str, Any]], log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run ``fn`` (it returns its own record: tokens, results), adding seconds, load averages and peak RSS."""
    load0 = load_average()
    t0 = time.perf_counter()
    rec = fn()
    rec = {
        "seconds": time.perf_counter() - t0,
        **rec,
        "load_avg_before": load0,
        "load_avg_after": load_average(),
        "peak_rss_mib": peak_rss_mib(),
    }
    log(f"[{name}] {rec['seconds']:.1f} s, load {load0[0]:.2f} -> {rec['load_avg_after'][0]:.2f}")
    return rec
