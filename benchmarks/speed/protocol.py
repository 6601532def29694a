"""The timing protocol of memlm's speed benchmarks (issue 34): an idle check before timing, and what each timed step
records (load average before and after, tokens, seconds, the machine: CPU flags, torch, threads).

It grows ``benchmarks/bench_efficient.py``'s idle wait (``wait_for_idle``: the share of the CPU that was busy over a
5-second sample, from /proc/stat) with the rules of issue 34: a timing taken while the 1-minute load average is over
``max_load`` (0.3) or while other processes keep more than ``busy_limit`` (5%) of the CPU busy is refused (or, with
``force``, recorded as not idle beside the numbers, so nobody reports it as a benchmark).
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_efficient import peak_rss_mib, wait_for_idle  # noqa: E402

__all__ = ["IDLE_BUSY", "IDLE_LOAD", "idle_check", "machine", "timed"]

IDLE_LOAD = 0.3  # the 1-minute load average above which a timing is not a benchmark
IDLE_BUSY = 0.05  # share of all CPUs busy over the sample (other processes) above which it is not either


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


def machine() -> dict[str, Any]:
    """What ran the benchmark: CPU model and the flags that pick a compute path, cores, torch, its threads and
    kernels (oneDNN, CPU capability), FAISS."""
    import torch

    from memlm.models.compute import cpu_flags

    try:
        import faiss

        faiss_version = faiss.__version__
    except ImportError:
        faiss_version = None
    return {
        "lscpu": _lscpu(),
        "cpu_flags": cpu_flags(),
        "cpus": os.cpu_count(),
        "affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "torch_cpu_capability": str(torch.backends.cpu.get_cpu_capability()),
        "mkldnn": bool(torch.backends.mkldnn.is_available()),
        "quantized_engine": torch.backends.quantized.engine,
        "faiss": faiss_version,
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
    }


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


def timed(name: str, fn: Callable[[], dict[str, Any]], log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run ``fn`` (it returns its own record: tokens, results), adding seconds, load averages and peak RSS."""
    load0 = os.getloadavg()
    t0 = time.perf_counter()
    rec = fn()
    rec = {
        "seconds": time.perf_counter() - t0,
        **rec,
        "load_avg_before": load0,
        "load_avg_after": os.getloadavg(),
        "peak_rss_mib": peak_rss_mib(),
    }
    log(f"[{name}] {rec['seconds']:.1f} s, load {load0[0]:.2f} -> {rec['load_avg_after'][0]:.2f}")
    return rec
