"""Which layers `--quantize int8` should keep in float32 (issue 34, session 44): perplexity change against float32 on
WikiText-2 **valid** (not test) for variants of the int8 rule, one JSON line per variant in ``scan.jsonl``
(resumable: variants already there are skipped).

    HF_HUB_OFFLINE=1 PYTHONPATH=src python docs/results/speed/int8_selection_outliers/scan.py alpha
    HF_HUB_OFFLINE=1 PYTHONPATH=src python docs/results/speed/int8_selection_outliers/scan.py layers
    HF_HUB_OFFLINE=1 PYTHONPATH=src python docs/results/speed/int8_selection_outliers/scan.py outliers

``alpha``: SmoothQuant's migration strength over 0.3-0.8 with the session-41 rule. ``layers``: the session-41 rule
with every attention projection or every gate/up projection kept in float32, then with each decoder layer in turn
kept in float32 (``alpha`` and ``layers`` call ``quantize_int8`` with ``outliers=0``: the session-41 rule).
``outliers``: the library's int8 path (session 44) with 8, 0, 16 or 4 outlier input channels multiplied in float32
(``memlm.models.int8.OUTLIER_CHANNELS``).
Not timed: the machine's load is not checked, and the rows say nothing of speed.
"""

from __future__ import annotations

import copy
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

import memlm.models.int8 as I
from memlm.data.corpora import load_documents
from memlm.data.windows import limit_documents
from memlm.knnlm.evaluate import lm_scores
from memlm.models.keys import find_decoder_layers
from memlm.models.resources import load_causal_lm

# token limits that whole articles fill: the first 4 (9,175 tokens) for alpha, 9 (35,467) for the others
TOKENS = {"alpha": 20_000, "layers": 36_000, "outliers": 36_000}
OUT = Path(__file__).with_name("scan.jsonl")
torch.set_num_threads(2)
original = I.linears_to_quantize


def keep_float32(model, layers: list[int] | None, roles: tuple[str, ...]):
    """``linears_to_quantize`` without the ``roles`` linears (``attn``: all but the gate/up ones; ``ffn``: gate/up)
    of decoder layers ``layers`` (None: all)."""
    decoder = list(find_decoder_layers(model))
    inside = {id(m) for i in (range(len(decoder)) if layers is None else layers) for m in decoder[i].modules()}

    def patched(m):
        targets, ups = original(m)
        kept = [t for t in targets if not (id(t[2]) in inside and ("ffn" if id(t[2]) in ups else "attn") in roles)]
        assert len(kept) < len(targets), (layers, roles)
        return kept, ups

    return patched


def main() -> None:
    what = sys.argv[1]
    rows = [json.loads(line) for line in OUT.open()] if OUT.exists() else []
    done = {r["variant"] for r in rows if r["split"] == what}
    base, tok = load_causal_lm("smollm2-135m", dtype="float32")
    docs = limit_documents(load_documents("wikitext2", "valid"), tok, TOKENS[what])

    def logprobs(model) -> np.ndarray:
        ts, _, _ = lm_scores(model, tok, docs, [], 1024, 512, 4, False)
        return ts.lm_logprob.astype(np.float64)

    ref = logprobs(base)
    n_layers = len(find_decoder_layers(base))
    if what == "alpha":
        variants = [(f"alpha={a}", a, None) for a in (0.3, 0.4, 0.5, 0.6, 0.7, 0.8)]
    elif what == "outliers":
        variants = [(f"outliers={k}", I.ALPHA, None) for k in (8, 0, 16, 4)]
    else:
        both = ("attn", "ffn")
        variants = [("session-41 rule", I.ALPHA, None), ("keep attn all", I.ALPHA, (None, ("attn",))),
                    ("keep ffn all", I.ALPHA, (None, ("ffn",)))]  # fmt: skip
        variants += [(f"keep layer {i}", I.ALPHA, ([i], both)) for i in range(n_layers - 1)]
    for name, alpha, keep in variants:
        if name in done:
            continue
        t = time.perf_counter()
        model = copy.deepcopy(base)
        I.linears_to_quantize = original if keep is None else keep_float32(model, *keep)
        outliers = int(name.split("=")[1]) if what == "outliers" else 0  # 0: the session-41 rule
        record = I.quantize_int8(model, tok, alpha=alpha, outliers=outliers)
        lp = logprobs(model)
        row = {
            "split": what,
            "variant": name,
            "alpha": alpha,
            "ppl_change": float(np.exp(ref.mean() - lp.mean()) - 1),
            "tokens": int(lp.size),
            "quantized_linears": record["quantized_linears"],
            "seconds": round(time.perf_counter() - t, 1),
        }
        print(json.dumps(row), flush=True)
        with OUT.open("a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
