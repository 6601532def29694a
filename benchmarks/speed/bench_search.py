"""Benchmark memlm.storage.index.search against raw ``faiss.Index.search`` on the same index and queries.

Builds an index per ``--factory`` over random float16 keys with :func:`memlm.storage.index.build_index`, then times
``index.search(q, k)`` and ``memlm.storage.index.search(index, q, k)`` (alternating, best of ``--repeats``) and
reports queries/second for both and their ratio (target: memlm >= 0.9x raw).

    PYTHONPATH=src python benchmarks/speed/bench_search.py          # n=200k, d=576, k=1024, 2000 queries
    PYTHONPATH=src python benchmarks/speed/bench_search.py --n 50000 --d 128 --queries 500 --json out.json
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import faiss
import numpy as np

from memlm.storage.index import build_index, flat_vectors, load_index, plan_index, search

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from protocol import IDLE_BUSY, IDLE_LOAD, load_average, machine, save_result, wait_for_idle  # noqa: E402

DEFAULT_FACTORIES = ("IVF1024,PQ64", "Flat")


def _time(fn: Any, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def bench_factory(
    keys: np.ndarray, queries: np.ndarray, factory: str, k: int, nprobe: int, repeats: int, workdir: Path
) -> dict[str, Any]:
    """Build one index and time raw vs memlm search on it."""
    plan = plan_index(len(keys), keys.shape[1], factory)
    print(plan, flush=True)
    path = workdir / (factory.replace(",", "_") + ".faiss")
    t0 = time.perf_counter()
    build_index(keys, path, factory, progress=False)
    build_s = time.perf_counter() - t0
    index = load_index(path, nprobe=nprobe)
    q = np.ascontiguousarray(queries, dtype=np.float32)

    index.search(q[: min(len(q), 64)], k)  # warm up (threads, precomputed tables, page cache)
    raw_t: list[float] = []
    memlm_t: list[float] = []
    for r in range(repeats):  # interleave (and swap order) so drifting machine load hits both alike
        if r % 2:
            memlm_t += _time(lambda: search(index, q, k), 1)
        raw_t += _time(lambda: index.search(q, k), 1)
        if not r % 2:
            memlm_t += _time(lambda: search(index, q, k), 1)

    # sanity: memlm returns the same neighbours as FAISS (a flat index is scored by torch in memlm: the same
    # scores to float32 rounding, so keys within rounding of each other, common among random keys, may swap places
    # or across the k-th place)
    dist, ids = index.search(q[:16], k)
    m_scores, m_ids = search(index, q[:16], k)
    if flat_vectors(index) is None:
        assert np.array_equal(m_ids, ids), "memlm.search returned other ids than FAISS"
        overlap = 1.0
    else:
        ref = -dist if index.metric_type == faiss.METRIC_L2 else dist
        np.testing.assert_allclose(m_scores, ref, rtol=1e-5, atol=1e-3, err_msg="memlm's flat scores differ")
        overlap = float(np.mean([len(np.intersect1d(a, b)) / k for a, b in zip(m_ids, ids, strict=True)]))
        assert overlap > 0.99, f"memlm.search shares only {overlap:.1%} of FAISS's neighbours"

    raw_med, memlm_med = float(np.median(raw_t)), float(np.median(memlm_t))
    res = {
        "factory": factory,
        "nprobe": nprobe if faiss.try_extract_index_ivf(index) is not None else None,
        "build_seconds": round(build_s, 2),
        "plan": str(plan),
        "memory_bytes_est": plan.memory_bytes,
        "disk_bytes": path.stat().st_size,
        "raw_seconds": [round(t, 4) for t in raw_t],
        "memlm_seconds": [round(t, 4) for t in memlm_t],
        "raw_qps_best": round(len(q) / min(raw_t), 1),
        "memlm_qps_best": round(len(q) / min(memlm_t), 1),
        "ratio_best": round(min(raw_t) / min(memlm_t), 4),
        "raw_qps_median": round(len(q) / raw_med, 1),
        "memlm_qps_median": round(len(q) / memlm_med, 1),
        "ratio_median": round(raw_med / memlm_med, 4),
        "neighbour_overlap_with_faiss": overlap,
    }
    print(
        f"{factory:>16}: raw {res['raw_qps_best']:9.1f} q/s | memlm {res['memlm_qps_best']:9.1f} q/s "
        f"(best of {repeats}) | ratio best {res['ratio_best']:.3f}, median {res['ratio_median']:.3f} "
        f"(build {build_s:.1f}s, file {res['disk_bytes'] / 2**20:.1f} MiB)",
        flush=True,
    )
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=200_000, help="number of keys")
    ap.add_argument("--d", type=int, default=576, help="key dimension (SmolLM2-135M hidden size: 576)")
    ap.add_argument(
        "--factory", action="append", help=f"FAISS factory string, repeatable (default: {DEFAULT_FACTORIES})"
    )
    ap.add_argument("--k", type=int, default=1024, help="neighbours per query")
    ap.add_argument("--queries", type=int, default=2000, help="number of queries")
    ap.add_argument("--nprobe", type=int, default=32, help="IVF lists probed")
    ap.add_argument("--repeats", type=int, default=5, help="timed runs per method (best is reported)")
    ap.add_argument("--threads", type=int, default=None, help="FAISS OpenMP threads (default: FAISS's own)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None, help="write results here")
    args = ap.parse_args(argv)
    factories = args.factory or list(DEFAULT_FACTORIES)
    if args.threads:
        faiss.omp_set_num_threads(args.threads)

    rng = np.random.default_rng(args.seed)
    keys = rng.standard_normal((args.n, args.d), dtype=np.float32).astype(np.float16)
    queries = rng.standard_normal((args.queries, args.d), dtype=np.float32)
    print(
        f"n={args.n:,} d={args.d} k={args.k} queries={args.queries} faiss {faiss.__version__} "
        f"threads={faiss.omp_get_max_threads()} cpus={os.cpu_count()}",
        flush=True,
    )
    results = []
    idle = wait_for_idle(IDLE_BUSY, IDLE_LOAD)  # recorded; a busy machine is marked idle: false, not refused
    with tempfile.TemporaryDirectory(prefix="memlm-bench-") as tmp:
        for factory in factories:
            results.append(bench_factory(keys, queries, factory, args.k, args.nprobe, args.repeats, Path(tmp)))
    report = {
        "benchmark": "search",
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "machine": machine(),
        "idle_before": idle,
        "load_avg_after": load_average(),
        "results": results,
    }
    save_result(args.json, report)
    if args.json:
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
