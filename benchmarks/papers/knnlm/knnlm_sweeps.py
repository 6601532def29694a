"""kNN-LM on SmolLM2-135M: the numbers in docs/results/knnlm.md (Khandelwal et al. 2020, Tables 1/4/5, Figs. 2-5).

One resumable command; every stage is cached in --out (datastores, indexes, forward passes, neighbour dumps):

    python benchmarks/papers/knnlm/knnlm_sweeps.py --out runs/knnlm

1. datastores (ffn_in keys): the first 500k tokens of wiki train and of news train; a wiki datastore with ``final``
   keys on the same text for the key-type comparison (Table 5 / Xu Table 1);
2. one forward pass per evaluation split (wiki and news, valid and test) capturing both key roles;
3. for every (evaluation corpus, datastore) pair: retrieve k=1024 neighbours, tune λ and temperature on valid, report
   test perplexity (base, kNN-LM, oracle);
4. sweeps on test with the valid-tuned temperature: perplexity vs k, vs λ (in- and out-of-domain), vs datastore size
   (random subsamples of the wiki datastore, λ and τ re-tuned on valid for each size);
5. results.json, results.md and PNG figures.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from memlm.core.tuning import DEFAULT_LAMBDAS, DEFAULT_TEMPERATURES
from memlm.data.corpora import corpus_fingerprint, load_corpora, load_documents
from memlm.data.windows import limit_documents
from memlm.io.fileio import atomic_write_json, dumps_json
from memlm.knnlm.evaluate import add_neighbours, lm_scores, perplexities
from memlm.knnlm.table import TokenTable
from memlm.knnlm.write import write_datastore
from memlm.mixing.report import fit_summary, fit_table
from memlm.models.keys import KeySpec, num_layers
from memlm.models.resources import load_causal_lm
from memlm.storage.datastore import Datastore
from memlm.storage.index import build_index, plan_index

FFN_IN, FINAL = KeySpec("ffn_in", -1), KeySpec("final", -1)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def datastore(args, model, tok, corpus: str, key: KeySpec, max_tokens: int | None, out: Path) -> Datastore:
    max_tokens = max_tokens or None
    docs = limit_documents(load_documents(corpus, "train"), tok, max_tokens)
    ds = write_datastore(
        model,
        tok,
        docs,
        out,
        key=key,
        window=args.window,
        min_context=args.min_context,
        batch_size=args.batch_size,
        source={
            "corpus": corpus,
            "split": "train",
            "documents": len(docs),
            "fingerprint": corpus_fingerprint(docs),
            "max_tokens": max_tokens,
        },
    )
    ensure_index(ds)
    return ds


def ensure_index(ds: Datastore) -> None:
    """Flat (exact) up to 100k entries, else IVF1024,Flat (exact L2 scores, 32 of 1024 lists probed).

    Cheaper to train on 2 cores than memlm's size-based default (IVF4096 on ~1M keys), which is what a user gets
    from ``memlm index build`` without --factory.
    """
    if not ds.index_path.exists():
        plan = plan_index(len(ds), ds.dim, "Flat" if len(ds) <= 100_000 else "IVF1024,Flat", train_size=60_000)
        build_index(ds.keys, ds.index_path, factory=plan.factory, metric="l2", train_size=plan.train_size)


def forward(args, model, tok, corpus: str, split: str, specs, out: Path):
    """LM scores + queries for both key roles, cached as npz."""
    path = out / f"forward-{corpus}-{split}.npz"
    names = [s.describe() for s in specs]
    if path.exists():
        with np.load(path) as z:
            ts = TokenTable(targets=z["targets"], lm_logprob=z["lm_logprob"], doc_index=z["doc_index"],
                            meta=json.loads(str(z["meta"])))  # fmt: skip
            return ts, {s: z[f"q_{n}"] for s, n in zip(specs, names, strict=True)}
    n = args.test_tokens if split == "test" else args.valid_tokens
    docs = limit_documents(load_corpora(corpus, split), tok, n)  # "wiki" or "wiki,news"
    log(f"forward {corpus}/{split}: {len(docs)} docs")
    ts, queries, _ = lm_scores(
        model, tok, docs, specs, args.window, args.min_context, args.batch_size, meta={"corpus": corpus, "split": split}
    )
    np.savez(
        path.with_suffix(".tmp.npz"),
        targets=ts.targets,
        lm_logprob=ts.lm_logprob,
        doc_index=ts.doc_index,
        meta=np.array(dumps_json(ts.meta, indent=None)),
        **{f"q_{n}": queries[s] for s, n in zip(specs, names, strict=True)},
    )
    path.with_suffix(".tmp.npz").replace(path)
    return ts, queries


def neighbours(base: TokenTable, queries, ds: Datastore, k: int, path: Path) -> TokenTable:
    if path.exists():
        return TokenTable.load(path)
    ts = base.select()
    add_neighbours(ts, queries[ds.key_spec], ds, k=k)
    ts.save(path)
    log(f"neighbours {path.name}: search {ts.meta['components']['knn']['seconds']:.1f} s")
    return ts


def tuned(valid: TokenTable, test: TokenTable, k: int | None = None) -> dict:
    best = fit_summary(fit_table(valid, "rule", DEFAULT_TEMPERATURES, k))  # λ by EM at each τ, the most likely
    return {
        **perplexities(test, lam=best["knn"], temperature=best["temperature"], k=k),
        "valid_ppl": best["ppl"],
        "valid_base_ppl": perplexities(valid)["base_ppl"],
    }


def add_forward_args(p: argparse.ArgumentParser, valid_tokens: int = 15_000, test_tokens: int = 30_000) -> None:
    """The model, the held-out text and the windows of :func:`forward`, and k: shared by the kNN-LM benchmarks."""
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--valid-tokens", type=int, default=valid_tokens)
    p.add_argument("--test-tokens", type=int, default=test_tokens)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--min-context", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=4, help="forward batch")
    p.add_argument("--k", type=int, default=1024)


def open_run(args: argparse.Namespace):
    """``(out folder, model, tokenizer, number of layers)`` of a benchmark run: --out created, --model loaded."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model, tok = load_causal_lm(args.model, dtype=args.dtype)
    return out, model, tok, num_layers(model)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/knnlm")
    add_forward_args(p)
    p.add_argument("--wiki-tokens", type=int, default=500_000, help="wiki train tokens in the datastore (0: all)")
    p.add_argument("--news-tokens", type=int, default=500_000, help="news train tokens in the datastore (0: all)")
    p.add_argument("--final-tokens", type=int, default=500_000, help="wiki tokens for the `final`-key datastore")
    p.add_argument("--fractions", type=float, nargs="+", default=[0.01, 0.03, 0.1, 0.3, 1.0])
    args = p.parse_args()
    t0 = time.perf_counter()
    out, model, tok, n_layers = open_run(args)
    specs = [FFN_IN.normalized(n_layers), FINAL.normalized(n_layers)]

    stores = {
        "wiki": datastore(args, model, tok, "wiki", FFN_IN, args.wiki_tokens, out / "ds-wiki-ffn_in"),
        "news": datastore(args, model, tok, "news", FFN_IN, args.news_tokens, out / "ds-news-ffn_in"),
        "wiki-final": datastore(args, model, tok, "wiki", FINAL, args.final_tokens, out / "ds-wiki-final"),
    }
    fw = {(c, s): forward(args, model, tok, c, s, specs, out) for c in ("wiki", "news") for s in ("valid", "test")}

    def dumps(corpus: str, name: str, ds: Datastore):
        return tuple(
            neighbours(*fw[(corpus, s)], ds, args.k, out / f"nb-{corpus}-{s}-{name}.npz") for s in ("valid", "test")
        )

    results: dict = {"config": vars(args), "datastores": {n: len(d) for n, d in stores.items()}}
    # main table + domain adaptation (Table 4) + key types (Table 5)
    rows = []
    for corpus, name in [
        ("wiki", "wiki"),
        ("wiki", "wiki-final"),
        ("news", "wiki"),
        ("news", "news"),
        ("news", "wiki-final"),
    ]:
        v, t = dumps(corpus, name, stores[name])
        r = tuned(v, t)
        r.update(
            eval=f"{corpus} test",
            datastore=name,
            key=stores[name].key_spec.describe(),
            datastore_entries=len(stores[name]),
        )
        rows.append(r)
        log(
            f"{corpus} with {name}: base {r['base_ppl']:.3f} kNN-LM {r['knn_ppl']:.3f} (λ={r['lambda']}, "
            f"τ={r['temperature']})"
        )
    results["rows"] = rows

    # perplexity vs k (Fig. 4) and vs λ (Fig. 5), on the in-domain and out-of-domain pairs
    sweeps = {}
    for corpus, name in [("wiki", "wiki"), ("news", "news"), ("news", "wiki")]:
        v, t = dumps(corpus, name, stores[name])
        best = fit_summary(fit_table(v, "rule", DEFAULT_TEMPERATURES))
        ks = [k for k in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024) if k <= args.k]
        sweeps[f"{corpus}|{name}"] = {
            "temperature": best["temperature"],
            "vs_k": [{"k": k, **tuned(v, t, k=k)} for k in ks],
            "vs_lambda": [
                {"lambda": lam, "ppl": perplexities(t, lam=lam, temperature=best["temperature"])["knn_ppl"]}
                for lam in DEFAULT_LAMBDAS
            ],
        }
    results["sweeps"] = sweeps

    # perplexity vs datastore size (Fig. 2): random subsamples of the wiki datastore
    size_rows = []
    for frac in args.fractions:
        if frac >= 1.0:
            ds = stores["wiki"]
        else:
            sub = out / f"ds-wiki-ffn_in-{frac:g}"
            ds = Datastore.open(sub) if (sub / "manifest.json").exists() else stores["wiki"].subsample(sub, frac)
            ensure_index(ds)
        v, t = dumps("wiki", "wiki" if frac >= 1.0 else f"wiki-{frac:g}", ds)
        r = tuned(v, t)
        size_rows.append({"fraction": frac, "entries": len(ds), **r})
        log(f"size {frac:g} ({len(ds)}): {r['knn_ppl']:.3f} (λ={r['lambda']})")
    results["vs_size"] = size_rows
    results["seconds"] = time.perf_counter() - t0
    atomic_write_json(out / "results.json", results)
    from knnlm_report import write_report  # noqa: E402 (benchmarks/ sibling)

    write_report(results, out)
    log(f"done in {results['seconds']:.0f} s: {out / 'results.json'}")


if __name__ == "__main__":
    main()
