"""Markdown tables and PNG figures from benchmarks/papers/knnlm/knnlm_sweeps.py's results.json.

python benchmarks/papers/knnlm/knnlm_report.py runs/knnlm/results.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _table(rows: list[dict], cols: list[tuple[str, str, str]]) -> str:
    head = "| " + " | ".join(c[1] for c in cols) + " |"
    sep = "|" + "|".join("---" for _ in cols) + "|"
    body = ["| " + " | ".join(format(r[c[0]], c[2]) if c[2] else str(r[c[0]]) for c in cols) + " |" for r in rows]
    return "\n".join([head, sep, *body])


def write_report(results: dict, out: Path) -> str:
    md = ["## Base vs kNN-LM (λ, τ tuned on valid; test perplexity)", ""]
    md.append(
        _table(
            results["rows"],
            [
                ("eval", "evaluated on", ""),
                ("datastore", "datastore", ""),
                ("key", "key", ""),
                ("datastore_entries", "entries", ","),
                ("tokens", "tokens", ","),
                ("base_ppl", "base ppl", ".3f"),
                ("knn_ppl", "kNN-LM ppl", ".3f"),
                ("oracle_ppl", "oracle ppl", ".3f"),
                ("lambda", "λ", ".2f"),
                ("temperature", "τ", "g"),
                ("target_in_neighbours", "target in top-k", ".3f"),
            ],
        )
    )
    md += ["", "## Perplexity vs datastore size (wiki test, ffn_in, λ and τ re-tuned on valid per size)", ""]
    md.append(
        _table(
            results["vs_size"],
            [
                ("fraction", "fraction", "g"),
                ("entries", "entries", ","),
                ("base_ppl", "base ppl", ".3f"),
                ("knn_ppl", "kNN-LM ppl", ".3f"),
                ("lambda", "tuned λ", ".2f"),
                ("temperature", "τ", "g"),
            ],
        )
    )
    for name, sw in results["sweeps"].items():
        corpus, ds = name.split("|")
        md += ["", f"## Perplexity vs k ({corpus} test, {ds} datastore, λ and τ tuned on valid per k)", ""]
        md.append(
            _table(
                sw["vs_k"],
                [("k", "k", "d"), ("knn_ppl", "kNN-LM ppl", ".3f"), ("lambda", "λ", ".2f"), ("temperature", "τ", "g")],
            )
        )
    text = "\n".join(md) + "\n"
    (out / "results.md").write_text(text)

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    ax = axes[0]
    sizes = results["vs_size"]
    ax.plot([r["entries"] for r in sizes], [r["knn_ppl"] for r in sizes], marker="o", label="kNN-LM")
    ax.axhline(sizes[0]["base_ppl"], color="gray", ls="--", label="base LM")
    ax.set_xscale("log")
    ax.set_xlabel("datastore entries (wiki train subsample)")
    ax.set_ylabel("wiki test perplexity")
    ax.set_title("vs datastore size (Fig. 2)")
    ax2 = ax.twinx()
    ax2.plot([r["entries"] for r in sizes], [r["lambda"] for r in sizes], color="C1", marker="x", label="tuned λ")
    ax2.set_ylabel("tuned λ", color="C1")
    ax.legend(loc="upper right")
    ax = axes[1]
    for name, sw in results["sweeps"].items():
        ax.plot(
            [r["k"] for r in sw["vs_k"]], [r["knn_ppl"] for r in sw["vs_k"]], marker="o", label=name.replace("|", " / ")
        )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("k (neighbours)")
    ax.set_ylabel("test perplexity")
    ax.set_yscale("log")
    ax.set_title("vs k (Fig. 4)")
    ax.legend()
    ax = axes[2]
    for name, sw in results["sweeps"].items():
        ax.plot(
            [r["lambda"] for r in sw["vs_lambda"]],
            [r["ppl"] for r in sw["vs_lambda"]],
            marker=".",
            label=name.replace("|", " / "),
        )
    ax.set_xlabel("λ")
    ax.set_ylabel("test perplexity")
    ax.set_yscale("log")
    ax.set_title("vs λ (Fig. 5): eval corpus / datastore")
    ax.legend()
    for a in axes:
        a.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "knnlm_sweeps.png", dpi=110)
    plt.close(fig)
    return text


if __name__ == "__main__":
    path = Path(sys.argv[1] if len(sys.argv) > 1 else "runs/knnlm/results.json")
    print(write_report(json.loads(path.read_text()), path.parent))
