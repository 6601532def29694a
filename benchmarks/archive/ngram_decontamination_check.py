"""Does the vectorized decontamination (memlm.ngram.decontaminate) decide exactly as the plain one did before it?

    python benchmarks/archive/ngram_decontamination_check.py --old-ref 2df1cbb \\
        --out docs/results/ngram/cost/decontamination_fast_check.json

Loads the six offline corpora's train splits and test splits (the default of ``memlm ngram build --corpus
wiki,news,brown,bbc,wikitext2,imdb``), runs ``overlap_fractions`` and ``decontaminate`` of the module as it was at
``--old-ref`` (read with ``git show``; the per-document Python tokenizer and hasher) and of this checkout (1 process,
then ``--workers``), and checks that every document's n-gram count, token count and overlap fraction with every test
split and with all of them are equal, and that the two records (dropped documents, per-set counts) are identical. The
times are for the comparison in one run on whatever machine runs it; they are not the idle-core build measurement
(``benchmarks/papers/ngram/ngram_cost.py build``), and the file says how loaded the machine was.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from memlm.data.corpora import load_corpora, load_documents
from memlm.io.fileio import atomic_write_json
from memlm.ngram import decontaminate as new


def _old_module(ref: str):
    root = Path(__file__).resolve().parents[2]
    src = subprocess.run(
        ["git", "show", f"{ref}:src/memlm/ngram/decontaminate.py"], cwd=root, check=True, capture_output=True, text=True
    ).stdout
    path = Path(tempfile.mkdtemp()) / "decontaminate_old.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("decontaminate_old", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _timed(fn, *args, **kwargs):
    def cpu() -> float:
        t = os.times()
        return t.user + t.system + t.children_user + t.children_system

    c, t = cpu(), time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - t, cpu() - c


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpora", default="wiki,news,brown,bbc,wikitext2,imdb")
    ap.add_argument("--old-ref", default="2df1cbb", help="a commit with the plain implementation")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    old = _old_module(args.old_ref)
    names = [c.strip() for c in args.corpora.split(",")]
    docs = load_corpora(names, "train")
    evals = {f"{c}:test": load_documents(c, "test") for c in names}
    load_before = os.getloadavg()
    a, old_f_wall, old_f_cpu = _timed(old.overlap_fractions, docs, evals)
    new._classes()  # the Word_Break table, built once per process (not timed)
    runs = {}
    for workers in sorted({1, args.workers}):
        b, wall, cpu = _timed(new.overlap_fractions, docs, evals, workers=workers)
        for key in ("ngrams", "tokens"):
            np.testing.assert_array_equal(a[key], b[key])
        for name in a["fraction"]:
            np.testing.assert_array_equal(a["fraction"][name], b["fraction"][name])
        assert a["eval_ngrams"] == b["eval_ngrams"]
        runs[f"new, workers={workers}"] = {
            "wall_seconds": wall,
            "cpu_seconds": cpu,
            "ratio_old_over_new": old_f_wall / wall,
        }
    (_, rec_old), old_d_wall, _ = _timed(old.decontaminate, docs, evals)
    (_, rec_new), new_d_wall, _ = _timed(new.decontaminate, docs, evals, workers=args.workers)
    assert rec_old == rec_new, "the records differ"
    out = {
        "command": "python benchmarks/archive/ngram_decontamination_check.py " + " ".join(sys.argv[1:]),
        "old_ref": args.old_ref,
        "documents": len(docs),
        "characters": sum(len(d.text) for d in docs),
        "eval_sets": {k: {"documents": len(v), "characters": sum(len(d.text) for d in v)} for k, v in evals.items()},
        "identical": "n-gram and token counts, overlap fractions (each test split, all), the decontaminate record",
        "dropped": [d["id"] for d in rec_new["dropped"]],
        "dropped_documents": rec_new["dropped_documents"],
        "timing_note": "one run on a shared machine (load average below): indicative ratios, not idle-core times",
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "overlap_fractions": {"old": {"wall_seconds": old_f_wall, "cpu_seconds": old_f_cpu}, **runs},
        "decontaminate_wall_seconds": {"old": old_d_wall, f"new, workers={args.workers}": new_d_wall},
    }
    atomic_write_json(Path(args.out), out)
    print(
        f"identical; dropped {out['dropped']}; overlap_fractions old {old_f_wall:.1f} s, "
        + ", ".join(f"{k} {v['wall_seconds']:.2f} s ({v['ratio_old_over_new']:.1f}x)" for k, v in runs.items())
    )


if __name__ == "__main__":
    main()
