"""Do the two memories add up? LM + kNN-LM + ∞-gram(s) on the efficiency benchmark's WikiText-2 dumps
(docs/results/ngram.md).

    python benchmarks/papers/ngram/ngram_knn.py --valid W/valid-knn.npz --valid-tokens 52000 --test W/test-knn.npz \\
        --test-tokens 24000 --index wt2=IDX1 --index all=IDX2 --out docs/results/ngram/knn_ngram.json

``--valid`` / ``--test``: dumps with datastore neighbours from ``benchmarks/speed/bench_efficient.py`` (the plain kNN
variant's valid dump and the ``knn`` row's test dump; documents = the first ``--*-tokens`` tokens of WikiText-2
valid / test, as that script reads them). The ∞-gram statistics of every index are added to both (no LM pass).
Every weight is tuned on valid and applied to test: the kNN-LM's λ, τ (``memlm tune``'s grid); each index's
λ_sparse, λ_dense alone and jointly with λ, τ (:func:`memlm.ngram.mixture.tune_ngram`); all indexes together, each
with its own weights, alone and beside the kNN term at its jointly tuned λ, τ
(:func:`memlm.ngram.mixture.tune_multi_ngram`). Each row also without WikiText's formatting tokens (the λ's
unchanged).
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
from memlm.data.corpora import load_documents  # noqa: E402
from memlm.data.windows import limit_documents  # noqa: E402
from memlm.io.fileio import atomic_write_json  # noqa: E402
from memlm.knnlm.evaluate import add_memory, tune  # noqa: E402
from memlm.knnlm.table import TokenTable  # noqa: E402
from memlm.models.resources import load_causal_lm  # noqa: E402
from memlm.ngram.memory import NgramMemory  # noqa: E402
from memlm.ngram.mixture import refs_logprob, tune_multi_ngram, tune_ngram  # noqa: E402


def _with_ngram(ts: TokenTable, docs, tok, memory) -> TokenTable:
    out = ts.select([n for n in ts.names() if n not in ts.names("ngram")])
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
    best = tune(dumps["valid"])["best"]
    knn = test.logprob("knn", temperature=best["temperature"])
    rows["knn"] = row(refs_logprob(lm, [], [], knn=knn, lam=best["lambda"]), **{
        "lambda": best["lambda"], "temperature": best["temperature"]})  # fmt: skip
    refs_test, joint_best = [], None
    for name in indexes:
        v, t = with_ng[name]["valid"], with_ng[name]["test"]
        ng, sp = torch.from_numpy(t.columns["ngram"]["logprob"]), torch.from_numpy(t.columns["ngram"]["sparse"])
        refs_test.append((ng, sp))
        a = tune_ngram(_no_knn(v))["best"]
        rows[f"ngram:{name}"] = row(refs_logprob(lm, [(ng, sp)], [(a["lambda_sparse"], a["lambda_dense"])]),
                                    lambda_sparse=a["lambda_sparse"], lambda_dense=a["lambda_dense"],
                                    sparse_share=float(sp.float().mean()),
                                    effective_n_median=float(np.median(t.columns["ngram"]["n"])))  # fmt: skip
        j = tune_ngram(v)["best"]
        k_j = t.logprob("knn", temperature=j["temperature"])
        rows[f"knn+ngram:{name}"] = row(
            refs_logprob(lm, [(ng, sp)], [(j["lambda_sparse"], j["lambda_dense"])], knn=k_j, lam=j["lambda"]),
            **{k: j[k] for k in ("lambda", "temperature", "lambda_sparse", "lambda_dense")},
        )
        if joint_best is None or j["ppl"] < joint_best["ppl"]:
            joint_best = j
    if len(indexes) > 1:
        valid_ng = [with_ng[n]["valid"] for n in indexes]
        v_refs = [(d.logprob("ngram"), torch.from_numpy(d.columns["ngram"]["sparse"])) for d in valid_ng]
        v_lm = torch.from_numpy(dumps["valid"].lm_logprob)
        m = tune_multi_ngram(v_lm, v_refs)
        rows["ngram:" + "+".join(indexes)] = row(refs_logprob(lm, refs_test, m["weights"]),
                                                 weights=m["weights"], valid_ppl=m["ppl"])  # fmt: skip
        vd = dumps["valid"]
        tau, lam = joint_best["temperature"], joint_best["lambda"]
        v_knn = vd.logprob("knn", temperature=tau)
        mk = tune_multi_ngram(v_lm, v_refs, knn=v_knn, lam=lam)
        k_t = test.logprob("knn", temperature=tau)
        rows["knn+ngram:" + "+".join(indexes)] = row(
            refs_logprob(lm, refs_test, mk["weights"], knn=k_t, lam=lam),
            **{"lambda": lam, "temperature": tau, "weights": mk["weights"], "valid_ppl": mk["ppl"]},
        )
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
