"""memlm's ``--quantize int8`` (int8 products with per-token activation scales, SmoothQuant-smoothed; memlm.models.int8)
against float32 on the same text in one process: how fast and how far from float32.

Rows, each after an idle wait: float32 (the reference, timed first and last so a drift of the machine shows);
``--quantize int8`` as memlm applies it (the feed-forward down projections and the last decoder layer kept float32); the
same int8 layers with their element-wise quantize and rescale run op by op (``FusedOps`` eager, as it once was)
instead of compiled; int8 without its outlier channels in float32 (its earlier rule); and the ablation that
quantizes every decoder linear layer the same way (each with its own σ), which shows why those stay float32. Each row:
``memlm eval``'s scoring (``lm_scores``, windows 1024 / 512, batch 4) on ``--tokens`` of the corpus' test split
(tokens/s, perplexity, relative key error of ``ffn_in@-1`` against float32) and ``datastore build``'s key pass on
``--build-tokens`` of its train split (entries/s).

    python benchmarks/speed/int8_w8a8.py --corpus wikitext2 --out docs/results/speed/int8_layer_ablation.json
    python benchmarks/speed/int8_w8a8.py --corpus wikitext2 --build-tokens 24000 \
      --rows float32,int8,no-outliers,float32-again \
      --out docs/results/speed/int8_outliers_fused.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]  # speed/, benchmarks/
import numpy as np  # noqa: E402
import protocol  # noqa: E402
import torch  # noqa: E402
from default_vs_old import time_eval_and_build  # noqa: E402
from torch import nn  # noqa: E402

from memlm.data.corpora import load_documents  # noqa: E402
from memlm.data.windows import limit_documents  # noqa: E402
from memlm.models import int8 as int8_lib  # noqa: E402
from memlm.models.compute import relative_key_error  # noqa: E402
from memlm.models.keys import find_decoder_layers  # noqa: E402
from memlm.models.resources import load_causal_lm  # noqa: E402

#: the int8 layers as they were before the outlier channels: no input channel multiplied in float32
NO_OUTLIERS = "int8, no outlier channels"
#: --rows key -> row name, in the order they run (eager reuses the int8 row's layers)
ROWS = {"float32": "float32", "int8": "int8", "eager": "int8, element-wise ops eager", "no-outliers": NO_OUTLIERS,
        "every-linear": "int8, every decoder linear (ablation)", "float32-again": "float32 (again)"}  # fmt: skip


def decoder_linears(model: nn.Module) -> list[tuple[nn.Module, str, nn.Linear]]:
    """(parent, attribute, linear) for every ``nn.Linear`` inside the decoder layers (the head is not one of them)."""
    return [(parent, name, child) for parent in find_decoder_layers(model).modules()
            for name, child in parent.named_children() if isinstance(child, nn.Linear)]  # fmt: skip


def quantize_every_linear(model: nn.Module, tok, originals: list) -> None:
    """The ablation: every decoder linear as an :class:`Int8Linear` with its own SmoothQuant σ (α = 0.5)."""
    linears = [lin for _, _, lin in originals]
    absmax, _ = int8_lib.input_absmax(model, linears, int8_lib.calibration_batches(tok))
    for (parent, name, lin), a in zip(originals, absmax, strict=True):
        setattr(parent, name, int8_lib.Int8Linear(lin, int8_lib.smooth_factor(a, [lin.weight])))


def time_row(model, tok, docs, build_docs, ref: dict | None, wait: float) -> dict[str, Any]:
    idle = protocol.wait_for_idle(protocol.IDLE_BUSY, protocol.IDLE_LOAD, max_wait=wait)
    timing, keys = time_eval_and_build(model, tok, docs, build_docs)
    row: dict[str, Any] = {"idle_before": idle, **timing, "load_after": protocol.load_average()}
    if ref is not None:
        e = relative_key_error(keys, ref["keys"])
        row.update(
            ppl_relative_difference=row["ppl"] / ref["ppl"] - 1,
            key_error_mean=float(e.mean()),
            key_error_p99=float(np.percentile(e, 99)),
            eval_ratio=row["eval_tok_per_s"] / ref["eval_tok_per_s"],
            build_ratio=row["build_entries_per_s"] / ref["build_entries_per_s"],
        )
    row["_keys"] = keys
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--tokens", type=int, default=20_000)
    p.add_argument("--build-tokens", type=int, default=8_000)
    p.add_argument("--corpus", default="wikitext2", help="named corpus: test split scored, train split keyed")
    p.add_argument("--wait-idle", type=float, default=600)
    p.add_argument("--rows", default="", help=f"comma-separated rows to run (default: all): {', '.join(ROWS)}")
    args = p.parse_args()
    rows = list(ROWS.values())
    if args.rows:
        chosen = [r.strip() for r in args.rows.split(",")]
        if set(chosen) - set(ROWS) or ("eager" in chosen and "int8" not in chosen):
            sys.exit(f"--rows: {args.rows!r}: choose from {', '.join(ROWS)} (eager only with int8)")
        rows = [name for key, name in ROWS.items() if key in chosen]
    torch.set_num_threads(min(torch.get_num_threads(), 2))
    model, tok = load_causal_lm(args.model, dtype="float32")
    docs = limit_documents(load_documents(args.corpus, "test"), tok, args.tokens)
    build_docs = limit_documents(load_documents(args.corpus, "train"), tok, args.build_tokens)
    originals = decoder_linears(model)
    result: dict[str, Any] = {"command": " ".join(["python", *sys.argv]), "machine": protocol.machine(),
                              "corpus": args.corpus, "rows": []}  # fmt: skip
    info: dict[str, Any] = {}
    ref = None
    for name in rows:
        fused = {f: f.mode for f in int8_lib.FUSED_OPS}
        if name == "int8, element-wise ops eager":  # the same int8 layers, their quantize and rescale op by op
            for f in fused:
                f.mode = "eager"
        else:
            for parent, attr, lin in originals:  # float32 back
                setattr(parent, attr, lin)
        if name == "int8":
            info = int8_lib.quantize_int8(model, tok)
        elif name == NO_OUTLIERS:
            int8_lib.quantize_int8(model, tok, outliers=0)
        elif name.startswith("int8, every"):
            quantize_every_linear(model, tok, originals)
        row = time_row(model, tok, docs, build_docs, ref, args.wait_idle)
        keys = row.pop("_keys")
        if ref is None:
            ref = {"keys": keys, "ppl": row["ppl"], "eval_tok_per_s": row["eval_tok_per_s"],
                   "build_entries_per_s": row["build_entries_per_s"]}  # fmt: skip
        result["rows"].append({"row": name, **row})
        print(
            f"{name}: eval {row['eval_tok_per_s']:.1f} tok/s ({row.get('eval_ratio', 1):.2f}x), build "
            f"{row['build_entries_per_s']:.1f} entries/s ({row.get('build_ratio', 1):.2f}x), ppl {row['ppl']:.5f} "
            f"({row.get('ppl_relative_difference', 0):+.3%}), key p99 {row.get('key_error_p99', 0):.3g}, load "
            f"before {row['idle_before']['load_avg_before']}",
            flush=True,
        )
        protocol.save_result(args.out, result)
        for f, mode in fused.items():
            f.mode = mode
    result["int8"] = info
    protocol.save_result(args.out, result)


if __name__ == "__main__":
    main()
