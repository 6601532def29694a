"""Forward speed of float32 vs bfloat16 on this machine, on memlm's evaluation forward pass (the choice of
``--dtype auto``).

Scores the same leading tokens of wiki test with SmolLM2-135M in each dtype (window 1024, min-context 512, batch 4,
float32 output head in both), after one warm-up window, and writes tokens/s and perplexity per dtype. Timing protocol:
``benchmarks/protocol.py`` (idle check first, or ``--force`` to record ``idle: false``; the machine, load averages and
peak RSS of each timed pass recorded)::

    python benchmarks/speed/dtype_speed.py --max-tokens 6000 --out docs/results/dtype_speed.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import protocol  # noqa: E402

from memlm.core.distribution import perplexity  # noqa: E402
from memlm.data.corpora import load_documents  # noqa: E402
from memlm.data.windows import limit_documents  # noqa: E402
from memlm.knnlm.evaluate import lm_scores  # noqa: E402
from memlm.models.resources import default_dtype, load_causal_lm  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--max-tokens", type=int, default=6000)
    ap.add_argument("--out", required=True)
    protocol.add_idle_args(ap)
    args = ap.parse_args()
    idle = protocol.idle_check(args.force, args.wait)
    runs = {}
    for dtype in ("float32", "bfloat16"):
        model, tok = load_causal_lm(args.model, dtype=dtype)
        docs = limit_documents(load_documents("wiki", "test"), tok, args.max_tokens)
        lm_scores(model, tok, docs[:1], window=256, min_context=128, progress=False)  # warm-up

        def scored(model=model, tok=tok, docs=docs) -> dict:
            ts, _, _ = lm_scores(model, tok, docs, window=1024, min_context=512, batch_size=4, progress=False)
            return {"tokens": len(ts), "ppl": perplexity(ts.lm_logprob)}

        runs[dtype] = rec = protocol.timed(dtype, scored)
        rec["tokens_per_second"] = rec["tokens"] / rec["seconds"]
        print(dtype, runs[dtype], flush=True)
    runs["bfloat16"]["speedup_vs_float32"] = (
        runs["bfloat16"]["tokens_per_second"] / runs["float32"]["tokens_per_second"]
    )
    runs["bfloat16"]["relative_ppl_difference"] = runs["bfloat16"]["ppl"] / runs["float32"]["ppl"] - 1
    protocol.save_result(
        args.out,
        {
            "command": " ".join(["python", *sys.argv]),
            "runs": runs,
            "idle": idle,
            "machine": protocol.machine(),
            "default_dtype_here": default_dtype(),
        },
    )


if __name__ == "__main__":
    main()
