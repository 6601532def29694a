"""Markdown tables for docs/results/scaling.md from docs/results/scaling/*.json (nothing is measured here).

python benchmarks/scale/scaling_report.py > tables.md
"""

from __future__ import annotations

import json
from pathlib import Path

R = Path(__file__).resolve().parents[2] / "docs" / "results" / "scaling"


def _load(name: str) -> dict | None:
    p = R / name
    return json.loads(p.read_text()) if p.exists() else None


def build() -> None:
    one = _load("build_inprocess_16k_idle.json")
    b = _load("build_idle.json")
    print("| configuration | entries | wall s | entries/s (wall) | entries/s per worker (forward only) |")
    print("|---|---:|---:|---:|---:|")
    if one:
        r = one["rows"][0]
        print(
            f"| in-process, 1 shard, 2 threads (16k tokens) | {r['entries']:,} | {r['wall_seconds']:.0f} | "
            f"{r['entries_per_s_wall']:.1f} | {r['entries_per_s_per_worker'][0]:.1f} |"
        )
    if b:
        for r in b["rows"]:
            per = ", ".join(f"{x:.1f}" for x in r["entries_per_s_per_worker"])
            print(
                f"| {r['config']} (run {r['repeat'] + 1}, {b['max_tokens'] // 1000}k tokens) | {r['entries']:,} | "
                f"{r['wall_seconds']:.0f} | "
                f"{r['entries_per_s_wall']:.1f} | {per} |"
            )
        print()
        print(f"mean entries/s (wall): {b['mean_entries_per_s_wall']}; ratio 2 workers / 1 worker: "
              f"{b['ratio_2workers_vs_1worker_wall']:.2f}")  # fmt: skip


SHARDS = {"single": 1, "mmap": 2, "mmap-threads2": 2, "ram": 2, "ray": 2}


def search_idle() -> None:
    """Mean q/s per size and mode over the repeats of search_idle.json, the ratio to one index per repeat, and a
    least-squares fit of ``1/q = S·a + c·codes`` (S shards searched one after the other, ``codes`` = PQ codes scanned
    per query = nprobe·N/nlist) on the in-process rows; writes search_idle_summary.json."""
    import numpy as np

    d = _load("search_idle.json")
    if not d:
        return
    rows, nlist = d["rows"], 1024
    out: dict = {"source": "search_idle.json", "command": d["command"], "sizes": []}
    print("| entries | mode | shards searched | q/s (mean of repeats) | vs one index (per repeat) | top-k overlap |")
    print("|---:|---|---:|---:|---:|---:|")
    for n in sorted({r["size"] for r in rows}):
        here = [r for r in rows if r["size"] == n]
        single = {r["repeat"]: r["qps"] for r in here if r["mode"] == "single"}
        for mode in SHARDS:
            mine = [r for r in here if r["mode"] == mode]
            if not mine:
                continue
            qps = float(np.mean([r["qps"] for r in mine]))
            ratios = [r["qps"] / single[r["repeat"]] for r in mine]
            ov = [r["topk_overlap_vs_single"] for r in mine if "topk_overlap_vs_single" in r]
            rng = f"{min(ratios):.2f}-{max(ratios):.2f}x" if mode != "single" else "1.00x"
            how = {"single": "1", "mmap": "2 (in turn)", "mmap-threads2": "2 (at once)", "ram": "2 (in turn)",
                   "ray": "2 (actors)"}[mode]  # fmt: skip
            print(f"| {n:,} | {mode} | {how} | {qps:.0f} | {rng} | {'' if not ov else f'{min(ov):.5f}'} |")
            out["sizes"].append({"n": n, "mode": mode, "qps_mean": qps, "ratio_min": min(ratios),
                                 "ratio_max": max(ratios), "topk_overlap_min": min(ov) if ov else None})  # fmt: skip
    fit_rows = [r for r in rows if r["mode"] in ("single", "mmap", "ram")]
    x = np.array([[SHARDS[r["mode"]], r["nprobe"] * r["size"] / nlist] for r in fit_rows], dtype=float)
    y = np.array([1.0 / r["qps"] for r in fit_rows])
    (a, c), *_ = np.linalg.lstsq(x, y, rcond=None)
    pred = x @ np.array([a, c])
    out["fit"] = {"model": "1/q = S*a + c*codes, codes = nprobe*N/nlist", "a_seconds_per_query_per_shard": float(a),
                  "c_seconds_per_code": float(c), "rows": len(fit_rows),
                  "max_relative_error": float(np.max(np.abs(pred - y) / y))}  # fmt: skip
    print()
    print(
        f"fit over {len(fit_rows)} rows (single, mmap, ram): a = {a * 1e3:.3f} ms per query and shard, "
        f"c = {c * 1e9:.1f} ns per code scanned; largest relative error {out['fit']['max_relative_error']:.0%}"
    )
    (R / "search_idle_summary.json").write_text(json.dumps(out, indent=2) + "\n")


def evaluation_idle() -> None:
    for name in ("eval_idle.json", "eval_limited_evict.json", "eval_limited_exact.json"):
        d = _load(name)
        if not d:
            continue
        print(f"\n{name}: `{d['command']}`\n")
        print(
            "| entries | datastore + index on disk | peak RSS MiB | RSS at exit: anon MiB | file MiB | cgroup limit "
            "MiB | cgroup max usage MiB | limit hits | OOM kills | major faults | seconds | printed |"
        )
        print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
        for r in d["rows"]:
            g = r.get("memory_cgroup") or {}
            print(
                f"| {r['size']:,} | {r.get('datastore_bytes', 0) / 2**30:.2f} GiB | {r['peak_rss_mib']:.0f} | "
                f"{r['RssAnon_mib']:.0f} | {r['RssFile_mib']:.0f} | {g.get('limit_mib', '-')} | "
                f"{g.get('max_usage_mib', float('nan')):.0f} | {g.get('failcnt', '-')} | {g.get('oom_kill', '-')} | "
                f"{g.get('pgmajfault', '-')} | {r['seconds']:.0f} | {'; '.join(r.get('printed', []))} |"
            )


def plan() -> None:
    d = _load("plan.json")
    print("| entries | datastore files | default factory | index on disk | index in RAM (loaded) | bytes/entry |")
    print("|---:|---:|---|---:|---:|---:|")
    for r in d["rows"]:
        print(
            f"| {r['n']:,} | {r['datastore_bytes'] / 1e9:.2f} GB | {r['factory']} | "
            f"{r['index_disk_bytes'] / 1e9:.2f} GB | {r['index_memory_bytes'] / 1e9:.2f} GB | "
            f"{r['index_bytes_per_entry']:.1f} |"
        )


if __name__ == "__main__":
    for f in (build, search_idle, evaluation_idle, plan):
        print(f"\n## {f.__name__}\n")
        f()
