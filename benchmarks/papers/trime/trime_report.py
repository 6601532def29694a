"""Collect the results of ``benchmarks/papers/trime/trime.sh`` into ``docs/results/trime/`` (summary JSON + markdown
tables).

Reads, under ``--runs`` (default ``runs/trime``): each model's ``log.json`` (validation perplexity and tokens/s of
training), ``eval-<model>/tuned.json`` (``memlm trime-tune``: every memory chosen on valid, applied to test) and
``eval-vanilla-knnlm/*.json`` (``memlm tune``: the vanilla LM with the continuous cache and the kNN-LM).

    .venv/bin/python benchmarks/papers/trime/trime_report.py --out docs/results/trime
    .venv/bin/python benchmarks/papers/trime/trime_report.py --out docs/results/trime --from-summary  # from the JSONs

writes ``summary.json`` / ``tables.md`` for the 400-update runs (``vanilla``, ``trimelm``, ...) and, when they exist,
``summary-2k.json`` / ``tables-2k.md`` for the 2,000-update runs trained on a GPU (``vanilla-2k``, ``trimelm-2k``, ...;
``benchmarks/papers/trime/trime.sh eval-2k``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from memlm.io.fileio import atomic_write_json

MODELS = {
    "vanilla": "Vanilla LM (CE)",
    "trimelm": "TrimeLM (local memory)",
    "trimelm-long": "TrimeLM_long (consecutive segments, m = 4)",
    "trimelm-ext": "TrimeLM_ext (BM25 batches, p = 0.9)",
    "trimelm-ext-random": "TrimeLM_ext, random batches (p = 0.9)",
    "trimelm-ext-p0": "TrimeLM_ext, BM25 batches, p = 0",
}
# the seeds and ablations runs (400 updates): the main rows with seeds 1 and 2 beside seed 0 (the plain names), the
# main rows under App. D's overlapping windows (eval-NAME-appd), and the ablations of TrimeLM_ext: p in {0, 0.5, 0.9}
# and no back-prop
MAIN = ("vanilla", "trimelm", "trimelm-long", "trimelm-ext")
OWN_MEMORY = {"vanilla": "local", "trimelm": "local", "trimelm-long": "long", "trimelm-ext": "external"}
SEEDS = {0: "", 1: "-s1", 2: "-s2"}
KNNLM_ROWS = {
    "knnlm": "Vanilla LM + kNN-LM (own datastore)",
    "cache-only": "Vanilla LM + continuous cache",
    "knnlm-cache": "Vanilla LM + kNN-LM + cache",
}
ABLATIONS = {
    "trimelm-ext": "p = 0.9 (TrimeLM_ext)",
    "trimelm-ext-p05": "p = 0.5",
    "trimelm-ext-p0": "p = 0",
    "trimelm-ext-detach": "p = 0.9, no back-propagation into the memory (memory keys detached)",
}
# the paper's WikiText-103 test perplexities as its text states them (Zhong et al. 2022, Sec. 5.3): the 247M model with
# segments of L = 3,072 tokens, and (TrimeLM_long) the 150M model with L = 150
PAPER = {
    "vanilla": "18.70 (L=3072); 25.87 (L=150)",
    "vanilla+cache": "18.26 (L=3072)",
    "vanilla+knnlm": "16.23",
    "vanilla+knnlm+cache": "-",
    "trimelm": "17.76 (L=3072); 25.60 (L=150)",
    "trimelm-long": "22.66 (L=150)",
    "trimelm-ext": "15.41 (15.55 without M_long)",
}


def _read(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.is_file() else None


def _training(run: Path) -> dict[str, Any] | None:
    log = _read(run / "log.json")
    if log is None:
        return None
    entries = log["log"]
    valid = [e for e in entries if e.get("valid_ppl") is not None]
    tps = [e["tokens_per_s"] for e in entries if e.get("tokens_per_s")]
    cfg = log["config"]
    full = cfg["batch_size"] * cfg["grad_accum"] * cfg["seq_len"]  # plain chunks have no padding
    return {
        "updates": len(entries),
        "tokens": sum(e.get("tokens", full) for e in entries),
        "final_valid_ppl": valid[-1]["valid_ppl"] if valid else None,
        "median_tokens_per_s": sorted(tps)[len(tps) // 2] if tps else None,
        "train_seconds": sum(e.get("seconds", 0.0) for e in entries) or None,
    }


def _memories(tuned: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"base": tuned["test"]["base_ppl"], "tokens": tuned["test"]["tokens"]}
    for kind in ("local", "long", "external"):
        if kind in tuned:
            out[kind] = {"ppl": tuned[kind]["test"]["ppl"], "params": tuned[kind]["best"]}
    return out


def _run(runs: Path, name: str) -> dict[str, Any]:
    """One model's training summary and, once evaluated, its test perplexity with each memory."""
    entry: dict[str, Any] = {"training": _training(runs / name)}
    tuned = _read(runs / f"eval-{name}" / "tuned.json")
    if tuned is not None:
        entry["test"] = _memories(tuned)
    return entry


def collect(runs: Path, suffix: str = "") -> dict[str, Any]:
    """Everything the tables need, from the files of ``benchmarks/papers/trime/trime.sh``; ``suffix`` picks the runs
    ``<model><suffix>`` (``-2k``: the 2,000-update models), still keyed by the plain model names."""
    res: dict[str, Any] = {"models": {}, "knnlm": {}, "suffix": suffix}
    for name in MODELS:
        res["models"][name] = _run(runs, f"{name}{suffix}")
    for row, tuned in _knnlm_results(runs, f"vanilla{suffix}").items():
        res["knnlm"][row] = {"test": tuned["test"], "best": tuned["valid"]["best"]}
    return res


def _knnlm_results(runs: Path, name: str) -> dict[str, dict[str, Any]]:
    """The ``memlm tune`` results of a vanilla run with the kNN-LM / cache (``trime.sh knnlm-only``), by row."""
    folder = runs / f"eval-{name}-knnlm"
    found = {row: _read(folder / f"{row}.json") for row in KNNLM_ROWS}
    return {row: tuned for row, tuned in found.items() if tuned is not None}


def _by_seed(per_seed: dict[Any, Any]) -> dict[int, Any]:
    """A per-seed dict with int keys (they come back from JSON as strings)."""
    return {int(seed): v for seed, v in per_seed.items()}


def _knnlm_ppl(test: dict[str, Any]) -> float:
    """Test perplexity of a ``memlm tune`` result: with the cache when it has one, else the kNN-LM's (λ may be 0).

    The mixture with the cache is ``knn_cache_ppl`` / ``lm_cache_ppl``, or ``cache_ppl`` in files written before.
    """
    for key in ("knn_cache_ppl", "lm_cache_ppl", "cache_ppl", "knn_ppl"):
        if key in test:
            return test[key]
    return test["base_ppl"]


def _stats(xs: list[float]) -> dict[str, Any]:
    """Mean, sample standard deviation and range over seeds."""
    n = len(xs)
    mean = sum(xs) / n
    sd = (sum((x - mean) ** 2 for x in xs) / (n - 1)) ** 0.5 if n > 1 else None
    return {"n": n, "mean": mean, "sd": sd, "min": min(xs), "max": max(xs), "values": xs}


def _seed_metrics(entry: dict[str, Any], name: str) -> dict[str, float]:
    """The numbers of one run that the seed table summarises."""
    out: dict[str, float] = {}
    tr, t = entry.get("training") or {}, entry.get("test") or {}
    if tr.get("final_valid_ppl") is not None:
        out["train_valid_ppl"] = tr["final_valid_ppl"]
    if "base" in t:
        out["test_none"] = t["base"]
    own = t.get(OWN_MEMORY[name])
    if own is not None:
        out["test_own_memory"] = own["ppl"]
    return out


def collect_seeds(runs: Path, previous: dict[str, Any] | None) -> dict[str, Any]:
    """Seeds (mean, sd, range), App. D rows, the TrimeLM_ext ablations. An ablation whose run is not
    under ``runs`` comes from ``previous`` (the committed summary.json) and says so; seed 0's new numbers are compared
    with ``previous`` (the same command, rerun)."""
    prev = (previous or {}).get("models", {})
    res: dict[str, Any] = {"seeds": {}, "appd": {}, "ablations": {}, "seed0_vs_summary": {}}
    for name in MAIN:
        per_seed = {seed: _run(runs, name + suffix) for seed, suffix in SEEDS.items()}
        per_seed = {seed: e for seed, e in per_seed.items() if e.get("test")}
        metrics = {seed: _seed_metrics(e, name) for seed, e in per_seed.items()}
        keys = sorted({k for m in metrics.values() for k in m})
        res["seeds"][name] = {
            "runs": per_seed,
            "own_memory": OWN_MEMORY[name],
            "stats": {k: _stats([m[k] for m in metrics.values() if k in m]) for k in keys},
        }
        if 0 in metrics and name in prev:
            old = _seed_metrics(prev[name], name)
            both = [k for k in old if k in metrics[0]]
            res["seed0_vs_summary"][name] = {k: {"now": metrics[0][k], "summary": old[k]} for k in both}
        tuned = _read(runs / f"eval-{name}-appd" / "tuned.json")
        if tuned is not None:
            scored = _read(runs / f"eval-{name}-appd" / "test.json") or {}  # the windows it was scored with
            res["appd"][name] = {
                "test": _memories(tuned),
                "context": scored.get("context"),
                "stream": scored.get("stream"),
            }
    # the kNN-LM (and continuous cache) over each vanilla seed's own datastore, App. D's windows (trime.sh knnlm-only)
    knn: dict[str, dict[int, float]] = {}
    for seed, suffix in SEEDS.items():
        for row, tuned in _knnlm_results(runs, f"vanilla{suffix}").items():
            knn.setdefault(row, {})[seed] = _knnlm_ppl(tuned["test"])
    res["knnlm"] = {row: {"runs": v, "stats": _stats(list(v.values()))} for row, v in knn.items()}
    res["test_documents"] = _document_lengths(runs / "eval-vanilla" / "test.npz")
    for name in ABLATIONS:
        entry = _run(runs, name)
        if entry.get("test"):
            res["ablations"][name] = {**entry, "source": "summary-seeds-ablations.json"}
        elif name in prev and prev[name].get("test"):
            res["ablations"][name] = {**prev[name], "source": "summary.json"}
    return res


def _document_lengths(dump: Path) -> dict[str, Any] | None:
    """How many test targets lie beyond the first segment of their document (where App. D's windows and the
    segments differ at all), from a segments dump of ``memlm trime-eval``."""
    if not dump.is_file():
        return None
    import numpy as np

    with np.load(dump, allow_pickle=False) as z:
        doc, seg = z["doc_index"], z["segment_index"]
    per_doc = np.bincount(doc)
    per_doc = per_doc[per_doc > 0]
    return {
        "dump": str(dump),
        "documents": int(len(per_doc)),
        "targets": int(len(doc)),
        "median_targets_per_document": float(np.median(per_doc)),
        "targets_after_the_first_segment": int((seg > 0).sum()),
    }


def _pm(st: dict[str, Any] | None) -> str:
    if not st:
        return "-"
    if st["n"] < 2:
        return f"{st['mean']:.2f} (1 seed)"
    return f"{st['mean']:.2f} ± {st['sd']:.2f} ({st['min']:.2f}-{st['max']:.2f})"


def tables_seeds(res: dict[str, Any]) -> str:
    """Markdown of the seeds, App. D protocol, ablations (400 updates)."""
    memory_label = {"local": "local memory", "long": "local + long-term memory", "external": "external + long-term"}
    lines = [
        "### Seeds (400 updates): mean ± sample sd (min-max) over the seeds that ran",
        "",
        "| model | metric | seed 0 | seed 1 | seed 2 | mean ± sd (range) |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in res["seeds"].items():
        if not r["runs"]:
            continue
        runs = _by_seed(r["runs"])
        for key, label in (
            ("train_valid_ppl", "valid ppl at the end of training"),
            ("test_none", "test ppl, no memory"),
            ("test_own_memory", f"test ppl, {memory_label[r['own_memory']]}"),
        ):
            cells = [_f(_seed_metrics(runs[s], name).get(key)) if s in runs else "-" for s in SEEDS]
            lines.append(f"| {MODELS[name]} | {label} | " + " | ".join(cells) + f" | {_pm(r['stats'].get(key))} |")
    for row, r in res.get("knnlm", {}).items():
        cells = [_f(_by_seed(r["runs"]).get(s)) for s in SEEDS]
        lines.append(
            f"| {KNNLM_ROWS[row]} | test ppl, App. D windows | " + " | ".join(cells) + f" | {_pm(r['stats'])} |"
        )
    if res["appd"]:
        lines += [
            "",
            "### App. D protocol (the kNN-LM rows' windows: one stream, 256 tokens, the last 128 scored) beside the "
            "segments (seed 0)",
            "",
            "| model | memory | segments: none | segments: with memory | App. D: none | App. D: with memory |",
            "|---|---|---|---|---|---|",
        ]
        for name, a in res["appd"].items():
            seed0 = _by_seed(res["seeds"].get(name, {}).get("runs", {})).get(0) or {}
            seg = seed0.get("test") or {}
            kind = OWN_MEMORY[name]
            lines.append(
                f"| {MODELS[name]} | {memory_label[kind]} | {_f(seg.get('base'))} | "
                f"{_f((seg.get(kind) or {}).get('ppl'))} | {_f(a['test'].get('base'))} | "
                f"{_f((a['test'].get(kind) or {}).get('ppl'))} |"
            )
    if res["ablations"]:
        lines += [
            "",
            "### TrimeLM_ext ablations (400 updates, seed 0): local-memory dropout p, back-propagation into memory",
            "",
            "| ablation | valid ppl (end of training) | no memory | local | long-term | external | file |",
            "|---|---|---|---|---|---|---|",
        ]
        for name, a in res["ablations"].items():
            t = a.get("test", {})
            cells = [_f((a.get("training") or {}).get("final_valid_ppl")), _f(t.get("base"))]
            cells += [_f((t.get(k) or {}).get("ppl")) for k in ("local", "long", "external")]
            lines.append(f"| {ABLATIONS[name]} | " + " | ".join(cells) + f" | {a['source']} |")
    return "\n".join(lines) + "\n"


def _f(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _params(p: dict[str, Any], keys: tuple[str, ...]) -> str:
    names = {"segments": "M", "local_temperature": "τ_local", "temperature": "τ", "lambda": "λ"}
    return ", ".join(f"{names[k]}={p[k]}" for k in keys if p.get(k) is not None)


def tables(res: dict[str, Any]) -> str:
    """Markdown: the paper's Tables 2-4 in our setting, the ablations, and training."""
    m, k = res["models"], res["knnlm"]
    rows: list[tuple[str, str, str, str, str]] = []

    def test(name: str) -> dict[str, Any]:
        return m.get(name, {}).get("test", {})

    def mem(name: str, kind: str) -> tuple[str, str]:
        t = test(name).get(kind)
        if t is None:
            return "-", ""
        return _f(t["ppl"]), _params(t["params"], ("segments", "local_temperature", "temperature", "lambda"))

    v = test("vanilla")
    rows.append(("Vanilla LM", "none", _f(v.get("base")), "", PAPER["vanilla"]))
    ppl, p = mem("vanilla", "local")
    rows.append(("Vanilla LM", "TRIME local memory at test time only", ppl, p, "-"))
    ppl, p = mem("vanilla", "long")
    rows.append(("Vanilla LM", "TRIME long-term memory at test time only", ppl, p, "-"))
    if "cache-only" in k:
        t, b = k["cache-only"]["test"], k["cache-only"]["best"]
        rows.append(("Vanilla LM", "none (sliding windows, 128 tokens of context)", _f(t["base_ppl"]), "", "-"))
        rows.append(
            (
                "Vanilla LM",
                "+ continuous cache (Grave et al.; sliding windows)",
                _f(_knnlm_ppl(t)),
                f"λc={b['cache_lambda']}, τc={b['cache_temperature']}",
                PAPER["vanilla+cache"],
            )
        )
    if "knnlm" in k:
        t, b = k["knnlm"]["test"], k["knnlm"]["best"]
        rows.append(
            (
                "Vanilla LM",
                "+ kNN-LM (sliding windows)",
                _f(_knnlm_ppl(t)),
                f"λ={b['lambda']}, τ={b['temperature']}",
                PAPER["vanilla+knnlm"],
            )  # fmt: skip
        )
    if "knnlm-cache" in k:
        t, b = k["knnlm-cache"]["test"], k["knnlm-cache"]["best"]
        rows.append(
            (
                "Vanilla LM",
                "+ kNN-LM + continuous cache (sliding windows)",
                _f(_knnlm_ppl(t)),
                f"λ={b['lambda']}, τ={b['temperature']}, λc={b['cache_lambda']}",
                PAPER["vanilla+knnlm+cache"],
            )
        )
    for name, kind, label in (
        ("trimelm", "local", "local memory"),
        ("trimelm-long", "long", "local + long-term memory (M segments)"),
        ("trimelm-ext", "external", "external memory (datastore) + long-term memory"),
    ):
        rows.append((MODELS[name], "none", _f(test(name).get("base")), "", "-"))
        ppl, p = mem(name, kind)
        rows.append((MODELS[name], label, ppl, p, PAPER[name]))
    lines = [
        f"Test perplexity on the first {v.get('tokens', '?')} target tokens of wiki+news test (segments of 256 tokens, "
        "no context across segments, unless the row says sliding windows). Every parameter is chosen on valid.",
        "",
        "| model | memory at test time | test ppl | tuned on valid | paper (WikiText-103) |",
        "|---|---|---|---|---|",
        *(f"| {a} | {b} | {c} | {d} | {e} |" for a, b, c, d, e in rows),
        "",
        "### Every model with each memory at test time (the ablations of TrimeLM_ext included)",
        "",
        "Each column adds one memory and is tuned on valid on its own: `local` = the segment's earlier tokens "
        "(M = 0); `long-term` = local + the M best previous segments; `external` = long-term + the datastore. "
        "The gain of a memory is its column against the one before it.",
        "",
        "| model | no memory | local | long-term (M) | external |",
        "|---|---|---|---|---|",
    ]
    for name in MODELS:
        if not test(name):
            continue
        t = test(name)
        long = t.get("long")
        cells = [
            _f(t.get("base")),
            mem(name, "local")[0],
            "-" if long is None else f"{_f(long['ppl'])} (M={long['params'].get('segments')})",
            mem(name, "external")[0],
        ]
        lines.append(f"| {MODELS[name]} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "### Training (same architecture, data and number of updates for every model)",
        "",
        "| model | updates | tokens trained on (padding excluded) | valid ppl at the end (plain LM, no memory) "
        "| median training tokens/s |",
        "|---|---|---|---|---|",
    ]
    for name, label in MODELS.items():
        tr = m.get(name, {}).get("training")
        if not tr:
            continue
        tps = tr.get("median_tokens_per_s")
        lines.append(
            f"| {label} | {tr.get('updates', '-')} | {tr.get('tokens', 0):,} | {_f(tr.get('final_valid_ppl'))} | "
            + ("-" if tps is None else f"{tps:,.0f}")
            + " |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", default="runs/trime")
    p.add_argument("--out", default="docs/results/trime")
    p.add_argument(
        "--from-summary",
        action="store_true",
        help="redraw tables*.md from the summary JSONs already in --out (no runs/ needed)",
    )
    p.add_argument(
        "--seeds-only",
        action="store_true",
        help="write only summary-seeds-ablations.json / tables-seeds-ablations.md (seeds, App. D, ablations); keep "
        "the other files",
    )
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.from_summary:
        res12 = _read(out / "summary-seeds-ablations.json")
    else:
        res12 = collect_seeds(Path(args.runs), _read(out / "summary.json"))
        if any(r["runs"] for r in res12["seeds"].values()):
            atomic_write_json(out / "summary-seeds-ablations.json", res12, sort_keys=False)
        else:
            res12 = None
    if res12 is not None:
        md = tables_seeds(res12)
        (out / "tables-seeds-ablations.md").write_text(md)
        print(f"## Seeds, App. D, ablations\n\n{md}")
    if args.seeds_only:
        return 0
    for suffix in ("", "-2k"):
        if args.from_summary:
            res = _read(out / f"summary{suffix}.json")
            if res is not None:
                md = tables(res)
                (out / f"tables{suffix}.md").write_text(md)
                print(f"## runs{suffix or ' (400 updates)'}\n\n{md}")
            continue
        res = collect(Path(args.runs), suffix)
        if not any(e.get("training") for e in res["models"].values()):
            continue
        atomic_write_json(out / f"summary{suffix}.json", res, sort_keys=False)
        md = tables(res)
        (out / f"tables{suffix}.md").write_text(md)
        print(f"## runs{suffix or ' (400 updates)'}\n\n{md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
