"""The machine's measured peak: matrix products in float32, bfloat16 and int8 at the model's shapes, in GFLOP/s.

A product ``[M, K] @ [K, N]`` is ``2 M K N`` floating-point (or integer multiply-add) operations. The shapes are a
forward batch of ``M`` tokens through SmolLM2-135M's linear layers (hidden 576, intermediate 1536, 9 query heads and 3
key/value heads of 64: q/o 576x576, k/v 576x192, gate/up 576x1536, down 1536x576, the output head 576x49152) and one
square product. ``float32`` and ``bfloat16`` time ``torch.matmul`` (oneDNN / MKL); ``int8`` times torch's dynamic int8
linear (``torch.ao.nn.quantized.dynamic.Linear``: activations quantized per call, int32 accumulation, fbgemm/oneDNN
VNNI where the CPU has it), the kernel ``--quantize int8-dynamic`` runs. Each shape: a warm-up, then the best of
``repeats`` timings of enough products to take ``min_seconds``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import warnings
from typing import Any

import torch

SHAPES: dict[str, tuple[int, int]] = {  # name -> (K, N) of a linear layer of SmolLM2-135M
    "q_proj/o_proj": (576, 576),
    "k_proj/v_proj": (576, 192),
    "gate_proj/up_proj": (576, 1536),
    "down_proj": (1536, 576),
    "lm_head": (576, 49152),
    "square 1024": (1024, 1024),
}


def _best_rate(fn, flops: float, repeats: int, min_seconds: float) -> float:
    fn()  # warm-up (kernel selection, weight packing)
    t0 = time.perf_counter()
    fn()
    once = max(time.perf_counter() - t0, 1e-6)
    calls = max(1, int(min_seconds / once))
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls)
    return flops / best / 1e9


def _int8_linear(k: int, n: int):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao.quantization's deprecation notice
        from torch.ao.quantization import quantize_dynamic

        return quantize_dynamic(
            torch.nn.Sequential(torch.nn.Linear(k, n, bias=False)), {torch.nn.Linear}, dtype=torch.qint8
        )


def measure_peak(tokens: int = 1024, repeats: int = 3, min_seconds: float = 0.3) -> dict[str, Any]:
    """GFLOP/s per (shape, dtype), and per dtype the best over shapes (the peak a forward pass is compared with)."""
    rows = []
    torch.manual_seed(0)
    with torch.inference_mode():
        for name, (k, n) in SHAPES.items():
            m = k if name.startswith("square") else tokens
            flops = 2.0 * m * k * n
            a32, b32 = torch.randn(m, k), torch.randn(k, n)
            row: dict[str, Any] = {"shape": name, "m": m, "k": k, "n": n}
            row["float32"] = _best_rate(lambda a=a32, b=b32: torch.matmul(a, b), flops, repeats, min_seconds)
            a16, b16 = a32.bfloat16(), b32.bfloat16()
            row["bfloat16"] = _best_rate(lambda a=a16, b=b16: torch.matmul(a, b), flops, repeats, min_seconds)
            try:
                lin = _int8_linear(k, n)
                row["int8"] = _best_rate(lambda a=a32, f=lin: f(a), flops, repeats, min_seconds)
            except (RuntimeError, ImportError) as e:  # no quantized engine on this build
                row["int8"] = None
                row["int8_error"] = str(e)[:200]
            rows.append(row)
            print(
                f"  peak {name:18s} [{m}x{k}]@[{k}x{n}]: "
                + ", ".join(f"{d} {row[d]:.1f}" for d in ("float32", "bfloat16", "int8") if row.get(d))
                + " GFLOP/s",
                flush=True,
            )
    peak = {d: max((r[d] for r in rows if r.get(d)), default=None) for d in ("float32", "bfloat16", "int8")}
    return {
        "threads": torch.get_num_threads(),
        "tokens": tokens,
        "rows": rows,
        "peak_gflops": peak,
        "note": "best of the shapes per dtype; int8 is torch's dynamic int8 linear (quantizes its input)",
    }


ONEDNN_PROBE = """
import torch
a, w = torch.randn(256, 576), torch.randn(1536, 576)
for dt in (torch.bfloat16, torch.float32):
    print("dtype", dt, flush=True)
    torch.nn.functional.linear(a.to(dt), w.to(dt))
"""


def onednn_check() -> dict[str, Any]:
    """Which kernel runs a linear layer per dtype: one product per dtype in a child process with ``ONEDNN_VERBOSE=1``;
    oneDNN's lines name its implementation and ISA (``brg_matmul:avx512_core_bf16``, ``..._amx``); a dtype with no
    line did not go through oneDNN (float32 goes to MKL / OpenBLAS)."""
    env = {**os.environ, "ONEDNN_VERBOSE": "1"}
    try:
        out = subprocess.run([sys.executable, "-c", ONEDNN_PROBE], capture_output=True, text=True, env=env,
                             timeout=120, check=False).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError) as e:
        return {"error": str(e)[:200]}
    seen: dict[str, list[str]] = {}
    dtype = None
    for line in out.splitlines():
        if line.startswith("dtype "):
            dtype = line.split()[1].removeprefix("torch.")
            seen[dtype] = []
        elif dtype and ",primitive,exec," in line:
            seen[dtype].append(line.split(",")[6])  # the implementation, e.g. brg_matmul:avx512_core_bf16
        elif ",info,cpu,isa:" in line:
            seen["isa"] = [line.split("isa:", 1)[1]]
    return {dt: sorted(set(v)) for dt, v in seen.items()}
