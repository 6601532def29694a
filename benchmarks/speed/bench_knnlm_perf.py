"""kNN-LM performance ratios, measured in one run (docs/results/performance.md):

    python benchmarks/speed/bench_knnlm_perf.py --out runs/perf

1. datastore build vs the forward pass alone over the same windows and batches (target <= 1.15x);
2. kNN-LM evaluation (forward + query capture + search) vs base evaluation (forward + LM log-probs);
3. memlm's ``search`` vs raw ``faiss.Index.search`` on the same index and queries (target >= 0.9x);
4. peak RSS of datastore builds over corpora of increasing size, each in a fresh process (should not grow).

Timing protocol: ``benchmarks/protocol.py`` (idle check first, or ``--force`` to record ``idle: false``; the machine
record; load averages and peak RSS beside each timed step). The record is written to ``OUT/perf.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import protocol  # noqa: E402

from memlm.data.corpora import load_documents
from memlm.data.windows import batched, limit_documents, sliding_windows, tokenize_documents
from memlm.knnlm.evaluate import add_neighbours, lm_scores
from memlm.knnlm.write import write_datastore
from memlm.models.forward import collate
from memlm.models.resources import load_causal_lm
from memlm.storage import index as index_lib

RSS_SCRIPT = """
import sys
from protocol import peak_rss_mib
from memlm.data.corpora import load_documents
from memlm.knnlm.write import write_datastore
from memlm.models.resources import load_causal_lm
from memlm.data.windows import limit_documents
model, tok = load_causal_lm(sys.argv[1], dtype=sys.argv[2])
docs = limit_documents(load_documents("wiki", "train"), tok, int(sys.argv[3]))
write_datastore(model, tok, docs, sys.argv[4], window=int(sys.argv[5]), min_context=int(sys.argv[6]), progress=False)
print(peak_rss_mib())
"""


def forward_only(model, tok, docs, window, min_context, batch_size) -> float:
    """What a user's own loop costs: the same windows and batches through ``model(...)``, nothing kept."""
    t0 = time.perf_counter()
    with torch.inference_mode():
        for batch in batched(sliding_windows(tokenize_documents(docs, tok), window, min_context), batch_size):
            ids, mask = collate(batch, tok.pad_token_id or 0)
            model(input_ids=ids, attention_mask=mask, use_cache=False)
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/perf")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--build-tokens", type=int, default=60_000)
    p.add_argument("--eval-tokens", type=int, default=10_000)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--min-context", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--k", type=int, default=1024)
    p.add_argument("--rss-tokens", type=int, nargs="+", default=[20_000, 80_000])
    p.add_argument("--force", action="store_true", help="time on a busy machine (recorded as idle: false)")
    p.add_argument("--wait-idle", type=float, default=600, help="seconds to wait for an idle machine")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res: dict = {
        "command": " ".join(["python", *sys.argv]),
        "config": vars(args),
        "idle": protocol.idle_check(args.force, args.wait_idle),
        "machine": protocol.machine(),
    }
    model, tok = load_causal_lm(args.model, dtype=args.dtype)
    docs = limit_documents(load_documents("wiki", "train"), tok, args.build_tokens)

    # 1. build vs forward alone (forward measured twice, before and after, to bound drift)
    fwd1 = forward_only(model, tok, docs, args.window, args.min_context, args.batch_size)
    with tempfile.TemporaryDirectory(dir=out) as tmp:
        t0 = time.perf_counter()
        ds = write_datastore(
            model,
            tok,
            docs,
            Path(tmp) / "ds",
            window=args.window,
            min_context=args.min_context,
            batch_size=args.batch_size,
            progress=False,
        )
        build = time.perf_counter() - t0
        n_entries = len(ds)
    fwd2 = forward_only(model, tok, docs, args.window, args.min_context, args.batch_size)
    fwd = min(fwd1, fwd2)
    res["build"] = {
        "entries": n_entries,
        "forward_s": [fwd1, fwd2],
        "build_s": build,
        "ratio": build / fwd,
        "entries_per_s": n_entries / build,
        "load_avg_after": protocol.load_average(),
    }
    print(f"build {build:.1f} s vs forward {fwd:.1f} s: {build / fwd:.3f}x ({n_entries} entries)", flush=True)

    # 2. eval: base vs kNN-LM, over a datastore built from the same text (index: default for its size)
    ds_dir = out / "ds"
    ds = write_datastore(
        model,
        tok,
        docs,
        ds_dir,
        window=args.window,
        min_context=args.min_context,
        batch_size=args.batch_size,
        progress=False,
    )
    if not ds.index_path.exists():
        index_lib.build_index(ds.keys, ds.index_path, progress=False)
    edocs = limit_documents(load_documents("wiki", "valid"), tok, args.eval_tokens)
    t0 = time.perf_counter()
    base, _, _ = lm_scores(model, tok, edocs, [], args.window, args.min_context, args.batch_size, progress=False)
    t_base = time.perf_counter() - t0
    t0 = time.perf_counter()
    ts, queries, _ = lm_scores(
        model, tok, edocs, [ds.key_spec], args.window, args.min_context, args.batch_size, progress=False
    )
    add_neighbours(ts, queries[ds.key_spec], ds, k=args.k, progress=False)
    t_knn = time.perf_counter() - t0
    res["eval"] = {
        "tokens": len(base),
        "base_s": t_base,
        "knn_s": t_knn,
        "ratio": t_knn / t_base,
        "search_s": ts.meta["seconds_search"],
        "index": index_lib.read_index_meta(ds.index_path)["factory"],
        "k": args.k,
        "base_tok_per_s": len(base) / t_base,
        "knn_tok_per_s": len(base) / t_knn,
        "load_avg_after": protocol.load_average(),
    }
    print(f"eval kNN-LM {t_knn:.1f} s vs base {t_base:.1f} s: {t_knn / t_base:.3f}x", flush=True)

    # 3. search overhead: memlm.storage.index.search vs raw faiss on the same index and queries
    index = index_lib.load_index(ds.index_path)
    q = np.ascontiguousarray(queries[ds.key_spec], dtype=np.float32)
    index.search(q[:64], args.k)  # warm-up
    raw, ours = [], []
    for _ in range(3):
        t0 = time.perf_counter()
        index.search(q, args.k)
        raw.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        index_lib.search(index, q, args.k)
        ours.append(time.perf_counter() - t0)
    res["search"] = {
        "queries": len(q),
        "k": args.k,
        "raw_qps": len(q) / min(raw),
        "memlm_qps": len(q) / min(ours),
        "ratio": min(raw) / min(ours),
        "load_avg_after": protocol.load_average(),
    }
    print(
        f"search: memlm {len(q) / min(ours):.0f} q/s vs raw {len(q) / min(raw):.0f} q/s ({min(raw) / min(ours):.3f}x)",
        flush=True,
    )

    # 4. peak RSS vs corpus size, each build in a fresh process
    rss = []
    for n in args.rss_tokens:
        with tempfile.TemporaryDirectory(dir=out) as tmp:
            r = subprocess.run(
                [
                    sys.executable,
                    "-c",
                    RSS_SCRIPT,
                    args.model,
                    args.dtype,
                    str(n),
                    str(Path(tmp) / "d"),
                    str(args.window),
                    str(args.min_context),
                ],
                capture_output=True,
                text=True,
                check=True,
                env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": os.pathsep.join(sys.path)},
            )
            rss.append({"tokens": n, "peak_rss_mib": float(r.stdout.strip().splitlines()[-1])})
            print(f"build of {n} tokens: peak RSS {rss[-1]['peak_rss_mib']:.0f} MiB", flush=True)
    res["rss"] = rss
    protocol.save_result(out / "perf.json", res)
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
