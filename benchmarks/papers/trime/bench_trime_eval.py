"""Evaluation throughput of TRIME's memories (Zhong et al. 2022, App. A): tokens/s of the same segments scored with
no memory (the model's forward pass alone), the local memory, the long-term memory (M previous segments) and the
external memory (top-k of a datastore, plus the long-term memory), all with :func:`memlm.trime.inference.score_trime`
except the first. Each is timed ``--repeats`` times and the best kept.

    .venv/bin/python benchmarks/papers/trime/bench_trime_eval.py --model runs/trime/trimelm-ext/final \\
        --datastore runs/trime/ds-trimelm-ext --json docs/results/trime/eval_throughput.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from memlm.data.corpora import load_corpora
from memlm.data.windows import limit_documents
from memlm.models.resources import load_causal_lm
from memlm.storage.datastore import Datastore
from memlm.trime.batching import segment_documents
from memlm.trime.inference import score_trime
from memlm.trime.training import tokenize_for_trime

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from protocol import machine, save_result  # noqa: E402


@torch.inference_mode()
def forward_only(model, tokenizer, docs, seq_len: int, batch_size: int) -> int:
    """The forward passes score_trime makes, without any memory; returns the number of targets."""
    segments = [s for s in segment_documents(tokenize_for_trime(docs, tokenizer), seq_len - 1) if len(s.targets)]
    n = 0
    for i in range(0, len(segments), batch_size):
        batch = segments[i : i + batch_size]
        width = max(len(s.inputs) for s in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, s in enumerate(batch):
            ids[r, : len(s.inputs)] = torch.from_numpy(s.inputs)
            mask[r, : len(s.inputs)] = 1
        torch.logsumexp(model(input_ids=ids, attention_mask=mask, use_cache=False).logits.float(), -1)
        n += sum(len(s.targets) for s in batch)
    return n


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--datastore", required=True, help="an ffn_in datastore of --model (with its FAISS index)")
    p.add_argument("--corpus", default="wiki,news")
    p.add_argument("--split", default="test")
    p.add_argument("--max-tokens", type=int, default=20000)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--segments", type=int, default=8, help="M of the long-term memory")
    p.add_argument("--k", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    model, tok = load_causal_lm(args.model, dtype=args.dtype)
    docs = limit_documents(load_corpora(args.corpus, args.split), tok, args.max_tokens)
    ds = Datastore.open(args.datastore)
    m, bs = args.segments, args.batch_size
    runs = {
        "none": lambda: forward_only(model, tok, docs, args.seq_len, args.batch_size),
        "local": lambda: len(score_trime(model, tok, docs, args.seq_len, 0, batch_size=bs)),
        "long": lambda: len(score_trime(model, tok, docs, args.seq_len, m, batch_size=bs)),
        "external": lambda: len(score_trime(model, tok, docs, args.seq_len, m, datastore=ds, k=args.k, batch_size=bs)),
    }
    best: dict[str, float] = {}
    for _ in range(args.repeats):
        for name, fn in runs.items():
            t0 = time.perf_counter()
            n = fn()
            tps = n / (time.perf_counter() - t0)
            best[name] = max(best.get(name, 0.0), tps)
            print(f"{name:9s} {tps:,.0f} tok/s", file=sys.stderr)
    result = {
        "command": "PYTHONPATH=src python benchmarks/papers/trime/bench_trime_eval.py "
        + " ".join(argv or sys.argv[1:]),
        "model": args.model,
        "datastore_entries": len(ds),
        "tokens": n,
        "seq_len": args.seq_len,
        "segments": args.segments,
        "k": args.k,
        "tokens_per_s": best,
        "ratio_vs_none": {k: v / best["none"] for k, v in best.items()},
        "machine": machine(),
    }
    print(json.dumps(result, indent=2))
    save_result(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
