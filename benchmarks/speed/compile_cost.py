"""What compiling costs per process, with and without inductor's FX graph cache.

``memlm.models.compiling.compile_dynamic`` turns inductor's FX graph cache off, because its key leaves out
``ATEN_CPU_CAPABILITY`` (a graph compiled under AVX2 served to an AVX-512 process gave wrong values:
docs/results/speed/int8_fx_cache_across_isas_nan.log). The
graphs are then generated again in every process; the cache of compiled C++ objects (``TORCHINDUCTOR_CACHE_DIR``) is
still used. This script measures that price. Each row is a fresh process started on an idle machine
(``protocol.wait_for_idle``) that loads SmolLM2-135M in float32 and then, timed:

- ``int8``: ``apply_compute_path(..., quantize="int8")`` (calibration, the int8 layers, and the warm-up forward that
  compiles ``FusedOps``' quantize and rescale);
- ``inductor``: ``apply_compute_path(..., compile="inductor")`` and the first forward of one [4, 1024] batch (which
  compiles the decoder blocks), against the second forward of the same batch (the steady state).

Modes: ``eager`` (``MEMLM_INT8_COMPILE=0``; for ``inductor`` no compile), ``fx-off`` (memlm's code as it is) and
``fx-on`` (the same call with ``fx_graph_cache`` on, patched in this script only: what the cache would save), each
``cold`` (an empty cache folder) and ``warm`` (the folder the cold row just filled).

    python benchmarks/speed/compile_cost.py --out docs/results/speed/compile_cost.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import protocol  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
ROWS = [
    ("int8", "eager", "cold"),
    ("int8", "fx-off", "cold"),
    ("int8", "fx-off", "warm"),
    ("int8", "fx-on", "cold"),
    ("int8", "fx-on", "warm"),
    ("inductor", "eager", "cold"),
    ("inductor", "fx-off", "cold"),
    ("inductor", "fx-off", "warm"),
    ("inductor", "fx-on", "cold"),
    ("inductor", "fx-on", "warm"),
]


def child(args: argparse.Namespace) -> None:
    """One row: load, then time the compute path's set-up (and, for inductor, the first and second forward)."""
    import torch

    from memlm.models import compiling, compute, int8
    from memlm.models.compute import ComputePath, apply_compute_path
    from memlm.models.resources import load_causal_lm

    if args.mode == "fx-on":  # this script's ablation only: memlm never turns the cache on

        def with_fx_cache(fn: Any) -> Any:
            return torch.compile(fn, dynamic=True)

        int8.compile_dynamic = compute.compile_dynamic = compiling.compile_dynamic = with_fx_cache
    torch.set_num_threads(min(torch.get_num_threads(), 2))
    model, tok = load_causal_lm(args.model, dtype="float32")
    out: dict[str, Any] = {}
    if args.kind == "int8":
        t0 = time.perf_counter()
        apply_compute_path(model, ComputePath("float32", quantize="int8"), tokenizer=tok)
        out["setup_s"] = time.perf_counter() - t0
        out["elementwise_ops"] = model.memlm_int8["elementwise_ops"]
    else:
        path = ComputePath("float32", compile="none" if args.mode == "eager" else "inductor")
        t0 = time.perf_counter()
        apply_compute_path(model, path)
        out["setup_s"] = time.perf_counter() - t0
        ids = torch.randint(0, tok.vocab_size, (4, 1024), generator=torch.Generator().manual_seed(0))
        for name in ("first_forward_s", "second_forward_s"):
            t0 = time.perf_counter()
            with torch.inference_mode():
                model.model(input_ids=ids, use_cache=False)
            out[name] = time.perf_counter() - t0
    print(json.dumps(out))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="JSON file of the results")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--kinds", default="int8,inductor")
    p.add_argument("--wait-idle", type=float, default=600)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--kind", help=argparse.SUPPRESS)
    p.add_argument("--mode", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args)
        return
    if not args.out:
        sys.exit("--out is required")
    kinds = args.kinds.split(",")
    result: dict[str, Any] = {"command": " ".join(["python", *sys.argv]), "machine": protocol.machine(), "rows": []}
    with tempfile.TemporaryDirectory() as tmp:
        for kind, mode, cache in ROWS:
            if kind not in kinds:
                continue
            cache_dir = Path(tmp) / f"{kind}-{mode}"  # cold: created empty here; warm: the cold row's
            cache_dir.mkdir(exist_ok=True)
            idle = protocol.wait_for_idle(protocol.IDLE_BUSY, protocol.IDLE_LOAD, max_wait=args.wait_idle)
            env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "TORCHINDUCTOR_CACHE_DIR": str(cache_dir)}
            env["MEMLM_INT8_COMPILE"] = "0" if mode == "eager" else "1"
            t0 = time.perf_counter()
            child_row = protocol.run_child(__file__, ["--kind", kind, "--mode", mode, "--model", args.model], env, True)
            row = {"kind": kind, "mode": mode, "cache": cache, "process_s": time.perf_counter() - t0,
                   "idle_before": idle, **child_row}  # fmt: skip
            result["rows"].append(row)
            print({k: v for k, v in row.items() if k != "idle_before"}, flush=True)
            protocol.save_result(args.out, result)


if __name__ == "__main__":
    main()
