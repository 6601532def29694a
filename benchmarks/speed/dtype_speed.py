"""Forward speed of float32 vs bfloat16 on this machine, on memlm's evaluation forward pass (the choice of
``--dtype auto``).

Scores the same leading tokens of wiki test with SmolLM2-135M in each dtype (window 1024, min-context 512, batch 4,
float32 output head in both), after one warm-up window, and writes tokens/s and perplexity per dtype::

    python benchmarks/speed/dtype_speed.py --max-tokens 6000 --out docs/results/dtype_speed.json
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import torch

from memlm.core.distribution import perplexity
from memlm.data.corpora import load_documents
from memlm.data.windows import limit_documents
from memlm.io.fileio import atomic_write_json
from memlm.knnlm.evaluate import lm_scores
from memlm.models.resources import _cpu_has_native_bf16, default_dtype, load_causal_lm


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--max-tokens", type=int, default=6000)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    runs = {}
    for dtype in ("float32", "bfloat16"):
        model, tok = load_causal_lm(args.model, dtype=dtype)
        docs = limit_documents(load_documents("wiki", "test"), tok, args.max_tokens)
        lm_scores(model, tok, docs[:1], window=256, min_context=128, progress=False)  # warm-up
        t0 = time.perf_counter()
        ts, _, _ = lm_scores(model, tok, docs, window=1024, min_context=512, batch_size=4, progress=False)
        seconds = time.perf_counter() - t0
        runs[dtype] = {"tokens": len(ts), "seconds": seconds, "tokens_per_second": len(ts) / seconds,
                       "ppl": perplexity(ts.lm_logprob)}  # fmt: skip
        print(dtype, runs[dtype], flush=True)
    runs["bfloat16"]["speedup_vs_float32"] = (
        runs["bfloat16"]["tokens_per_second"] / runs["float32"]["tokens_per_second"]
    )
    runs["bfloat16"]["relative_ppl_difference"] = runs["bfloat16"]["ppl"] / runs["float32"]["ppl"] - 1
    atomic_write_json(
        args.out,
        {
            "command": f"python benchmarks/speed/dtype_speed.py --max-tokens {args.max_tokens} --out {args.out}",
            "runs": runs,
            "machine": {
                "cpus": os.cpu_count(),
                "torch_threads": torch.get_num_threads(),
                "processor": platform.processor(),
                "native_bf16": _cpu_has_native_bf16(),
                "loadavg_at_end": os.getloadavg(),
            },  # fmt: skip
            "default_dtype_here": default_dtype(),
        },
    )


if __name__ == "__main__":
    main()
