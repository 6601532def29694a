"""Int8 matrix products with per-token activation scales and SmoothQuant smoothing: the ``--quantize int8`` compute
path (opt-in, see :mod:`memlm.models.compute`).

Each quantized linear layer ``y = x Wᵀ`` of the decoder computes (Xiao et al. 2023, "SmoothQuant", Eqs. 1-4, with
the per-token activation and per-channel weight granularity of their Table 2):

    x' = x / σ            W' = W · diag(σ)                          (Eq. 3: the same product, outliers moved to W)
    s_x[t] = max_j |x'[t, j]| / 127        s_w[o] = max_j |W'[o, j]| / 127
    y[t, o] = s_x[t] · s_w[o] · Σ_j round(x'[t, j] / s_x[t]) · round(W'[o, j] / s_w[o])

with the integer sum by ``torch._int_mm`` (int8 × int8 → int32: VNNI or AMX-INT8 where the CPU has them) and
``σ_j = max|X_j|^α / max|W_j|^(1-α)`` (Eq. 4, α = 0.5) from the largest input activations seen on a calibration
text (:data:`CALIBRATION_TOKENS` tokens of the ``wiki`` corpus' train split unless given). The
:data:`OUTLIER_CHANNELS` input channels with the largest calibration maxima (a set O per input) leave the int8
product and are multiplied in float32 (Dettmers et al. 2022, "LLM.int8()", Sec. 3.2, mixed-precision decomposition,
with O fixed at calibration instead of found per batch):

    y[t, o] = Σ_{j∈O} x[t, j] · W[o, j] + s_x[t] · s_w[o] · Σ_{j∉O} round(x'[t, j] / s_x[t]) · round(W'[o, j] / s_w[o])

with s_x and s_w taken over the channels outside O. On SmolLM2-135M (the first 9 articles of WikiText-2
valid, 35,467 tokens: ``docs/results/speed/int8_selection_outliers/``) this took the perplexity change from +0.35%
to +0.09%: simulated, the weights' rounding gave +0.12% and the activations' +0.21%; the outlier channels set the
per-token scale of every other channel and, once smoothed, the per-row scale of the weights.

Which layers stay float32 (SmolLM2-135M, ``docs/results/performance.md``): every feed-forward *down* projection
(its input, SiLU(gate) × up, carries the activation outliers no per-token scale absorbs) and every linear layer of the
*last* decoder layer (its output goes straight into the head; a per-layer scan in a scratch run, not kept, found int8
weights costliest there). Quantizing every decoder linear instead: +0.84% perplexity on the first 19,711 WikiText-2
test tokens against +0.11% (``docs/results/speed/int8_layer_ablation.json``). The output head stays float32, so the LM
log-softmax does too. Layers that read the same tensor and are feed-forward up projections (gate and up) share one σ
and quantize their input once; the attention projections keep a σ each (one σ over q/k/v cost more perplexity on
WikiText-2 valid: ``docs/results/speed/int8_selection_layers/``).

Perplexity moves by +0.10% on all of WikiText-2 test (95% interval over its 62 documents +0.07% to +0.13%:
``docs/results/speed/ppl_intervals_int8.json``), within a 0.2% bound; without the outlier channels it
moved by +0.35% on WikiText-2 valid (``docs/results/speed/int8_selection_outliers/``). Keys move by p99 0.046
relative (0.062 without; bfloat16's: 0.028; ``docs/results/speed/key_error_avx512_int8.json``), past
:data:`memlm.models.compute.KEY_TOLERANCE` alone, so a float32 datastore is refused to an int8 query. Not memlm's
default: it needs a calibration text and a C++ compiler for its fused element-wise ops to pay, on a CPU with AMX it is
slower than bfloat16 (0.79x eval, 0.43x build: ``docs/results/speed/default_vs_old_amx_int8.json``), and on
x86 CPUs without VNNI or AMX-INT8 torch's int8 products saturate or, exact, run ~24x slower than float32's, so the
path is refused there (:func:`int8_products_exact`, :func:`int8_products_native`). FBGEMM's 7-bit product, which
cannot saturate there (:class:`ReducedRangeInt8Linear`), moved perplexity by +0.46% (+0.41% to +0.52%) on all of
WikiText-2 test (303,288 tokens) on an AVX2 EPYC at 1.21x float32's speed (:data:`REDUCED_RANGE_AVX2`): past the 0.2%
bound, so it is refused too (:func:`int8_linear_class`).

torch's dynamic int8 linear (``--quantize int8-dynamic``) uses one activation scale per batch instead, which
SmolLM2's outliers defeat (+283% perplexity).
"""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from memlm.errors import MemlmError
from memlm.models.compiling import compile_dynamic
from memlm.models.keys import _up_down_pairs, decoder_layer_parts, outer_linears

__all__ = [
    "ALPHA",
    "CALIBRATION_TOKENS",
    "INT8_FEATURES",
    "OUTLIER_CHANNELS",
    "FUSED_OPS",
    "FusedOps",
    "Int8Linear",
    "PPL_BOUND",
    "REDUCED_RANGE_AVX2",
    "ReducedRangeInt8Linear",
    "SharedInput",
    "fbgemm_available",
    "input_absmax",
    "int8_linear_class",
    "linears_to_quantize",
    "quantize_int8",
    "reduced_range_adopted",
    "smooth_factor",
]

#: SmoothQuant's migration strength (their default for most models; Xiao et al. 2023, Sec. 4)
ALPHA = 0.5
#: calibration tokens: the per-channel maxima settle within a few windows (σ moves by < 1% from 2k to 4k tokens)
CALIBRATION_TOKENS = 2048
#: input channels per layer input multiplied in float32 instead (the largest calibration maxima; Dettmers et al. 2022,
#: "LLM.int8()", Sec. 3.2, by count rather than their 6.0 threshold): SmolLM2-135M, WikiText-2 valid
OUTLIER_CHANNELS = 8


@functools.cache
def int8_products_exact() -> bool:
    """Whether ``torch._int_mm`` sums int8 products exactly on this machine (checked once per process against int64
    arithmetic on the largest values: ±127 times ±127, 512 terms). x86 kernels without VNNI or AMX-INT8 multiply
    with ``vpmaddubsw``, whose 16-bit pair sums saturate (255 × 127 × 2 > 32,767): there the product is wrong."""
    g = torch.Generator().manual_seed(0)
    a = (torch.randint(0, 2, (64, 512), generator=g) * 254 - 127).to(torch.int8)
    b = (torch.randint(0, 2, (96, 512), generator=g) * 254 - 127).to(torch.int8)
    a[0], b[0] = 127, 127  # one all-positive row and column: the largest sum
    a[1, :256], a[1, 256:] = 127, -127
    want = a.long() @ b.long().t()
    return bool(torch.equal(torch._int_mm(a, b.t()).long(), want))


#: CPU features with int8 dot-product instructions, where ``torch._int_mm`` is fast (x86 as /proc/cpuinfo names them;
#: Arm's i8mm)
INT8_FEATURES = ("avx512_vnni", "avx_vnni", "amx_int8", "i8mm")


def int8_products_native() -> bool:
    """Whether this CPU has int8 dot-product instructions (:data:`INT8_FEATURES`). Without them ``torch._int_mm``
    either saturates (:func:`int8_products_exact`) or is exact and slow: on a 2-core AMD EPYC with AVX2 and no VNNI
    (torch 2.13) a ``[2048, 576] x [576, 1536]`` int8 product took 5.5 s against float32's 0.23 s (24x), and one
    SmolLM2-135M up projection as ``--quantize int8`` computes it 4.95 s against 0.19 s
    (``docs/results/speed/int8_reduced_range_product_avx2.json``, a loaded machine: ratios only). True where the CPU's
    features cannot be read (no ``/proc/cpuinfo``): no claim is made there."""
    from memlm.models.cpu import cpu_flags

    flags = cpu_flags()
    return not flags or any(f in flags for f in INT8_FEATURES)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per row: ``(q, s)`` with ``x ≈ q * s``, ``s = max |row| / 127`` (a zero row gets s = 1e-8/127)."""
    s = x.abs().amax(-1, keepdim=True).clamp_min_(1e-8).div_(127)
    return torch.round(x / s).clamp_(-127, 127).to(torch.int8), s


def _quantize_input(x: torch.Tensor, inv_smooth: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's input as ``[tokens, D]`` float32, divided by σ (``inv_smooth`` = 1 / σ), quantized per row."""
    x2 = x.reshape(-1, x.shape[-1]).float()
    if inv_smooth is not None:
        x2 = x2 * inv_smooth
    return quantize_rows(x2)


def _rescale(acc: torch.Tensor, s_x: torch.Tensor, s_w: torch.Tensor) -> torch.Tensor:
    """The int32 sums back to float32: ``acc[t, o] · s_x[t] · s_w[o]``."""
    return acc.float().mul_(s_x).mul_(s_w)


def _rescale_outliers(acc: torch.Tensor, s_x: torch.Tensor, s_w: torch.Tensor, x_out: torch.Tensor,
                      w_out_t: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """:func:`_rescale` plus the outlier channels' float32 share, ``Σ_k x_out[t, k] · w_out_t[k, o]``, as element-wise
    multiply-adds (one per channel) that inductor fuses into the rescale's loop: one pass over the output. As a rank-8
    ``addmm_`` after the rescale the share read and wrote the output once more, 12% of int8's eval time
    (``docs/results/speed/int8_outliers_addmm.json``)."""
    y = _rescale(acc, s_x, s_w)
    for k in range(w_out_t.shape[0]):
        y = y.addcmul_(x_out[:, k : k + 1], w_out_t[k])
    return y


class FusedOps:
    """``fn`` compiled by :func:`memlm.models.compiling.compile_dynamic` (inductor: one graph for every number of
    tokens), else ``fn`` itself: the same operations, bit for bit (``tests/test_int8.py``; :func:`_rescale_outliers`
    within float32 rounding, as the C++ compiler may contract its multiply-adds into FMAs).

    Quantizing a layer's input and rescaling its int32 sums are element-wise passes over ``[tokens, D]`` tensors; run
    one torch operation at a time they cost more than the int8 product itself (2 cores, SmolLM2-135M, eval of 8
    windows of 1024: 2.02 s of element-wise work against 1.25 s of ``_int_mm``), compiled 0.81 s
    (``docs/results/speed/int8_profile.json``; ``docs/results/performance.md``). Where compiling
    fails (no C++ compiler, a platform inductor does not support) or ``MEMLM_INT8_COMPILE=0``, the eager ``fn``
    runs, with one warning the first time."""

    def __init__(self, fn: Callable[..., Any]):
        self.fn = fn
        self._compiled: Callable[..., Any] | None = None
        self.mode = "eager" if os.environ.get("MEMLM_INT8_COMPILE", "1").lower() in ("0", "off", "no") else "inductor"

    def __call__(self, *args: Any) -> Any:
        if self.mode == "inductor":
            try:
                if self._compiled is None:
                    self._compiled = compile_dynamic(self.fn)
                return self._compiled(*args)
            except Exception as e:  # noqa: BLE001 - any failure to compile: the eager operations are the same
                self.mode = "eager"
                warnings.warn(f"--quantize int8: torch.compile of {self.fn.__name__} failed ({type(e).__name__}: "
                              f"{str(e)[:200]}); running it op by op (slower, same numbers)", stacklevel=2)  # fmt: skip
        return self.fn(*args)


def _normalize_input(x: torch.Tensor, inv_smooth: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's input as ``[tokens, D]`` float32, divided by σ, each row divided by its largest magnitude ``m[t]``:
    ``(x' / m, m)``. FBGEMM's dynamic linear takes one activation scale per call; with every row's range [-1, 1] that
    scale is each token's own (:class:`ReducedRangeInt8Linear`)."""
    x2 = x.reshape(-1, x.shape[-1]).float()
    if inv_smooth is not None:
        x2 = x2 * inv_smooth
    m = x2.abs().amax(-1, keepdim=True).clamp_min_(1e-8)
    return x2 / m, m


def _rescale_rows(y: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """The product of the normalized rows back to the input's scale: ``y[t, o] · m[t]``."""
    return y.mul_(m)


def _rescale_rows_outliers(y: torch.Tensor, m: torch.Tensor, x_out: torch.Tensor,
                           w_out_t: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """:func:`_rescale_rows` plus the outlier channels' float32 share (as in :func:`_rescale_outliers`)."""
    y = _rescale_rows(y, m)
    for k in range(w_out_t.shape[0]):
        y = y.addcmul_(x_out[:, k : k + 1], w_out_t[k])
    return y


quantize_input = FusedOps(_quantize_input)
rescale = FusedOps(_rescale)
rescale_outliers = FusedOps(_rescale_outliers)
normalize_input = FusedOps(_normalize_input)
rescale_rows = FusedOps(_rescale_rows)
rescale_rows_outliers = FusedOps(_rescale_rows_outliers)
#: every compiled element-wise step of an int8 layer (benchmarks switch them to eager together)
FUSED_OPS = (quantize_input, rescale, rescale_outliers, normalize_input, rescale_rows, rescale_rows_outliers)


def inverse_smooth(channels: int, smooth: torch.Tensor | None, outliers: torch.Tensor | None) -> torch.Tensor | None:
    """What a layer's input is multiplied by before it is quantized: 1 / σ, and 0 on the outlier channels (they are
    multiplied in float32 instead); None when there is neither."""
    if smooth is None and (outliers is None or not outliers.numel()):
        return None
    inv = torch.ones(channels) if smooth is None else 1.0 / smooth.float()
    if outliers is not None:
        inv[outliers] = 0.0
    return inv


class SharedInput:
    """The quantized input of a group of layers that read the same tensor (gate/up of a feed-forward block), smoothed
    by one σ: the first layer to see a tensor quantizes it (``prepare``), the others reuse it, and the last of the
    group's ``users`` lets it go (nothing of a batch is held between forward passes)."""

    def __init__(self, inv_smooth: torch.Tensor | None,
                 prepare: Callable[..., tuple[torch.Tensor, torch.Tensor]] = quantize_input):  # fmt: skip
        self.inv_smooth = inv_smooth
        self.prepare = prepare  # quantize_input (Int8Linear) or normalize_input (ReducedRangeInt8Linear)
        self.users = 0  # Int8Linear layers reading through this one (each registers itself)
        self.clear()

    def quantized(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        key = (x.data_ptr(), 0 if x.is_inference() else x._version, tuple(x.shape))  # inference tensors: no version
        if self._quantized is None or self._x is not x or self._key != key:
            self._x, self._key, self._quantized = x, key, self.prepare(x, self.inv_smooth)
            self._left = self.users
        out = self._quantized
        self._left -= 1
        if self._left <= 0:
            self.clear()
        return out

    def clear(self) -> None:
        self._x: torch.Tensor | None = None
        self._key: tuple[int, int, tuple[int, ...]] | None = None
        self._quantized: tuple[torch.Tensor, torch.Tensor] | None = None
        self._left = 0


class Int8Linear(nn.Module):
    """``linear`` as an int8 × int8 product (module docstring): weights per output channel, activations per token,
    ``smooth`` (σ, per input channel) dividing the input and multiplying the weight; layers given the same
    :class:`SharedInput` quantize a shared input once. ``in_features`` and ``out_features`` stay, so key capture
    (:mod:`memlm.models.keys`) still finds the layer's roles."""

    def __init__(self, linear: nn.Linear, smooth: torch.Tensor | None = None, shared: SharedInput | None = None,
                 outliers: torch.Tensor | None = None):  # fmt: skip
        super().__init__()
        w = linear.weight.detach().float()
        self.register_buffer("outliers", None, persistent=False)
        if outliers is not None and outliers.numel():
            outliers = outliers.long()
            if int(outliers.min()) < 0 or int(outliers.max()) >= linear.in_features:
                raise MemlmError(f"outlier channels out of range for a linear layer of {linear.in_features} inputs")
            self.outliers = outliers
            # [k, out]: the outlier channels' float32 product; their columns leave the int8 weight
            self.register_buffer("weight_outlier_t", w[:, outliers].t().contiguous(), persistent=False)
            w = w.clone()
            w[:, outliers] = 0
        if smooth is not None:
            if smooth.shape != (linear.in_features,):
                raise MemlmError(f"smoothing factors of shape {tuple(smooth.shape)} for a linear layer of "
                                 f"{linear.in_features} inputs")  # fmt: skip
            w = w * smooth.float()[None, :]
        self._set_weight(w)
        if shared is None:
            shared = SharedInput(inverse_smooth(linear.in_features, smooth, self.outliers), self.prepare)
        self.shared = shared
        self.shared.users += 1
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().float(), requires_grad=False)
        self.in_features, self.out_features = linear.in_features, linear.out_features

    #: what a (shared) input goes through before the product: per-token int8 rows and their scales
    prepare = quantize_input

    def _set_weight(self, w: torch.Tensor) -> None:
        """Quantize the smoothed weight (outlier columns zeroed) ``[out, in]``, symmetric int8 per output channel."""
        wq, s_w = quantize_rows(w)
        # [in, out] as a transposed view (column-major): the layout _int_mm runs fastest with here
        self.register_buffer("weight_int8_t", wq.t(), persistent=False)
        self.register_buffer("weight_scale", s_w.reshape(-1), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xq, s_x = self.shared.quantized(x)
        acc = torch._int_mm(xq, self.weight_int8_t)
        if self.outliers is None:
            y = rescale(acc, s_x, self.weight_scale)
        else:  # the outlier channels' share, in float32: y += x[:, O] · W[:, O]ᵀ
            x_out = x.reshape(-1, x.shape[-1]).index_select(1, self.outliers).float()
            y = rescale_outliers(acc, s_x, self.weight_scale, x_out, self.weight_outlier_t)
        if self.bias is not None:
            y = y.add_(self.bias)
        return y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


class ReducedRangeInt8Linear(Int8Linear):
    """:class:`Int8Linear` whose integer product cannot saturate on x86 CPUs without VNNI: FBGEMM's dynamic int8
    linear with ``reduce_range`` (``torch.ops.quantized.linear_dynamic``), activations on 7 bits.

    Without VNNI, FBGEMM and ``torch._int_mm`` multiply with ``vpmaddubsw`` (unsigned 8-bit × signed 8-bit, adjacent
    pairs summed into a saturating int16): with 8-bit activations a pair reaches 255 · 127 · 2 = 64,770 > 32,767; with
    7-bit ones (0..127) at most 127 · 127 · 2 = 32,258, so every int32 sum is exact. FBGEMM quantizes its input with one
    asymmetric scale per call (the range of the whole tensor, 0 included); dividing each smoothed row by its largest
    magnitude ``m[t]`` first makes that range [-1, 1] and the scale each token's own (SmoothQuant's per-token
    granularity, Xiao et al. 2023, Table 2):

        x̂[t, j] = x'[t, j] / m[t],   s = (max x̂ - min x̂) / 127,   z = round(-min x̂ / s)
        q[t, j] = clamp(round(x̂[t, j] / s) + z, 0, 127)
        y[t, o] = Σ_{j∈O} x[t, j] · W[o, j] + m[t] · s · s_w[o] · Σ_{j∉O} (q[t, j] - z) · round(W'[o, j] / s_w[o])

    with x' and W' smoothed as in :class:`Int8Linear` and the outlier channels O in float32. The activation step is
    ``2 m[t] / 127`` at most: twice :class:`Int8Linear`'s ``m[t] / 127`` (one bit fewer), so the activations'
    rounding error doubles. Its perplexity and speed on a CPU without VNNI: :data:`REDUCED_RANGE_AVX2`."""

    prepare = normalize_input

    def _set_weight(self, w: torch.Tensor) -> None:
        """FBGEMM's packed weight: ``w`` symmetric int8 per output channel (the scales of :func:`quantize_rows`)."""
        scale = w.abs().amax(1).clamp_min(1e-8) / 127
        zero = torch.zeros(w.shape[0], dtype=torch.long)
        with warnings.catch_warnings():  # torch 2.13 marks quantized tensors deprecated; FBGEMM's packing takes them
            warnings.simplefilter("ignore", UserWarning)
            qw = torch.quantize_per_channel(w, scale.double(), zero, 0, torch.qint8)
        engine = torch.backends.quantized.engine
        try:
            torch.backends.quantized.engine = "fbgemm"
            self._packed = torch.ops.quantized.linear_prepack(qw, None)
        finally:
            torch.backends.quantized.engine = engine

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xn, m = self.shared.quantized(x)
        y = torch.ops.quantized.linear_dynamic(xn, self._packed, True)  # reduce_range: 7-bit activations
        if self.outliers is None:
            y = rescale_rows(y, m)
        else:
            x_out = x.reshape(-1, x.shape[-1]).index_select(1, self.outliers).float()
            y = rescale_rows_outliers(y, m, x_out, self.weight_outlier_t)
        if self.bias is not None:
            y = y.add_(self.bias)
        return y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)


def linears_to_quantize(model: nn.Module) -> tuple[list[tuple[nn.Module, str, nn.Linear]], set[int]]:
    """(parent, attribute, linear) of each ``nn.Linear`` of the decoder layers that :func:`quantize_int8` replaces:
    all but the feed-forward down projections and the last layer's; and the ids of those that are feed-forward up
    projections."""
    out = []
    ups: set[int] = set()
    for parts in decoder_layer_parts(model)[:-1]:
        layer = parts.layer
        ffn_root = parts.ffn if parts.ffn is not None else layer
        ups_found, downs_found = _up_down_pairs(outer_linears(ffn_root), parts.hidden)
        downs = {id(d.module) for d in downs_found}
        ups.update(id(u.module) for u in ups_found)
        for parent in layer.modules():
            for name, child in parent.named_children():
                if type(child) is nn.Linear and id(child) not in downs:
                    out.append((parent, name, child))
    return out, ups


def input_absmax(
    model: nn.Module, linears: Sequence[nn.Linear], batches: Sequence[torch.Tensor]
) -> tuple[list[torch.Tensor], list[list[int]]]:
    """max over tokens of |input| per input channel of each of ``linears`` over the forward passes of ``batches``
    (token ids ``[B, T]``), and the groups of them (indices into ``linears``) that read the same tensor in the first
    pass (an attention block's q/k/v, a feed-forward block's gate/up)."""
    amax: dict[int, torch.Tensor] = {}
    index = {id(lin): i for i, lin in enumerate(linears)}
    first: list[tuple[torch.Tensor, list[int]]] = []  # (input tensor, the linears that read it) of the first pass
    grouping = True

    def hook(mod: nn.Module, inp: tuple, _out: Any) -> None:
        x = inp[0].detach()
        a = x.reshape(-1, x.shape[-1]).abs().amax(0).float()
        amax[id(mod)] = torch.maximum(amax[id(mod)], a) if id(mod) in amax else a
        if grouping:
            for seen, group in first:
                if seen is inp[0]:
                    group.append(index[id(mod)])
                    return
            first.append((inp[0], [index[id(mod)]]))

    handles = [lin.register_forward_hook(hook) for lin in linears]
    try:
        with torch.inference_mode():
            for ids in batches:
                model(input_ids=ids, use_cache=False)
                grouping = False
    finally:
        for h in handles:
            h.remove()
    return [amax[id(lin)] for lin in linears], [group for _, group in first]


def smooth_factor(absmax: torch.Tensor, weights: Sequence[torch.Tensor], alpha: float = ALPHA) -> torch.Tensor:
    """SmoothQuant's ``σ_j = max|X_j|^α / max_o |W[o, j]|^(1-α)`` (Xiao et al. 2023, Eq. 4), both clamped at 1e-5;
    for layers that read the same input (``weights`` of each), the weights' maximum over all of them (their q/k/v)."""
    wmax = torch.stack([w.detach().float().abs().amax(0) for w in weights]).amax(0).clamp_min(1e-5)
    return absmax.float().clamp_min(1e-5).pow(alpha) / wmax.pow(1 - alpha)


def calibration_batches(tokenizer, texts: Sequence[str] | None = None, tokens: int = CALIBRATION_TOKENS,
                        window: int = 512) -> list[torch.Tensor]:  # fmt: skip
    """Token-id windows of at most ``window`` from ``texts`` (default: the ``wiki`` corpus' train split), ``tokens``
    in all."""
    if texts is None:
        from memlm.data.corpora import load_documents

        texts = [d.text for d in load_documents("wiki", "train")]
    ids: list[int] = []
    for text in texts:
        ids.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
        if len(ids) >= tokens:
            break
    ids = ids[:tokens]
    if len(ids) < 16:
        raise MemlmError(f"--quantize int8 needs a calibration text of at least 16 tokens, got {len(ids)}")
    return [torch.tensor([ids[i : i + window]]) for i in range(0, len(ids), window)]


#: the bound on the perplexity change's paired 95% interval that a faster int8 path must stay within (relative)
PPL_BOUND = 0.002

#: :class:`ReducedRangeInt8Linear` against float32 on a CPU without VNNI (2-core AMD EPYC, AVX2, beside other jobs:
#: 1-minute load 1.0-13.8): perplexity on WikiText-2 test (``memlm eval``'s protocol; the relative change and its
#: paired bootstrap interval over documents) and scored tokens/s end to end, the two alternating chunk by chunk
#: (``benchmarks/speed/int8_reduced_range_wikitext2.py``). +0.46% (+0.41% to +0.52%) at 1.21x on all 303,288
#: tokens: the 7-bit activations' rounding (twice the 8-bit step) costs 4x :class:`Int8Linear`'s +0.10%, so the path
#: is refused (:func:`reduced_range_adopted`)
REDUCED_RANGE_AVX2: dict[str, Any] = {
    "ppl_change": 0.004633680315294306,
    "ppl_change_low": 0.004106672372194598,
    "ppl_change_high": 0.005197463286846081,
    "speed_vs_float32": 1.211296811859959,
    "complete": True,  # all 37 chunks, 303,288 tokens, 62 documents
    "tokens": 303288,
    "file": "docs/results/speed/int8_reduced_range_wikitext2_avx2.json",
}

#: what each layer class computes its integer product with (recorded with a datastore)
PRODUCTS = {
    Int8Linear: "torch._int_mm: int8 activations per token",
    ReducedRangeInt8Linear: "FBGEMM dynamic linear, reduce_range: 7-bit activations per token",
}


def reduced_range_adopted(measured: dict[str, Any]) -> bool:
    """The rule for CPUs without int8 dot-product instructions: :class:`ReducedRangeInt8Linear` is what
    ``--quantize int8`` does there only if its perplexity change's paired interval lies within ±:data:`PPL_BOUND` and
    it is faster than float32 end to end, both measured on all of WikiText-2 test (``complete``); otherwise the path
    is refused, float32 being the faster choice."""
    low, high, speed = (measured.get(k) for k in ("ppl_change_low", "ppl_change_high", "speed_vs_float32"))
    if low is None or high is None or speed is None or not measured.get("complete"):
        return False  # not measured, or not on all of the test set
    return -PPL_BOUND <= low and high <= PPL_BOUND and speed > 1.0


def _describe(measured: dict[str, Any]) -> str:
    """``measured`` in words, for a refusal: the numbers and which part of the rule they miss."""
    if measured.get("ppl_change") is None:
        return "not measured"
    tokens = measured.get("tokens")
    where = "all of WikiText-2 test" if measured.get("complete") else f"{tokens or 0:,} tokens of WikiText-2 test"
    missed = [m for m, bad in (
        (f"perplexity interval outside ±{PPL_BOUND:.1%}", not -PPL_BOUND <= measured["ppl_change_low"]
         or not measured["ppl_change_high"] <= PPL_BOUND),
        ("not faster than float32", not measured["speed_vs_float32"] > 1.0),
        ("not the whole test set", not measured.get("complete")),
    ) if bad]  # fmt: skip
    return (f"perplexity {measured['ppl_change']:+.2%} (95% paired interval {measured['ppl_change_low']:+.2%} to "
            f"{measured['ppl_change_high']:+.2%}), {measured['speed_vs_float32']:.2f}x float32's tokens/s, on {where}"
            f" ({'; '.join(missed) or 'within the rule'}; {measured['file']})")  # fmt: skip


def fbgemm_available() -> bool:
    """Whether this torch has FBGEMM's quantized kernels (x86 builds), which :class:`ReducedRangeInt8Linear` needs."""
    return "fbgemm" in torch.backends.quantized.supported_engines


def int8_linear_class() -> type[Int8Linear]:
    """The layer ``--quantize int8`` uses on this CPU: :class:`Int8Linear` where it has int8 dot-product instructions
    and ``torch._int_mm`` is exact; else :class:`ReducedRangeInt8Linear` if FBGEMM is there and
    :func:`reduced_range_adopted` holds for :data:`REDUCED_RANGE_AVX2`; else a :class:`MemlmError` naming the measured
    result and the faster choice."""
    exact, native = int8_products_exact(), int8_products_native()
    if exact and native:
        return Int8Linear
    if fbgemm_available() and reduced_range_adopted(REDUCED_RANGE_AVX2):
        return ReducedRangeInt8Linear
    why = ("its int8 matrix products are not exact (torch._int_mm saturates without VNNI or AMX-INT8)" if not exact
           else "torch's int8 products run about 24x slower than float32's without VNNI or AMX-INT8")  # fmt: skip
    raise MemlmError(
        f"--quantize int8: this CPU has no int8 dot-product instructions (VNNI, AVX-VNNI, AMX-INT8), and {why}; "
        f"the 7-bit FBGEMM int8 path, measured on such a CPU: {_describe(REDUCED_RANGE_AVX2)}. Use --quantize none "
        "with --dtype float32 (or --dtype auto, float32 here): the faster choice on this CPU within the bound"
    )


def quantize_int8(model: nn.Module, tokenizer, texts: Sequence[str] | None = None, alpha: float = ALPHA,
                  tokens: int = CALIBRATION_TOKENS, outliers: int = OUTLIER_CHANNELS,
                  layer: type[Int8Linear] | None = None) -> dict[str, Any]:  # fmt: skip
    """Put ``layer`` (default :func:`int8_linear_class`: :class:`Int8Linear` or, on a CPU without int8 dot-product
    instructions, :class:`ReducedRangeInt8Linear` or a refusal) in place of the decoder's linear layers (all but the
    down projections and the last layer's), smoothed with factors calibrated on ``texts``, each input's ``outliers``
    largest channels (by their calibration maxima) multiplied in float32; returns what was done (recorded with a
    datastore). A benchmark passes ``layer`` to measure a path the rule does not choose."""
    if outliers < 0:
        raise MemlmError(f"--quantize int8: outliers must be >= 0 channels, got {outliers}")
    if next(iter(model.parameters())).dtype != torch.float32:
        raise MemlmError("--quantize int8 quantizes a float32 model: pass --dtype float32")
    linear_cls = int8_linear_class() if layer is None else layer
    targets, ups = linears_to_quantize(model)
    if not targets:
        raise MemlmError(f"{type(model).__name__} has no nn.Linear layers to quantize in its decoder layers "
                         "(all but the last): use --quantize none")  # fmt: skip
    batches = calibration_batches(tokenizer, texts, tokens)
    linears = [lin for _, _, lin in targets]
    absmax, groups = input_absmax(model, linears, batches)
    if sorted(i for g in groups for i in g) != list(range(len(linears))):
        raise MemlmError("--quantize int8: some linear layers of the decoder did not run on the calibration text; "
                         "use --quantize none for this model")  # fmt: skip
    # one σ and one quantized input for the feed-forward up projections that read the same tensor (gate/up); the
    # attention projections keep a σ each: sharing one over q/k/v moved WikiText-2 valid perplexity by +0.39%
    # against +0.25% (docs/results/speed/int8_selection_layers/)
    groups = [g2 for g in groups for g2 in ([g] if all(id(linears[i]) in ups for i in g) else [[i] for i in g])]
    for group in groups:
        a = torch.stack([absmax[i] for i in group]).amax(0)  # the same tensor: the same maxima
        smooth = smooth_factor(a, [linears[i].weight for i in group], alpha)
        top = torch.topk(a, min(outliers, a.numel() - 1)).indices.sort().values if outliers else None
        shared = SharedInput(inverse_smooth(a.numel(), smooth, top), linear_cls.prepare)
        for i in group:
            parent, name, lin = targets[i]
            setattr(parent, name, linear_cls(lin, smooth, shared, top))
    with torch.inference_mode():  # compiles the element-wise ops now (FusedOps), not in the first timed batch
        model(input_ids=batches[0][:, :64], use_cache=False)
    return {
        "alpha": alpha,
        "calibration": "wiki train" if texts is None else "given texts",
        "calibration_tokens": sum(int(b.shape[1]) for b in batches),
        "quantized_linears": len(targets),
        "input_groups": len(groups),
        "outlier_channels": outliers,
        "products": PRODUCTS[linear_cls],
        "float32_kept": "feed-forward down projections, the last decoder layer, the head, the outlier channels",
        "elementwise_ops": modes.pop() if len(modes := {f.mode for f in FUSED_OPS}) == 1 else "mixed",
    }
