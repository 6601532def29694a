"""The demo's exact search (:func:`memlm.storage.index.exact_search`: torch matmul + top-k over all keys) against a
FAISS Flat L2 index over the same keys: CPU seconds of each, single-threaded (CPU time, not wall time, so that a busy
machine's other jobs do not enter it; each best of 3), and how many of each query's top-10 ids agree. Keys: random
576-dim float16 vectors in 64 clusters (SmolLM2-135M's ``ffn_in`` width, stored as a datastore stores them), queries
near random keys::

    PYTHONPATH=src python benchmarks/speed/demo_search.py --out docs/results/speed/demo_search.json
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import faiss
import numpy as np
import torch

from memlm.io.fileio import atomic_write_json
from memlm.storage.index import exact_search


def cpu_seconds(fn, repeats: int = 3) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeats):
        t = time.process_time()
        out = fn()
        best = min(best, time.process_time() - t)
    return best, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--keys", type=int, default=32_000)
    ap.add_argument("--queries", type=int, default=2_048)
    ap.add_argument("--k", type=int, default=256)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    faiss.omp_set_num_threads(1)
    rng = np.random.default_rng(0)
    centres = rng.normal(0, 1, (64, 576)).astype(np.float32)
    keys = (centres[rng.integers(0, 64, args.keys)] + rng.normal(0, 0.5, (args.keys, 576))).astype(np.float16)
    queries = keys[rng.integers(0, args.keys, args.queries)].astype(np.float32)
    queries += rng.normal(0, 0.1, queries.shape).astype(np.float32)
    index = faiss.IndexFlatL2(576)
    index.add(keys.astype(np.float32))
    faiss_s, (_, faiss_ids) = cpu_seconds(lambda: index.search(queries, args.k))
    torch_s, (_, torch_ids) = cpu_seconds(lambda: exact_search(keys, queries, args.k, "l2"))
    agree = float((np.sort(faiss_ids[:, :10], 1) == np.sort(torch_ids[:, :10], 1)).all(1).mean())
    pairs = args.keys * args.queries
    result = {"keys": args.keys, "queries": args.queries, "k": args.k, "threads": 1, "faiss_flat_cpu_s": faiss_s,
              "exact_search_cpu_s": torch_s, "ratio": torch_s / faiss_s, "faiss_cpu_s_per_pair": faiss_s / pairs,
              "exact_cpu_s_per_pair": torch_s / pairs, "top10_ids_equal_share": agree,
              "faiss": faiss.__version__, "torch": torch.__version__}  # fmt: skip
    print(result)
    atomic_write_json(args.out, result)


if __name__ == "__main__":
    main()
