"""Scaling measurements for docs/results/scaling.md: build entries/s by Ray workers, sharded search, peak RSS by size.

Subcommands (each writes one JSON under --results, default docs/results/scaling/; long ones belong in the background):

    build   real SmolLM2-135M datastore of wiki/train (--max-tokens) built three ways: in-process (1 shard, 2 torch
            threads), Ray 1 worker x 2 threads (2 shards, one after the other), Ray 2 workers x 1 thread (2 shards at
            once); entries/s of each (wall, and per worker from the shard manifests). Each in a fresh process.
    synth   synthetic sharded datastores (2 shards) of --sizes entries whose keys are drawn from N(mean, cov) of the
            real build's keys (values from the real values' unigram distribution; NOT real text: for memory and speed
            only), each with one sharded IVF index (--factory, same for every size) trained once.
    search  per size, in a fresh process each: 4096 real keys (not in the synthetic data) as queries, k=1024, nprobe 32:
            peak RSS and q/s of the sharded index memory-mapped (threads, and Ray actors) and loaded into RAM; sharded
            vs one index over all entries with the same quantizer (q/s, top-k overlap).
    eval    per size: `memlm eval` (SmolLM2, wiki/valid, 1024 tokens, k=1024) under /usr/bin/time: peak RSS.

    PYTHONPATH=src python benchmarks/scale/bench_scaling.py build --max-tokens 16000
    PYTHONPATH=src python benchmarks/scale/bench_scaling.py synth --sizes 100000 1000000 5000000
    PYTHONPATH=src python benchmarks/scale/bench_scaling.py search --sizes 100000 1000000 5000000
    PYTHONPATH=src python benchmarks/scale/bench_scaling.py eval --sizes 100000 1000000 5000000
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from protocol import host, load_average  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
WORK = Path(os.environ.get("MEMLM_BENCH_DIR", ROOT / "logs" / "scaling"))
RESULTS = ROOT / "docs" / "results" / "scaling"


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _rss_parts_mib() -> dict[str, float]:
    """Resident memory now, split (Linux /proc/self/status): anonymous (heap: grows only with what is loaded) and
    file-backed (pages of memory-mapped files: page cache the kernel can drop under memory pressure)."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        name, _, rest = line.partition(":")
        if name in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
            out[name + "_mib"] = int(rest.split()[0]) / 1024
    return out


def _machine() -> dict[str, Any]:
    return {**host(), "loadavg_at_start": load_average()}


def _write(name: str, data: dict[str, Any]) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / name).write_text(json.dumps(data, indent=2) + "\n")
    print(f"wrote {RESULTS / name}", file=sys.stderr)


def _run_child(args: list[str]) -> dict[str, Any]:
    out = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, env=os.environ)
    if out.returncode != 0:
        raise RuntimeError(f"child {args} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------------------------------------- build


def child_build(a: argparse.Namespace) -> None:
    import torch

    from memlm.data.corpora import load_corpus_source as _documents
    from memlm.knnlm.write import build_sharded
    from memlm.models.resources import load_causal_lm

    torch.set_num_threads(2)
    model, tok = load_causal_lm("smollm2-135m", dtype=a.dtype)
    docs, source = _documents("wiki", "train", tok, a.max_tokens)
    out = WORK / (a.out or f"build-{a.config}")
    t0 = time.perf_counter()
    if a.config == "inprocess":
        ds = build_sharded(model, docs, out, 1, tokenizer=tok, source=source, progress=False)
    else:
        cpus = 2 if a.config == "ray-1x2" else 1
        ds = build_sharded("smollm2-135m", docs, out, 2, tokenizer=tok, source=source, ray="local", dtype=a.dtype,
                           cpus_per_worker=cpus, progress=False)  # fmt: skip
    wall = time.perf_counter() - t0
    shards = [{"count": len(s), "build_seconds": s.manifest["build_seconds"]} for s in ds.shards]
    print(json.dumps({"config": a.config, "entries": len(ds), "wall_seconds": wall, "shards": shards}))


def cmd_build(a: argparse.Namespace) -> None:
    """Each config ``repeats`` times, interleaved (a, b, a, b, ...) so that drifting load hits all configs alike."""
    import shutil

    rows = []
    for rep in range(a.repeats):
        for config in a.configs:
            out = f"build-{config}" if config == "inprocess" else f"build-{config}-{rep}"
            r = _run_child(["child-build", "--config", config, "--max-tokens", str(a.max_tokens), "--dtype", a.dtype,
                            "--out", out])  # fmt: skip
            r.update(repeat=rep, loadavg_after=load_average())
            r["entries_per_s_wall"] = r["entries"] / r["wall_seconds"]
            r["entries_per_s_per_worker"] = [s["count"] / s["build_seconds"] for s in r["shards"]]
            rows.append(r)
            print(json.dumps(r), file=sys.stderr, flush=True)
            if config != "inprocess":
                shutil.rmtree(WORK / out)
    mean = {c: float(np.mean([r["entries_per_s_wall"] for r in rows if r["config"] == c])) for c in a.configs}
    _write(
        a.json,
        {
            "what": "SmolLM2-135M datastore of wiki/train, window 1024, min_context 512, batch 4, key ffn_in@29",
            "dtype": a.dtype,
            "max_tokens": a.max_tokens,
            "machine": _machine(),
            "note": "2-core machine shared with other jobs (see loadavg); wall includes Ray start and model loads",
            "configs": {
                "inprocess": "build_sharded in-process, 1 shard, torch 2 threads",
                "ray-1x2": "Ray local cluster, 2 shards, tasks of 2 CPUs (one at a time), torch 2 threads",
                "ray-2x1": "Ray local cluster, 2 shards, tasks of 1 CPU (two at once), torch 1 thread each",
            },
            "rows": rows,
            "mean_entries_per_s_wall": mean,
            "ratio_2workers_vs_1worker_wall": (
                mean["ray-2x1"] / mean["ray-1x2"] if {"ray-2x1", "ray-1x2"} <= set(mean) else None
            ),
            "command": f"PYTHONPATH=src python benchmarks/scale/bench_scaling.py build --max-tokens {a.max_tokens} "
            f"--dtype {a.dtype} --configs {' '.join(a.configs)} --repeats {a.repeats} --json {a.json}",
        },
    )


# --------------------------------------------------------------------------------------------------------- synth


def _real() -> Any:
    from memlm.storage.sharded import ShardedDatastore

    return ShardedDatastore.open(WORK / "build-inprocess")


def cmd_synth(a: argparse.Namespace) -> None:
    import faiss

    from memlm.io.fileio import atomic_write_json
    from memlm.storage.datastore import FOLDER
    from memlm.storage.sharded_index import build_sharded_index

    real = _real()
    keys = np.asarray(real.keys[:], dtype=np.float64)
    mean, cov = keys.mean(0), np.cov(keys, rowvar=False)
    chol = np.linalg.cholesky(cov + 1e-6 * np.eye(len(mean)) * np.trace(cov) / len(mean))
    mean32, chol32 = mean.astype(np.float32), chol.astype(np.float32)
    values = np.asarray(real.values[:])
    d = real.dim
    info = []
    for n in a.sizes:
        out = WORK / f"synth-{n}"
        if (out / "index.faiss.json").exists():
            continue
        t0 = time.perf_counter()
        rng = np.random.default_rng(n)
        sizes = [n // 2, n - n // 2]
        plan = []
        for s, m in enumerate(sizes):
            folder = out / f"shard-{s:05d}"
            folder.mkdir(parents=True, exist_ok=True)
            with open(folder / "keys.bin", "wb") as f:
                for c in range(0, m, 200_000):
                    z = rng.standard_normal((min(200_000, m - c), d), dtype=np.float32)
                    f.write((mean32 + z @ chol32.T).astype(np.float16).tobytes())
            rng.choice(values, m).astype(np.int32).tofile(folder / "values.bin")
            rng.integers(-(2**62), 2**62, m, dtype=np.int64).tofile(folder / "doc_hash.bin")
            (np.arange(m) % 1000).astype(np.int32).tofile(folder / "offset.bin")
            manifest = json.loads(json.dumps(real.shards[0].manifest))
            for stale in ("files", "manifest_sha256"):
                manifest.pop(stale, None)
            manifest.update(count=m, sources=[{"synthetic": f"N(mean, cov) of {real.path}'s keys"}])
            FOLDER.publish(folder, manifest)  # checksums of the synthetic arrays, manifest sealed
            lo = 1 + sum(sizes[:s])
            plan.append({"index": s, "doc_lo": s, "doc_hi": s + 1, "target_lo": lo, "target_hi": lo + m,
                         "first_window": 0, "read_doc": s, "read_skip": 0})  # fmt: skip
        state = json.loads((real.path / "shards.json").read_text())
        state.update(plan=plan, count=n, complete=True, synthetic=True)
        atomic_write_json(out / "shards.json", state)
        from memlm.storage.sharded import ShardedDatastore

        ds = ShardedDatastore.open(out)
        faiss.omp_set_num_threads(2)
        t1 = time.perf_counter()
        desc = build_sharded_index(ds, factory=a.factory, train_size=a.train_size, progress=True)
        info.append({"n": n, "data_seconds": t1 - t0, "index_seconds": time.perf_counter() - t1, "index": desc})
        print(json.dumps(info[-1])[:300], file=sys.stderr, flush=True)
    if info:
        old = json.loads((RESULTS / "synth.json").read_text())["sizes"] if (RESULTS / "synth.json").exists() else []
        _write(
            "synth.json",
            {
                "what": "synthetic keys ~ N(mean, cov) of the real SmolLM2 ffn_in@29 keys of build-inprocess "
                "(values: the real values' unigram distribution); 2 shards; one sharded index per size",
                "real_keys": len(real),
                "factory": a.factory,
                "sizes": [o for o in old if o["n"] not in {i["n"] for i in info}] + info,
                "command": "PYTHONPATH=src python benchmarks/scale/bench_scaling.py synth --sizes "
                + " ".join(map(str, a.sizes)),
            },
        )


# -------------------------------------------------------------------------------------------------------- search


def _queries(nq: int) -> np.ndarray:
    """Real SmolLM2 keys (from the real build; none of them is in a synthetic datastore)."""
    real = _real()
    idx = np.random.default_rng(0).choice(len(real), nq, replace=False)
    return np.asarray(real.keys[np.sort(idx)], dtype=np.float32)


def child_search(a: argparse.Namespace) -> None:
    import faiss

    from memlm.storage import index as index_lib
    from memlm.storage.sharded import ShardedDatastore
    from memlm.storage.sharded_index import ShardedSearcher, merge_topk, search_with_offset

    faiss.omp_set_num_threads(a.threads)
    q = _queries(a.queries)
    rss0 = _peak_rss_mib()
    ds = ShardedDatastore.open(WORK / f"synth-{a.size}")
    res: dict[str, Any] = {"size": a.size, "mode": a.mode, "threads": a.threads, "rss_mib_before_index": rss0}
    t0 = time.perf_counter()
    if a.mode in ("mmap", "mmap-threads2"):
        searcher = ShardedSearcher.open(ds, nprobe=a.nprobe, workers=2 if a.mode == "mmap-threads2" else 1)
        t1 = time.perf_counter()
        sc, ids = searcher.search(q, a.k)
    elif a.mode == "ray":
        searcher = ShardedSearcher.open(ds, nprobe=a.nprobe, ray="local")
        searcher.search(q[:8], a.k)  # actors up
        t1 = time.perf_counter()
        sc, ids = searcher.search(q, a.k)
    elif a.mode == "ram":
        indexes = [faiss.read_index(str(s.path / "index.faiss")) for s in ds.shards]  # read into RAM
        for ix in indexes:
            faiss.extract_index_ivf(ix).nprobe = a.nprobe
        t1 = time.perf_counter()
        sc, ids = merge_topk(
            [search_with_offset(ix, q, a.k, int(o)) for ix, o in zip(indexes, ds.offsets, strict=True)], a.k
        )
    elif a.mode == "single":  # one index over all entries with the same trained quantizer, in RAM
        path = WORK / f"synth-{a.size}-single.faiss"
        if not path.exists():  # the shards' inverted lists merged into one index (ids shifted by the offsets)
            one = faiss.read_index(str(ds.path / "index.faiss.trained"))
            for s, o in zip(ds.shards, ds.offsets, strict=True):
                one.merge_from(faiss.read_index(str(s.path / "index.faiss")), int(o))
            faiss.write_index(one, str(path))
            del one
        index = faiss.read_index(str(path))  # benchmark-internal: no memlm sidecar
        faiss.extract_index_ivf(index).nprobe = a.nprobe
        t1 = time.perf_counter()
        sc, ids = index_lib.search(index, q, a.k)
    else:
        raise SystemExit(f"unknown mode {a.mode}")
    t2 = time.perf_counter()
    np.save(WORK / f"ids-{a.size}-{a.mode}.npy", ids)
    res.update(
        load_seconds=t1 - t0,
        search_seconds=t2 - t1,
        queries=len(q),
        k=a.k,
        nprobe=a.nprobe,
        qps=len(q) / (t2 - t1),
        loadavg_after=load_average(),
        peak_rss_mib=_peak_rss_mib(),
        **_rss_parts_mib(),
    )
    print(json.dumps(res))


def _overlap(a: np.ndarray, b: np.ndarray) -> float:
    return float(
        np.mean([len(np.intersect1d(x[x >= 0], y[y >= 0])) / max(1, (x >= 0).sum()) for x, y in zip(a, b, strict=True)])
    )


def cmd_search(a: argparse.Namespace) -> None:
    rows = []
    for n in a.sizes:
        for repeat in range(a.repeats):  # modes interleaved, so a change of machine load hits every mode alike
            for mode in a.modes:
                r = _run_child(["child-search", "--size", str(n), "--mode", mode, "--k", str(a.k), "--nprobe",
                                str(a.nprobe), "--queries", str(a.queries), "--threads", str(a.threads)])  # fmt: skip
                r["repeat"] = repeat
                rows.append(r)
                print(json.dumps(r), file=sys.stderr, flush=True)
        ref = WORK / f"ids-{n}-single.npy"
        if ref.exists():
            for r in rows:
                if r["size"] == n and r["mode"] != "single":
                    r["topk_overlap_vs_single"] = _overlap(np.load(WORK / f"ids-{n}-{r['mode']}.npy"), np.load(ref))
                    r["identical_ids_vs_single"] = float(
                        np.mean(np.load(WORK / f"ids-{n}-{r['mode']}.npy") == np.load(ref))
                    )
    _write(
        a.json,
        {
            "what": "4096 real SmolLM2 keys as queries against synthetic sharded datastores (2 shards), k=1024; peak "
            "RSS (ru_maxrss) of a fresh process that opens the datastore, loads the index and searches once",
            "modes": {
                "mmap": "ShardedSearcher, shard indexes memory-mapped (IO_FLAG_MMAP), shards searched one after the "
                "other",
                "mmap-threads2": "same, the 2 shards searched by 2 threads at once",
                "ray": "ShardedSearcher with one Ray actor per shard (local cluster, 1 CPU each)",
                "ram": "shard indexes read into RAM (memlm.storage.index.load_index), merged the same way",
                "single": "one index over all entries with the same trained quantizer, in RAM",
            },
            "machine": _machine(),
            "rows": rows,
            "command": "PYTHONPATH=src python benchmarks/scale/bench_scaling.py search --sizes "
            + " ".join(map(str, a.sizes))
            + f" --modes {' '.join(a.modes)} --threads {a.threads} --repeats {a.repeats} --json {a.json}",
        },
    )


# ---------------------------------------------------------------------------------------------------------- eval


def _folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def _memory_cgroup(limit_mib: int, name: str) -> Path:
    """A cgroup-v1 memory group capped at ``limit_mib`` (page cache included: the kernel must evict the memory-mapped
    keys and index lists to stay under it, and kills the process if its anonymous memory alone exceeds it)."""
    group = Path("/sys/fs/cgroup/memory") / name
    if not Path("/sys/fs/cgroup/memory").is_dir():
        raise SystemExit("--memory-limit-mib needs a writable cgroup-v1 memory controller at /sys/fs/cgroup/memory")
    if group.exists():
        group.rmdir()
    group.mkdir()
    (group / "memory.limit_in_bytes").write_text(str(limit_mib * 2**20))
    (group / "memory.memsw.limit_in_bytes").write_text(str(limit_mib * 2**20))  # no escape into swap
    return group


def _cgroup_report(group: Path) -> dict[str, Any]:
    read = lambda name: int((group / name).read_text().split()[0])  # noqa: E731
    stat = dict(line.split() for line in (group / "memory.stat").read_text().splitlines())
    report = {
        "limit_mib": read("memory.limit_in_bytes") / 2**20,
        "max_usage_mib": read("memory.max_usage_in_bytes") / 2**20,
        "failcnt": read("memory.failcnt"),  # times the limit was hit (the kernel reclaimed page cache)
        "oom_kill": int(
            dict(line.split() for line in (group / "memory.oom_control").read_text().splitlines()).get("oom_kill", 0)
        ),  # fmt: skip
        "pgmajfault": int(stat.get("total_pgmajfault", stat.get("pgmajfault", 0))),
    }
    group.rmdir()
    return report


def _evict_page_cache(folder: Path) -> int:
    """Drop ``folder``'s files from the page cache (``sync``, then ``posix_fadvise(DONTNEED)`` per file; no root
    needed), so a later reader faults every page it touches in again, charged to its own memory cgroup. Returns the
    bytes of the files advised."""
    subprocess.run(["sync"], check=True)
    total = 0
    for f in sorted(p for p in folder.rglob("*") if p.is_file()):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        total += f.stat().st_size
    return total


def cmd_eval(a: argparse.Namespace) -> None:
    rows = []
    for n in a.sizes:
        for target, label in ((WORK / f"synth-{n}", "sharded-mmap"),):
            argv = [
                "eval",
                "--model",
                "smollm2-135m",
                "--dtype",
                a.dtype,
                "--corpus",
                "wiki",
                "--split",
                "valid",
                "--max-tokens",
                str(a.tokens),
                "--memory",
                str(target),
                "--k",
                "1024",
                "--nprobe",
                "32",
                "--scores",
                a.scores,
            ]
            code = (
                f"import json, sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import bench_scaling as b; "
                f"from memlm.cli import main; rc = main({argv!r}); "
                "print(json.dumps({'rc': rc, 'peak_rss_mib': b._peak_rss_mib(), **b._rss_parts_mib()}))"
            )
            # fmt: skip
            evicted = _evict_page_cache(target) if a.evict else 0  # pages then read (and charged) inside the limit
            t0 = time.perf_counter()
            group = _memory_cgroup(a.memory_limit_mib, f"memlm-eval-{n}") if a.memory_limit_mib else None
            try:
                out = subprocess.run(
                    [sys.executable, "-c", code],
                    capture_output=True,
                    text=True,
                    env=os.environ,
                    preexec_fn=(lambda g=group: (g / "cgroup.procs").write_text(str(os.getpid()))) if group else None,
                    timeout=a.timeout_s or None,
                )
            except subprocess.TimeoutExpired:  # recorded, not raised: "did not finish in T s" is the measurement
                rows.append({"size": n, "mode": label, "timed_out": True, "seconds": time.perf_counter() - t0,
                             "memory_cgroup": _cgroup_report(group) if group else None, "evicted_bytes": evicted,
                             "datastore_bytes": _folder_bytes(target)})  # fmt: skip
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
                continue
            limit = _cgroup_report(group) if group else None
            if out.returncode != 0:
                raise RuntimeError(f"{limit}\n{out.stderr[-3000:]}")
            res = json.loads(out.stdout.strip().splitlines()[-1])
            if res["rc"] != 0:
                raise RuntimeError(f"memlm eval failed ({res['rc']}): {out.stderr[-2000:]}")
            ppl = [x for x in out.stdout.splitlines() if x.startswith(("base_ppl", "knn_ppl", "tokens"))]
            rows.append({"size": n, "mode": label, **res, "seconds": time.perf_counter() - t0, "printed": ppl,
                         "datastore_bytes": _folder_bytes(target), "memory_cgroup": limit,
                         "evicted_bytes": evicted})  # fmt: skip
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    _write(
        a.json,
        {
            "what": f"peak RSS of `memlm eval` (SmolLM2-135M {a.dtype}, wiki/valid first {a.tokens} tokens, k=1024, "
            "nprobe 32) with synthetic sharded datastores: keys memory-mapped, shard indexes memory-mapped",
            "machine": _machine(),
            "rows": rows,
            "command": "PYTHONPATH=src python benchmarks/scale/bench_scaling.py eval --sizes "
            + " ".join(map(str, a.sizes))
            + (f" --memory-limit-mib {a.memory_limit_mib}" if a.memory_limit_mib else "")
            + (" --evict" if a.evict else "")
            + (f" --timeout-s {a.timeout_s}" if a.timeout_s else "")
            + f" --scores {a.scores}"
            + f" --tokens {a.tokens} --json {a.json}",
        },
    )


def cmd_plan(a: argparse.Namespace) -> None:
    """Bytes for N entries of d-dim fp16 keys: datastore files and the default index
    (memlm.storage.index.plan_index)."""
    from memlm.storage.index import default_factory, plan_index

    rows = []
    for n in a.sizes:
        factory = default_factory(n, a.d)
        # plan_index's estimates need no training data: n keys are only counted
        plan = plan_index(n, a.d, factory)
        rows.append(
            {
                "n": n,
                "d": a.d,
                "datastore_bytes": n * (2 * a.d + 4 + 8 + 4),
                "datastore_bytes_per_entry": 2 * a.d + 16,
                "factory": factory,
                "index_memory_bytes": plan.memory_bytes,
                "index_disk_bytes": plan.disk_bytes,
                "index_bytes_per_entry": plan.disk_bytes / n,
                "train_size": plan.train_size,
            }
        )
    _write(
        "plan.json",
        {
            "what": "datastore files (fp16 keys + int32 value + int64 doc hash + int32 offset per entry) and the "
            "default index (memlm.storage.index.default_factory / plan_index) for d-dim keys",
            "rows": rows,
            "command": "PYTHONPATH=src python benchmarks/scale/bench_scaling.py plan --sizes "
            + " ".join(map(str, a.sizes)),
        },
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("--max-tokens", type=int, default=16000)
    b.add_argument("--dtype", default="bfloat16")
    b.add_argument("--configs", nargs="+", default=["inprocess", "ray-1x2", "ray-2x1"])
    b.add_argument("--repeats", type=int, default=1)
    b.add_argument("--json", default="build.json")
    cb = sub.add_parser("child-build")
    cb.add_argument("--config", required=True)
    cb.add_argument("--max-tokens", type=int, required=True)
    cb.add_argument("--dtype", default="bfloat16")
    cb.add_argument("--out", default=None)
    s = sub.add_parser("synth")
    s.add_argument("--sizes", type=int, nargs="+", default=[100_000, 1_000_000, 5_000_000])
    s.add_argument("--factory", default="IVF1024,PQ64")
    s.add_argument("--train-size", type=int, default=65536)
    se = sub.add_parser("search")
    se.add_argument("--sizes", type=int, nargs="+", default=[100_000, 1_000_000, 5_000_000])
    se.add_argument("--modes", nargs="+", default=["single", "mmap", "mmap-threads2", "ram", "ray"])
    se.add_argument("--json", default="search.json")
    for q in (se, cs := sub.add_parser("child-search")):
        q.add_argument("--k", type=int, default=1024)
        q.add_argument("--nprobe", type=int, default=32)
        q.add_argument("--queries", type=int, default=4096)
        q.add_argument("--threads", type=int, default=2, help="FAISS OpenMP threads of each search process")
    se.add_argument("--repeats", type=int, default=1)
    cs.add_argument("--size", type=int, required=True)
    cs.add_argument("--mode", required=True)
    e = sub.add_parser("eval")
    e.add_argument("--sizes", type=int, nargs="+", default=[100_000, 1_000_000, 5_000_000])
    e.add_argument("--tokens", type=int, default=1024)
    e.add_argument("--dtype", default="bfloat16")
    e.add_argument("--json", default="eval.json")
    e.add_argument("--memory-limit-mib", type=int, default=0, help="run each eval in a cgroup capped at this memory")
    e.add_argument("--scores", default="index", choices=["index", "exact"], help="exact: read the retrieved keys")
    e.add_argument("--evict", action="store_true", help="drop the datastore's files from the page cache first")
    e.add_argument("--timeout-s", type=int, default=0, help="stop an eval after this long and record it as timed out")
    pl = sub.add_parser("plan")
    pl.add_argument("--sizes", type=int, nargs="+", default=[100_000, 1_000_000, 5_000_000, 100_000_000, 10**9])
    pl.add_argument("--d", type=int, default=576)
    a = p.parse_args()
    WORK.mkdir(parents=True, exist_ok=True)
    {"build": cmd_build, "child-build": child_build, "synth": cmd_synth, "search": cmd_search,
     "child-search": child_search, "eval": cmd_eval, "plan": cmd_plan}[a.cmd](a)  # fmt: skip


if __name__ == "__main__":
    main()
