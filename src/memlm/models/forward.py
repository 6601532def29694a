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
    "logprob_statistics",
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
    length = max([1, *(len(x) for x in sequences)])
    ids = torch.full((len(sequences), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), length), dtype=torch.long)
    for b, x in enumerate(sequences):
        ids[b, : len(x)] = torch.from_numpy(np.asarray(x, dtype=np.int64))
        mask[b, : len(x)] = 1
    return ids, mask


def collate(batch: Sequence[Window], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of windows as :func:`right_pad`'s ``(input_ids, attention_mask)``."""
    return right_pad([w.input_ids for w in batch], pad_id)


class _Buffers:
    """Scratch tensors kept between batches, each grown to the largest size asked: a ``[rows, vocab]`` float32 buffer
    is 25-200 MiB, and a fresh one per batch is ``mmap``ed and touched page by page again
    (:mod:`memlm.models.allocator`)."""

    def __init__(self) -> None:
        self._flat: dict[str, torch.Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
        size = int(np.prod(shape))
        flat = self._flat.get(name)
        if flat is None or flat.numel() < size or flat.device != device:
            flat = self._flat[name] = torch.empty(size, dtype=torch.float32, device=device)
        return flat[:size].view(shape)


class fp32_head:  # noqa: N801 - used like a function: ``with fp32_head(model): ...``
    """Within the block the model's output projection (``get_output_embeddings()``) computes float32 logits.

    A bfloat16 body returns bfloat16 logits: for logits of 16-32 that is about +-0.06 nats of rounding per logit,
    which casting afterwards cannot undo. Here the head's ``forward`` is replaced by
    ``z = float32(h) W^T (+ b)``, computed from the same (bf16) final hidden state ``h`` with float32 weights, so the
    log-softmax (Eq. 3's p_LM) sees float32 logits whatever the body's dtype (hooks on the head still run: the
    ``final`` key is its input). Logit post-processing the model does after its head (e.g. soft-capping) then runs on
    float32. A head that is not an ``nn.Linear`` (quantized) is left as it is; so is a float32 head unless
    ``reuse_output``.

    Where bfloat16 products are fast (:func:`memlm.models.compute.bf16_products_available`: a CPU with AMX-BF16),
    ``h`` is bfloat16 and ``W`` holds bfloat16 values (a bf16 model's head), the product runs as bfloat16 products
    with float32 sums (oneDNN's ``fp32_precision = "bf16"``). Both factors are exactly bf16 values, so every product
    ``h_i W_ji`` is exact in float32 and only the sums round, as in a float32 product: the logits agree with
    ``float64(h) float64(W)^T`` to float32 rounding (tests/test_forward.py), against the 2^-9 of bf16 logits.
    ``bf16_products=False`` keeps the float32 product.

    ``reuse_output``: the logits are written row block by row block into one buffer kept between calls, so the
    returned tensor is overwritten by the next call: for a caller that reads each batch's logits before the next
    (:func:`forward_windows`). The float32 weights are made once per instance: reuse one instance across batches (it
    can be entered many times).
    """

    rows_per_block = 1024  # logit rows per product (SmolLM2: 192 MiB of float32 logits)

    def __init__(self, model: torch.nn.Module, reuse_output: bool = False, bf16_products: bool | None = None) -> None:
        from memlm.models.compute import bf16_products_available
        from memlm.models.cpu import warn_if_emulated

        get = getattr(model, "get_output_embeddings", None)
        head = get() if callable(get) else None
        linear = isinstance(head, torch.nn.Linear)
        self.head = head if linear and (head.weight.dtype != torch.float32 or reuse_output) else None
        self.reuse_output = reuse_output
        self._buffers = _Buffers()
        self._saved_forward = None
        self.bf16_products = False
        if self.head is not None:
            self.weight = self.head.weight.detach().float()
            if self.head.weight.dtype == torch.bfloat16:  # bf16 values, exact in bf16 products
                warn_if_emulated(torch.bfloat16, self.weight.device)  # a bf16 model built outside load_causal_lm
                available = bf16_products_available(self.weight.device)
                self.bf16_products = available if bf16_products is None else bf16_products
            self.bias = self.head.bias.detach().float() if self.head.bias is not None else None

    @property
    def arithmetic(self) -> str:
        """How the logits are computed: ``model`` (the model's own head), ``float32``, or ``bf16-products`` (exact
        bf16 products with float32 sums, on bf16 final hidden states)."""
        return "model" if self.head is None else "bf16-products" if self.bf16_products else "float32"

    def _forward(self, h: torch.Tensor) -> torch.Tensor:
        with torch.autocast(h.device.type, enabled=False):
            bf16 = self.bf16_products and h.dtype == torch.bfloat16  # a bf16 h is exact in bf16 products
            lead, x = h.shape[:-1], h.reshape(-1, h.shape[-1]).float()
            n, vocab = x.shape[0], self.weight.shape[0]
            if not self.reuse_output and not bf16:
                return torch.nn.functional.linear(x, self.weight, self.bias).view(*lead, vocab)
            out = (self._buffers.get("logits", (n, vocab), x.device) if self.reuse_output
                   else torch.empty(n, vocab, device=x.device))  # fmt: skip
            with _bf16_products() if bf16 else contextlib.nullcontext():
                for lo in range(0, n, self.rows_per_block):
                    rows = slice(lo, min(n, lo + self.rows_per_block))
                    block = torch.mm(x[rows], self.weight.t(), out=out[rows])
                    if self.bias is not None:
                        block.add_(self.bias)
            return out.view(*lead, vocab)

    def __enter__(self) -> fp32_head:
        if self.head is not None:
            self._saved_forward = self.head.__dict__.get("forward")
            self.head.forward = self._forward
        return self

    def __exit__(self, *exc: object) -> None:
        if self.head is not None:
            if self._saved_forward is None:
                self.head.__dict__.pop("forward", None)
            else:
                self.head.forward = self._saved_forward
            self._saved_forward = None


@contextlib.contextmanager
def _bf16_products() -> Iterator[None]:
    """Within the block oneDNN computes float32 matmuls as bfloat16 products with float32 sums."""
    matmul = torch.backends.mkldnn.matmul
    before = matmul.fp32_precision
    matmul.fp32_precision = "bf16"
    try:
        yield
    finally:
        matmul.fp32_precision = before


def logprob_statistics(
    logits: torch.Tensor, targets: torch.Tensor, buffers: _Buffers | None = None, rows_per_block: int = 128
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``log p(target)``, ``max_w log p(w)`` and ``H(p)`` (:func:`lm_entropy`) of each row of float32 ``logits``
    ``[n, V]`` with ``p = softmax(logits)``: the LM terms of one window.

    Row block by row block into two ``[rows_per_block, V]`` buffers, so the log-softmax and the entropy's products
    are read back from cache instead of from three fresh ``[n, V]`` tensors. Every operation is per row, so the values
    are the same as on the whole ``[n, V]`` at once (tests/test_forward.py checks equality).
    """
    buffers = buffers or _Buffers()
    n, vocab = logits.shape
    lp, max_lp, entropy = (torch.empty(n, device=logits.device) for _ in range(3))
    for lo in range(0, n, rows_per_block):
        rows = slice(lo, min(n, lo + rows_per_block))
        shape = (rows.stop - lo, vocab)
        logp = torch.log_softmax(logits[rows].float(), -1, out=buffers.get("logp", shape, logits.device))
        lp[rows] = logp.gather(-1, targets[rows, None]).squeeze(-1)
        max_lp[rows] = logp.amax(-1)
        entropy[rows] = lm_entropy(logp, out=buffers.get("terms", shape, logits.device))
    return lp.cpu().numpy(), max_lp.cpu().numpy(), entropy.cpu().numpy()


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
    head = fp32_head(model, reuse_output=True) if with_logprobs else contextlib.nullcontext()
    buffers = _Buffers()
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
                lm_lp, max_lp, entropy = logprob_statistics(logit_rows(out.logits, b), targets, buffers)
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


def lm_entropy(logp: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """H(p) = -sum_w p(w) log p(w) per row of log-probabilities ``logp`` [n, V], with 0 log 0 = 0.

    One [n, V] buffer beside ``logp`` (``out``, when given: overwritten). Rows with a -inf log-probability (a model
    that masks tokens) give 0 * -inf = nan in the product; only those rows are summed again with 0 for it.
    """
    terms = (logp.exp() if out is None else torch.exp(logp, out=out)).mul_(logp)
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
