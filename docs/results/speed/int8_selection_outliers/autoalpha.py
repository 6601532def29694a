"""Where `--quantize int8`'s perplexity change comes from, and whether a SmoothQuant α per input group helps (issue 34,
session 44). Rows go to ``scan.jsonl`` with ``"split": "autoalpha"`` (resumable), perplexity change against float32
on the first 9 articles of WikiText-2 **valid** (35,467 tokens), the same slice as ``scan.py layers``:

    HF_HUB_OFFLINE=1 PYTHONPATH=src python docs/results/speed/int8_selection_outliers/autoalpha.py

- ``fake w+a``, ``fake w``, ``fake a``: the session-41 rule simulated in float32 (``dequant(q(x/σ)) ·
  dequant(q(Wσ))ᵀ``), with both quantized, only the weights, only the activations.
- ``auto alpha grid=...``: the real int8 path with α chosen per input group (gate/up share one; q, k, v, o each
  their own) as the grid value whose simulated output error Σ‖y − ŷ‖² over the calibration text is least.
- ``fake w+a outliers=K``: simulated, with each input's K channels of largest calibration maxima left out of the
  quantized product and multiplied in float32 (LLM.int8()'s decomposition; the rule ``memlm.models.int8`` took).
Not timed.
"""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

import memlm.models.int8 as I
from memlm.data.corpora import load_documents
from memlm.data.windows import limit_documents
from memlm.knnlm.evaluate import lm_scores
from memlm.models.resources import load_causal_lm

OUT = Path(__file__).with_name("scan.jsonl")
torch.set_num_threads(2)


def dequantized(x: torch.Tensor) -> torch.Tensor:
    q, s = I.quantize_rows(x)
    return q.float() * s


class FakeQuant(nn.Module):
    """``outliers``: input channels (indices) multiplied in float32 and left out of the int8 product."""

    def __init__(self, linear: nn.Linear, smooth: torch.Tensor, weights: bool, acts: bool, outliers=None):
        super().__init__()
        w0 = linear.weight.detach().float()
        mask = torch.ones_like(smooth)
        if outliers is not None:
            mask[outliers] = 0
            self.w_out = w0[:, outliers]
        self.outliers = outliers
        w = w0 * (smooth * mask)[None, :]
        self.w = dequantized(w) if weights else w
        self.inv, self.acts, self.bias = mask / smooth, acts, linear.bias

    def forward(self, x):
        x0 = x.reshape(-1, x.shape[-1]).float()
        x2 = x0 * self.inv
        y = (dequantized(x2) if self.acts else x2) @ self.w.t()
        if self.outliers is not None:
            y = y + x0[:, self.outliers] @ self.w_out.t()
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], -1)


def groups_of(model, tok):
    """The library's targets, calibration batches, input maxima and σ groups (as ``quantize_int8`` forms them)."""
    targets, ups = I.linears_to_quantize(model)
    linears = [t[2] for t in targets]
    batches = I.calibration_batches(tok, None, I.CALIBRATION_TOKENS)
    absmax, groups = I.input_absmax(model, linears, batches)
    groups = [g2 for g in groups for g2 in ([g] if all(id(linears[i]) in ups for i in g) else [[i] for i in g])]
    return targets, linears, batches, absmax, groups


def fake(model, tok, weights: bool, acts: bool, k: int = 0) -> None:
    targets, linears, _, absmax, groups = groups_of(model, tok)
    for g in groups:
        a = torch.stack([absmax[i] for i in g]).amax(0)
        outliers = torch.topk(a, k).indices.sort().values if k else None
        smooth = I.smooth_factor(a, [linears[i].weight for i in g])
        for i in g:
            parent, name, lin = targets[i]
            setattr(parent, name, FakeQuant(lin, smooth, weights, acts, outliers))


def auto_alpha(model, tok, grid: list[float]) -> dict[int, float]:
    """id(first weight of a group) -> the grid α with the least simulated output error on the calibration text."""
    targets, linears, batches, absmax, groups = groups_of(model, tok)
    err = {gi: np.zeros(len(grid)) for gi in range(len(groups))}
    cand: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}  # linear index -> per α (1/σ, dequantized Wσ)
    group_of = {i: gi for gi, g in enumerate(groups) for i in g}
    for g in groups:
        a = torch.stack([absmax[i] for i in g]).amax(0)
        for al in grid:
            s = I.smooth_factor(a, [linears[i].weight for i in g], al)
            for i in g:
                cand.setdefault(i, []).append((1 / s, dequantized(linears[i].weight.detach().float() * s[None, :])))
    index = {id(lin): i for i, lin in enumerate(linears)}

    def hook(mod, inp, out):
        i = index[id(mod)]
        x = inp[0].reshape(-1, inp[0].shape[-1]).float()
        y = x @ mod.weight.float().t()
        for k, (inv, wd) in enumerate(cand[i]):
            err[group_of[i]][k] += float(((dequantized(x * inv) @ wd.t() - y) ** 2).sum())

    hs = [lin.register_forward_hook(hook) for lin in linears]
    with torch.inference_mode():
        for b in batches[:2]:
            model(input_ids=b, use_cache=False)
    for h in hs:
        h.remove()
    return {id(linears[g[0]].weight): grid[int(np.argmin(err[gi]))] for gi, g in enumerate(groups)}


def main() -> None:
    rows = [json.loads(line) for line in OUT.open()] if OUT.exists() else []
    done = {r["variant"] for r in rows if r["split"] == "autoalpha"}
    base, tok = load_causal_lm("smollm2-135m", dtype="float32")
    docs = limit_documents(load_documents("wikitext2", "valid"), tok, 36_000)

    def logprobs(model) -> np.ndarray:
        ts, _, _ = lm_scores(model, tok, docs, [], 1024, 512, 4, False)
        return ts.lm_logprob.astype(np.float64)

    ref = logprobs(base)
    grid = [round(0.1 * k, 1) for k in range(11)]
    original_smooth = I.smooth_factor
    variants = ["fake w+a", "fake w", "fake a", f"auto alpha grid={grid[0]}..{grid[-1]}"]
    variants += [f"fake w+a outliers={k}" for k in (8, 32, 2, 4)]
    for name in variants:
        if name in done:
            continue
        t = time.perf_counter()
        model = copy.deepcopy(base)
        extra = {}
        if name.startswith("fake"):
            parts = name.split()
            k = int(parts[2].split("=")[1]) if len(parts) > 2 else 0
            fake(model, tok, "w" in parts[1], "a" in parts[1], k)
        else:
            chosen = auto_alpha(model, tok, grid)
            extra["alphas"] = sorted(chosen.values())
            I.smooth_factor = lambda a, ws, alpha=0.5, c=chosen: original_smooth(a, ws, c[id(ws[0])])
            I.quantize_int8(model, tok)
            I.smooth_factor = original_smooth
        lp = logprobs(model)
        row = {"split": "autoalpha", "variant": name, "ppl_change": float(np.exp(ref.mean() - lp.mean()) - 1),
               "tokens": int(lp.size), "seconds": round(time.perf_counter() - t, 1), **extra}  # fmt: skip
        print(json.dumps(row), flush=True)
        with OUT.open("a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
