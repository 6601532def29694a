"""Do the two memories add up? LM + kNN-LM + ∞-gram(s) on the efficiency benchmark's WikiText-2 dumps
(docs/results/ngram.md).

    python benchmarks/papers/ngram/ngram_knn.py --valid W/valid-knn.npz --valid-tokens 52000 --test W/test-knn.npz \\
        --test-tokens 24000 --index wt2=IDX1 --index all=IDX2 --out docs/results/ngram/knn_ngram.json

``--valid`` / ``--test``: dumps with datastore neighbours from ``benchmarks/speed/bench_efficient.py`` (the plain kNN
variant's valid dump and the ``knn`` row's test dump; documents = the first ``--*-tokens`` tokens of WikiText-2
valid / test, as that script reads them). The ∞-gram statistics of every index are added to both (no LM pass).
Every weight is fitted on valid and applied to test, by the rule fitted as ``memlm tune`` fits it
(:func:`memlm.mixing.report.fit_table`: EM per joint sparse state of the ∞-grams, τ the most likely): the kNN-LM's λ,
τ; each index's λ_sparse, λ_dense alone and together with λ, τ; all indexes together, each with its own weights, alone
and beside the kNN term. Each row also without WikiText's formatting tokens (the λ's unchanged).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ngram_report import formatting_mask_of  # noqa: E402

from memlm.core.distribution import perplexity  # noqa: E402
from memlm.core.tuning import DEFAULT_TEMPERATURES  # noqa: E402
from memlm.data.corpora import load_documents  # noqa: E402
from memlm.data.windows import limit_documents  # noqa: E402
from memlm.io.fileio import atomic_write_json  # noqa: E402
from memlm.knnlm.evaluate import add_memory  # noqa: E402
from memlm.knnlm.table import TokenTable  # noqa: E402
from memlm.mixing.report import fit_summary, fit_table  # noqa: E402
from memlm.models.resources import load_causal_lm  # noqa: E402
from memlm.ngram.memory import NgramMemory  # noqa: E402


def _with_ngram(ts: TokenTable, docs, tok, *memories) -> TokenTable:
    out = ts.select([n for n in ts.names() if n not in ts.names("ngram")])
    for memory in memories:
        add_memory(out, memory, docs, tok)
    return out


def _no_knn(ts: TokenTable) -> TokenTable:
    return ts.select(ts.names("ngram"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--valid", required=True)
    ap.add_argument("--valid-tokens", type=int, required=True)
    ap.add_argument("--test", required=True)
    ap.add_argument("--test-tokens", type=int, required=True)
    ap.add_argument("--index", action="append", required=True, help="NAME=FOLDER (an ∞-gram index)")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    _, tok = load_causal_lm(args.model, dtype="float32")
    docs = {
        "valid": limit_documents(load_documents("wikitext2", "valid"), tok, args.valid_tokens),
        "test": limit_documents(load_documents("wikitext2", "test"), tok, args.test_tokens),
    }
    dumps = {"valid": TokenTable.load(args.valid), "test": TokenTable.load(args.test)}
    indexes = dict(x.split("=", 1) for x in args.index)
    with_ng = {name: {s: _with_ngram(dumps[s], docs[s], tok, NgramMemory(p)) for s in dumps}
               for name, p in indexes.items()}  # fmt: skip
    test = dumps["test"]
    keep = torch.from_numpy(~formatting_mask_of(test, docs["test"], tok))
    lm = torch.from_numpy(test.lm_logprob)

    def row(logp: torch.Tensor, **params) -> dict:
        return {"ppl": perplexity(logp), "ppl_without_formatting": perplexity(logp[keep]), **params}

    out: dict = {
        "command": " ".join(["python", *sys.argv]),
        "valid_tokens": len(dumps["valid"]),
        "test_tokens": len(test),
        "formatting_tokens": int((~keep).sum()),
        "datastore": test.meta.get("datastore"),
        "datastore_entries": test.meta.get("datastore_entries"),
        "indexes": {n: {"path": p, "tokens": int(NgramMemory(p).index.manifest["tokens"])} for n, p in indexes.items()},
        "rows": {},
    }
    rows = out["rows"]
    rows["base"] = row(lm)

    def fitted(valid: TokenTable, test: TokenTable, **params) -> dict:
        dm = fit_table(valid, "rule", DEFAULT_TEMPERATURES)
        return row(dm.logprob(test, "the test dump"), **fit_summary(dm), **params)

    rows["knn"] = fitted(dumps["valid"].select(["knn"]), test.select(["knn"]))
    for name in indexes:
        v, t = with_ng[name]["valid"], with_ng[name]["test"]
        cols = t.columns["ngram"]
        rows[f"ngram:{name}"] = fitted(_no_knn(v), _no_knn(t), sparse_share=float(np.mean(cols["sparse"])),
                                       effective_n_median=float(np.median(cols["n"])))  # fmt: skip
        rows[f"knn+ngram:{name}"] = fitted(v, t)
    if len(indexes) > 1:
        every = {s: _with_ngram(dumps[s], docs[s], tok, *(NgramMemory(p) for p in indexes.values())) for s in dumps}
        rows["ngram:" + "+".join(indexes)] = fitted(_no_knn(every["valid"]), _no_knn(every["test"]))
        rows["knn+ngram:" + "+".join(indexes)] = fitted(every["valid"], every["test"])
    for r in rows.values():
        r["relative"] = r["ppl"] / rows["base"]["ppl"] - 1
        r["relative_without_formatting"] = r["ppl_without_formatting"] / rows["base"]["ppl_without_formatting"] - 1
    atomic_write_json(Path(args.out), out)
    for name, r in rows.items():
        print(f"{name:32s} {r['ppl']:8.3f} ({100 * r['relative']:+.1f}%)  without formatting "
              f"{r['ppl_without_formatting']:8.3f} ({100 * r['relative_without_formatting']:+.1f}%)")  # fmt: skip
    print(json.dumps({k: v for k, v in out.items() if k != "rows"}))


if __name__ == "__main__":
    main()
