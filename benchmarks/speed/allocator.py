"""The C allocator's share of a forward pass: glibc's defaults against memlm's thresholds (``memlm.models.allocator``).

Each row is one fresh process that loads the model with ``load_causal_lm`` (which tunes the allocator unless
``MEMLM_MALLOC=default``), runs the model's body on a ``[batch, window]`` batch of random token ids once untimed, then
``--steps`` times, and records the forward tokens/s, the minor page faults, and the user and kernel CPU seconds per
step (``getrusage``). Rows alternate default / tuned ``--repeats`` times, each started on an idle machine.

    python benchmarks/speed/allocator.py --out docs/results/speed/allocator.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import protocol  # noqa: E402

MODES = ("default", "tuned")


def child(args: argparse.Namespace) -> None:
    import torch

    from memlm.models.allocator import allocator_state
    from memlm.models.resources import load_causal_lm

    model, _ = load_causal_lm(args.model, dtype=args.dtype)
    ids = torch.randint(
        0, model.config.vocab_size, (args.batch, args.window), generator=torch.Generator().manual_seed(0)
    )
    body = model.get_decoder()

    def step() -> None:
        with torch.inference_mode():
            body(input_ids=ids)

    step()
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    for _ in range(args.steps):
        step()
    seconds, r1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
    n = args.steps
    print(
        json.dumps(
            {
                "allocator": allocator_state(),
                "forward_tokens_per_s": args.batch * args.window * n / seconds,
                "seconds_per_step": seconds / n,
                "minor_faults_per_step": (r1.ru_minflt - r0.ru_minflt) / n,
                "user_s_per_step": (r1.ru_utime - r0.ru_utime) / n,
                "kernel_s_per_step": (r1.ru_stime - r0.ru_stime) / n,
                "peak_rss_mib": protocol.peak_rss_mib(),
            }
        )
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="JSON file of the results")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--window", type=int, default=1024)
    p.add_argument("--steps", type=int, default=6, help="timed forward passes per row (6 x 4,096 = 24,576 tokens)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--wait-idle", type=float, default=600)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args)
        return
    result: dict[str, Any] = {"command": " ".join(["python", *sys.argv]), "machine": protocol.machine(), "rows": []}
    for rep in range(args.repeats):
        for mode in MODES:
            idle = protocol.wait_for_idle(protocol.IDLE_BUSY, protocol.IDLE_LOAD, max_wait=args.wait_idle)
            env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
            env["MEMLM_MALLOC"] = "default" if mode == "default" else "tuned"
            row = {"mode": mode, "repeat": rep, "idle_before": idle, **protocol.run_child(__file__, sys.argv[1:], env)}
            result["rows"].append(row)
            print(
                f"{mode} #{rep}: {row['forward_tokens_per_s']:.1f} forward tok/s, "
                f"{row['minor_faults_per_step']:.0f} faults/step, kernel {row['kernel_s_per_step']:.3f} s/step, "
                f"user {row['user_s_per_step']:.2f} s/step (load before {idle['load_avg_before']:.2f})",
                flush=True,
            )
            protocol.save_result(args.out, result)
    speed = {m: statistics.median(r["forward_tokens_per_s"] for r in result["rows"] if r["mode"] == m) for m in MODES}
    result["summary"] = {"tokens_per_s": speed, "ratio_tuned_over_default": speed["tuned"] / speed["default"]}
    print(json.dumps(result["summary"]))
    protocol.save_result(args.out, result)


if __name__ == "__main__":
    main()
