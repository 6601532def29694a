"""Collect the results of ``benchmarks/papers/npm/npm.sh`` into ``docs/results/npm/`` (summary JSON, markdown tables,
figures).

Reads, under ``--runs`` (default ``runs/npm``): each encoder's ``log.json`` (training loss, tokens/s, final validation
loss), ``eval/<task>-<setting>.json`` (``memlm npm eval``) and the phrase indexes' ``manifest.json`` / file sizes.
Writes under ``--out``:

    summary.json       one row per evaluation (task, setting, score, by-length EM, queries/s, peak RSS)
    tables.md          the tables of docs/results/npm.md
    em_by_length.png   cloze EM by answer length in subword tokens, per model (the paper's Fig. 8)
    reference_size.png cloze EM vs reference-corpus size for NPM (the paper's Fig. 7)
    <task>-<setting>.json  the evaluation files themselves (no per-query predictions)

    .venv/bin/python benchmarks/papers/npm/npm_report.py --runs runs/npm --out docs/results/npm
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
from pathlib import Path
from typing import Any

ENCODERS = {
    "npm": "NPM",
    "npm-single": "NPM SINGLE",
    "mlm": "MLM (parametric baseline)",
}
# evaluation settings: file suffix -> (model row, retrieval)
SETTINGS = {
    "npm": ("NPM", "full index"),
    "npm-bm25": ("NPM", "BM25 top-3 passages"),
    "npm-single": ("NPM SINGLE", "full index"),
    "npm-single-bm25": ("NPM SINGLE", "BM25 top-3 passages"),
    "untrained": ("untrained encoder, NPM inference", "full index"),
    "untrained-bm25": ("untrained encoder, NPM inference", "BM25 top-3 passages"),
    "untrained-single": ("untrained encoder, NPM SINGLE inference", "full index"),
    "untrained-single-bm25": ("untrained encoder, NPM SINGLE inference", "BM25 top-3 passages"),
    "mlm": ("MLM (parametric baseline)", "none (vocabulary softmax)"),
}
ORDER = list(SETTINGS)


def _load(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.exists() else None


def _fmt(x: float | None) -> str:
    """A share as a percentage with one decimal; ``-`` when missing."""
    return "-" if x is None else f"{100 * x:.1f}"


def training_rows(runs: Path) -> list[dict[str, Any]]:
    rows = []
    for name, label in ENCODERS.items():
        log = _load(runs / name / "log.json")
        if log is None:
            continue
        entries = log["log"]
        first, last = entries[:10], entries[-10:]
        rows.append(
            {
                "encoder": name,
                "label": label,
                "updates": entries[-1]["step"],
                "tokens": int(sum(e["tokens"] for e in entries)),
                "loss_first10": statistics.mean(e["loss"] for e in first),
                "loss_last10": statistics.mean(e["loss"] for e in last),
                "valid_loss": entries[-1].get("valid_loss"),
                "median_tokens_per_s": statistics.median(e["tokens_per_s"] for e in entries),
                "batch_size": log["config"].get("batch_size"),
                "seq_len": log["config"].get("seq_len"),
                "lr": log["config"].get("lr"),
            }
        )
    for objective in ("npm", "npm-single"):  # the encoder before training (benchmarks/papers/npm/npm_valid_loss.py)
        before = _load(runs / f"valid-untrained-{objective}.json")
        if before is not None:
            label = f"untrained encoder, {ENCODERS[objective]} validation loss"
            rows.append({"encoder": f"untrained-{objective}", "label": label, "updates": 0,
                         "valid_loss": before["valid_loss"]})  # fmt: skip
    return rows


def eval_rows(runs: Path) -> list[dict[str, Any]]:
    rows = []
    for f in sorted((runs / "eval").glob("*.json")):
        r = json.loads(f.read_text())
        task = r["task"]
        setting = f.stem[len(task) + 1 :]
        speed = r.get("speed") or r.get("edited", {}).get("speed", {})
        score = {"bbc": r.get("accuracy"), "cloze": r.get("em"), "update": r.get("updated_em")}[task]
        rows.append(
            {
                "file": f.name,
                "task": task,
                "setting": setting,
                "model": r["model"],
                "index_tokens": r["index_tokens"],
                "n": r.get("n"),
                "score": score,
                "macro_em": r.get("macro_em"),
                "original_em": r.get("original_em"),
                "stale": r.get("stale"),
                "unmatched": r.get("unmatched"),
                "by_length": r.get("by_length", {}),
                "per_label_n": {y: v["n"] for y, v in r.get("per_label", {}).items()},
                "queries_per_second": speed.get("queries_per_second"),
                "peak_rss_mb": speed.get("peak_rss_mb"),
            }
        )
    return rows


def _by(rows: list[dict[str, Any]], task: str) -> dict[str, dict[str, Any]]:
    return {r["setting"]: r for r in rows if r["task"] == task}


def tables(train: list[dict[str, Any]], rows: list[dict[str, Any]], runs: Path) -> str:
    out: list[str] = []
    if train:
        out += ["### Training (same encoder, data, batches and number of updates)", "",
                "| encoder | updates | batch | tokens | loss, first 10 updates | loss, last 10 updates | "
                "valid loss | median tokens/s |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for t in train:
            if not t["updates"]:
                out.append(f"| {t['label']} | 0 | - | - | - | - | {t['valid_loss']:.3f} | - |")
                continue
            out.append(f"| {t['label']} | {t['updates']} | {t['batch_size']} x {t['seq_len']} | {t['tokens']:,} | "
                       f"{t['loss_first10']:.1f} | {t['loss_last10']:.1f} | "
                       f"{'-' if t['valid_loss'] is None else format(t['valid_loss'], '.3f')} | "
                       f"{t['median_tokens_per_s']:,.0f} |")  # fmt: skip
        out += ["", "NPM's loss is summed over masked spans (start + end terms), NPM SINGLE's over masked tokens, the "
                "MLM's is the mean cross-entropy per masked token: the columns compare a model with itself, not "
                "across rows.", ""]  # fmt: skip

    bbc = _by(rows, "bbc")
    if bbc:
        out += ["### Closed set: BBC topic classification (accuracy %, 5 classes; in parentheses: queries where no "
                "retrieved candidate matched a verbalizer)", "",
                "| model | wiki reference | wiki + BM25 top-3 | BBC-train reference | BBC-train + BM25 top-3 |",
                "|---|---|---|---|---|"]  # fmt: skip
        for base in ("npm", "npm-single", "untrained", "untrained-single", "mlm"):
            cells = []
            for s in (base, f"{base}-bm25", f"{base}-bbcref", f"{base}-bm25-bbcref"):
                r = bbc.get(s)
                if r is None:
                    cells.append("-")
                elif r["unmatched"]:
                    cells.append(f"{_fmt(r['score'])} ({_fmt(r['unmatched'])})")
                else:
                    cells.append(_fmt(r["score"]))
            if base == "mlm":
                cells = [cells[0], "n/a", "n/a", "n/a"]
            if any(c != "-" for c in cells):
                out.append(f"| {SETTINGS[base][0]} | " + " | ".join(cells) + " |")
        n = next(iter(bbc.values()))["n"]
        per = next(iter(bbc.values()))["per_label_n"]
        most = max(per.values())
        tops = sorted(y for y, v in per.items() if v == most)  # every class of the largest size (ties named)
        out += ["", f"{n} BBC test articles; chance is 20%; the largest class{'es are' if len(tops) > 1 else ' is'} "
                f"{' and '.join(tops)} ({most} articles, {100 * most / n:.1f}%{' each' if len(tops) > 1 else ''}).",
                ""]  # fmt: skip

    cloze = _by(rows, "cloze")
    if cloze:
        out += [
            "### Open set: cloze probes from held-out wiki sentences (exact match %, by answer length in "
            "subword tokens)",
            "",
            "| model | retrieval | all | 1 | 2 | 3 | 4+ | macro |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for s in ORDER:
            r = cloze.get(s)
            if r is None:
                continue
            b = r["by_length"]
            cells = [_fmt(b.get(k, {}).get("em")) for k in ("1", "2", "3", "4+")]
            out.append(f"| {SETTINGS[s][0]} | {SETTINGS[s][1]} | {_fmt(r['score'])} | " + " | ".join(cells)
                       + f" | {_fmt(r['macro_em'])} |")  # fmt: skip
        r0 = cloze.get("npm") or next(iter(cloze.values()))
        ns = ", ".join(f"{k}: {v['n']}" for k, v in r0["by_length"].items())
        out += ["", f"{r0['n']} probes ({ns} by answer length).", ""]
        sizes = [(cloze[s]["index_tokens"], s) for s in ("npm-ref10", "npm-ref30", "npm") if s in cloze]
        if len(sizes) > 1:
            out += [
                "### Reference-corpus size (NPM, the same cloze probes; the paper's Fig. 7)",
                "",
                "| reference tokens | all | 1 | 2 | 3 | 4+ |",
                "|---|---|---|---|---|---|",
            ]
            for n_tok, s in sizes:
                b = cloze[s]["by_length"]
                out.append(
                    f"| {n_tok:,} | {_fmt(cloze[s]['score'])} | "
                    + " | ".join(_fmt(b.get(k, {}).get("em")) for k in ("1", "2", "3", "4+"))
                    + " |"
                )
            out.append("")

    upd = _by(rows, "update")
    if upd:
        out += ["### Corpus update (the TempLAMA idea): the same probes against the original and the edited "
                "reference passages", "",
                "| model | retrieval | original corpus: original answer (EM %) | edited corpus: new answer (EM %) | "
                "edited corpus: still the old answer (%) |", "|---|---|---|---|---|"]  # fmt: skip
        for s in ORDER:
            r = upd.get(s)
            if r is None:
                continue
            out.append(
                f"| {SETTINGS[s][0]} | {SETTINGS[s][1]} | {_fmt(r['original_em'])} | {_fmt(r['score'])} | "
                f"{_fmt(r['stale'])} |"
            )
        out += ["", f"{next(iter(upd.values()))['n']} probes.", ""]

    if rows:
        out += [
            "### Speed and memory (queries per second and peak resident memory of the `memlm npm eval` process; "
            "the paper's Table 4)",
            "",
            "| task | model | retrieval | reference tokens | queries/s | peak RSS (MiB) |",
            "|---|---|---|---|---|---|",
        ]
        for r in rows:
            s = r["setting"]
            name = SETTINGS.get(s.replace("-bbcref", "").replace("-ref10", "").replace("-ref30", ""), (s, ""))
            ref = " (BBC)" if s.endswith("bbcref") else ""
            out.append(
                f"| {r['task']} | {name[0]} | {name[1]} | {r['index_tokens']:,}{ref} | "
                f"{r['queries_per_second'] or 0:.2f} | {r['peak_rss_mb'] or 0:,.0f} |"
            )
        out.append("")
        sizes_line = _index_sizes(runs)
        if sizes_line:
            out += ["Phrase indexes on disk: " + sizes_line + ".", ""]
    return "\n".join(out)


def _index_sizes(runs: Path) -> str:
    parts = []
    for d in sorted(runs.glob("idx-*")):
        m = _load(d / "manifest.json")
        if m is None:
            continue
        size = sum(f.stat().st_size for f in d.rglob("*") if f.is_file())
        parts.append(f"`{d.name}` {m['count']:,} tokens, {size / 2**20:,.0f} MiB")
    return "; ".join(parts)


def figures(rows: list[dict[str, Any]], out: Path) -> list[str]:
    from memlm.experiments.plots import finish_figure, pyplot

    plt = pyplot()
    made = []
    cloze = _by(rows, "cloze")
    shown = [s for s in ("npm", "npm-bm25", "npm-single", "untrained", "mlm") if s in cloze]
    if shown:
        buckets = ("1", "2", "3", "4+")
        fig, ax = plt.subplots(figsize=(7, 3.6))
        w = 0.8 / len(shown)
        for i, s in enumerate(shown):
            ems = [100 * (cloze[s]["by_length"].get(b, {}).get("em") or 0) for b in buckets]
            label = SETTINGS[s][0] + (" + BM25" if s.endswith("bm25") else "")
            ax.bar([x + i * w for x in range(len(buckets))], ems, w, label=label)
        ax.set_xticks([x + w * (len(shown) - 1) / 2 for x in range(len(buckets))], buckets)
        title = "Cloze probes by answer length (cf. Min et al. 2023, Fig. 8)"
        finish_figure(fig, out / "em_by_length.png", ax, xlabel="answer length (subword tokens)",
                      ylabel="exact match (%)", title=title, legend_fontsize=7)  # fmt: skip
        made.append("em_by_length.png")
    sizes = sorted((cloze[s]["index_tokens"], s) for s in ("npm-ref10", "npm-ref30", "npm") if s in cloze)
    if len(sizes) > 1:
        fig, ax = plt.subplots(figsize=(5, 3.4))
        xs = [n for n, _ in sizes]
        ax.plot(xs, [100 * cloze[s]["score"] for _, s in sizes], "o-", label="all")
        for b in ("1", "2"):
            ax.plot(
                xs,
                [100 * (cloze[s]["by_length"].get(b, {}).get("em") or 0) for _, s in sizes],
                "s--",
                label=f"{b}-token answers",
            )
        ax.set_xscale("log")
        finish_figure(fig, out / "reference_size.png", ax, xlabel="reference corpus (tokens)",
                      ylabel="exact match (%)", title="NPM vs reference size (cf. Fig. 7)",
                      legend_fontsize=7)  # fmt: skip
        made.append("reference_size.png")
    return made


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=Path, default=Path("runs/npm"))
    ap.add_argument("--out", type=Path, default=Path("docs/results/npm"))
    args = ap.parse_args(argv)
    if not (args.runs / "eval").is_dir():
        print(
            f"error: no evaluations under {args.runs / 'eval'}: run bash benchmarks/papers/npm/npm.sh first",
            file=sys.stderr,
        )
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    train, rows = training_rows(args.runs), eval_rows(args.runs)
    for r in rows:  # the evaluation files themselves (written without per-query predictions)
        shutil.copyfile(args.runs / "eval" / r["file"], args.out / r["file"])
    (args.out / "summary.json").write_text(json.dumps({"training": train, "evaluations": rows}, indent=2) + "\n")
    md = tables(train, rows, args.runs)
    (args.out / "tables.md").write_text(md + "\n")
    made = figures(rows, args.out)
    print(md)
    print(f"wrote {args.out}/summary.json, tables.md" + "".join(f", {m}" for m in made))
    return 0


if __name__ == "__main__":
    sys.exit(main())
