"""The domain-adaptation rows: the fixed-weight rule beside the learned mixture on IMDB test, test tokens only.

SmolLM2-135M (float32, windows 1024 / 512) and memories built from the target domain's training text (Khandelwal
et al. 2020, Sec. 4.2: the LM unchanged, the datastore swapped for one over the new domain): the ∞-gram over all of
IMDB train (``memlm ngram build --corpus imdb --holdout 0``, decontaminated against IMDB valid and test), a datastore
over the first 50k IMDB train tokens, the continuous cache. Both weightings tuned on the same IMDB VALID dump (the
first 20k tokens) and applied to the first 20k IMDB test tokens, rows (a)-(d) as ``mixture_table.py``'s. Stages are
skipped when their output exists; the commands run are recorded in the JSON::

    python benchmarks/quality/mixture_imdb.py --work data/imdb --out docs/results/mixture/imdb.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mixture_stdlib import run  # one resumable command runner (same folder)
from mixture_table import ROWS, markdown, summary, tune, view

LABELS = {
    "a": "LM + ∞-gram (IMDB train)",
    "b": "LM + datastore (50k IMDB train tokens)",
    "c": "LM + datastore + ∞-gram",
    "d": "LM + datastore + ∞-gram + cache",
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", type=Path, default=Path("data/imdb"))
    ap.add_argument("--out", type=Path, default=Path("docs/results/mixture/imdb.json"))
    ap.add_argument("--tokens", type=int, default=20000, help="--max-tokens of the valid and the test dump")
    args = ap.parse_args()
    res, work = args.out.parent, args.work
    work.mkdir(parents=True, exist_ok=True)
    log, ran = res / "imdb.log", []
    cli = [sys.executable, "-m", "memlm.cli"]
    model = ["--model", "smollm2-135m", "--dtype", "float32"]
    run([*cli, "ngram", "build", *model, "--corpus", "imdb", "--holdout", "0", "--out", str(work / "ix")],
        work / "ix" / "manifest.json", log, ran)  # fmt: skip
    run([*cli, "datastore", "build", *model, "--corpus", "imdb", "--split", "train", "--max-tokens", "50000",
         "--out", str(work / "ds50k")], work / "ds50k" / "manifest.json", log, ran)  # fmt: skip
    dumps = {}
    for split in ("valid", "test"):
        dumps[split] = work / f"{split}_knn_ngram_cache.npz"
        run([*cli, "eval", *model, "--corpus", "imdb", "--split", split, "--max-tokens", str(args.tokens),
             "--memory", str(work / "ds50k"), "--memory", str(work / "ix"), "--memory", "cache", "--dump",
             str(dumps[split]), "--json", str(res / f"eval_imdb_{split}.json")], dumps[split], log, ran)  # fmt: skip
    rows = []
    for row in "abcd":
        keep = ROWS[row][0]
        v, t = work / f"view_{row}_valid.npz", work / f"view_{row}_test.npz"
        view(dumps["valid"], v, keep)
        view(dumps["test"], t, keep)
        out = res / f"tune_imdb_{row}.json"
        tune(v, t, out, log, ran)
        rows.append({"test": "imdb", **summary(out, row), "memories": LABELS[row]})
    from memlm.io.fileio import atomic_write_json

    atomic_write_json(args.out, {"script": "python benchmarks/quality/mixture_imdb.py " + " ".join(sys.argv[1:]),
                                 "commands": ran, "rows": rows})  # fmt: skip
    print(markdown(rows))


if __name__ == "__main__":
    main()
