"""TRIME evaluation: local vs external memory tokens/s, back to back in one process (the protocol of
benchmarks/papers/trime/bench_trime_eval.py and docs/results/trime.md: TrimeLM_ext, the leading 10k tokens of
wiki+news test,
segments of 256 tokens, batches of 16 segments, top-1,024 of a 500k-entry ``IVF1024,Flat`` datastore, exact
``q.k/sqrt(d)`` rescoring, plus the long-term memory of M = 8 segments).

Runs, each timed ``--repeats`` times in turn (local, external, ...) and the best kept:

* ``local``: :func:`score_trime` with ``max_segments=0`` (the local memory);
* ``external``: the external memory as the code runs it now, nprobe 32 (the FAISS index is read once, before the
  timing: its read is reported as ``index_load_s``);
* ``external_legacy`` (``--legacy``): the earlier code, emulated in process: the index read by every
  score_trime call, the old rescoring (64 MiB blocks, NumPy float16 cast); its dump must be identical to
  ``external``'s (``legacy_identical``);
* ``external_nprobeN`` (``--nprobes 16 8 4``): the current code with fewer IVF lists probed. This changes the
  neighbours: each gets the share of nprobe-32 neighbours it keeps (``recall_vs_nprobe32``) and the test perplexity
  of the external memory (M = 8, tau = 1, lambda = 0, as ``memlm trime-eval`` reports it) next to nprobe 32's;
* ``external_dotindex_nprobeN`` (``--dot-index``): ``ext_scores="dot-index"``, q.k from the IVF-Flat index's own L2
  distances and the keys' norms instead of re-reading the 1,024 keys; at nprobe 32 it gets the largest score and
  log-probability differences to ``external`` (float32 rounding);
* ``external_IVF<n>_...`` (``--alt-index PATH --alt-nprobes 32 16``): another FAISS index over the same keys (e.g.
  ``IVF4096,Flat``), with both score modes;
* ``--exact-recall``: one untimed exact (brute-force) search gives every run's ``recall_vs_exact``.

    PYTHONPATH=src python benchmarks/speed/bench_trime_speed.py --model runs/trime/trimelm-ext/final \\
        --datastore runs/trime/ds-500k --legacy --nprobes 16 8 4 --json docs/results/speed/trime_local_vs_external.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import faiss
import numpy as np
import torch

from memlm.data.corpora import load_corpora
from memlm.data.windows import limit_documents
from memlm.models.resources import load_causal_lm
from memlm.storage import index as index_lib
from memlm.storage.datastore import Datastore
from memlm.trime import inference as ti
from memlm.trime.inference import score_trime, trime_perplexity

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from protocol import load_average, machine, save_result  # noqa: E402


def old_exact_scores(keys, ids, queries, metric):
    """memlm.storage.index.exact_scores as it was."""
    q = np.ascontiguousarray(queries, dtype=np.float32)
    nq, k = ids.shape
    d = q.shape[1]
    out = np.full((nq, k), -np.inf, dtype=np.float32)
    block = max(1, 64 * 1024**2 // (k * d * 4))
    for s in range(0, nq, block):
        e = min(s + block, nq)
        bids = ids[s:e]
        valid = bids >= 0
        if not valid.any():
            continue
        uniq, inv = np.unique(bids[valid], return_inverse=True)
        kv = np.ascontiguousarray(keys[uniq], dtype=np.float32)[inv]
        qv = np.broadcast_to(q[s:e, None, :], (*bids.shape, d))[valid]
        if metric == "l2":
            diff = qv - kv
            vals = -np.einsum("nd,nd->n", diff, diff)
        else:
            vals = np.einsum("nd,nd->n", qv, kv)
        out[s:e][valid] = vals
    return out


def legacy_external(model, tok, docs, ds, args):
    """score_trime's external memory as it was: the index read by the call, the old rescoring (the search is
    one call per segment, now as then)."""
    real_exact = index_lib.exact_scores
    index_lib.exact_scores = old_exact_scores
    try:
        return score_trime(model, tok, docs, args.seq_len, args.segments, datastore=ds, k=args.k, nprobe=32,
                           batch_size=args.batch_size)  # fmt: skip
    finally:
        index_lib.exact_scores = real_exact


def recall(a: np.ndarray, b: np.ndarray) -> float:
    """Mean share of b's valid neighbour ids (rows) that a also retrieves."""
    hits = total = 0
    for ra, rb in zip(a, b, strict=True):
        rb = rb[rb >= 0]
        hits += np.isin(rb, ra).sum()
        total += len(rb)
    return float(hits / max(total, 1))


def score_difference(a, b) -> dict[str, float]:
    """Largest |score difference| of the same (query, entry) pairs in two dumps, and the max |log-prob difference| of
    the external memory (M = 8, tau = 1)."""
    diffs = []
    for sa, va, sb, vb in zip(a.ext_scores, a.ext_values, b.ext_scores, b.ext_values, strict=True):
        oa, ob = np.argsort(va, kind="stable"), np.argsort(vb, kind="stable")
        same = va[oa] == vb[ob]
        ok = same & (va[oa] >= 0)
        if ok.any():
            diffs.append(np.abs(sa[oa][ok] - sb[ob][ok]).max())
    lp = ti.trime_target_logprobs(a, 8).numpy() - ti.trime_target_logprobs(b, 8).numpy()
    return {"max_abs_score_diff": float(max(diffs, default=0.0)), "max_abs_logprob_diff": float(np.abs(lp).max())}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--datastore", required=True, help="an ffn_in datastore of --model with an IVF index")
    p.add_argument("--corpus", default="wiki,news")
    p.add_argument("--split", default="test")
    p.add_argument("--max-tokens", type=int, default=10000)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--segments", type=int, default=8, help="M of the long-term memory (external runs)")
    p.add_argument("--k", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--legacy", action="store_true", help="also time the earlier code")
    p.add_argument("--nprobes", type=int, nargs="*", default=[], help="also time these nprobe values (not 32)")
    p.add_argument("--dot-index", action="store_true", help="also time ext_scores='dot-index' (each nprobe)")
    p.add_argument("--alt-index", default=None, help="another FAISS index of the datastore's keys (e.g. IVF4096,Flat)")
    p.add_argument("--alt-nprobes", type=int, nargs="*", default=[32], help="nprobe values for --alt-index")
    p.add_argument(
        "--exact-recall",
        action="store_true",
        help="also score once with exact search (untimed) and give each run's recall against it",
    )
    p.add_argument("--threads", type=int, default=None, help="torch and FAISS threads (default: theirs)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
        faiss.omp_set_num_threads(args.threads)
    load0 = load_average()
    model, tok = load_causal_lm(args.model, dtype=args.dtype)
    docs = limit_documents(load_corpora(args.corpus, args.split), tok, args.max_tokens)
    ds = Datastore.open(args.datastore)
    t0 = time.perf_counter()
    index = index_lib.load_index(ds.index_path, nprobe=32)
    index_load_s = time.perf_counter() - t0
    ivf = faiss.extract_index_ivf(index)
    m, bs = args.segments, args.batch_size
    dumps: dict[str, ti.TrimeScores] = {}

    def external(nprobe, ext_scores="dot"):
        def run():
            ivf.nprobe = nprobe
            return score_trime(model, tok, docs, args.seq_len, m, datastore=ds, k=args.k, batch_size=bs, index=index,
                               ext_scores=ext_scores)  # fmt: skip

        return run

    runs = {
        "local": lambda: score_trime(model, tok, docs, args.seq_len, 0, batch_size=bs),
        "external": external(32),
        **{f"external_nprobe{n}": external(n) for n in args.nprobes},
    }
    if args.dot_index:
        runs.update({f"external_dotindex_nprobe{n}": external(n, "dot-index") for n in (32, *args.nprobes)})
    if args.alt_index:
        alt = index_lib.load_index(args.alt_index, nprobe=32, expect=index_lib.expected_source(ds.index_path))
        alt_ivf = faiss.extract_index_ivf(alt)
        alt_name = f"IVF{alt_ivf.nlist}"

        def external_alt(nprobe, ext_scores):
            def run():
                alt_ivf.nprobe = nprobe
                return score_trime(model, tok, docs, args.seq_len, m, datastore=ds, k=args.k, batch_size=bs,
                                   index=alt, ext_scores=ext_scores)  # fmt: skip

            return run

        for n in args.alt_nprobes:
            runs[f"external_{alt_name}_nprobe{n}"] = external_alt(n, "dot")
            runs[f"external_{alt_name}_dotindex_nprobe{n}"] = external_alt(n, "dot-index")
    if args.legacy:
        runs["external_legacy"] = lambda: legacy_external(model, tok, docs, ds, args)
    score_trime(model, tok, docs[:2], args.seq_len, 0, batch_size=bs)  # warm-up (first-call allocations)
    best: dict[str, float] = {}
    for _ in range(args.repeats):
        for name, fn in runs.items():
            t = time.perf_counter()
            ts = fn()
            tps = len(ts) / (time.perf_counter() - t)
            best[name] = max(best.get(name, 0.0), tps)
            dumps[name] = ts
            print(f"{name:20s} {tps:,.0f} tok/s  load {load_average()[0]}", file=sys.stderr)
    ref = dumps["external"]
    exact = None
    if args.exact_recall:
        t = time.perf_counter()
        exact = score_trime(model, tok, docs, args.seq_len, m, datastore=ds, k=args.k, batch_size=bs, search="exact")
        print(f"exact search {time.perf_counter() - t:.0f} s", file=sys.stderr)
    quality = {}
    for name, ts in dumps.items():
        if name == "local":
            continue
        q = {"ppl_external_M8": trime_perplexity(ts, m)["ppl"], "seconds_search": ts.meta["seconds_search"]}
        if name != "external":
            q["recall_vs_nprobe32"] = recall(ts.ext_values, ref.ext_values)
            q["ppl_change_vs_nprobe32"] = q["ppl_external_M8"] / trime_perplexity(ref, m)["ppl"] - 1.0
        if name == "external_dotindex_nprobe32":
            q.update(score_difference(ts, ref))
        if exact is not None:
            q["recall_vs_exact"] = recall(ts.ext_values, exact.ext_values)
        quality[name] = q
    if exact is not None:
        quality["exact_search"] = {"ppl_external_M8": trime_perplexity(exact, m)["ppl"],
                                   "ppl_change_vs_nprobe32": trime_perplexity(exact, m)["ppl"]
                                   / trime_perplexity(ref, m)["ppl"] - 1.0}  # fmt: skip
    result = {
        "command": "PYTHONPATH=src python benchmarks/speed/bench_trime_speed.py " + " ".join(argv or sys.argv[1:]),
        "model": args.model,
        "datastore": args.datastore,
        "datastore_entries": len(ds),
        "index": ds.index_path.name,
        "index_factory": json.loads(index_lib.meta_path(ds.index_path).read_text()).get("factory"),
        "index_load_s": index_load_s,
        "tokens": len(ref),
        "seq_len": args.seq_len,
        "segments_external": m,
        "k": args.k,
        "batch_size": bs,
        "tokens_per_s": best,
        "local_over_external": best["local"] / best["external"],
        "quality": quality,
        "local_ppl_M0": trime_perplexity(dumps["local"], 0)["ppl"],
        "loadavg_before": load0,
        "loadavg_after": load_average(),
        "machine": machine(),
    }
    for name in best:
        if name.startswith("external_") and name != "external_legacy":
            result[f"local_over_{name}"] = best["local"] / best[name]
    if args.legacy:
        leg = dumps["external_legacy"]
        result["local_over_external_legacy"] = best["local"] / best["external_legacy"]
        result["external_speedup_vs_legacy"] = best["external"] / best["external_legacy"]
        result["legacy_identical"] = bool(
            np.array_equal(leg.ext_scores, ref.ext_scores) and np.array_equal(leg.ext_values, ref.ext_values)
        )
    print(json.dumps(result, indent=2))
    save_result(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
