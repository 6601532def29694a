"""Markdown tables for docs/SCALING.md from docs/results/scaling/*.json (nothing is measured here).

python benchmarks/scaling_report.py > /tmp/tables.md
"""

from __future__ import annotations

import json
from pathlib import Path

R = Path(__file__).resolve().parents[1] / "docs" / "results" / "scaling"


def _load(name: str) -> dict | None:
    p = R / name
    return json.loads(p.read_text()) if p.exists() else None


def build() -> None:
    one = _load("build_inprocess_16k.json")
    b = _load("build.json")
    print("| configuration | entries | wall s | entries/s (wall) | entries/s per worker (forward only) |")
    print("|---|---:|---:|---:|---:|")
    if one:
        r = one["row"]
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


def search() -> None:
    rows = []
    for name in ("search.json", "search_3m.json"):
        d = _load(name)
        if d:
            rows += d["rows"]
    single = {r["size"]: r["qps"] for r in rows if r["mode"] == "single"}
    print("| entries | mode | q/s | vs one index | top-k overlap | same ids | peak RSS MiB | anon MiB | file MiB |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        ratio = r["qps"] / single[r["size"]] if r["size"] in single else float("nan")
        ov = r.get("topk_overlap_vs_single")
        same = r.get("identical_ids_vs_single")
        print(
            f"| {r['size']:,} | {r['mode']} | {r['qps']:.0f} | {ratio:.2f}x | "
            f"{'' if ov is None else f'{ov:.4f}'} | {'' if same is None else f'{same:.4f}'} | "
            f"{r['peak_rss_mib']:.0f} | {r.get('RssAnon_mib', 0):.0f} | {r.get('RssFile_mib', 0):.0f} |"
        )


def evaluation() -> None:
    rows = [r for name in ("eval.json", "eval_3m.json") if (d := _load(name)) for r in d["rows"]]
    print("| entries | peak RSS MiB | RSS at exit: anon MiB | file MiB | seconds |")
    print("|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['size']:,} | {r['peak_rss_mib']:.0f} | {r['RssAnon_mib']:.0f} | {r['RssFile_mib']:.0f} | "
            f"{r['seconds']:.0f} |"
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
    for f in (build, search, evaluation, plan):
        print(f"\n## {f.__name__}\n")
        f()
