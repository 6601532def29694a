"""One int8 product that cannot saturate on a CPU without VNNI, against float32: speed and error of a decoder
linear layer's product ``y = x W^T`` on real activations.

x86 CPUs without VNNI or AMX-INT8 multiply int8 with ``vpmaddubsw`` (unsigned 8-bit times signed 8-bit, pairs summed
into 16 bits with saturation): ``255 * 127 * 2 > 32,767``, so ``torch._int_mm`` (memlm's ``--quantize int8``,
:mod:`memlm.models.int8`) saturates there and memlm refuses it. FBGEMM's dynamic linear with ``reduce_range=True``
(``torch.ao.nn.quantized.dynamic.Linear``) quantizes the activations to 7 bits (0..127): ``127 * 127 * 2 = 32,258``
fits, so its products are exact on AVX2. It takes one activation scale per batch, which outlier channels defeat
(SmolLM2's ``--quantize int8-dynamic``: +283% perplexity, ``memlm.models.compute.KEY_ERROR``); the rows below add
memlm's SmoothQuant smoothing (Xiao et al. 2023, Eq. 4: ``x / σ`` and ``W σ``, α = 0.5) and its float32 outlier
channels (the 8 input channels of largest calibration maxima multiplied in float32; Dettmers et al. 2022, Sec. 3.2),
calibrated as :func:`memlm.models.int8.quantize_int8` calibrates.

The product: SmolLM2-135M's feed-forward up projection of one decoder layer (``--layer``, 576 -> 1,536), its input
captured on ``--tokens`` of the ``wiki`` test split; σ and the outlier channels from as many tokens of its train split.
Rows (each the median of ``--repeats`` timed products after warm-up): float32 ``F.linear`` (the reference), FBGEMM's
dynamic int8 with reduce_range (weights per output channel) plain, smoothed, smoothed with outliers in float32; the
same without reduce_range (8-bit activations: may saturate); and memlm's ``Int8Linear`` (per-token scales, the path
refused on such CPUs) for its error. Error: per token, ``||y - y_fp32|| / ||y_fp32||`` (max, p99, mean).

    python benchmarks/speed/int8_reduced_range.py --out docs/results/speed/int8_reduced_range_product_avx2.json

The record holds the CPU flags (``lscpu``) and the load average before and after; a timing taken while the machine is
not idle is kept with ``idle: false`` (``--force``; :func:`protocol.idle_check`): not a benchmark.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path[:0] = [str(Path(__file__).resolve().parents[1])]  # benchmarks/
import numpy as np  # noqa: E402
import protocol  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

from memlm.data.corpora import load_documents  # noqa: E402
from memlm.models import int8 as int8_lib  # noqa: E402
from memlm.models.keys import find_decoder_layers  # noqa: E402
from memlm.models.resources import load_causal_lm  # noqa: E402


def layer_input(model: nn.Module, tok, split: str, tokens: int, layer: int) -> torch.Tensor:
    """The input of decoder layer ``layer``'s up projection, ``[tokens, 576]`` float32, over ``wiki``'s ``split``."""
    batches = int8_lib.calibration_batches(tok, [d.text for d in load_documents("wiki", split)], tokens)
    up = find_decoder_layers(model)[layer].mlp.up_proj
    seen: list[torch.Tensor] = []
    handle = up.register_forward_hook(lambda _m, inp, _o: seen.append(inp[0].detach().reshape(-1, inp[0].shape[-1])))
    try:
        with torch.inference_mode():
            for ids in batches:
                model(input_ids=ids, use_cache=False)
    finally:
        handle.remove()
    return torch.cat(seen).float().clone()


def dynamic_linear(weight: torch.Tensor) -> Any:
    """FBGEMM's dynamic int8 linear of ``weight`` (int8 per output channel, symmetric)."""
    import torch.ao.nn.quantized.dynamic as nnqd

    scale = weight.abs().amax(1).clamp_min(1e-8) / 127
    qw = torch.quantize_per_channel(weight, scale.double(), torch.zeros(weight.shape[0], dtype=torch.long), 0,
                                    torch.qint8)  # fmt: skip
    lin = nnqd.Linear(weight.shape[1], weight.shape[0], bias_=False, dtype=torch.qint8)
    lin.set_weight_bias(qw, None)
    return lin


def rows(weight: torch.Tensor, calib: torch.Tensor, outliers: int) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """Each row's product ``x -> y``, all of ``weight`` ``[out, in]``, calibrated on ``calib``."""
    absmax = calib.abs().amax(0)
    smooth = int8_lib.smooth_factor(absmax, [weight])
    top = torch.topk(absmax, outliers).indices.sort().values
    inv_smooth = int8_lib.inverse_smooth(weight.shape[1], smooth, None)
    inv_out = int8_lib.inverse_smooth(weight.shape[1], smooth, top)
    plain = dynamic_linear(weight)
    smoothed = dynamic_linear(weight * smooth[None, :])
    w_rest = weight.clone()
    w_rest[:, top] = 0
    with_out = dynamic_linear(w_rest * smooth[None, :])
    w_out_t = weight[:, top].t().contiguous()
    packed = plain._packed_params._packed_params
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    linear.weight.data = weight.clone()
    memlm_int8 = int8_lib.Int8Linear(linear, smooth, outliers=top)
    return {
        "float32": lambda x: torch.nn.functional.linear(x, weight),
        "dynamic int8, reduce_range": plain,
        "dynamic int8, reduce_range, SmoothQuant": lambda x: smoothed(x * inv_smooth),
        f"dynamic int8, reduce_range, SmoothQuant, {outliers} outlier channels float32": lambda x: with_out(
            x * inv_out
        ).addmm_(x.index_select(1, top), w_out_t),
        "dynamic int8, full range (8-bit activations)": lambda x: torch.ops.quantized.linear_dynamic(
            x, packed, reduce_range=False
        ),
        f"memlm --quantize int8 (per-token scales, _int_mm, {outliers} outlier channels)": memlm_int8,
    }


def time_product(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, repeats: int) -> list[float]:
    with torch.inference_mode():
        for _ in range(3):
            fn(x)
        seconds = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn(x)
            seconds.append(time.perf_counter() - t0)
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layer", type=int, default=15, help="decoder layer whose up projection is measured")
    ap.add_argument("--tokens", type=int, default=2048, help="tokens of the test split (and of the calibration)")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--outliers", type=int, default=int8_lib.OUTLIER_CHANNELS)
    ap.add_argument("--force", action="store_true", help="record timings on a busy machine, marked not idle")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    warnings.simplefilter("ignore")  # torch's note that torch.ao.quantization moves to torchao
    torch.backends.quantized.engine = "fbgemm"
    idle = protocol.idle_check(args.force)
    model, tok = load_causal_lm("smollm2-135m", dtype="float32")
    calib = layer_input(model, tok, "train", args.tokens, args.layer)
    x = layer_input(model, tok, "test", args.tokens, args.layer)
    weight = find_decoder_layers(model)[args.layer].mlp.up_proj.weight.detach().float().clone()
    del model
    load0 = protocol.load_average()
    reference = torch.nn.functional.linear(x, weight)
    results = []
    for name, fn in rows(weight, calib, args.outliers).items():
        with torch.inference_mode():
            y = fn(x)
        err = ((y - reference).norm(dim=1) / reference.norm(dim=1).clamp_min(1e-12)).numpy()
        seconds = time_product(fn, x, args.repeats)
        med = statistics.median(seconds)
        row = {"row": name, "median_s": med, "tokens_per_s": x.shape[0] / med, "min_s": min(seconds),
               "rel_error_max": float(err.max()), "rel_error_p99": float(np.quantile(err, 0.99)),
               "rel_error_mean": float(err.mean())}  # fmt: skip
        results.append(row)
        print(f"{name:75s} {med * 1e3:8.2f} ms  err max {row['rel_error_max']:.4f} p99 {row['rel_error_p99']:.4f} "
              f"mean {row['rel_error_mean']:.4f}", flush=True)  # fmt: skip
    base = results[0]["median_s"]
    for row in results:
        row["speed_vs_float32"] = base / row["median_s"]
    protocol.save_result(args.out, {
        "what": "one product y = x W^T: SmolLM2-135M up_proj of a decoder layer, int8 paths that cannot saturate "
                "without VNNI against float32 (benchmarks/speed/int8_reduced_range.py)",
        "layer": args.layer, "shape": {"tokens": x.shape[0], "in": weight.shape[1], "out": weight.shape[0]},
        "calibration": f"wiki train, {calib.shape[0]} tokens; measured on wiki test",
        "int8_products_exact": int8_lib.int8_products_exact(), "quantized_engine": torch.backends.quantized.engine,
        "repeats": args.repeats, "idle": idle, "load_avg_before": load0, "load_avg_after": protocol.load_average(),
        "machine": protocol.machine(), "lscpu_flags": protocol.lscpu_flags(), "rows": results,
    })  # fmt: skip


if __name__ == "__main__":
    main()
