"""How much faster a profiled forward pass could be at the CPU's measured peak ("say what stands between the
result and the peak").

Reads a profile written by ``run.py --steps peak,profile`` and, for each path and style (eval, build), puts every
part that does floating-point products (the linear layers, the attention core, the output projection) at the
dtype's measured peak and keeps the other parts (norms, activation, log-softmax, hooks, the rest) at their measured
seconds::

    t_peak = (F_linear + F_attention + F_head) / peak + t_rest          bound = t_measured / t_peak

and the same with only the attention core at the peak (the one product far from it). ``bound`` is the largest
speed-up this dtype can give on this CPU over the profiled step; multiplied by a measured ratio over an older
default (``--ratio``), it bounds what any float32 change can reach against that default.

``--int8-model NAME`` adds the bound of ``--quantize int8`` as it is (memlm.models.int8: every decoder linear but the
down projections and the last layer's): the step's seconds if the layers it replaces took **no time at all**, their
share of each linear group's seconds taken as their share of its FLOPs (the shapes run at about the same GFLOP/s:
``peak``'s rows). No int8 kernel beats that, and the quantize / rescale work it adds is left out.

    python benchmarks/speed/peak_bound.py docs/results/speed/profile_2core_avx2.json \\
      --ratio build=1.0155 --ratio eval=1.1219 --int8-model smollm2-135m \\
      --out docs/results/speed/peak_bound_avx2.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]  # speed/, benchmarks/
import protocol  # noqa: E402

PRODUCTS = {"linear": ("linear (FFN)", "linear (attention q/k/v/o)"), "attention": ("attention core",),
            "head": ("output projection",)}  # fmt: skip


def bound(profile: dict[str, Any], peak_gflops: float) -> dict[str, Any]:
    """The step's seconds with its products at ``peak_gflops``, and the speed-up bounds (see the module docstring)."""
    seconds, flops, total = profile["seconds"], profile["flops"], profile["seconds_total"]
    product_s = {k: sum(seconds.get(p, 0.0) for p in parts) for k, parts in PRODUCTS.items()}
    at_peak = {k: flops[k] / (peak_gflops * 1e9) for k in PRODUCTS}
    rest = total - sum(product_s.values())
    all_at_peak = rest + sum(at_peak.values())
    attention_at_peak = total - product_s["attention"] + at_peak["attention"]
    return {
        "seconds_measured": total,
        "seconds_products_measured": product_s,
        "seconds_products_at_peak": at_peak,
        "seconds_rest": rest,
        "seconds_all_products_at_peak": all_at_peak,
        "bound_all_products_at_peak": total / all_at_peak,
        "bound_attention_at_peak": total / attention_at_peak,
        "share_of_peak_by_product": {k: at_peak[k] / product_s[k] if product_s[k] else None for k in PRODUCTS},
    }


def int8_fractions(model_name: str) -> dict[str, float]:
    """Share of each linear group's FLOPs (``linear (FFN)``, ``linear (attention q/k/v/o)``) in the layers that
    ``--quantize int8`` replaces."""
    import components

    from memlm.models import int8
    from memlm.models.keys import linear_dims
    from memlm.models.resources import load_causal_lm

    model, _ = load_causal_lm(model_name, dtype="float32")
    groups = components._layer_modules(model)
    quantized = {id(lin) for _, _, lin in int8.linears_to_quantize(model)[0]}
    out = {}
    for label, key in (("linear (FFN)", "ffn_linear"), ("linear (attention q/k/v/o)", "attn_linear")):
        flops = {id(m): d[0] * d[1] for m in groups[key] if (d := linear_dims(m)) is not None}
        out[label] = sum(f for i, f in flops.items() if i in quantized) / sum(flops.values())
    return out


def int8_free_bound(profile: dict[str, Any], fractions: dict[str, float]) -> float:
    """Measured seconds over the seconds left when int8's layers (``fractions`` of each group) take none."""
    seconds, total = profile["seconds"], profile["seconds_total"]
    return total / (total - sum(f * seconds.get(label, 0.0) for label, f in fractions.items()))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("profile", help="JSON written by run.py with the peak and profile steps")
    p.add_argument("--ratio", action="append", default=[], help="STYLE=R: a measured ratio over an old default")
    p.add_argument("--int8-model", help="model name: add the bound of --quantize int8's layers taking no time")
    p.add_argument("--out")
    args = p.parse_args()
    data = json.loads(Path(args.profile).read_text())
    ratios = {style: float(r) for style, r in (x.split("=") for x in args.ratio)}
    out: dict[str, Any] = {"command": " ".join(["python", *sys.argv]), "profile": args.profile, "paths": {}}
    fractions = int8_fractions(args.int8_model) if args.int8_model else None
    if fractions:
        out["int8_flop_fractions"] = fractions
    for label, styles in data["profile"].items():
        dtype = label.split("+")[0]
        peak = data["peak"]["peak_gflops"][dtype]
        rows = {}
        for style in ("eval", "build"):
            prof = styles[style]
            row = {"peak_gflops": peak, **bound(prof, peak)}
            if fractions:
                row["bound_int8_layers_free"] = int8_free_bound(prof, fractions)
            if style in ratios:
                row["measured_ratio_over_old_default"] = ratios[style]
                row["ratio_bound_over_old_default"] = ratios[style] * row["bound_all_products_at_peak"]
                if fractions:
                    row["int8_ratio_bound_over_old_default"] = ratios[style] * row["bound_int8_layers_free"]
            rows[style] = row
            print(f"{label} {style}: {prof['seconds_total']:.3f} s measured, {row['seconds_all_products_at_peak']:.3f}"
                  f" s at the {dtype} peak ({peak:.0f} GFLOP/s): at most {row['bound_all_products_at_peak']:.2f}x"
                  f" (attention core alone at the peak {row['bound_attention_at_peak']:.2f}x)"
                  + (f"; x {ratios[style]} measured = {row['ratio_bound_over_old_default']:.2f}x over the old default"
                     if style in ratios else "")
                  + (f"; int8's layers free: {row['bound_int8_layers_free']:.2f}x" if fractions else ""))  # fmt: skip
        out["paths"][label] = rows
    if args.out:
        protocol.save_result(args.out, out)


if __name__ == "__main__":
    main()
