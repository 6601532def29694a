"""The stdlib case: λ's tuned on a small slice against the guarded learned mixture (memlm.mixture).

An ∞-gram over Python 3.11's standard library (every ``.py`` file of ``--stdlib`` outside site-/dist-packages, one
document per file, minus the held-out modules below), SmolLM2-135M as the LM. An earlier run tuned the λ's on one
held-out module file (887 scored tokens) without naming it; here every module file of 850-950 tokens (SmolLM2's
tokenizer) is a small tuning slice in turn (16 files, chosen by that rule before any result was seen), and all 16
together are a 17th, larger slice. The test text is four other modules (``glob``, ``graphlib``, ``numbers``,
``chunk``; 8,148 scored tokens). None of them is in the index. For each slice, on the test dump:

* the bare LM;
* the ∞-gram with memlm's fallback λ's (λ_sparse 0.1, λ_dense 0.03: what an index without calibration uses);
* the two-λ rule fitted on the slice (:func:`memlm.mixing.report.fit_table`, EM per sparse state: what ``memlm tune
  --valid`` runs on a one-index dump), as a new user would;
* the guarded learned mixture (:func:`memlm.core.mixture.fit_guarded`) fitted on the slice: the form it chose, its
  held-out log-likelihoods on the kept part, its warnings.

Stages (each skipped when its output exists; the commands run are recorded in the JSON)::

    python benchmarks/quality/mixture_stdlib.py --stdlib /usr/lib/python3.11 --work data/mixture \
        --out docs/results/mixture/stdlib.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

SMALL = ("bisect.py", "curses/__init__.py", "distutils/command/install_egg_info.py", "distutils/dep_util.py",
         "email/errors.py", "email/mime/audio.py", "importlib/resources/_legacy.py", "importlib/resources/readers.py",
         "lib2to3/fixes/fix_except.py", "lib2to3/fixes/fix_has_key.py", "lib2to3/fixes/fix_map.py",
         "lib2to3/fixes/fix_operator.py", "multiprocessing/dummy/__init__.py", "sqlite3/dbapi2.py", "sqlite3/dump.py",
         "xml/sax/__init__.py")  # fmt: skip
TEST = ("glob.py", "graphlib.py", "numbers.py", "chunk.py")
SKIP_DIRS = ("site-packages", "dist-packages", "__pycache__")


def stdlib_files(root: Path) -> list[Path]:
    """Every ``.py`` file of the standard library under ``root``, sorted, outside site-/dist-packages."""
    return sorted(p for p in root.rglob("*.py") if p.is_file() and not set(p.relative_to(root).parts) & set(SKIP_DIRS))


def write_jsonl(path: Path, root: Path, files: list[Path]) -> int:
    tmp = path.with_suffix(".tmp")
    n = 0
    with tmp.open("w", encoding="utf-8") as f:
        for p in files:
            text = p.read_text(encoding="utf-8", errors="replace")
            if text.strip():
                f.write(json.dumps({"id": p.relative_to(root).as_posix(), "text": text}) + "\n")
                n += 1
    tmp.replace(path)
    return n


def prepare(root: Path, work: Path) -> dict:
    """The three corpora as .jsonl files (one document per module): the index's, the small slice, the test text."""
    files = stdlib_files(root)
    held = {root / name for name in SMALL + TEST}
    missing = [str(p) for p in held if p not in set(files)]
    if missing:
        sys.exit(f"not in {root}: {missing}")
    out = {}
    for name, chosen in (("index", [p for p in files if p not in held]), ("small", [root / n for n in SMALL]),
                         ("test", [root / n for n in TEST])):  # fmt: skip
        path = work / f"{name}.jsonl"
        if not path.exists():
            write_jsonl(path, root, chosen)
        out[name] = {"path": str(path), "documents": sum(1 for line in path.open() if line.strip())}
    return out


def run(cmd: list[str], done: Path, log: Path, commands: list[str]) -> None:
    commands.append(" ".join(cmd))
    if done.exists():
        return
    with log.open("a") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        subprocess.run(cmd, check=True, stdout=f, stderr=subprocess.STDOUT)


def commands(work: Path, model: str) -> list[tuple[list[str], Path]]:
    memlm = [sys.executable, "-m", "memlm.cli"]
    index = work / "index"
    steps = [([*memlm, "ngram", "build", "--model", model, "--corpus", str(work / "index.jsonl"), "--split", "all",
               "--holdout", "0", "--decontaminate", "none", "--out", str(index)], index / "manifest.json")]  # fmt: skip
    for name in ("small", "test"):
        steps.append(([*memlm, "eval", "--model", model, "--dtype", "float32", "--corpus", str(work / f"{name}.jsonl"),
                       "--split", "all", "--memory", str(index), "--dump", str(work / f"{name}.npz"),
                       "--json", str(work / f"{name}_eval.json")], work / f"{name}.npz"))  # fmt: skip
    return steps


def subset(ts, mask):
    """The dump's tokens where ``mask`` holds."""
    import dataclasses

    return dataclasses.replace(ts, **{k: v[mask] for k, v in ts.arrays().items()})


def slice_row(small, test, name: str) -> dict:
    """Test perplexities of the two-λ rule fitted on ``small`` and of the guarded mixture fitted on it."""
    import torch

    from memlm.core.distribution import perplexity
    from memlm.core.mixture import fit_guarded
    from memlm.mixing.inputs import mixture_inputs
    from memlm.mixing.report import fit_summary, fit_table

    rule_fit = fit_table(small, "rule")
    tuned = fit_summary(rule_fit)
    lm = torch.from_numpy(test.lm_logprob)
    rule = rule_fit.logprob(test, "the test dump")
    fit_in, test_in = mixture_inputs(small), mixture_inputs(test)
    fit = fit_guarded(fit_in.logprobs, fit_in.features, fit_in.doc_index, fit_in.components, fit_in.feature_names)
    base = perplexity(lm)
    rows = {
        "tuned_lambdas": perplexity(rule),
        "guarded_mixture": perplexity(fit.mixture.logprob(test_in.logprobs, test_in.features)),
    }
    return {
        "slice": name,
        "slice_tokens": len(small),
        "slice_lm_ppl": perplexity(torch.from_numpy(small.lm_logprob)),
        "tuned": {"lambda_sparse": tuned["ngram_sparse"], "lambda_dense": tuned["ngram_dense"],
                  "slice_ppl": tuned["ppl"]},
        "test_ppl": rows,
        "test_change_vs_lm_percent": {k: 100.0 * (v / base - 1.0) for k, v in rows.items()},
        "fit": fit.to_dict(),
    }  # fmt: skip


def compare(work: Path) -> dict:
    """Test perplexities of the bare LM and the fallback λ's, and per slice the tuned rule and the guarded mixture."""
    import numpy as np
    import torch

    from memlm.core.distribution import perplexity
    from memlm.knnlm.table import TokenTable
    from memlm.mixing.dump import rule_logprob
    from memlm.ngram.mixture import DEFAULT_LAMBDA_DENSE, DEFAULT_LAMBDA_SPARSE

    small, test = TokenTable.load(work / "small.npz"), TokenTable.load(work / "test.npz")
    lm = torch.from_numpy(test.lm_logprob)
    fallback = perplexity(rule_logprob(test, {"ngram": (DEFAULT_LAMBDA_SPARSE, DEFAULT_LAMBDA_DENSE)}))
    slices = [slice_row(subset(small, small.doc_index == d), test, SMALL[d]) for d in range(len(SMALL))]
    slices.append(slice_row(small, test, "all 16 modules"))
    base = perplexity(lm)
    one = slices[:-1]

    def worse(key: str) -> int:
        return sum(r["test_ppl"][key] > base for r in one)

    return {
        "test_tokens": len(test),
        "test_lm_ppl": base,
        "test_fallback_lambdas_ppl": fallback,
        "test_fallback_change_vs_lm_percent": 100.0 * (fallback / base - 1.0),
        "test_sparse_share": float(np.mean(test.columns["ngram"]["sparse"])),
        "slices": slices,
        "summary_one_module_slices": {
            "slices": len(one),
            "tuned_lambdas_worse_than_lm": worse("tuned_lambdas"),
            "guarded_mixture_worse_than_lm": worse("guarded_mixture"),
            "guarded_forms": {f: sum(r["fit"]["form"] == f for r in one) for f in ("lm", "constant", "gate")},
            "tuned_lambdas_worst_ppl": max(r["test_ppl"]["tuned_lambdas"] for r in one),
            "guarded_mixture_worst_ppl": max(r["test_ppl"]["guarded_mixture"] for r in one),
            "tuned_lambdas_mean_change_percent": float(np.mean([r["test_change_vs_lm_percent"]["tuned_lambdas"]
                                                                for r in one])),
            "guarded_mixture_mean_change_percent": float(np.mean([r["test_change_vs_lm_percent"]["guarded_mixture"]
                                                                  for r in one])),
        },
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--stdlib", type=Path, default=Path("/usr/lib/python3.11"))
    ap.add_argument("--work", type=Path, default=Path("data/mixture"))
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--out", type=Path, default=Path("docs/results/mixture/stdlib.json"))
    ap.add_argument("--prepare-only", action="store_true")
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    corpora = prepare(args.stdlib, args.work)
    if args.prepare_only:
        return
    ran: list[str] = []
    for cmd, done in commands(args.work, args.model):
        run(cmd, done, args.work / "commands.log", ran)
    result = {"stdlib": str(args.stdlib), "model": args.model, "small_modules": list(SMALL),
              "test_modules": list(TEST), "corpora": corpora, "commands": ran,
              "script": "python benchmarks/quality/mixture_stdlib.py " + " ".join(sys.argv[1:]),
              **compare(args.work)}  # fmt: skip
    from memlm.io.fileio import atomic_write_json

    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.out, result)
    print(json.dumps(result["summary_one_module_slices"], indent=1))


if __name__ == "__main__":
    main()
