"""Relative key error and perplexity difference of each compute path against float32 (memlm.models.compute.KEY_ERROR).

Scores the same leading tokens of the `wiki` corpus' test split (Wikipedia lead sections) with SmolLM2-135M on each path
(windows 512, min-context 256, batch 2) and compares the ``ffn_in@-1`` keys, ``e = ||k - k_fp32|| / ||k_fp32||`` per
key, and the perplexity. Not a timing:
it may run on a busy machine. ``--int8-variants`` adds two int8 quantizations that are not paths (per-channel weights;
every linear but ``down_proj``), to show where int8's error comes from, and ``--quantize int8`` without its outlier
channels (its earlier rule)::

    python benchmarks/speed/key_error.py --tokens 2048 --int8-variants --out docs/results/speed/key_error.json
    python benchmarks/speed/key_error.py --tokens 2048 --int8-variants \
      --out docs/results/speed/key_error_avx512_int8.json    # with the int8 path
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import numpy as np
import torch

from memlm.core.distribution import perplexity
from memlm.data.corpora import load_documents
from memlm.data.windows import batched, limit_documents, sliding_windows, tokenize_documents
from memlm.io.fileio import atomic_write_json
from memlm.models.compute import ComputePath, apply_compute_path, relative_key_error
from memlm.models.forward import forward_windows
from memlm.models.keys import KeySpec
from memlm.models.resources import load_causal_lm

SPEC = KeySpec("ffn_in", -1)
PATHS = [
    ComputePath("float32"),
    ComputePath("float32", "eager"),
    ComputePath("bfloat16"),
    ComputePath("float32", quantize="int8-dynamic"),
    ComputePath("float32", quantize="int8"),
]


def _int8_variant(model: torch.nn.Module, variant: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

        layers = model.model.layers
        names = {
            f"{i}.{n}"
            for i, layer in enumerate(layers)
            for n, m in layer.named_modules()
            if isinstance(m, torch.nn.Linear) and (variant == "per-channel" or not n.endswith("down_proj"))
        }
        quantize_dynamic(layers, {n: per_channel_dynamic_qconfig for n in names}, inplace=True)


def run(args: argparse.Namespace, path: ComputePath, variant: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    model, tok = load_causal_lm(args.model, dtype=path.dtype)
    if variant is None:
        apply_compute_path(model, path, tokenizer=tok)
    elif variant == "no-outliers":  # --quantize int8 as it was before its outlier channels
        from memlm.models.int8 import quantize_int8

        quantize_int8(model, tok, outliers=0)
    else:
        _int8_variant(model, variant)
    docs = limit_documents(load_documents("wiki", "test"), tok, args.tokens)
    windows = sliding_windows(tokenize_documents(docs, tok), 512, 256)
    keys, lp = [], []
    for outputs in forward_windows(model, batched(windows, 2), [SPEC], True):
        keys += [o.keys[SPEC] for o in outputs]
        lp += [o.lm_logprob for o in outputs]
    return np.concatenate(keys), np.concatenate(lp).astype(np.float64)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--int8-variants", action="store_true")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    ref_keys, ref_lp = run(args, PATHS[0])
    ref_ppl = perplexity(ref_lp)
    rows = {"float32+sdpa": {"tokens": len(ref_lp), "ppl": ref_ppl}}
    todo = [(x.label(), x, None) for x in PATHS[1:]]
    if args.int8_variants:
        todo += [(f"float32+int8-{v} (not a path)", PATHS[0], v) for v in ("per-channel", "per-channel-no-down_proj")]
        todo += [("float32+sdpa+int8, no outlier channels", PATHS[0], "no-outliers")]
    for name, path, variant in todo:
        keys, lp = run(args, path, variant)
        e = relative_key_error(keys, ref_keys)
        ppl = perplexity(lp)
        rows[name] = {
            "tokens": len(lp),
            "ppl": ppl,
            "relative_ppl_difference": ppl / ref_ppl - 1,
            "key_error_mean": float(e.mean()),
            "key_error_p50": float(np.median(e)),
            "key_error_p99": float(np.percentile(e, 99)),
            "key_error_max": float(e.max()),
        }
        print(name, rows[name], flush=True)
    atomic_write_json(
        args.out,
        {
            "command": " ".join(["python", *sys.argv]),
            "key": SPEC.describe(),
            "windows": {"window": 512, "min_context": 256, "batch_size": 2},
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "paths": rows,
        },
    )
    print(f"wrote {Path(args.out)}")


if __name__ == "__main__":
    main()
