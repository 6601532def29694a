"""The evidence behind a `memlm eval` result: its perplexities with 95% bootstrap intervals over documents,
the paired interval of each relative change, and the change by frequency bucket, recomputed from the run's dump.

The dump (`memlm eval --dump`) and the result (`--json`) of one run are read back; every row is recomputed with the
run's own weights (λ, τ, k of the kNN term; λ_sparse, λ_dense of the ∞-gram: the values in the result) through the
same functions `memlm eval` uses (memlm.knnlm.evaluate.perplexities, memlm.ngram.results.ngram_result), checked equal to
the result's perplexities, and written with its evidence. WikiText's formatting tokens (the `@` and `-`/`,`/`.` of
` @-@ `, ` @,@ `, ` @.@ `) can be left out for a second set of rows (--without-formatting, as ngram_report.py);
--other-dump compares the run's ∞-gram with another index swapped into the same dump (ngram_swap.py), paired.

    python benchmarks/quality/intervals_report.py --dump T.npz --result R.json --out docs/results/evidence/X.json \
        [--without-formatting --corpus wikitext2 --split test --max-tokens 20000]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from memlm.io.fileio import atomic_write_json  # noqa: E402
from memlm.knnlm.calibration import ngram_parameters  # noqa: E402
from memlm.knnlm.evaluate import perplexities, value_counts  # noqa: E402
from memlm.knnlm.table import TokenTable  # noqa: E402
from memlm.mixing.dump import rule_for  # noqa: E402
from memlm.mixing.report import report as mixture_report  # noqa: E402
from memlm.ngram.results import ngram_result  # noqa: E402

ROWS = ("base_ppl", "knn_ppl", "ngram_ppl", "knn_ngram_ppl")


def rescore(ts: TokenTable, res: dict) -> dict:
    """The run's result recomputed from its dump, with intervals, differences and frequency buckets."""
    from memlm.ngram.memory import NgramMemory
    from memlm.storage.sharded import open_datastore

    has_knn = "knn" in ts.columns
    lam = float(res["lambda"]) if has_knn else 0.0
    temperature = float(res.get("temperature", 1.0)) if has_knn else 1.0
    counts = value_counts(open_datastore(res["datastore"]), ts.targets) if has_knn else None
    out = perplexities(ts, lam=lam, temperature=temperature, k=res.get("k"), target_counts=counts)
    if "ngram" in ts.columns:
        memory = NgramMemory(res["ngram"])
        weights = [ngram_parameters(memory.index, res["lambda_sparse"], res["lambda_dense"], announce=False)]
        out.update(ngram_result(ts, memory, lam, temperature, weights, base=out))
    for key in ROWS:
        if key in res:
            assert math.isclose(out[key], res[key], rel_tol=1e-9), (key, out[key], res[key])
    return out


def per_document(ts: TokenTable, res: dict) -> list[dict]:
    """Each document's tokens and perplexity under every row (with few documents, whether they agree in sign says
    more than an interval)."""
    import numpy as np

    from memlm.core.distribution import perplexity
    from memlm.mixing.dump import rule_logprob

    rows = {"base_ppl": ts.lm_logprob}
    if "ngram" in ts.columns:
        lam = res.get("lambda") if "knn" in ts.columns else None
        rows["ngram_ppl"] = rule_logprob(ts, {"ngram": (res["lambda_sparse"], res["lambda_dense"])})
        if lam is not None:
            w3 = res["knn_ngram_weights"]
            knn = (res["temperature"], res["k"])
            rows.update(knn_ppl=rule_logprob(ts, {"knn": lam}, *knn),
                        knn_ngram_ppl=rule_logprob(ts, {"knn": lam, "ngram": (w3["lambda_sparse"], w3["lambda_dense"])},
                                                   *knn))  # fmt: skip
    doc = np.asarray(ts.doc_index)
    return [{"document": i, "tokens": int((doc == d).sum()),
             **{k: perplexity(np.asarray(v)[doc == d]) for k, v in rows.items()}}
            for i, d in enumerate(np.unique(doc))]  # fmt: skip


def buckets_without(ts: TokenTable, res: dict, keep) -> dict:
    """The ∞-gram's frequency buckets on the tokens in ``keep`` only (e.g. without WikiText's formatting tokens)."""
    import dataclasses

    from memlm.core.frequency import bucket_table
    from memlm.mixing.dump import rule_logprob
    from memlm.ngram.memory import NgramMemory

    if "ngram" not in ts.columns:
        return {}
    fields = [f.name for f in dataclasses.fields(ts) if f.name != "meta"]
    sub = dataclasses.replace(ts, **{f: getattr(ts, f)[keep] for f in fields if getattr(ts, f) is not None})
    mixed = rule_logprob(sub, {"ngram": (res["lambda_sparse"], res["lambda_dense"])})
    return {"ngram_ppl": bucket_table(sub, mixed, NgramMemory(res["ngram"]).token_counts(sub.targets),
                                      f"∞-gram index {res['ngram']}")}  # fmt: skip


def other_reference(ts: TokenTable, res: dict, path: str, fmt) -> dict:
    """LM + ∞-gram with another index (the same dump's LM scores, the other index's statistics: benchmarks/
    ngram_swap.py) against this run's ∞-gram, paired, with the run's λ_sparse, λ_dense for both."""
    import numpy as np

    from memlm.core.bootstrap import evidence
    from memlm.mixing.dump import rule_logprob

    other = TokenTable.load(path)
    for f in ("targets", "doc_index", "lm_logprob"):
        assert np.array_equal(getattr(other, f), getattr(ts, f)), f"{path} is not a swap of this dump ({f})"
    lams = (res["lambda_sparse"], res["lambda_dense"])
    rows = {"base_ppl": ts.lm_logprob, "ngram_ppl": rule_logprob(ts, {"ngram": lams}),
            "other_ngram_ppl": rule_logprob(other, {"ngram": lams})}  # fmt: skip
    pairs = [("base_ppl", "other_ngram_ppl"), ("ngram_ppl", "other_ngram_ppl")]
    out = {"dump": path, "index": other.meta.get("ngram"), "lambdas": list(lams), **evidence(rows, ts.doc_index, pairs)}
    if fmt is not None:
        out["without_formatting"] = evidence(rows, ts.doc_index, pairs, mask=~fmt)
    return out


def table(out: dict) -> list[str]:
    """Markdown rows: system, ppl [95% interval], change vs base [paired interval]."""
    lines = ["| | perplexity [95% interval] | vs base LM [paired 95% interval] | vs LM + kNN |", "|---|---|---|---|"]
    for key in ROWS:
        row = out["intervals"].get(key)
        if row is None:
            continue
        cells = [key, f"{row['ppl']:.3f} [{row['low']:.2f}, {row['high']:.2f}]"]
        for ref in ("base_ppl", "knn_ppl"):
            d = out["differences"].get(f"{key} vs {ref}")
            cells.append("" if d is None else f"{100 * d['relative_change']:+.1f}% [{100 * d['low']:+.1f}%, "
                         f"{100 * d['high']:+.1f}%]")  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dump", required=True)
    ap.add_argument("--result", required=True, help="the run's memlm eval --json")
    ap.add_argument("--out", required=True)
    ap.add_argument("--without-formatting", action="store_true", help="also rows without WikiText's formatting tokens")
    ap.add_argument("--corpus", default="wikitext2")
    ap.add_argument("--split", default="test")
    ap.add_argument("--max-tokens", type=int, default=None)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--other-dump", default=None, help="this dump with another index's ∞-gram scores (ngram_swap.py)")
    args = ap.parse_args()
    ts = TokenTable.load(args.dump)
    res = json.loads(Path(args.result).read_text())
    out = rescore(ts, res)
    report = {
        "dump": args.dump,
        "result": args.result,
        "command": "python " + " ".join(sys.argv),
        "model": res.get("model"),
        "corpus": res.get("corpus"),
        "split": res.get("split"),
        "tokens": len(ts),
        "documents": out["bootstrap"]["documents"],
        "memories": {k: res.get(k) for k in ("datastore", "ngram", "ngram_tokens") if res.get(k) is not None},
        "weights": {
            k: res.get(k)
            for k in ("lambda", "temperature", "k", "lambda_sparse", "lambda_dense", "knn_ngram_weights")
            if k in res
        },  # fmt: skip
        **{k: out[k] for k in ("bootstrap", "intervals", "differences", "frequency_buckets") if k in out},
    }
    report["per_document"] = per_document(ts, res)
    fmt = None
    if args.without_formatting:
        from ngram_report import formatting_mask

        fmt = formatting_mask(ts, args.corpus, args.split, args.max_tokens, args.model)
    if args.other_dump:
        report["other_reference"] = other_reference(ts, res, args.other_dump, fmt)
    if fmt is not None:
        w3 = res.get("knn_ngram_weights") or {}
        lam = res.get("lambda") if "knn" in ts.columns else None
        ls, ld = res["lambda_sparse"], res["lambda_dense"]
        import torch

        rows = {"base_ppl": torch.from_numpy(ts.lm_logprob), "ngram_ppl": rule_for(ts, {"ngram": (ls, ld)})}
        pairs = [("base_ppl", "ngram_ppl")]
        if lam is not None and w3:
            pair = (w3["lambda_sparse"], w3["lambda_dense"])
            rows.update(knn_ppl=rule_for(ts, {"knn": lam}), knn_ngram_ppl=rule_for(ts, {"knn": lam, "ngram": pair}))
            same = pair == (ls, ld)  # the ∞-gram row's weights: comparable
            pairs += [("base_ppl", "knn_ngram_ppl"), ("knn_ppl", "knn_ngram_ppl")]
            pairs += [("ngram_ppl", "knn_ngram_ppl")] if same else []
        rep = mixture_report(ts, rows, pairs, mask=~fmt, temperature=res.get("temperature", 1.0), k=res.get("k"))
        report["without_formatting"] = {"tokens": int((~fmt).sum()), "formatting_tokens": int(fmt.sum()),
                                        "intervals": rep["intervals"], "differences": rep["differences"],
                                        "frequency_buckets": buckets_without(ts, res, ~fmt)}  # fmt: skip
    atomic_write_json(Path(args.out), report)
    print("\n".join(table(out)))
    if "without_formatting" in report:
        print("without formatting tokens:")
        print("\n".join(table(report["without_formatting"])))
    without = report.get("without_formatting", {}).get("frequency_buckets", {})
    for system, buckets in [*out.get("frequency_buckets", {}).items(), *[(k + " w/o formatting", v)
                                                                         for k, v in without.items()]]:  # fmt: skip
        print(f"\n{system} by frequency in {buckets['counted_in']}")
        for r in buckets["rows"]:
            if r["tokens"]:
                print(f"| {r['bucket']} | {r['tokens']:,} | {r['base_ppl']:.2f} | {r['memory_ppl']:.2f} | "
                      f"{100 * r['relative_change']:+.1f}% [{100 * r['low']:+.1f}%, {100 * r['high']:+.1f}%] | "
                      f"{r['nats_gained']:+.0f} |")  # fmt: skip
    if "other_reference" in report:
        o = report["other_reference"]
        for part in (o, o.get("without_formatting")):
            if part:
                print("other index:", {k: v for k, v in part["intervals"].items()})
                print("             ", {k: v for k, v in part["differences"].items()})
    for d in report["per_document"]:
        print(f"document {d['document']}: {d['tokens']:,} tokens, "
              + ", ".join(f"{k} {v:.3f}" for k, v in d.items() if k.endswith("_ppl")))  # fmt: skip
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
