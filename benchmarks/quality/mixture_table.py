"""The table: the fixed-weight rule beside the learned mixture on WikiText-2 test, test tokens only.

SmolLM2-135M (float32, windows 1024 / 512) with the memories of benchmarks/quality/intervals.sh (read from
``--data``): the ∞-gram over all of WikiText-2 train (``wt2``, 2.55M tokens, --holdout 0) and the datastore over the
first 50k WikiText-2 train tokens (``ds50k``, 43,344 entries); the continuous cache. Both weightings are tuned on the
same WikiText-2 VALID dump (``--valid-max-tokens 60000``, the default: the first 18 articles, 58,429 scored tokens,
every memory in one forward pass) and applied to a test dump:

* (a) LM + ∞-gram, (b) LM + datastore, (c) LM + both, (d) LM + both + cache;
* the rule (λ, λ_sparse / λ_dense and the cache's λc by EM, τ the most likely) and the guarded learned mixture, each
  fitted on valid by :func:`memlm.mixing.report.fit_table` (what ``memlm tune --mixture rule`` / ``guarded`` run),
  both applied to test in one :func:`memlm.mixing.report.report`, with the 95% bootstrap interval over test
  documents and paired differences.

Each row's dumps are views of the full dumps with the other memories left out (the per-token scores of one memory do
not depend on the others). Test dumps: the first 59,848 test tokens (11 articles, intervals.sh's, no cache: rows
a-c) and the first 19,711 (4 articles, scored here again with --memory cache: rows a-d). Stages are skipped when their
output exists; the commands run are recorded in the JSON::

    python benchmarks/quality/mixture_table.py --data data/ev-intervals --work data/mixture-wire \
        --out docs/results/mixture/wikitext2_valid60k.json

``--stdlib``: the code case too (benchmarks/quality/mixture_stdlib.py's dumps: its 16 small modules together as
the valid dump, its 4 test modules as the test dump).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from mixture_stdlib import run  # one resumable command runner for both mixture benchmarks (same folder)

ROWS = {  # row: (memories kept, what the row is)
    "a": (("ngram",), "LM + ∞-gram (WikiText-2 train)"),
    "b": (("knn",), "LM + datastore (43,344 entries)"),
    "c": (("knn", "ngram"), "LM + datastore + ∞-gram"),
    "d": (("knn", "ngram", "cache"), "LM + datastore + ∞-gram + cache"),
}
META = {"knn": ("datastore_build_id",)}  # what the eval recorded of a memory beside the table's components


def evals(data: Path, work: Path, res: Path, valid_tokens: int, datastore: Path | None = None,
          tag: str = "") -> list[tuple[list[str], Path]]:  # fmt: skip
    ds = datastore or data / "ds50k"
    memlm = [sys.executable, "-m", "memlm.cli", "eval", "--model", "smollm2-135m", "--dtype", "float32", "--corpus",
             "wikitext2", "--memory", str(ds), "--memory", str(data / "wt2"), "--memory", "cache"]  # fmt: skip
    out = []
    for split, tokens in (("valid", valid_tokens), ("test", 20000)):
        name = f"{split}{tokens // 1000}k_knn_ngram_cache"
        out.append(([*memlm, "--split", split, "--max-tokens", str(tokens), "--dump", str(work / f"{name}.npz"),
                     "--json", str(res / f"eval_{name}{tag}.json")], work / f"{name}.npz"))  # fmt: skip
    return out


def view(src: Path, dst: Path, keep: tuple[str, ...]) -> None:
    """``src`` with only the memories in ``keep`` (their columns and their meta), written to ``dst``."""
    from memlm.knnlm.table import TokenTable

    if dst.exists():
        return
    ts = TokenTable.load(src).select(keep)
    for memory, keys in META.items():
        if memory not in keep:
            for k in keys:
                ts.meta.pop(k, None)
    ts.save(dst)


#: ``--rule-cache``: the cache's τc candidates of both fits (row d; otherwise τc = 1)
CACHE_TEMPERATURES = (0.5, 1.0, 2.0, 5.0)


def tune(valid: Path, test: Path, out: Path, ran: list[str], cache_temperatures=(1.0,)) -> None:
    """The rule and the guarded mixture fitted on ``valid`` (:func:`memlm.mixing.report.fit_table`: the weights by
    maximum likelihood, τ the most likely of ``DEFAULT_TEMPERATURES``), both applied to ``test`` in one report;
    skipped when ``out`` exists."""
    ran.append(f"fit_table({valid}, rule and guarded, cache τ {list(cache_temperatures)}) applied to {test}")
    if out.exists():
        return
    import torch

    from memlm.core.tuning import DEFAULT_TEMPERATURES
    from memlm.io.fileio import atomic_write_json
    from memlm.knnlm.table import TokenTable
    from memlm.mixing.report import fit_summary, fit_table, report

    v, t = TokenTable.load(valid), TokenTable.load(test)
    rule, dm = (fit_table(v, form, DEFAULT_TEMPERATURES, cache_temperatures=cache_temperatures)
                for form in ("rule", "guarded"))  # fmt: skip
    rows = {"base_ppl": torch.from_numpy(t.lm_logprob), "rule_ppl": rule.logprob(t), "mixture_ppl": dm.logprob(t)}
    pairs = (("base_ppl", "rule_ppl"), ("base_ppl", "mixture_ppl"), ("rule_ppl", "mixture_ppl"))
    atomic_write_json(out, {"valid": {"best": fit_summary(rule)}, "rule": rule.to_dict(), "mixture": dm.to_dict(),
                            "mixture_test": report(t, rows, pairs)})  # fmt: skip


def summary(path: Path, row: str) -> dict:
    """One table row: base, rule and learned mixture on test with intervals and paired changes, the chosen form,
    τ, the rule's weights and the gate's W and b per feature."""
    t = json.loads(path.read_text())
    m, fit = t["mixture_test"], t["mixture"]["fit"]
    mix = fit["mixture"]

    def interval(key: str) -> list:
        i = m["intervals"][key]
        return [i["low"], i["high"]]

    def change(key: str) -> dict:
        d = m["differences"][key]
        return {"change": d["relative_change"], "interval": [d["low"], d["high"]]}

    return {
        "row": row,
        "memories": ROWS[row][1],
        "tune_json": str(path),
        "test_tokens": m["tokens"],
        "test_documents": m["bootstrap"]["documents"],
        "valid_tokens": fit["tokens"],
        "valid_documents": fit["documents"],
        "base_ppl": m["base_ppl"],
        "base_interval": interval("base_ppl"),
        "rule_ppl": m["rule_ppl"],
        "rule_interval": interval("rule_ppl"),
        "rule_vs_base": change("rule_ppl vs base_ppl"),
        "rule_weights": t["valid"]["best"],
        "mixture_ppl": m["mixture_ppl"],
        "mixture_interval": interval("mixture_ppl"),
        "mixture_vs_base": change("mixture_ppl vs base_ppl"),
        "mixture_vs_rule": change("mixture_ppl vs rule_ppl"),
        "form": fit["form"],
        "temperature": t["mixture"]["temperature"],
        "heldout_loglik": fit["heldout_loglik"],
        "mean_weights": dict(zip(mix["components"], fit["mean_weights"], strict=True)),
        "gate": {
            c: {"b": b, "W": dict(zip(mix["feature_names"], w, strict=True))}
            for c, w, b in zip(mix["components"], mix["W"], mix["b"], strict=True)
        },  # fmt: skip
        "warnings": fit["warnings"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", type=Path, default=Path("data/ev-intervals"))
    ap.add_argument("--work", type=Path, default=Path("data/mixture-wire"))
    ap.add_argument("--out", type=Path, default=Path("docs/results/mixture/wikitext2_valid60k.json"))
    ap.add_argument("--evals-only", action="store_true")
    ap.add_argument("--valid-max-tokens", type=int, default=60000, help="--max-tokens of the valid dump")
    ap.add_argument("--stdlib", type=Path, default=None, help="mixture_stdlib.py's --work (its dumps)")
    ap.add_argument("--datastore", type=Path, default=None, help="another datastore than --data's ds50k (rows b-d on "
                    "test20k only; every output file named with --tag)")  # fmt: skip
    ap.add_argument("--tag", default="", help="appended to the names of the eval and tune JSON files")
    ap.add_argument("--rule-cache", action="store_true", help="row d only, the cache's τc chosen among "
                    "CACHE_TEMPERATURES (tune files named ..._rulecache)")  # fmt: skip
    args = ap.parse_args()
    res = args.out.parent
    args.work.mkdir(parents=True, exist_ok=True)
    res.mkdir(parents=True, exist_ok=True)
    log, ran = res / f"{args.out.stem}.log", []
    tag = ("" if args.valid_max_tokens == 20000 else f"_valid{args.valid_max_tokens // 1000}k") + args.tag
    for cmd, done in evals(args.data, args.work, res, args.valid_max_tokens, args.datastore, args.tag):
        run(cmd, done, log, ran)
    if args.evals_only:
        return
    valid = args.work / f"valid{args.valid_max_tokens // 1000}k_knn_ngram_cache.npz"
    tests = {"test20k": (args.work / "test20k_knn_ngram_cache.npz", "abcd" if args.datastore is None else "bcd"),
             "test60k": (args.data / "test60k_knn_ngram.npz", "abc")}  # fmt: skip
    if args.datastore is not None:  # the 60k test dump holds ds50k's neighbours
        del tests["test60k"]
    rows = []
    for name, (test, which) in tests.items():
        for row in which:
            if args.rule_cache and row != "d":
                continue
            keep = ROWS[row][0]
            v, t = args.work / f"view_{row}_valid{tag}.npz", args.work / f"view_{row}_{name}.npz"
            view(valid, v, keep)
            view(test, t, keep)
            out = res / f"tune_{row}_{name}{tag}{'_rulecache' if args.rule_cache else ''}.json"
            tune(v, t, out, ran, CACHE_TEMPERATURES if args.rule_cache else (1.0,))
            row_summary = summary(out, row)
            if args.rule_cache:
                row_summary["memories"] += " (the cache's τc chosen too)"
            if args.datastore is not None:
                row_summary["memories"] = row_summary["memories"].replace("43,344 entries", args.datastore.name)
            rows.append({"test": name, **row_summary})
    if args.stdlib is not None:  # mixture_stdlib.py's dumps: all 16 small modules as valid, 4 as test
        out = res / "tune_stdlib.json"
        tune(args.stdlib / "small.npz", args.stdlib / "test.npz", out, ran)
        rows.append({"test": "stdlib", **summary(out, "a"), "memories": "LM + ∞-gram (Python 3.11 stdlib, 3.16M)"})
    from memlm.io.fileio import atomic_write_json

    atomic_write_json(args.out, {"script": "python benchmarks/quality/mixture_table.py " + " ".join(sys.argv[1:]),
                                 "commands": ran, "rows": rows})  # fmt: skip
    print(markdown(rows))


def _pct(d: dict) -> str:
    lo, hi = d["interval"]
    return f"{100 * d['change']:+.2f}% [{100 * lo:+.2f}, {100 * hi:+.2f}]"


def markdown(rows: list[dict]) -> str:
    """The table of docs/results/mixture.md and each fitted gate's W and b per feature (standardised features)."""
    out = ["| test | row | memories | base LM | rule | rule vs base | learned | learned vs base | learned vs rule | "
           "form (τ) |", "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        tau = "" if r["temperature"] is None else f" (τ {r['temperature']:g})"
        out.append(f"| {r['test']} | ({r['row']}) | {r['memories']} | {r['base_ppl']:.3f} | {r['rule_ppl']:.3f} | "
                   f"{_pct(r['rule_vs_base'])} | {r['mixture_ppl']:.3f} | {_pct(r['mixture_vs_base'])} | "
                   f"{_pct(r['mixture_vs_rule'])} | {r['form']}{tau} |")  # fmt: skip
    for r in rows:
        comps = [c for c in r["gate"] if c != "lm"]
        feats = list(r["gate"]["lm"]["W"])
        out += ["", f"{r['test']} ({r['row']}), form {r['form']}: W (per standard deviation of the feature) and b, "
                "relative to the LM", "", "| feature | " + " | ".join(comps) + " |",
                "|---|" + "---|" * len(comps)]  # fmt: skip
        out += [f"| {f} | " + " | ".join(f"{r['gate'][c]['W'][f]:+.3f}" for c in comps) + " |" for f in feats]
        bs = ["-inf" if r["gate"][c]["b"] is None else f"{r['gate'][c]['b']:+.3f}" for c in comps]
        out.append("| b | " + " | ".join(bs) + " |")
        out.append("| mean λ on valid | " + " | ".join(f"{r['mean_weights'][c]:.4f}" for c in comps) + " |")
    return "\n".join(out)


if __name__ == "__main__":
    main()
