"""Where the time of the slow README lines goes: ``memlm lm-eval``, ``memlm index build`` with an
OPQ factory, ``memlm datastore prune``, each run once under cProfile in its own process, its self time grouped into
what it is (the forward pass's matmuls, attention, log-softmax; FAISS training, adding, searching; tokenization;
lm-eval's harness; the rest of Python).

    python benchmarks/speed/profile_commands.py --datastore DS --out docs/results/speed/commands_profile.json

``DS`` is any datastore folder (its copy is pruned and indexed in a temporary folder; the datastore is not changed).
The shares hold under load (the profile is of one process); the seconds are a benchmark only where the JSON says the
machine was idle (benchmarks/protocol.py).
"""

from __future__ import annotations

import argparse
import pstats
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import protocol  # noqa: E402

# (bucket, substrings of "file:function" that put a function's self time there), first match wins
BUCKETS = (
    ("FAISS training (OPQ rotation, k-means, PQ codebooks)", ("_train", "train_", "kmeans", "Clustering")),
    ("FAISS search", ("_search", "search_")),
    ("FAISS add / index write", ("_add", "add_", "write_index", "read_index")),
    ("forward: linear layers (matmul)", ("linear", "addmm", "matmul", " mm", "bmm")),
    ("forward: attention core (SDPA)", ("scaled_dot_product_attention",)),
    ("forward: log-softmax / entropy", ("log_softmax", "softmax", "logsumexp")),
    ("forward: other torch ops (norms, activations, embedding, copies)", ("torch", "_C.", "silu", "rms", "embedding")),
    ("tokenization", ("tokenizers", "tokenization", "encode")),
    ("lm-eval harness", ("lm_eval",)),
    ("numpy (merging, sorting, copies)", ("numpy",)),
)


def bucket(key: str) -> str:
    low = key.lower()
    for name, subs in BUCKETS:
        if any(s.lower() in low for s in subs):
            return name
    return "Python and the rest"


def summarise(prof: Path, top: int = 15) -> dict:
    st = pstats.Stats(str(prof))
    rows = []
    for (file, _line, fn), (_cc, _nc, tt, _ct, _callers) in st.stats.items():  # type: ignore[attr-defined]
        rows.append((f"{file}:{fn}", tt))
    total = sum(t for _, t in rows) or 1.0
    shares: dict[str, float] = {}
    for key, t in rows:
        shares[bucket(key)] = shares.get(bucket(key), 0.0) + t
    rows.sort(key=lambda r: -r[1])
    return {
        "self_seconds": total,
        "buckets": {k: {"seconds": v, "share": v / total} for k, v in sorted(shares.items(), key=lambda kv: -kv[1])},
        "top": [{"function": k, "seconds": t, "share": t / total} for k, t in rows[:top]],
    }


def profiled(name: str, argv: list[str], work: Path) -> dict:
    prof = work / f"{name}.prof"
    cmd = [sys.executable, "-m", "cProfile", "-o", str(prof), "-m", "memlm.cli", *argv]
    load_before = protocol.load_average()
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        raise SystemExit(f"{name} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return {"command": "memlm " + " ".join(argv), "wall_s": wall, "load_before": load_before,
            "load_after": protocol.load_average(), **summarise(prof)}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--datastore", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--factory", default="OPQ32_128,IVF1024,PQ32")
    ap.add_argument("--tasks", default="memlm_wikitext2,memlm_imdb")
    ap.add_argument("--limit", type=int, default=20)
    ap.add_argument("--only", default="index,prune,lmeval")
    args = ap.parse_args()
    only = args.only.split(",")
    results = {"machine": protocol.machine(), "idle_before": protocol.idle_check(force=True)}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        ds = work / "ds"
        shutil.copytree(args.datastore, ds)
        if "index" in only:
            results["index_build"] = profiled("index", ["index", "build", str(ds), "--factory", args.factory,
                                                        "--out", str(work / "opq.faiss")], work)  # fmt: skip
        if "prune" in only:
            results["prune"] = profiled("prune", ["datastore", "prune", str(ds), "--out", str(work / "pruned")], work)
        if "lmeval" in only:
            results["lm_eval"] = profiled("lmeval", ["lm-eval", "--tasks", args.tasks, "--memory", str(ds),
                                                     "--limit", str(args.limit), "--out", str(work / "le.json")],
                                          work)  # fmt: skip
    protocol.save_result(args.out, results)
    for name in ("index_build", "prune", "lm_eval"):
        if name in results:
            r = results[name]
            print(f"\n{r['command']}  ({r['wall_s']:.1f} s wall, load {r['load_before']})")
            for b, v in r["buckets"].items():
                print(f"  {100 * v['share']:5.1f}%  {v['seconds']:8.1f} s  {b}")


if __name__ == "__main__":
    main()
