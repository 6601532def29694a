"""One forward pass over sliding windows: the LM's log-probability of each target and the keys h_ds at its context.

Shared by datastore building (keys only) and evaluation (keys as queries, plus the LM term of Eq. 3), so a datastore
key and an evaluation query for the same context are computed by exactly the same code.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from memlm.data.windows import TokenChunk, Window, batched, sliding_windows
from memlm.errors import MemlmError
from memlm.models.keys import KeyCapture, KeySpec

__all__ = [
    "RollingScores",
    "WindowOutput",
    "collate",
    "forward_windows",
    "fp32_head",
    "lm_entropy",
    "rolling_forward",
    "slices_logits_by_mask",
]


@dataclass
class WindowOutput:
    """Per scored target of one window (n = window.n_targets)."""

    window: Window
    targets: np.ndarray  # [n] int64
    keys: dict[KeySpec, np.ndarray]  # spec -> [n, D] float32: h_ds at the position before each target
    lm_logprob: np.ndarray | None  # [n] float32: log p_LM(target | context), None when not asked
    lm_entropy: np.ndarray | None = None  # [n] float32: H(p_LM(. | context)) (adaptive retrieval's gate features)
    lm_max_logprob: np.ndarray | None = None  # [n] float32: max_w log p_LM(w | context)


def _takes_logits_to_keep(model: torch.nn.Module) -> bool:
    try:
        return "logits_to_keep" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def model_device(model: torch.nn.Module) -> torch.device:
    """Where ``model``'s parameters are (its inputs go there)."""
    return next(model.parameters()).device


def right_pad(sequences: Sequence[np.ndarray], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad token id arrays into ``(input_ids, attention_mask)``, both ``[B, max length]``.

    Right padding is safe for causal LMs: no real position attends to the padding on its right.
    """
    length = max(len(x) for x in sequences)
    ids = torch.full((len(sequences), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), length), dtype=torch.long)
    for b, x in enumerate(sequences):
        ids[b, : len(x)] = torch.from_numpy(np.asarray(x, dtype=np.int64))
        mask[b, : len(x)] = 1
    return ids, mask


def collate(batch: Sequence[Window], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of windows as :func:`right_pad`'s ``(input_ids, attention_mask)``."""
    return right_pad([w.input_ids for w in batch], pad_id)


class fp32_head:  # noqa: N801 - used like a function: ``with fp32_head(model): ...``
    """Within the block the model's output projection (``get_output_embeddings()``) runs in float32 on its input.

    A bfloat16 body returns bfloat16 logits: for logits of 16-32 that is about +-0.06 nats of rounding per logit,
    which casting afterwards cannot undo. Here a forward hook replaces the head's output by
    ``z = float32(h) W^T (+ b)`` computed from the same (bf16) final hidden state ``h`` with float32 weights, so the
    log-softmax (Eq. 3's p_LM) sees float32 logits whatever the body's dtype. Logit post-processing the model does
    after its head (e.g. soft-capping) then runs on float32. A float32 head, or a head that is not an
    ``nn.Linear`` (quantized), is left as it is. The float32 weights are made once per instance: reuse one instance
    across batches (it can be entered many times).
    """

    def __init__(self, model: torch.nn.Module) -> None:
        get = getattr(model, "get_output_embeddings", None)
        head = get() if callable(get) else None
        self.head = head if isinstance(head, torch.nn.Linear) and head.weight.dtype != torch.float32 else None
        self._handle = None
        if self.head is not None:
            self.weight = self.head.weight.detach().float()
            self.bias = self.head.bias.detach().float() if self.head.bias is not None else None

    def _hook(self, _m: torch.nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        with torch.autocast(args[0].device.type, enabled=False):
            return torch.nn.functional.linear(args[0].float(), self.weight, self.bias)

    def __enter__(self) -> fp32_head:
        if self.head is not None:
            self._handle = self.head.register_forward_hook(self._hook)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None


@torch.inference_mode()
def forward_windows(
    model: torch.nn.Module,
    batches: Iterable[list[Window]],
    key_specs: Sequence[KeySpec] = (),
    with_logprobs: bool = True,
    pad_id: int = 0,
) -> Iterator[list[WindowOutput]]:
    """Run ``model`` on each batch of windows; yield one :class:`WindowOutput` per window.

    Windows in a batch are right-padded (causal attention never looks right, and the mask excludes padding).
    Keys are returned in float32 regardless of the model's dtype; the output projection and the LM log-softmax are
    computed in float32 (:func:`fp32_head`) when log-probabilities are asked for.
    """
    device = model_device(model)
    specs = list(key_specs)
    head = fp32_head(model) if with_logprobs else contextlib.nullcontext()
    # keys only (a datastore build): the output projection of the last position alone, where the model allows it
    # (Hugging Face's logits_to_keep), instead of [batch, window, vocab] logits nobody reads; not for the ``final``
    # key, which is captured at that projection's input
    no_final = all(s.role != "final" for s in specs)
    keys_only = not with_logprobs and no_final
    takes_keep = _takes_logits_to_keep(model)
    skip_head = {"logits_to_keep": 1} if keys_only and takes_keep else {}
    # scoring: logits only for the positions each window scores (a sliding window scores its last ``stride``
    # positions: half of them at window 1024 / stride 512), not [batch, window, vocab]; the kept logits are the same
    # numbers, so the perplexity and keys do not move (tests/test_forward.py)
    keep = None
    if with_logprobs and no_final and takes_keep:
        keep = "mask" if slices_logits_by_mask(model) else "positions"
    # keys only: the pass also stops once every key is captured (KeyCapture's stop_after), so the layers above the
    # deepest key (for ffn_in@-1: the last FFN, the final norm, the head) are not computed; the keys are the same
    stop = not with_logprobs and bool(specs)
    for batch in batches:
        ids, mask = (t.to(device) for t in collate(batch, pad_id))
        kept, logit_rows = _scored_logits(batch, ids.shape, device, keep) if with_logprobs else (skip_head, None)
        with KeyCapture(model, specs, stop_after=stop) as cap, head:
            run = cap.run if stop else model
            out = run(input_ids=ids, attention_mask=mask, use_cache=False, **kept)
            captured = {s: cap.keys_by_spec[s] for s in specs}
        outputs = []
        for b, w in enumerate(batch):
            if w.score_from < 1:
                # position score_from - 1 would wrap to the window's last position (or padding): future text
                raise MemlmError(f"window {w.index} scores from position {w.score_from}; it must be at least 1")
            rows = torch.arange(w.score_from - 1, len(w.input_ids) - 1, device=device)  # positions before targets
            targets = torch.from_numpy(w.targets).to(device)
            keys = {s: captured[s][b, rows].float().cpu().numpy() for s in specs}
            lm_lp = entropy = max_lp = None
            if with_logprobs:
                logp = torch.log_softmax(logit_rows(out.logits, b).float(), -1)  # [n, V]
                lm_lp = logp.gather(-1, targets[:, None]).squeeze(-1).cpu().numpy()
                max_lp = logp.amax(-1).cpu().numpy()
                entropy = lm_entropy(logp).cpu().numpy()
            outputs.append(WindowOutput(w, w.targets, keys, lm_lp, entropy, max_lp))
        yield outputs


@functools.cache
def _class_slices_by_mask(cls: type) -> bool:
    try:
        return "slice_logits_to_keep" in inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False


def slices_logits_by_mask(model: torch.nn.Module) -> bool:
    """Whether ``model`` slices its head's input with transformers' ``slice_logits_to_keep``, which takes a boolean
    ``[batch, length]`` mask (every architecture of transformers 5; older or remote code may take an int or a 1-D
    tensor of positions only). Read once per model class."""
    return _class_slices_by_mask(type(model))


RowReader = Callable[[torch.Tensor, int], torch.Tensor]  # (logits, b) -> window b's scored rows [n, V]


def _scored_logits(
    batch: Sequence[Window], shape: torch.Size, device: torch.device, keep: str | None
) -> tuple[dict, RowReader]:
    """The ``logits_to_keep`` argument of a scoring batch and how to read window ``b``'s scored rows from the logits.

    ``keep``: ``"mask"``, a boolean mask of exactly the scored positions (the model returns them flattened, window
    after window); ``"positions"``, the positions from the first any window scores; None, every position.
    """
    spans = [(w.score_from - 1, len(w.input_ids) - 1) for w in batch]  # positions before each scored target
    if keep == "mask":
        mask = torch.zeros(shape, dtype=torch.bool)
        for b, (lo, hi) in enumerate(spans):
            mask[b, lo:hi] = True
        offsets = np.cumsum([0] + [hi - lo for lo, hi in spans])
        return {"logits_to_keep": mask.to(device)}, lambda logits, b: logits[offsets[b] : offsets[b + 1]]
    first = min(lo for lo, _ in spans) if keep == "positions" else 0  # row 0 of the logits is this position
    kept = {"logits_to_keep": torch.arange(first, shape[1], device=device)} if first > 0 else {}
    return kept, lambda logits, b: logits[b, spans[b][0] - first : spans[b][1] - first]


def lm_entropy(logp: torch.Tensor) -> torch.Tensor:
    """H(p) = -sum_w p(w) log p(w) per row of log-probabilities ``logp`` [n, V], with 0 log 0 = 0.

    One [n, V] buffer beside ``logp``. Rows with a -inf log-probability (a model that masks tokens) give 0 * -inf =
    nan in the product; only those rows are summed again with 0 for it.
    """
    terms = logp.exp().mul_(logp)
    entropy = -terms.sum(-1)
    bad = entropy.isnan()
    if bool(bad.any()):
        entropy[bad] = -terms[bad].nan_to_num(nan=0.0).sum(-1)
    return entropy


class RollingScores(NamedTuple):
    """:func:`rolling_forward`'s result, per scored target in document order."""

    lm_logprob: np.ndarray  # [N] float32: log p_LM(target | context)
    targets: np.ndarray  # [N] int64
    doc_index: np.ndarray  # [N] int32
    keys: dict[KeySpec, np.ndarray]  # spec -> [N, D] float32: the key at each target's context
    lm_entropy: np.ndarray  # [N] float32: H(p_LM(. | context)) (a learned mixture's LM features)
    lm_max_logprob: np.ndarray  # [N] float32: max_w log p_LM(w | context)


def rolling_forward(
    model: torch.nn.Module,
    token_lists: Sequence[Sequence[int]],
    key_specs: Sequence[KeySpec] = (),
    window: int = 1024,
    min_context: int = 512,
    batch_size: int = 4,
    prefix_id: int = 0,
    pad_id: int = 0,
) -> RollingScores:
    """Every token of every document scored on its own, after ``prefix_id``: lm-evaluation-harness's
    ``loglikelihood_rolling`` protocol, through memlm's sliding windows (linear in document length).

    Each stream ``[prefix_id] + tokens`` is cut by :func:`memlm.data.windows.sliding_windows` (no context crosses a
    document boundary); windows of different documents share batches. Returns :class:`RollingScores` in document
    order, ``N = sum(len(tokens))``.
    """
    specs = list(key_specs)
    chunks = [
        TokenChunk(np.asarray([prefix_id, *t], dtype=np.int64), i, 0) for i, t in enumerate(token_lists) if len(t)
    ]
    windows = itertools.chain.from_iterable(sliding_windows([c], window, min_context) for c in chunks)
    lm, targets, docs, entropy, max_lp = [], [], [], [], []
    keys: dict[KeySpec, list[np.ndarray]] = {s: [] for s in specs}
    for outputs in forward_windows(model, batched(windows, batch_size), specs, pad_id=pad_id):
        for o in outputs:
            lm.append(o.lm_logprob)
            entropy.append(o.lm_entropy)
            max_lp.append(o.lm_max_logprob)
            targets.append(o.targets)
            docs.append(o.window.doc_index[o.window.score_from :])
            for s in specs:
                keys[s].append(o.keys[s])
    if not targets:
        raise MemlmError("no document has a token to score; give some text")
    return RollingScores(
        np.concatenate(lm).astype(np.float32),
        np.concatenate(targets).astype(np.int64),
        np.concatenate(docs).astype(np.int32),
        {s: np.concatenate(v) for s, v in keys.items()},
        np.concatenate(entropy).astype(np.float32),
        np.concatenate(max_lp).astype(np.float32),
    )
