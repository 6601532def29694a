"""Where a forward pass's time goes, by component, and how many FLOPs it does.

Timing: forward pre/post hooks on the model's modules read ``time.perf_counter`` (CPU execution is synchronous, so a
module's wall time is its compute). Categories, exclusive (nested time subtracted):

* ``linear (attention q/k/v/o)`` and ``linear (FFN)``: the linear-like modules inside each layer's attention and FFN
  (found by :mod:`memlm.models.keys`' structural rules, so quantized linears count too);
* ``attention core``: the attention block less its projections (rotary, QK^T, softmax, AV: SDPA or eager);
* ``FFN activation``: the FFN block less its linears (SiLU, gate product);
* ``norms``: the norm modules (no linears) of each layer, and the final norm;
* ``embedding``; ``output projection``: from the head's input to the end of the model's forward (with
  :class:`memlm.models.forward.fp32_head` this is its float32 logits, in place of the model's own head);
* ``key capture hooks``: :class:`memlm.models.keys.KeyCapture`'s copy of each key (timed in its ``store``);
* ``rest of the model``: the model's forward less all of the above (residual adds, masks, rotary tables, Python);
* ``log-softmax, entropy, key copies out``: :func:`memlm.models.forward.forward_windows` less the model's forward
  (float32 log-softmax of the scored rows, entropy, max, the keys' ``float().cpu().numpy()``, collation).

FLOPs (multiply-adds count 2): per position, ``2 * in * out`` for every linear of the decoder layers; attention
``2 * 2 * d * (i + 1)`` at position ``i`` of a window (QK^T and AV over the causal prefix, ``d`` the attention width)
per layer; the output head ``2 * d_model * vocab`` per position it computes (every position when log-probabilities are
asked; none for a keys-only build, which stops at its key: for ``ffn_in@-1`` the last FFN is not counted either).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Sequence
from contextlib import contextmanager
from typing import Any

import torch

from memlm.models import keys as keys_lib
from memlm.models.forward import forward_windows
from memlm.models.keys import KeySpec, find_decoder_layers

CATEGORIES = (
    "linear (attention q/k/v/o)",
    "linear (FFN)",
    "attention core",
    "FFN activation",
    "norms",
    "embedding",
    "output projection",
    "key capture hooks",
    "rest of the model",
    "log-softmax, entropy, key copies out",
)


def _layer_modules(model: torch.nn.Module) -> dict[str, list[torch.nn.Module]]:
    out: dict[str, list[torch.nn.Module]] = defaultdict(list)
    for parts in keys_lib.decoder_layer_parts(model):
        for name, block in (("attn", parts.attn), ("ffn", parts.ffn)):
            if block is not None:
                out[name].append(block)
                out[f"{name}_linear"] += [lin.module for lin in keys_lib.outer_linears(block)]
        out["norm"] += parts.norms
    return out


def head_positions_scored(model: torch.nn.Module, lengths: Sequence[int], scored: int) -> int:
    """Positions the output head computes when scoring: the scored ones where memlm.models.forward asks the model for
    exactly those (a model that slices with transformers' ``slice_logits_to_keep``), else every position (an upper
    bound: the fallback keeps the positions from the batch's first scored one)."""
    from memlm.models.forward import slices_logits_by_mask

    return scored if slices_logits_by_mask(model) else sum(lengths)


def count_flops(model: torch.nn.Module, lengths: Sequence[int], head_positions: int) -> dict[str, float]:
    """FLOPs of forward passes over windows of ``lengths`` tokens with the head computed at ``head_positions``."""
    mods = _layer_modules(model)
    linear = sum(
        2 * d[0] * d[1] for m in mods["attn_linear"] + mods["ffn_linear"] if (d := keys_lib.linear_dims(m)) is not None
    )
    q_widths = [keys_lib.linear_dims(m) for m in mods["attn_linear"][:1]]  # the first projection: q
    d_attn = q_widths[0][1] if q_widths and q_widths[0] else keys_lib.decoder_layer_parts(model)[0].hidden
    n_layers = len(find_decoder_layers(model))
    head = model.get_output_embeddings()
    head_flops = 2 * head.in_features * head.out_features if hasattr(head, "in_features") else 0
    positions = sum(lengths)
    attention = n_layers * sum(2 * d_attn * L * (L + 1) for L in lengths)  # sum_i 4 d (i+1) = 2 d L (L+1)
    return {
        "linear": float(linear * positions),
        "attention": float(attention),
        "head": float(head_flops * head_positions),
        "positions": positions,
    }


@contextmanager
def _timing_hooks(model: torch.nn.Module, totals: dict[str, float]):
    """Install the hooks; ``totals`` gets inclusive seconds per group (see :func:`profile_forward`)."""
    mods = _layer_modules(model)
    groups = {
        "attn": mods["attn"],
        "attn_linear": mods["attn_linear"],
        "ffn": mods["ffn"],
        "ffn_linear": mods["ffn_linear"],
        "norm": mods["norm"],
    }
    inner = getattr(model, "model", None)
    final_norm = getattr(inner, "norm", None)
    if isinstance(final_norm, torch.nn.Module):
        groups["norm"] = [*groups["norm"], final_norm]
    groups["embedding"] = [model.get_input_embeddings()]
    handles = []
    starts: dict[int, float] = {}

    def pre(group):
        def hook(m, _args):
            starts[id(m)] = time.perf_counter()

        return hook

    def post(group):
        def hook(m, _args, _out):
            totals[group] += time.perf_counter() - starts.pop(id(m), time.perf_counter())

        return hook

    for group, modules in groups.items():
        for m in modules:
            handles += [m.register_forward_pre_hook(pre(group)), m.register_forward_hook(post(group), always_call=True)]
    head = model.get_output_embeddings()
    handles.append(head.register_forward_pre_hook(lambda m, a: starts.__setitem__("head", time.perf_counter())))
    handles.append(model.register_forward_pre_hook(lambda m, a: starts.__setitem__("model", time.perf_counter())))

    def model_end(m, _args, _out):
        end = time.perf_counter()
        totals["model"] += end - starts.pop("model", end)
        totals["head"] += end - starts.pop("head", end)

    handles.append(model.register_forward_hook(model_end, always_call=True))  # also when a key stops the pass
    store = keys_lib.KeyCapture.store

    def timed_store(self, spec, tensor):
        t0 = time.perf_counter()
        try:
            return store(self, spec, tensor)
        finally:
            totals["keys"] += time.perf_counter() - t0

    keys_lib.KeyCapture.store = timed_store
    try:
        yield
    finally:
        keys_lib.KeyCapture.store = store
        for h in handles:
            h.remove()


def profile_forward(model, batches: list, specs: Sequence[KeySpec], with_logprobs: bool, pad_id: int) -> dict:
    """Seconds per :data:`CATEGORIES` over ``batches`` (lists of windows) through
    :func:`memlm.models.forward.forward_windows`, the FLOPs, and the tokens scored."""
    totals: dict[str, float] = defaultdict(float)
    scored = 0
    with _timing_hooks(model, totals):
        t0 = time.perf_counter()
        for outputs in forward_windows(model, batches, specs, with_logprobs, pad_id=pad_id):
            scored += sum(len(o.targets) for o in outputs)
        total = time.perf_counter() - t0
    attn_lin, ffn_lin = totals["attn_linear"], totals["ffn_linear"]
    seconds = {
        "linear (attention q/k/v/o)": attn_lin,
        "linear (FFN)": ffn_lin,
        "attention core": totals["attn"] - attn_lin,
        "FFN activation": totals["ffn"] - ffn_lin,
        "norms": totals["norm"],
        "embedding": totals["embedding"],
        "output projection": totals["head"],
        "key capture hooks": totals["keys"],
    }
    seconds["rest of the model"] = totals["model"] - sum(seconds.values())
    seconds["log-softmax, entropy, key copies out"] = total - totals["model"]
    lengths = [len(w.input_ids) for b in batches for w in b]
    keys_only = not with_logprobs and bool(specs)  # forward_windows stops at the key (KeyCapture stop_after)
    scored = sum(w.n_targets for b in batches for w in b)
    head_positions = 0 if keys_only else head_positions_scored(model, lengths, scored)
    flops = count_flops(model, lengths, head_positions)
    if keys_only and all(s.role == "ffn_in" and s.layer in (-1, len(find_decoder_layers(model)) - 1) for s in specs):
        ffn = keys_lib.decoder_layer_parts(model)[-1].ffn  # the last FFN: not computed
        dims = [keys_lib.linear_dims(lin.module) for lin in (keys_lib.outer_linears(ffn) if ffn is not None else [])]
        flops["linear"] -= sum(2 * d[0] * d[1] for d in dims if d) * sum(lengths)
    return {
        "seconds_total": total,
        "seconds": seconds,
        "share": {k: v / total for k, v in seconds.items()},
        "scored_tokens": scored,
        "forward_positions": sum(lengths),
        "flops": flops,
    }


def achieved(flops: dict[str, float], seconds: float, peak_gflops: float | None) -> dict[str, Any]:
    """Achieved GFLOP/s of a run and its share of the measured peak of its dtype."""
    total = flops["linear"] + flops["attention"] + flops["head"]
    rate = total / seconds / 1e9 if seconds > 0 else None
    return {
        "gflop": total / 1e9,
        "gflops_per_s": rate,
        "share_of_peak": rate / peak_gflops if rate is not None and peak_gflops else None,
    }
