"""Greedy-merging sweep (docs/results/efficient-knnlm.md, "Pruning: entries kept against perplexity"): how many
entries greedy
merging (He et al. 2021 Sec. 5.2, :mod:`memlm.knnlm.prune`) removes at growing ``k_merge``, and what it costs.

    python benchmarks/quality/prune_sweep.py --datastore DS --work WORK --out docs/results/prune_sweep/NAME.json \\
        --k-merge 8 16 32 64 128 256 --valid-tokens 12288 --test-tokens 20000

Protocol (the same for the unpruned reference and every pruned datastore):

1. one forward pass of the datastore's model over the first ``--valid-tokens`` tokens of the corpus's valid split and
   the first ``--test-tokens`` of its test split (default windows: 1,024 tokens advancing by 512), cached in WORK;
2. each datastore is searched with its own FAISS index (the source's factory, rebuilt on the pruned entries), k
   neighbours, ``--nprobe``, the index's scores; merged counts enter the kNN softmax as w * exp(s / tau);
3. the rule's λ is fitted on the valid tokens by EM at each τ of ``DEFAULT_TEMPERATURES``, the most likely kept
   (:func:`memlm.mixing.report.fit_table`), and the test perplexity is computed with them.

``k_merge`` grows through the list until half of the entries are gone or the test perplexity is more than
``--max-cost`` (default 1%) above the unpruned reference's (that row is kept; ``--all`` runs the whole list). Pruned
datastores are written to ``WORK/pruned-k{K}-s{seed}`` and reused when their manifest matches; the JSON is rewritten
after every row, so an interrupted sweep resumes where it stopped. Wall-clock seconds of pruning and of the index
build are recorded as such (a loaded machine's times, not measurements of speed).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from protocol import load_average  # noqa: E402


def _take_tokens(docs: list, tok, n: int) -> list:
    """The leading documents holding ``n`` tokens, the last one cut (:func:`memlm.data.windows.truncate_document`)."""
    from memlm.data.windows import limit_documents, tokenize_documents, truncate_document

    kept = limit_documents(docs, tok, n)
    total = sum(len(c.tokens) for c in tokenize_documents(kept, tok))
    if total < n and len(kept) < len(docs) and n - total > 1:
        kept.append(truncate_document(docs[len(kept)], tok, n - total))
    return kept


def _forward(args: argparse.Namespace, ds, split: str, n_tokens: int):
    """LM scores and queries of ``n_tokens`` of ``split``, cached in WORK (``ds`` None: ``--model`` / ``--key``)."""
    import numpy as np

    from memlm.data.corpora import load_documents
    from memlm.knnlm.evaluate import lm_scores
    from memlm.knnlm.table import TokenTable
    from memlm.models.resources import load_causal_lm

    work = Path(args.work)
    dump, qfile = work / f"lm-{split}-{n_tokens}.npz", work / f"queries-{split}-{n_tokens}.npy"
    if dump.exists() and qfile.exists():
        ts = TokenTable.load(dump)
        if ds is not None and (ts.meta.get("model"), ts.meta.get("key")) != (ds.model_name, ds.key_spec.describe()):
            raise SystemExit(f"{dump} was made with {ts.meta.get('model')} {ts.meta.get('key')}, not the datastore's")
        return ts, np.load(qfile)
    from memlm.models.keys import KeySpec, num_layers

    name = ds.model_name if ds is not None else args.model
    model, tok = load_causal_lm(name, dtype=args.dtype)
    spec = ds.key_spec if ds is not None else KeySpec.parse(args.key).normalized(num_layers(model))
    if ds is not None:
        ds.check_compatible(model, tok)
    docs = _take_tokens(load_documents(args.corpus, split), tok, n_tokens)
    meta = {"model": name, "key": spec.describe(), "corpus": args.corpus, "split": split, "max_tokens": n_tokens,
            "dtype": args.dtype}  # fmt: skip
    ts, queries, _ = lm_scores(model, tok, docs, [spec], window=args.window, min_context=args.min_context,
                               batch_size=args.batch_size, meta=meta)  # fmt: skip
    q = queries[spec].astype(np.float32)
    np.save(qfile.with_suffix(".tmp.npy"), q)
    os.replace(qfile.with_suffix(".tmp.npy"), qfile)
    ts.save(dump)
    return ts, q


def _evaluate(args: argparse.Namespace, ds, valid, test) -> dict[str, Any]:
    """Search ``ds``, fit the rule's λ (EM) and τ on valid, the test perplexity with them."""
    import numpy as np

    from memlm.core.tuning import DEFAULT_TEMPERATURES
    from memlm.knnlm.evaluate import perplexities
    from memlm.mixing.datastore import DatastoreComponent
    from memlm.mixing.report import fit_summary, fit_table
    from memlm.retrieval import DatastoreMemory

    memory = DatastoreMemory(ds, "index", "index", args.nprobe, progress=True)
    dumps = {}
    for name, (ts0, q) in (("valid", valid), ("test", test)):
        r = memory.search(q, args.k)
        ts = ts0.select()
        columns = {"scores": r.scores, "values": r.values.astype(np.int32)}
        if r.log_counts is not None:
            columns["log_counts"] = r.log_counts
        ts.add(DatastoreComponent(memory, args.k), columns)
        dumps[name] = ts
    best = fit_summary(fit_table(dumps["valid"], "rule", DEFAULT_TEMPERATURES))
    res = perplexities(dumps["test"], lam=best["knn"], temperature=best["temperature"])
    pruned = "log_counts" in dumps["test"].columns["knn"]
    authors = _authors_weighting(dumps["valid"], dumps["test"]) if pruned else None
    edge = {"temperature": best["temperature"] in (min(DEFAULT_TEMPERATURES), max(DEFAULT_TEMPERATURES))}
    return {
        "entries": len(ds),
        "lambda": best["knn"],
        "temperature": best["temperature"],
        "on_grid_edge": edge,
        "valid_ppl": best["ppl"],
        "test_ppl": res["knn_ppl"],
        "test_base_ppl": res["base_ppl"],
        "target_in_neighbours": res["target_in_neighbours"],
        "test_tokens": res["tokens"],
        "valid_tokens": len(dumps["valid"]),
        **({"authors_weighting": authors} if authors is not None else {}),
    }


def _authors_weighting(valid, test) -> dict[str, Any]:
    """He et al.'s code weights a merged entry by softmax((s + log w) / tau), i.e. w ** (1 / tau): the same tuning
    and test with that weighting, for comparison with memlm's w * exp(s / tau)."""
    import torch

    from memlm.core.distribution import mix, perplexity
    from memlm.core.mixture import fit_constant
    from memlm.core.tuning import DEFAULT_TEMPERATURES
    from memlm.mixing.inputs import memory_logprob

    def knn(ts, t):
        knn = ts.columns["knn"]
        return memory_logprob(knn["scores"], knn["values"], ts.targets, t, None, knn["log_counts"] / t)

    def ppl(ts, knn_lp, lam):
        return perplexity(mix([torch.from_numpy(ts.lm_logprob), knn_lp], weights=[1.0 - lam, lam]))

    best = (float("inf"), None, None)
    for t in DEFAULT_TEMPERATURES:  # λ by EM at each τ (memlm.core.mixture.fit_constant), the most likely τ kept
        k_lp = knn(valid, t)
        lam = float(fit_constant(torch.stack([torch.from_numpy(valid.lm_logprob).double(), k_lp.double()], 1))[0][1])
        best = min(best, (ppl(valid, k_lp, lam), lam, t), key=lambda x: x[0])
    valid_ppl, lam, t = best
    return {"lambda": lam, "temperature": t, "valid_ppl": valid_ppl, "test_ppl": ppl(test, knn(test, t), lam)}


def _pruned(args: argparse.Namespace, src, k_merge: int) -> tuple[Any, dict[str, Any]]:
    """The datastore pruned with ``k_merge`` (reused when its manifest matches) and its index."""
    from memlm.knnlm.prune import prune_datastore
    from memlm.storage.datastore import Datastore
    from memlm.storage.index import read_index_meta

    out = Path(args.work) / f"pruned-k{k_merge}-s{args.seed}"
    info: dict[str, Any] = {}
    ds = None
    if (out / "manifest.json").exists():
        ds = Datastore.open(out)
        rec = ds.manifest.get("pruned", {})
        same = (rec.get("of_count"), rec.get("k_merge"), rec.get("seed")) == (len(src), k_merge, args.seed)
        if not same or read_index_meta(ds.index_path) is None:
            ds = None
    if ds is None:
        t0 = time.perf_counter()
        ds = prune_datastore(src, out, k_merge=k_merge, nprobe=args.nprobe, seed=args.seed, overwrite=True)
        info["prune_wall_clock_seconds"] = round(time.perf_counter() - t0, 1)
        meta = read_index_meta(src.index_path)
        t0 = time.perf_counter()
        ds.build_index(factory=meta["factory"], metric=meta["metric"])
        info["index_wall_clock_seconds"] = round(time.perf_counter() - t0, 1)
        info["factory"] = meta["factory"]
    else:
        info["prune_wall_clock_seconds"] = ds.manifest["pruned"].get("seconds")
        info["reused"] = str(out)
    info["pruned_path"] = str(out)
    return Datastore.open(out), info


def _write(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--datastore", help="the unpruned datastore (with its index)")
    p.add_argument("--forward-only", action="store_true", help="only the cached forward passes (--model, --key)")
    p.add_argument("--model", default="smollm2-135m", help="with --forward-only: the datastore's model")
    p.add_argument("--key", default="ffn_in", help="with --forward-only: the datastore's key spec")
    p.add_argument("--work", required=True, help="folder for the pruned datastores and the cached forward passes")
    p.add_argument("--out", help="the JSON result (rewritten after every row)")
    p.add_argument("--k-merge", type=int, nargs="+", default=[8, 16, 32, 64, 128, 256])
    p.add_argument("--all", action="store_true", help="run every k_merge (no stop at half the entries / the cost)")
    p.add_argument("--max-cost", type=float, default=0.01, help="stop once test ppl exceeds the reference by this")
    p.add_argument("--seed", type=int, default=0, help="the visiting order's seed (He et al.: random order)")
    p.add_argument("--corpus", default="wikitext2")
    p.add_argument("--valid-tokens", type=int, default=12288)
    p.add_argument("--test-tokens", type=int, default=20000)
    p.add_argument("--k", type=int, default=1024)
    p.add_argument("--nprobe", type=int, default=32)
    p.add_argument("--window", type=int, default=1024)
    p.add_argument("--min-context", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--dtype", default="auto")
    args = p.parse_args(argv)

    from memlm.storage.datastore import Datastore
    from memlm.storage.index import read_index_meta

    Path(args.work).mkdir(parents=True, exist_ok=True)
    if args.forward_only:
        _forward(args, None, "valid", args.valid_tokens)
        _forward(args, None, "test", args.test_tokens)
        return
    if not args.datastore or not args.out:
        p.error("--datastore and --out are required (unless --forward-only)")
    src = Datastore.open(args.datastore)
    meta = read_index_meta(src.index_path) or {}
    out = Path(args.out)
    setup = {
        "datastore": str(src.path),
        "entries": len(src),
        "model": src.model_name,
        "key": src.key_spec.describe(),
        "index": {key: meta.get(key) for key in ("factory", "metric", "n", "d")},
        "corpus": args.corpus,
        "valid_tokens_budget": args.valid_tokens,
        "test_tokens_budget": args.test_tokens,
        "k": args.k,
        "nprobe": args.nprobe,
        "window": args.window,
        "min_context": args.min_context,
        "dtype": args.dtype,
        "seed": args.seed,
        "max_cost": args.max_cost,
        "weighting": "w * exp(s / tau) (memlm.core.distribution.knn_weights)",
        "command": "python benchmarks/quality/prune_sweep.py " + " ".join(sys.argv[1:] if argv is None else argv),
    }
    data = json.loads(out.read_text()) if out.exists() else {}
    if data.get("setup", {}).get("datastore") != setup["datastore"] or data.get("setup", {}).get("seed") != args.seed:
        data = {"setup": setup, "reference": None, "rows": []}
    data["setup"].update(command=setup["command"], load_average=load_average())

    valid = _forward(args, src, "valid", args.valid_tokens)
    test = _forward(args, src, "test", args.test_tokens)
    if data["reference"] is None:
        data["reference"] = _evaluate(args, src, valid, test)
        _write(out, data)
    ref = data["reference"]["test_ppl"]
    print(f"reference: {len(src):,} entries, test ppl {ref:.4f}", file=sys.stderr)
    done = {r["k_merge"]: r for r in data["rows"]}
    for k_merge in args.k_merge:
        row = done.get(k_merge)
        if row is None:
            ds, info = _pruned(args, src, k_merge)
            row = {"k_merge": k_merge, **_evaluate(args, ds, valid, test), **info}
            row["kept_fraction"] = row["entries"] / len(src)
            row["cost"] = row["test_ppl"] / ref - 1.0
            data["rows"] = sorted([*data["rows"], row], key=lambda r: r["k_merge"])
            _write(out, data)
        print(f"k_merge {k_merge}: {row['entries']:,} entries ({row['kept_fraction']:.1%}), test ppl "
              f"{row['test_ppl']:.4f} ({row['cost']:+.2%})", file=sys.stderr)  # fmt: skip
        if not args.all and (row["kept_fraction"] <= 0.5 or row["cost"] > args.max_cost):
            break


if __name__ == "__main__":
    main()
