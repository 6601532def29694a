"""Where ``--quantize int8``'s time goes: float32, int8 with its element-wise ops run op by op (eager), and
int8 with them compiled (``memlm.models.int8.FusedOps``, the default), on the same windows.

Per row and style (eval: log-probabilities + the ``ffn_in@-1`` key; build: keys only), two passes after a warm-up:
``components.profile_forward``'s seconds by component (module hooks), then a ``torch.profiler`` pass whose op table
gives the int8 product (``aten::_int_mm``), the float32 products (``aten::mm``/``addmm``), SDPA, and the two
element-wise steps of each int8 layer, labelled ``int8 quantize`` (divide by σ, per-token scale, round to int8) and
``int8 rescale`` (the int32 sums times both scales) by wrapping ``FusedOps.__call__`` in ``record_function`` here.
Profiled seconds include the profiler's own overhead; the component pass is the one to compare with ``run.py``'s.

    python benchmarks/speed/int8_profile.py --out docs/results/speed/int8_profile.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]  # speed/, benchmarks/
import components  # noqa: E402
import protocol  # noqa: E402
from torch.profiler import ProfilerActivity, profile, record_function  # noqa: E402

from memlm.data.corpora import load_documents  # noqa: E402
from memlm.data.windows import batched, limit_documents, resolve_stride, sliding_windows, tokenize_documents  # noqa: E402
from memlm.models import int8 as int8_lib  # noqa: E402
from memlm.models.forward import forward_windows  # noqa: E402
from memlm.models.keys import KeySpec  # noqa: E402
from memlm.models.resources import load_causal_lm  # noqa: E402

SPEC = KeySpec("ffn_in", -1)
LABELS = {"_quantize_input": "int8 quantize", "_rescale": "int8 rescale"}
OPS = ("aten::_int_mm", "aten::mm", "aten::addmm", "aten::_scaled_dot_product_flash_attention_for_cpu",
       "aten::_log_softmax", *LABELS.values())  # fmt: skip


REAL_CALL = int8_lib.FusedOps.__call__


def labelled_call(self: int8_lib.FusedOps, *args: Any) -> Any:
    with record_function(LABELS[self.fn.__name__]):
        return REAL_CALL(self, *args)


def op_table(model, batches, with_lp: bool, pad: int) -> dict[str, Any]:
    """Self CPU seconds of :data:`OPS` (total CPU seconds for the labelled ranges) in one profiled pass."""
    int8_lib.FusedOps.__call__ = labelled_call
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in forward_windows(model, batches, [SPEC], with_lp, pad_id=pad):
                pass
    finally:
        int8_lib.FusedOps.__call__ = REAL_CALL
    events = {e.key: e for e in prof.key_averages()}
    out = {}
    for name in OPS:
        if name in events:
            e = events[name]
            us = e.cpu_time_total if name in LABELS.values() else e.self_cpu_time_total
            out[name] = {"seconds": us / 1e6, "calls": e.count}
    out["profiled_total_s"] = sum(e.self_cpu_time_total for e in events.values()) / 1e6
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--corpus", default="wikitext2")
    p.add_argument("--windows", type=int, default=8, help="windows of 1024 / stride 512 profiled (batches of 4)")
    p.add_argument("--wait-idle", type=float, default=600)
    args = p.parse_args()
    model, tok = load_causal_lm(args.model, dtype="float32")
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    docs = limit_documents(load_documents(args.corpus, "test"), tok, 40_000)
    stride, _ = resolve_stride(1024, 512, None)
    windows = list(sliding_windows(tokenize_documents(docs, tok), 1024, stride=stride))[: args.windows]
    batches = list(batched(iter(windows), 4))
    result: dict[str, Any] = {"command": " ".join(["python", *sys.argv]), "machine": protocol.machine(),
                              "windows": len(windows), "rows": []}  # fmt: skip
    fused = int8_lib.FUSED_OPS
    for name in ("float32", "int8, element-wise ops eager", "int8, element-wise ops compiled"):
        if name == "int8, element-wise ops eager":
            result["int8"] = int8_lib.quantize_int8(model, tok)
        for f in fused:
            f.mode = "inductor" if name.endswith("compiled") else "eager"
        components.profile_forward(model, batches[:1], [SPEC], True, pad)  # warm-up (and compile)
        row: dict[str, Any] = {"row": name}
        for style, with_lp in (("eval", True), ("build", False)):
            idle = protocol.wait_for_idle(protocol.IDLE_BUSY, protocol.IDLE_LOAD, max_wait=args.wait_idle)
            prof = components.profile_forward(model, batches, [SPEC], with_lp, pad)
            row[style] = {"idle_before": idle, **prof, "ops": op_table(model, batches, with_lp, pad)}
            ops = row[style]["ops"]
            print(f"{name} {style}: {prof['seconds_total']:.2f} s; "
                  + ", ".join(f"{k.removeprefix('aten::')} {v['seconds']:.3f} s" for k, v in ops.items()
                              if isinstance(v, dict)), flush=True)  # fmt: skip
        result["rows"].append(row)
        protocol.save_result(args.out, result)


if __name__ == "__main__":
    main()
