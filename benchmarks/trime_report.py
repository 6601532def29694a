"""Collect the results of ``benchmarks/trime.sh`` into ``docs/results/trime/`` (summary JSON + markdown tables).

Reads, under ``--runs`` (default ``runs/trime``): each model's ``log.json`` (validation perplexity and tokens/s of
training), ``eval-<model>/tuned.json`` (``memlm trime-tune``: every memory chosen on valid, applied to test) and
``eval-vanilla-knnlm/*.json`` (``memlm tune``: the vanilla LM with the continuous cache and the kNN-LM).

    .venv/bin/python benchmarks/trime_report.py --out docs/results/trime
    .venv/bin/python benchmarks/trime_report.py --out docs/results/trime --from-summary   # tables from the JSONs

writes ``summary.json`` / ``tables.md`` for the 400-update runs (``vanilla``, ``trimelm``, ...) and, when they exist,
``summary-2k.json`` / ``tables-2k.md`` for the 2,000-update runs trained on a GPU (``vanilla-2k``, ``trimelm-2k``, ...;
``benchmarks/trime.sh eval-2k``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from memlm.fileio import atomic_write_json

MODELS = {
    "vanilla": "Vanilla LM (CE)",
    "trimelm": "TrimeLM (local memory)",
    "trimelm-long": "TrimeLM_long (consecutive segments, m = 4)",
    "trimelm-ext": "TrimeLM_ext (BM25 batches, p = 0.9)",
    "trimelm-ext-random": "TrimeLM_ext, random batches (p = 0.9)",
    "trimelm-ext-p0": "TrimeLM_ext, BM25 batches, p = 0",
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


def collect(runs: Path, suffix: str = "") -> dict[str, Any]:
    """Everything the tables need, from the files of ``benchmarks/trime.sh``; ``suffix`` picks the runs
    ``<model><suffix>`` (``-2k``: the 2,000-update models), still keyed by the plain model names."""
    res: dict[str, Any] = {"models": {}, "knnlm": {}, "suffix": suffix}
    for name in MODELS:
        entry: dict[str, Any] = {"training": _training(runs / f"{name}{suffix}")}
        tuned = _read(runs / f"eval-{name}{suffix}" / "tuned.json")
        if tuned is not None:
            entry["test"] = _memories(tuned)
        res["models"][name] = entry
    k = runs / f"eval-vanilla{suffix}-knnlm"
    for name in ("cache-only", "knnlm", "knnlm-cache"):
        tuned = _read(k / f"{name}.json")
        if tuned is not None:
            res["knnlm"][name] = {"test": tuned["test"], "best": tuned["valid"]["best"]}
    return res


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
                _f(t.get("cache_ppl", t["base_ppl"])),
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
                _f(t.get("knn_ppl")),
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
                _f(t.get("cache_ppl", t.get("knn_ppl"))),
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
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
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
