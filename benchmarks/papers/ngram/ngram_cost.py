"""What the ∞-gram memory costs (docs/results/ngram.md, "Cost"), each part timed on idle cores, one at a time.

    python benchmarks/papers/ngram/ngram_cost.py build --out docs/results/ngram/cost_build.json  # builds, end to end
    python benchmarks/papers/ngram/ngram_cost.py query --index IDX [--index IDX2] \\
        --out docs/results/ngram/cost_query.json
    python benchmarks/papers/ngram/ngram_cost.py dense --datastore DS --out docs/results/ngram/cost_dense.json

``build`` runs ``memlm ngram build`` from corpus names (WikiText-2 train, then all six offline corpora's train
splits; ``--holdout 0``, no LM pass) in a fresh process each and records the wall time, tokens/s, bytes per token
and the process's peak RSS. ``query`` opens an index and, over the first ``--tokens`` WikiText-2 test tokens, times
(a) ``NgramMemory.score_documents`` (what ``memlm eval --memory ngram:DIR`` calls: every target of a document in one
walk that reuses the previous position's suffix), per token; (b) one cold query per position (``score_documents``
on that position alone: the longest-suffix search from scratch), p50 / p99; (c) the full next-token distribution of a
context (``NgramMemory.search``, what each generation step calls), p50 / p99; and the peak RSS. ``dense`` reads a
dense datastore's manifest and files (entries/s of its build, bytes per entry) for the comparison.
Before each timed part the script waits until nothing else uses the CPU (a 5-s sample) and records the load.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from protocol import host, load_average, peak_rss_mib, wait_for_idle  # noqa: E402

CORPORA = {"wikitext2-train": "wikitext2", "all-offline-train": "wiki,news,brown,bbc,wikitext2,imdb"}


def _rss_mib() -> float:
    """This process's resident set now (VmRSS)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _write(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")


def build(args: argparse.Namespace) -> None:
    memlm = str(Path(sys.executable).parent / "memlm")
    out: dict = {"machine": host(), "builds": {}}
    for name, corpus in CORPORA.items():
        folder = Path(args.work) / name
        cmd = [memlm, "ngram", "build", "--model", args.model, "--corpus", corpus, "--out", str(folder),
               "--holdout", "0", "--overwrite"]  # fmt: skip
        idle = wait_for_idle(0.05, None)
        c0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        seconds = time.perf_counter() - t0
        if proc.returncode:
            raise SystemExit(proc.stderr[-3000:])
        c1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        m = json.loads((folder / "manifest.json").read_text())
        size = sum(f.stat().st_size for f in folder.iterdir() if f.is_file())
        out["builds"][name] = {
            "command": " ".join(["memlm", *cmd[1:]]),
            "corpus": corpus,
            "tokens": m["tokens"],
            "documents": m["documents"],
            "wall_seconds": seconds,
            "tokens_per_second": m["tokens"] / seconds,
            "build_seconds_in_manifest": m.get("build_seconds"),
            "bytes": size,
            "bytes_per_token": size / m["tokens"],
            "cpu_seconds": (c1.ru_utime + c1.ru_stime) - (c0.ru_utime + c0.ru_stime),
            "peak_rss_mib_children": c1.ru_maxrss / 1024,
            **idle,
            "load_avg_after": load_average(),
        }
        print(name, json.dumps(out["builds"][name]), flush=True)
        _write(Path(args.out), out)


def query(args: argparse.Namespace) -> None:
    import numpy as np

    from memlm.data.corpora import load_documents
    from memlm.data.windows import limit_documents, tokenize_documents
    from memlm.models.resources import load_causal_lm
    from memlm.ngram.memory import NgramMemory

    _, tok = load_causal_lm(args.model, dtype="float32")
    docs = limit_documents(load_documents("wikitext2", "test"), tok, args.tokens)
    chunks = [c.tokens for c in tokenize_documents(docs, tok)]
    n_tokens = sum(len(c) for c in chunks)
    rng = np.random.default_rng(0)
    out: dict = {"machine": host(), "eval_tokens": n_tokens, "indexes": {},
                 "rss_before_any_index_mib": _rss_mib(), "peak_rss_before_any_index_mib": peak_rss_mib()}  # fmt: skip
    for path in args.index:
        memory = NgramMemory(path)
        rec = time_memory(memory, chunks, args.queries, rng)
        rec["index"] = path
        out["indexes"][Path(path).name] = rec
        print(Path(path).name, json.dumps(rec), flush=True)
        _write(Path(args.out), out)


def time_memory(memory, chunks: list, queries: int, rng, idle_wait: float = 900.0) -> dict:
    """(a) the walk over every target, per token (and its effective n, sparse share); (b) ~``queries`` cold queries;
    (c) as many next-token distributions (p50 / p99 each), each part after an idle check (at most ``idle_wait`` s);
    the peak RSS. Shared by ``query`` and ``ngram_scale.py``."""
    import numpy as np

    n_tokens = sum(len(c) for c in chunks)
    rec: dict = {"index_tokens": int(memory.index.manifest["tokens"])}
    rec["idle_before_walk"] = wait_for_idle(0.05, None, max_wait=idle_wait)
    t0 = time.perf_counter()
    scores = memory.score_documents(chunks, [np.arange(len(c)) for c in chunks])
    walk = time.perf_counter() - t0
    rec["walk_seconds"] = walk
    rec["walk_ms_per_token"] = 1000 * walk / n_tokens
    rec["effective_n"] = {"median": float(np.median(scores.n)), "mean": float(scores.n.mean()),
                          "sparse_share": float(scores.sparse.mean())}  # fmt: skip
    picks = []  # about ``queries`` positions, spread over the documents in proportion to their length
    for d, c in enumerate(chunks):
        size = min(len(c), max(1, queries * len(c) // n_tokens))
        picks += [(d, int(p)) for p in rng.choice(len(c), size=size, replace=False)]
    rec["idle_before_cold"] = wait_for_idle(0.05, None, max_wait=idle_wait)
    cold = []
    for d, p in picks:
        t0 = time.perf_counter()
        memory.score_documents([chunks[d]], [np.array([p])])
        cold.append(time.perf_counter() - t0)
    rec["idle_before_search"] = wait_for_idle(0.05, None, max_wait=idle_wait)
    dist = []
    for d, p in picks:
        ctx = chunks[d][:p].tolist()
        t0 = time.perf_counter()
        memory.search([ctx], k=1000)
        dist.append(time.perf_counter() - t0)
    for name, xs in (("cold_query", cold), ("next_token_distribution", dist)):
        ms = 1000 * np.asarray(xs)
        rec[name] = {"queries": len(ms), "p50_ms": float(np.percentile(ms, 50)),
                     "p99_ms": float(np.percentile(ms, 99)), "mean_ms": float(ms.mean())}  # fmt: skip
    rec["peak_rss_mib"] = peak_rss_mib()  # the process: what was loaded before, then the index's pages
    rec["rss_after_mib"] = _rss_mib()
    rec["load_avg_after"] = load_average()
    return rec


def dense(args: argparse.Namespace) -> None:
    ds = Path(args.datastore)
    m = json.loads((ds / "manifest.json").read_text())
    files = {f.name: f.stat().st_size for f in ds.iterdir() if f.is_file()}
    data = sum(v for k, v in files.items() if k.endswith(".bin"))
    index = sum(v for k, v in files.items() if k.endswith(".faiss"))
    rec = {
        "datastore": str(ds),
        "entries": m["count"],
        "build_seconds": m["build_seconds"],
        "entries_per_second": m["count"] / m["build_seconds"],
        "build_dtype": m["build"]["dtype"],
        "bytes_keys_values_provenance": data,
        "bytes_index": index,
        "bytes_per_entry": (data + index) / m["count"],
        "bytes_per_entry_without_index": data / m["count"],
        "files": files,
    }
    print(json.dumps(rec, indent=1))
    _write(Path(args.out), rec)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("--model", default="smollm2-135m")
    bench_work = os.environ.get("MEMLM_BENCH_WORK", os.path.join(tempfile.gettempdir(), "memlm-bench"))
    b.add_argument("--work", default=bench_work + "/ngram")
    b.add_argument("--out", required=True)
    q = sub.add_parser("query")
    q.add_argument("--model", default="smollm2-135m")
    q.add_argument("--index", action="append", required=True)
    q.add_argument("--tokens", type=int, default=20000, help="WikiText-2 test tokens")
    q.add_argument("--queries", type=int, default=2000, help="cold queries and distributions timed")
    q.add_argument("--out", required=True)
    d = sub.add_parser("dense")
    d.add_argument("--datastore", required=True)
    d.add_argument("--out", required=True)
    args = p.parse_args()
    {"build": build, "query": query, "dense": dense}[args.cmd](args)


if __name__ == "__main__":
    main()
