"""Efficient kNN-LM at scale (docs/results/efficient-knnlm.md): the base LM, the plain kNN-LM and each
efficiency option on the same test text, back to back, for contiguous-prefix datastores of growing size.

    # 100k and 300k entries: the first rows of the 1M datastore (contiguous prefixes keep RetoMaton's chains)
    python benchmarks/speed/bench_efficient.py prefix ds/wt2-1m --entries 100000 --out ds/wt2-100k \\
        --factory IVF1024,PQ64
    python benchmarks/speed/bench_efficient.py prefix ds/wt2-1m --entries 300000 --out ds/wt2-300k \\
        --factory IVF2048,PQ64
    # untimed setup (resumable, may run on a busy machine: it only computes perplexities)
    python benchmarks/speed/bench_efficient.py run --datastore ds/wt2-100k --datastore ds/wt2-300k \\
        --datastore ds/wt2-1m --setup-only --out docs/results/efficient
    # timed rows, one process at a time, each started only when nothing else uses the CPU
    python benchmarks/speed/bench_efficient.py run --datastore ... --out docs/results/efficient

For every datastore ``DS`` (a memlm datastore folder with its IVF-PQ index; k = 1024, nprobe 32):

1. setup, untimed and cached under ``$MEMLM_BENCH_WORK/<DS name>``: the datastore pruned by greedy merging (He et
   al. 2021, ``--k-merge``, seeded random visiting order), a compressed index (``--compressed-factory``, OPQ + PQ32
   over the same IVF), and one valid dump per retrieval variant (plain, pointer reuse, pruned, compressed, pointer
   over the pruned datastore) on which λ and τ are tuned **per variant**: one forward pass over ``--gate-tokens``
   (>= 50,000) WikiText-2 valid tokens, shared by every variant and datastore, then each variant's retrieval; the
   plain variant's dump also trains the adaptive gate;
2. timed, each configuration in a fresh process (so its peak RSS is its own) on the same ``--max-tokens`` test text
   (>= 20,000 scored tokens): ``base``, ``knn``, ``adaptive``, ``pointer``, ``pipeline``, ``pruned``,
   ``compressed`` and the combinations in ``CONFIGS``. Before each row the script waits until at most
   ``--idle-busy`` of the CPU was busy over 5 s (nothing else running) and records the 1-minute load average before
   and after and the CPU share used by other processes while the row ran (``other_cpu_share``).

Each row: perplexity with its variant's tuned λ, τ (``adaptive``: the gate's λ per token, the variant's τ),
tokens/s of ``score_tokens`` (forward + queries + search + scores; the model is loaded before the clock starts),
the ratio to ``base``, the fraction of tokens searched and the peak RSS. Results: ``OUT/efficient.json``, the table
``OUT/efficient.md`` and ``OUT/efficient.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from protocol import cpu_times, host, load_average, peak_rss_mib, wait_for_idle  # noqa: E402

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
# the retrieval variants whose valid dumps tune λ, τ (pipelining changes no result; the gate sets λ, not τ)
VARIANTS = {
    "knn": {},
    "pointer": {"pointer": True},
    "pruned": {"pruned": True},
    "compressed": {"compressed": True},
    "pointer+pruned": {"pointer": True, "pruned": True},
}


def variant_of(config: str) -> str:
    """The valid-dump variant whose tuned λ, τ a configuration uses."""
    opts = CONFIGS[config]
    key = tuple(o for o in ("pointer", "pruned", "compressed") if opts.get(o))
    for name, v in VARIANTS.items():
        if tuple(o for o in ("pointer", "pruned", "compressed") if v.get(o)) == key:
            return name
    raise KeyError(config)


def score_kwargs(opts: dict, args: argparse.Namespace, setup: dict) -> dict:
    """``score_tokens`` keyword arguments of a configuration (its datastore is chosen by the caller)."""
    kw = dict(
        k=args.k,
        nprobe=args.nprobe,
        pointer_min=args.pointer_min if opts.get("pointer") else 0,
        pipeline=bool(opts.get("pipeline")),
        index_path=setup["compressed_index"] if opts.get("compressed") else None,
    )
    if opts.get("adaptive"):
        kw.update(adaptive=setup["gate"], adaptive_fraction=args.adaptive_fraction)
    return kw


def one(args: argparse.Namespace) -> None:
    """Run one configuration in this process and print its JSON row."""
    import torch

    from memlm.data.corpora import load_documents
    from memlm.data.windows import limit_documents
    from memlm.knnlm.evaluate import perplexities
    from memlm.knnlm.scoring import score_tokens
    from memlm.models.resources import load_causal_lm
    from memlm.storage.datastore import Datastore

    opts = CONFIGS[args.one]
    setup = json.loads(Path(args.setup).read_text())
    model, tok = load_causal_lm(args.model, dtype=args.dtype)
    docs = limit_documents(load_documents(args.corpus, "test"), tok, args.max_tokens)
    ds = None
    if args.one != "base":
        ds = Datastore.open(setup["pruned"] if opts.get("pruned") else args.ds)
    kw = score_kwargs(opts, args, setup)
    t0 = time.perf_counter()
    ts = score_tokens(model, tok, docs, ds, progress=False, **kw)
    seconds = time.perf_counter() - t0
    base_ppl = perplexities(ts)["base_ppl"]
    tuned = setup["tuned"][variant_of(args.one)] if ds is not None else {}
    res = perplexities(ts, lam=tuned["lambda"], temperature=tuned["temperature"]) if ds is not None else {}
    row = {
        "config": args.one,
        "tokens": len(ts),
        "seconds": seconds,
        "tok_per_s": len(ts) / seconds,
        "ppl": res.get("knn_ppl", base_ppl),
        "base_ppl": base_ppl,
        "lambda": res.get("lambda"),
        "temperature": res.get("temperature"),
        "tuned_on": variant_of(args.one) if ds is not None else None,
        "searched_fraction": res.get("searched_fraction", 1.0 if ds else 0.0),
        "peak_rss_mib": peak_rss_mib(),
        "seconds_forward": ts.meta.get("seconds_forward"),
        "seconds_search_after_forward": ts.meta.get("seconds_search"),
        "torch_threads": torch.get_num_threads(),
        "retrieval": ts.meta.get("retrieval"),
        "datastore_entries": len(ds) if ds is not None else None,
    }
    if args.one == "knn":  # after the clock: the test dump, for mixing other memories in later (docs/results/ngram.md)
        ts.save(Path(args.setup).parent / "test-knn.npz")
    print("ROW " + json.dumps(row))


def setup(args: argparse.Namespace, ds_path: Path, work: Path) -> dict:
    """Pruned datastore, compressed index, per-variant valid dumps and tuned λ, τ, and the gate for one datastore,
    each step cached in ``work`` (a rerun continues where it stopped)."""

    from memlm.core.tuning import DEFAULT_TEMPERATURES
    from memlm.knnlm.adaptive import gate_features, train_gate
    from memlm.knnlm.evaluate import attach_neighbours
    from memlm.knnlm.prune import prune_datastore
    from memlm.knnlm.table import TokenTable
    from memlm.mixing.report import fit_summary, fit_table
    from memlm.retrieval import DatastoreMemory
    from memlm.storage.datastore import Datastore

    path = work / "setup.json"
    st = json.loads(path.read_text()) if path.exists() else {}
    st.setdefault("tuned", {})
    ds = Datastore.open(ds_path)

    def save() -> None:
        path.write_text(json.dumps(st, indent=1))

    pruned = work / "pruned"
    if "pruned" not in st:
        t0 = time.perf_counter()
        if not (pruned / "index.faiss").exists():
            if not (pruned / "manifest.json").exists():
                prune_datastore(ds, pruned, k_merge=args.k_merge, nprobe=args.nprobe, seed=args.seed)
            Datastore.open(pruned).build_index(factory=ds_factory(ds))
        st.update(pruned=str(pruned), pruned_entries=len(Datastore.open(pruned)), k_merge=args.k_merge,
                  prune_seed=args.seed, prune_seconds=time.perf_counter() - t0)  # fmt: skip
        save()
    compressed = work / "compressed.faiss"
    if "compressed_index" not in st:
        t0 = time.perf_counter()
        factory = compressed_factory(args.compressed_factory, ds_factory(ds))
        if not compressed.exists():
            ds.build_index(factory=factory, path=compressed)
        st.update(compressed_index=str(compressed), compressed_factory=factory,
                  compressed_seconds=time.perf_counter() - t0)  # fmt: skip
        save()
    st.update(datastore=str(ds_path), entries=len(ds), factory=ds_factory(ds))
    valid_lm = queries = provenance = None
    for name, opts in VARIANTS.items():
        dump = work / f"valid-{name}.npz"
        if name in st["tuned"]:
            continue
        if dump.exists():
            valid = TokenTable.load(dump)
        else:
            if valid_lm is None:
                valid_lm, queries, provenance = valid_forward(args, ds, work.parent / "valid-forward")
            use = Datastore.open(st["pruned"]) if opts.get("pruned") else ds
            kw = score_kwargs(opts, args, st)
            memory = DatastoreMemory(use, nprobe=args.nprobe, index_path=kw["index_path"], progress=True)
            valid = valid_lm.select()
            attach_neighbours(valid, queries, memory, args.k, pointer_min=kw["pointer_min"])
            valid.save(dump)
        best = fit_summary(fit_table(valid, "rule", DEFAULT_TEMPERATURES))  # λ by EM at each τ, the most likely
        st["tuned"][name] = {"lambda": best["knn"], "temperature": best["temperature"], "valid_ppl": best["ppl"],
                             "valid_tokens": len(valid), "dump": str(dump)}  # fmt: skip
        print(f"{ds_path.name} {name}: λ {best['knn']:.4g} τ {best['temperature']} valid ppl {best['ppl']:.3f} "
              f"on {len(valid):,} tokens", flush=True)  # fmt: skip
        save()
    if "gate" not in st:
        valid = TokenTable.load(work / "valid-knn.npz")
        tau = st["tuned"]["knn"]["temperature"]
        knn = valid.logprob("knn", temperature=tau).float()
        feats = gate_features(valid.lm_entropy, valid.lm_max_logprob, valid.position)
        gate = train_gate(feats, valid.lm_logprob, knn.numpy())
        gate.save(work / "gate.npz")
        st.update(gate=str(work / "gate.npz"), gate_tokens=len(valid), gate_temperature=tau)
        save()
    return st


def valid_forward(args: argparse.Namespace, ds, cache: Path):
    """One forward pass over ``--gate-tokens`` WikiText-2 valid tokens (cached in ``cache``): the LM scores, the
    queries of the datastore's key and the provenance, shared by every variant and datastore (same model and key)."""
    import numpy as np

    from memlm.data.corpora import load_documents
    from memlm.data.windows import limit_documents
    from memlm.knnlm.evaluate import lm_scores
    from memlm.knnlm.table import TokenTable
    from memlm.models.resources import load_causal_lm

    spec = ds.key_spec
    tag = f"{args.model}-{spec.describe()}-{args.gate_tokens}".replace("/", "_").replace("@", "_")
    cache.mkdir(parents=True, exist_ok=True)
    lm_path, q_path, p_path = cache / f"{tag}-lm.npz", cache / f"{tag}-queries.npy", cache / f"{tag}-prov.npz"
    if not (lm_path.exists() and q_path.exists() and p_path.exists()):
        model, tok = load_causal_lm(args.model, dtype=args.dtype)
        ds.check_compatible(model, tok)
        docs = limit_documents(load_documents(args.corpus, "valid"), tok, args.gate_tokens)
        ts, queries, prov = lm_scores(model, tok, docs, [spec], progress=True)
        np.savez(p_path, **prov)
        np.save(q_path, queries[spec])
        ts.save(lm_path)  # last: its presence marks the cache complete
    prov = dict(np.load(p_path))
    return TokenTable.load(lm_path), np.load(q_path, mmap_mode="r"), prov


def compressed_factory(template: str, base: str) -> str:
    """``template`` with ``{ivf}`` replaced by the datastore index's own ``IVF<nlist>`` (same coarse quantizer size)."""
    ivf = next((part for part in base.split(",") if part.startswith("IVF")), "IVF1024")
    return template.format(ivf=ivf)


def ds_factory(ds) -> str:
    from memlm.storage import index as index_lib

    meta = index_lib.read_index_meta(ds.index_path)
    return meta["factory"]


def prefix(args: argparse.Namespace) -> None:
    """The first ``--entries`` rows of a datastore as a new datastore, with its own index."""
    import numpy as np

    from memlm.storage.datastore import Datastore

    src = Datastore.open(args.source)
    if args.entries > len(src):
        raise SystemExit(f"{args.source} has {len(src):,} entries, fewer than --entries {args.entries:,}")
    out = Path(args.out)
    if not (out / "manifest.json").exists():
        src.write_rows(out, np.arange(args.entries), {"prefix": {"of": str(src.path), "entries": args.entries}},
                       "write a prefix datastore")  # fmt: skip
    ds = Datastore.open(out)
    if not ds.index_path.exists():
        ds.build_index(factory=args.factory)
    print(f"{out}: {len(ds):,} entries, index {ds_factory(ds)}")


def run(args: argparse.Namespace) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results_path = out / "efficient.json"
    results = json.loads(results_path.read_text()) if results_path.exists() else {"runs": {}}
    results["command"] = " ".join([Path(sys.executable).name, *sys.argv])
    results["machine"] = {**host(), "idle_busy_limit": args.idle_busy, "idle_load_limit": args.idle_load}
    for ds_path in map(Path, args.datastore):
        root = os.environ.get("MEMLM_BENCH_WORK", os.path.join(tempfile.gettempdir(), "memlm-bench"))
        work = Path(root) / ds_path.name
        work.mkdir(parents=True, exist_ok=True)
        st = setup(args, ds_path, work)
        if args.setup_only:
            continue
        rows = results["runs"].setdefault(ds_path.name, {"setup": st, "rows": {}})
        rows["setup"] = st
        rows = rows["rows"]
        for name in args.configs.split(","):
            if name in rows and not args.rerun:
                continue
            cmd = [sys.executable, __file__, "run", "--one", name, "--ds", str(ds_path),
                   "--setup", str(work / "setup.json"), "--model", args.model, "--dtype", args.dtype, "--corpus",
                   args.corpus, "--max-tokens", str(args.max_tokens), "--k", str(args.k), "--nprobe", str(args.nprobe),
                   "--adaptive-fraction", str(args.adaptive_fraction),
                   "--pointer-min", str(args.pointer_min)]  # fmt: skip
            idle = wait_for_idle(args.idle_busy, args.idle_load)
            busy0, _ = cpu_times()
            child0 = resource.getrusage(resource.RUSAGE_CHILDREN)
            w0 = time.time()
            proc = subprocess.run(cmd, capture_output=True, text=True)
            wall = time.time() - w0
            child1 = resource.getrusage(resource.RUSAGE_CHILDREN)
            busy1, _ = cpu_times()
            child_cpu = (child1.ru_utime + child1.ru_stime) - (child0.ru_utime + child0.ru_stime)
            line = next((x for x in proc.stdout.splitlines() if x.startswith("ROW ")), None)
            if line is None:
                print(proc.stderr[-3000:], file=sys.stderr)
                raise SystemExit(f"{name} on {ds_path} failed")
            row = json.loads(line[4:])
            row.update(idle)
            row["load_avg_after"] = load_average()
            # CPU used by anything but this row's process while it ran, as a share of all cores
            row["other_cpu_share"] = max(0.0, (busy1 - busy0) - child_cpu) / (wall * (os.cpu_count() or 1))
            rows[name] = row
            base = rows.get("base")
            if base:
                row["ratio_to_base"] = row["tok_per_s"] / base["tok_per_s"]
            print(f"{ds_path.name} {name}: {row['tok_per_s']:.1f} tok/s ppl {row['ppl']:.3f} "
                  f"searched {row['searched_fraction']:.2f} load {idle['load_avg_before']:.2f} "
                  f"other CPU {row['other_cpu_share']:.1%}", flush=True)  # fmt: skip
            results_path.write_text(json.dumps(results, indent=1))
    if not args.setup_only:
        report(results, out)


def report(results: dict, out: Path) -> None:
    """Markdown table and the plot of tok/s ratio and perplexity against datastore size."""
    lines = ["| datastore | entries | config | λ | τ | ppl | vs kNN-LM | tok/s | ratio to base | searched | "
             "peak RSS MiB | load before | other CPU |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for name, run_ in results["runs"].items():
        knn = run_["rows"].get("knn", {}).get("ppl")
        for cfg, r in run_["rows"].items():
            entries = r["datastore_entries"] or run_["setup"]["entries"]
            lam = r.get("lambda")
            lam_s = "-" if lam is None else (lam if isinstance(lam, str) else f"{lam:g}")
            tau = "-" if r.get("temperature") is None else f"{r['temperature']:g}"
            rel = "-" if knn is None or cfg == "base" else f"{100 * (r['ppl'] / knn - 1):+.2f}%"
            lines.append(f"| {name} | {entries:,} | {cfg} | {lam_s} | {tau} | {r['ppl']:.3f} | {rel} | "
                         f"{r['tok_per_s']:.1f} | {r.get('ratio_to_base', float('nan')):.2f} | "
                         f"{r['searched_fraction']:.2f} | {r['peak_rss_mib']:.0f} | "
                         f"{r.get('load_avg_before', float('nan')):.2f} | "
                         f"{100 * r.get('other_cpu_share', float('nan')):.1f}% |")  # fmt: skip
    (out / "efficient.md").write_text("\n".join(lines) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    cfgs = sorted({c for run_ in results["runs"].values() for c in run_["rows"]} - {"base"})
    for cfg in cfgs:
        xs, ys, ps = [], [], []
        for run_ in results["runs"].values():
            r = run_["rows"].get(cfg)
            if r and "ratio_to_base" in r:
                xs.append(run_["setup"]["entries"])
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
    a1.axhline(0.8, color="grey", ls=":", lw=0.8)
    a1.legend(fontsize=7)
    fig.suptitle("kNN-LM cost vs datastore size (SmolLM2-135M, k = 1024, 2 CPU cores)")
    fig.tight_layout()
    fig.savefig(out / "efficient.png", dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    pre = sub.add_parser("prefix", help="the first N rows of a datastore as a new datastore")
    pre.add_argument("source")
    pre.add_argument("--entries", type=int, required=True)
    pre.add_argument("--out", required=True)
    pre.add_argument("--factory", default=None)
    r = sub.add_parser("run", help="setup and timed rows")
    r.add_argument("--datastore", action="append", default=[])
    r.add_argument("--model", default="smollm2-135m")
    r.add_argument("--dtype", default="auto")
    r.add_argument("--corpus", default="wikitext2")
    r.add_argument("--max-tokens", type=int, default=24000, help="test token budget (>= 20,000 scored tokens)")
    r.add_argument(
        "--gate-tokens",
        type=int,
        default=52000,
        help="valid tokens (one forward pass) on which every variant's λ, τ are tuned and the gate trained",
    )
    r.add_argument("--k", type=int, default=1024)
    r.add_argument("--nprobe", type=int, default=32)
    r.add_argument("--k-merge", type=int, default=8)
    r.add_argument("--seed", type=int, default=0, help="greedy merging's visiting order")
    r.add_argument("--adaptive-fraction", type=float, default=0.5)
    r.add_argument("--pointer-min", type=int, default=16)
    r.add_argument("--compressed-factory", default="OPQ32_128,{ivf},PQ32")
    r.add_argument("--configs", default=",".join(CONFIGS))
    r.add_argument("--out", default="docs/results/efficient")
    r.add_argument(
        "--idle-busy",
        type=float,
        default=0.05,
        help="before a row, wait until at most this share of the CPU was busy over 5 s (nothing else runs)",
    )
    r.add_argument(
        "--idle-load",
        type=float,
        default=None,
        help="also wait for the 1-minute load average to fall below this (it lags: see wait_for_idle)",
    )
    r.add_argument("--rerun", action="store_true", help="rerun rows already in the JSON")
    r.add_argument("--setup-only", action="store_true", help="only the untimed setup")
    r.add_argument("--one", help=argparse.SUPPRESS)
    r.add_argument("--ds", help=argparse.SUPPRESS)
    r.add_argument("--setup", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.cmd == "prefix":
        return prefix(args)
    if args.one:
        return one(args)
    return run(args)


if __name__ == "__main__":
    main()
