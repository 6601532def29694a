"""SmolLM2-135M forward tokens/s in float32 and in bfloat16 on this CPU: the cost that
:data:`memlm.models.cpu.EMULATION_COST` names where bf16 is emulated (no AVX512-BF16, AMX-BF16 or Arm BF16).

    python benchmarks/speed/bf16_emulated.py --tokens 512 --out docs/results/speed/bf16_emulated_avx2.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import protocol  # noqa: E402

from memlm.data.corpora import load_documents  # noqa: E402
from memlm.models.cpu import cpu_flags  # noqa: E402
from memlm.models.resources import load_causal_lm  # noqa: E402


def tokens_per_second(dtype: str, ids: torch.Tensor) -> float:
    model, _ = load_causal_lm("smollm2-135m", dtype=dtype)
    with torch.inference_mode():
        model(ids[:, :32])  # warm-up
        t0 = time.perf_counter()
        model(ids)
        return ids.numel() / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    _, tok = load_causal_lm("smollm2-135m", dtype="float32")
    text = " ".join(d.text for d in load_documents("wiki", "test")[:20])
    ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"][: args.tokens]])
    load_before = protocol.load_average()
    rows = {dtype: tokens_per_second(dtype, ids) for dtype in ("float32", "bfloat16")}
    out = {
        "tokens": args.tokens,
        "tokens_per_second": rows,
        "ratio_float32_over_bf16": rows["float32"] / rows["bfloat16"],
        "cpu_flags": cpu_flags(),
        "machine": protocol.host(),
        "loadavg_before": load_before,
        "loadavg_after": protocol.load_average(),
    }
    protocol.save_result(args.out, out)
    print(json.dumps(out["tokens_per_second"]), round(out["ratio_float32_over_bf16"], 1))


if __name__ == "__main__":
    main()
