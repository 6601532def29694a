"""bf16 body vs float32: SmolLM2-135M perplexity on the same text.

memlm computes the output projection and log-softmax in float32 whatever the body's dtype
(memlm.models.forward.fp32_head). This script scores the same leading tokens of wiki test with the model in float32 and
in bfloat16 and writes both perplexities, their relative difference and the per-token log-prob differences:

    OMP_NUM_THREADS=2 python benchmarks/quality/precision.py --out docs/results/precision_bf16_vs_fp32.json

Also scored: the bf16 body with the model's own bf16 logits (the behaviour before the fp32 head), for comparison.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
import torch

from memlm.core.distribution import perplexity
from memlm.data.corpora import load_documents
from memlm.data.windows import limit_documents
from memlm.io.fileio import atomic_write_json
from memlm.knnlm.evaluate import lm_scores
from memlm.models.forward import fp32_head
from memlm.models.resources import load_causal_lm


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--corpus", default="wiki")
    p.add_argument("--split", default="test")
    p.add_argument("--max-tokens", type=int, default=20_000)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--min-context", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.set_num_threads(2)
    runs, scores = {}, {}
    for name, dtype in (("float32", "float32"), ("bfloat16", "bfloat16"), ("bfloat16_bf16_logits", "bfloat16")):
        model, tok = load_causal_lm(args.model, dtype=dtype)
        docs = limit_documents(load_documents(args.corpus, args.split), tok, args.max_tokens)
        t0 = time.perf_counter()
        if name == "bfloat16_bf16_logits":  # turn the float32 head off: the model's own bf16 logits
            orig = fp32_head.__init__

            def no_head(self, model, *args, _orig=orig, **kwargs):
                _orig(self, model, *args, **kwargs)
                self.head = None

            fp32_head.__init__ = no_head
            try:
                ts, _, _ = lm_scores(model, tok, docs, [], args.window, args.min_context, args.batch_size, False)
            finally:
                fp32_head.__init__ = orig
        else:
            ts, _, _ = lm_scores(model, tok, docs, [], args.window, args.min_context, args.batch_size, False)
        scores[name] = ts.lm_logprob.astype(np.float64)
        runs[name] = {"ppl": perplexity(ts.lm_logprob), "tokens": len(ts), "seconds": time.perf_counter() - t0}
        print(name, runs[name], flush=True)
    ref = runs["float32"]["ppl"]
    for name in ("bfloat16", "bfloat16_bf16_logits"):
        d = scores[name] - scores["float32"]
        runs[name].update(
            relative_ppl_difference=runs[name]["ppl"] / ref - 1,
            logprob_abs_diff_mean=float(np.abs(d).mean()),
            logprob_abs_diff_max=float(np.abs(d).max()),
        )
    atomic_write_json(
        args.out,
        {
            "command": "OMP_NUM_THREADS=2 python benchmarks/quality/precision.py " + " ".join(sys.argv[1:]),
            "settings": {k: v for k, v in vars(args).items() if k != "out"},
            "runs": runs,
        },
    )


if __name__ == "__main__":
    main()
