"""Efficient kNN-LM at scale (docs/BENCHMARKS.md, "Efficient kNN-LM"): the base LM, the plain kNN-LM and each
efficiency option on the same test text, back to back, for datastores of growing size.

    python benchmarks/bench_efficient.py --datastore DS_100K --datastore DS_300K --datastore DS_1M \\
        --corpus wikitext2 --max-tokens 4096 --valid-tokens 4096 --out docs/results/efficient

For every datastore ``DS`` (a memlm datastore folder with its default IVF-PQ index; k = 1024):

1. setup, untimed: a valid dump (``--valid-tokens`` of the valid split) trains the adaptive gate (He et al. 2021)
   and tunes λ, τ for the plain kNN-LM; the datastore is pruned by greedy merging (``DS-pruned``, k_merge = 8) and
   a compressed index (``--compressed-factory``, e.g. OPQ + PQ32) is built, each once and cached;
2. timed, each configuration in a fresh process (so its peak RSS is its own) on the same test tokens: ``base``,
   ``knn``, ``adaptive`` (``--adaptive-fraction`` of tokens searched), ``pointer`` (``--pointer-min`` pointers),
   ``pipeline``, ``pruned``, ``compressed`` and the combinations in ``COMBOS``.

Each row: perplexity (λ, τ tuned on valid for the plain kNN-LM, the same values for every option but ``adaptive``,
whose gate gives λ per token), tokens/s of ``score_tokens`` (forward + queries + search + scores; the model is
loaded before the clock starts), the ratio to ``base``, the fraction of tokens searched and the peak RSS. Results:
``OUT/efficient.json``, the table ``OUT/efficient.md`` and ``OUT/efficient.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

CONFIGS = {
    "base": {},
    "knn": {},
    "adaptive": {"adaptive": True},
    "pointer": {"pointer": True},
    "pipeline": {"pipeline": True},
    "pruned": {"pruned": True},
    "compressed": {"compressed": True},
    "pruned+pipeline": {"pruned": True, "pipeline": True},
    "compressed+pipeline": {"compressed": True, "pipeline": True},
    "adaptive+pruned": {"adaptive": True, "pruned": True},
    "pointer+pruned": {"pointer": True, "pruned": True},
}


def one(args: argparse.Namespace) -> None:
    """Run one configuration in this process and print its JSON row."""
    from memlm.corpora import load_documents
    from memlm.datastore import Datastore
    from memlm.knnlm.evaluate import perplexities, score_tokens
    from memlm.resources import load_causal_lm
    from memlm.windows import limit_documents

    opts = CONFIGS[args.one]
    model, tok = load_causal_lm(args.model, dtype=args.dtype)
    docs = limit_documents(load_documents(args.corpus, "test"), tok, args.max_tokens)
    ds = None
    if args.one != "base":
        ds = Datastore.open(args.pruned_path if opts.get("pruned") else args.ds)
    setup = json.loads(Path(args.setup).read_text())
    kw = dict(
        adaptive=setup["gate"] if opts.get("adaptive") else None,
        adaptive_fraction=args.adaptive_fraction if opts.get("adaptive") else None,
        pointer_min=args.pointer_min if opts.get("pointer") else 0,
        pipeline=bool(opts.get("pipeline")),
        index_path=(setup["compressed_index"] if opts.get("compressed") else None),
    )
    if opts.get("compressed") and opts.get("pruned"):
        raise SystemExit("compressed and pruned are separate indexes")
    t0 = time.perf_counter()
    ts = score_tokens(model, tok, docs, ds, k=args.k, nprobe=args.nprobe, progress=False, **kw)
    seconds = time.perf_counter() - t0
    res = perplexities(ts, lam=setup["lambda"], temperature=setup["temperature"]) if ds is not None else {}
    row = {
        "config": args.one,
        "tokens": len(ts),
        "seconds": seconds,
        "tok_per_s": len(ts) / seconds,
        "ppl": res.get("knn_ppl", perplexities(ts)["base_ppl"]),
        "base_ppl": perplexities(ts)["base_ppl"],
        "searched_fraction": (float(ts.searched.mean()) if ts.searched is not None else (1.0 if ds else 0.0)),
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "seconds_forward": ts.meta.get("seconds_forward"),
        "seconds_search_after_forward": ts.meta.get("seconds_search"),
        "retrieval": ts.meta.get("retrieval"),
        "datastore_entries": len(ds) if ds is not None else None,
    }
    print("ROW " + json.dumps(row))


def setup(args: argparse.Namespace, ds_path: Path, out: Path) -> dict:
    """Gate, λ/τ, pruned datastore and compressed index for one datastore (cached in ``out``)."""
    from memlm.core.distribution import knn_target_logprob
    from memlm.corpora import load_documents
    from memlm.datastore import Datastore
    from memlm.knnlm.adaptive import gate_features, train_gate
    from memlm.knnlm.evaluate import score_tokens, tune
    from memlm.knnlm.prune import prune_datastore
    from memlm.resources import load_causal_lm
    from memlm.windows import limit_documents

    path = out / "setup.json"
    if path.exists():
        return json.loads(path.read_text())
    ds = Datastore.open(ds_path)
    model, tok = load_causal_lm(args.model, dtype=args.dtype)
    docs = limit_documents(load_documents(args.corpus, "valid"), tok, args.valid_tokens)
    valid = score_tokens(model, tok, docs, ds, k=args.k, nprobe=args.nprobe, progress=True)
    best = tune(valid)["best"]
    import torch

    knn = knn_target_logprob(torch.from_numpy(valid.knn_scores), torch.from_numpy(valid.knn_values.astype("int64")),
                             torch.from_numpy(valid.targets), best["temperature"])  # fmt: skip
    feats = gate_features(valid.lm_entropy, valid.lm_max_logprob, valid.position)
    gate = train_gate(feats, valid.lm_logprob, knn.numpy())
    gate.save(out / "gate.npz")
    t0 = time.perf_counter()
    pruned = out / "pruned"
    if not (pruned / "manifest.json").exists():
        prune_datastore(ds, pruned, k_merge=8, nprobe=args.nprobe)
        Datastore.open(pruned).build_index(factory=ds_factory(ds))
    prune_seconds = time.perf_counter() - t0
    t0 = time.perf_counter()
    compressed = out / "compressed.faiss"
    factory = compressed_factory(args.compressed_factory, ds_factory(ds))
    if not compressed.exists():
        ds.build_index(factory=factory, path=compressed)
    res = {
        "datastore": str(ds_path),
        "entries": len(ds),
        "pruned_entries": len(Datastore.open(pruned)),
        "lambda": best["lambda"],
        "temperature": best["temperature"],
        "valid_tokens": len(valid),
        "valid_knn_ppl": best["ppl"],
        "gate": str(out / "gate.npz"),
        "pruned": str(pruned),
        "prune_seconds": prune_seconds,
        "compressed_index": str(compressed),
        "compressed_factory": factory,
        "compressed_seconds": time.perf_counter() - t0,
    }
    path.write_text(json.dumps(res, indent=1))
    return res


def compressed_factory(template: str, base: str) -> str:
    """``template`` with ``{ivf}`` replaced by the datastore index's own ``IVF<nlist>`` (same coarse quantizer size)."""
    ivf = next((part for part in base.split(",") if part.startswith("IVF")), "IVF1024")
    return template.format(ivf=ivf)


def ds_factory(ds) -> str:
    from memlm import index as index_lib

    meta = index_lib.read_index_meta(ds.index_path)
    return meta["factory"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--datastore", action="append", default=[])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--corpus", default="wikitext2")
    p.add_argument("--max-tokens", type=int, default=4096)
    p.add_argument("--valid-tokens", type=int, default=4096)
    p.add_argument("--k", type=int, default=1024)
    p.add_argument("--nprobe", type=int, default=32)
    p.add_argument("--adaptive-fraction", type=float, default=0.5)
    p.add_argument("--pointer-min", type=int, default=16)
    p.add_argument("--compressed-factory", default="OPQ32_128,{ivf},PQ32")
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--out", default="docs/results/efficient")
    p.add_argument("--setup-only", action="store_true", help="prepare gates, pruned datastores, compressed indexes")
    p.add_argument("--one", help=argparse.SUPPRESS)
    p.add_argument("--ds", help=argparse.SUPPRESS)
    p.add_argument("--pruned-path", help=argparse.SUPPRESS)
    p.add_argument("--setup", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        return one(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results_path = out / "efficient.json"
    results = json.loads(results_path.read_text()) if results_path.exists() else {"runs": {}}
    results["command"] = " ".join([Path(sys.executable).name, *sys.argv])
    for ds_path in map(Path, args.datastore):
        work = Path(os.environ.get("MEMLM_BENCH_WORK", "/tmp/memlm-bench")) / ds_path.name
        work.mkdir(parents=True, exist_ok=True)
        st = setup(args, ds_path, work)
        if args.setup_only:
            continue
        rows = results["runs"].setdefault(ds_path.name, {"setup": st, "rows": {}})["rows"]
        for name in args.configs.split(","):
            cmd = [sys.executable, __file__, "--one", name, "--ds", str(ds_path), "--pruned-path", st["pruned"],
                   "--setup", str(work / "setup.json"), "--model", args.model, "--dtype", args.dtype, "--corpus",
                   args.corpus, "--max-tokens", str(args.max_tokens), "--k", str(args.k), "--nprobe", str(args.nprobe),
                   "--adaptive-fraction", str(args.adaptive_fraction),
                   "--pointer-min", str(args.pointer_min)]  # fmt: skip
            proc = subprocess.run(cmd, capture_output=True, text=True)
            line = next((x for x in proc.stdout.splitlines() if x.startswith("ROW ")), None)
            if line is None:
                print(proc.stderr[-3000:], file=sys.stderr)
                raise SystemExit(f"{name} on {ds_path} failed")
            rows[name] = json.loads(line[4:])
            rows[name]["load_avg"] = os.getloadavg()
            base = rows.get("base")
            if base:
                rows[name]["ratio_to_base"] = rows[name]["tok_per_s"] / base["tok_per_s"]
            print(f"{ds_path.name} {name}: {rows[name]['tok_per_s']:.1f} tok/s ppl {rows[name]['ppl']:.3f} "
                  f"searched {rows[name]['searched_fraction']:.2f}", flush=True)  # fmt: skip
            results_path.write_text(json.dumps(results, indent=1))
    if not args.setup_only:
        report(results, out)


def report(results: dict, out: Path) -> None:
    """Markdown table and the plot of tok/s ratio and perplexity against datastore size."""
    lines = ["| datastore | entries | config | ppl | tok/s | ratio to base | searched | peak RSS MiB |",
             "|---|---:|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    for name, run in results["runs"].items():
        for cfg, r in run["rows"].items():
            entries = r["datastore_entries"] or run["setup"]["entries"]
            lines.append(f"| {name} | {entries:,} | {cfg} | {r['ppl']:.3f} | {r['tok_per_s']:.1f} | "
                         f"{r.get('ratio_to_base', float('nan')):.2f} | {r['searched_fraction']:.2f} | "
                         f"{r['peak_rss_mib']:.0f} |")  # fmt: skip
    (out / "efficient.md").write_text("\n".join(lines) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    cfgs = sorted({c for run in results["runs"].values() for c in run["rows"]} - {"base"})
    for cfg in cfgs:
        xs, ys, ps = [], [], []
        for run in results["runs"].values():
            r = run["rows"].get(cfg)
            if r and "ratio_to_base" in r:
                xs.append(run["setup"]["entries"])
                ys.append(r["ratio_to_base"])
                ps.append(r["ppl"])
        order = sorted(range(len(xs)), key=xs.__getitem__)
        a1.plot([xs[i] for i in order], [ys[i] for i in order], marker="o", label=cfg)
        a2.plot([xs[i] for i in order], [ps[i] for i in order], marker="o", label=cfg)
    for a, yl in ((a1, "tokens/s ÷ base LM tokens/s"), (a2, "test perplexity")):
        a.set_xscale("log")
        a.set_xlabel("datastore entries")
        a.set_ylabel(yl)
        a.grid(alpha=0.3)
    a1.axhline(0.5, color="grey", ls="--", lw=0.8)
    a1.axhline(0.8, color="grey", ls=":", lw=0.8)
    a1.legend(fontsize=7)
    fig.suptitle("kNN-LM cost vs datastore size (SmolLM2-135M, k = 1024, 2 CPU cores)")
    fig.tight_layout()
    fig.savefig(out / "efficient.png", dpi=120)


if __name__ == "__main__":
    main()
