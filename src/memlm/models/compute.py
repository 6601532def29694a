"""The compute path of a forward pass: how the same model's numbers are computed (dtype, attention kernel, compile,
quantization), recorded with every datastore and checked when its keys are queried another way.

A kNN-LM compares a query key ``f(c)`` computed now with datastore keys computed at build time (Khandelwal et al.
2020, Eq. 2: ``d(f(c), k_i)``). Both must come from the same function; the *model* is pinned by its fingerprint
(:func:`memlm.models.resources.model_fingerprint`), the *arithmetic* is the compute path:

========================  =======================================================================================
part                      choices
========================  =======================================================================================
``dtype``                 float32, bfloat16 (oneDNN / AVX512-BF16 / AMX on CPU), float16
``attention``             ``sdpa`` (torch's scaled_dot_product_attention, transformers' default) or ``eager``
``compile``               ``none`` or ``inductor``: the attention and feed-forward blocks of each decoder layer
                          compiled with ``torch.compile`` (their *modules* keep their hooks: keys by role still
                          come from :class:`memlm.models.keys.KeyCapture`)
``quantize``              ``none``, ``int8`` or ``int8-dynamic``. ``int8``: the decoder's linear layers but the
                          feed-forward down projections and the last layer's as int8 products with one scale per
                          token and per output channel, SmoothQuant-smoothed, each input's outlier channels in
                          float32 (:mod:`memlm.models.int8`; VNNI or AMX-INT8 where the CPU has them).
                          ``int8-dynamic``: every decoder ``nn.Linear`` replaced by torch's dynamic int8 linear
                          (one activation scale per batch). The output projection stays float32 in both, so the
                          LM log-softmax stays float32.
========================  =======================================================================================

Each path's keys differ from float32's by a relative error ``e = ||k_path - k_fp32|| / ||k_fp32||`` per key
(:func:`relative_key_error`); :data:`KEY_ERROR` holds the error measured per path (its 99th percentile over keys,
SmolLM2-135M, ``ffn_in`` of the last layer; ``benchmarks/speed/run.py`` measures it again on each machine). A
datastore built on path A and queried on path B is allowed when A and B compute in the same dtype and quantization, or
when ``e_A + e_B <= KEY_TOLERANCE`` (the triangle inequality bounds the distance between the two paths' keys by the sum
of their distances to float32's), and refused past it with one error naming both paths and the fix
(:func:`check_compute_paths`).
"""

from __future__ import annotations

import logging
import platform
import warnings
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from memlm.errors import MemlmError
from memlm.models.compiling import compile_dynamic
from memlm.models.cpu import cpu_flags
from memlm.models.keys import decoder_layer_parts, find_decoder_layers

__all__ = [
    "ATTENTIONS",
    "COMPILES",
    "KEY_ERROR",
    "KEY_TOLERANCE",
    "QUANTIZATIONS",
    "ComputePath",
    "bf16_products_available",
    "apply_compute_path",
    "check_compute_paths",
    "describe_compute_path",
    "path_key_error",
    "relative_key_error",
]

log = logging.getLogger(__name__)

ATTENTIONS = ("sdpa", "eager")
COMPILES = ("none", "inductor")
QUANTIZATIONS = ("none", "int8", "int8-dynamic")

#: an upper bound of the 99th percentile of the relative key error against float32, per (dtype, quantize) part of the
#: path. Measured on SmolLM2-135M, ffn_in@29, 1,980 `wiki` test tokens (Wikipedia lead sections) (windows 512, min-
#: context 256; docs/results/speed/key_error.json, benchmarks/speed/key_error.py): bfloat16 p99 0.028, max 0.037,
#: perplexity
#: -0.11%; int8-dynamic (per-tensor activations) p99 0.78, max 1.21, perplexity +283% (per-channel weights: p99 0.77,
#: +237%; every linear but down_proj, per-channel: p99 0.31, +23%): SmolLM2's activation outliers defeat dynamic
#: int8, so that path is a measurement option, not one to build or report with.
#: int8 (memlm.models.int8): with its outlier channels in float32, p99 0.046, max 0.11
#: (docs/results/speed/key_error_avx512_int8.json), perplexity +0.10% on all 62 WikiText-2 test documents (95% interval
#: over documents +0.07% to +0.13%; windows 1024 / 512; docs/results/speed/ppl_intervals_int8.json); without them
#: p99 0.062 (the same files). Bound 0.08: past
#: KEY_TOLERANCE alone, so int8 keys and float32 keys are never mixed.
#: float16 is not measured on CPU; its 10 mantissa bits round less than bfloat16's 7, so bfloat16's bound is used.
#: The attention kernel and compile change keys by float32 rounding only (eager vs sdpa: p99 1.9e-6).
#: tests/test_compute_path.py::test_real_model_key_error_within_the_stated_error pins the measurement under these.
KEY_ERROR: dict[tuple[str, str], float] = {
    ("float32", "none"): 0.0,
    ("bfloat16", "none"): 0.04,
    ("float16", "none"): 0.04,
    ("float32", "int8"): 0.08,
    ("float32", "int8-dynamic"): 0.8,
}

#: the largest e_A + e_B allowed between a datastore's path and a query's other path: admits bfloat16 (or float16)
#: against float32 (bf16's measured perplexity difference: -0.03% to -0.11%, docs/results/precision_bf16_vs_fp32.json,
#: dtype_speed.json), refuses bfloat16 against float16 and int8 against anything else. The same (dtype, quantize) on
#: both sides is always allowed: the same arithmetic.
KEY_TOLERANCE = 0.05


@dataclass(frozen=True)
class ComputePath:
    """How a forward pass computes: see the module's table. ``dtype`` is a resolved dtype name (not ``auto``)."""

    dtype: str = "float32"
    attention: str = "sdpa"
    compile: str = "none"
    quantize: str = "none"

    def __post_init__(self) -> None:
        for name, value, allowed in (("attention", self.attention, ATTENTIONS), ("compile", self.compile, COMPILES),
                                     ("quantize", self.quantize, QUANTIZATIONS)):  # fmt: skip
            if value not in allowed:
                raise MemlmError(f"unknown --{name} {value!r}: use one of {', '.join(allowed)}")
        if self.quantize != "none" and self.dtype != "float32":
            raise MemlmError(
                f"--quantize {self.quantize} quantizes float32 linear layers, not {self.dtype} ones: pass --dtype "
                "float32"
            )

    def label(self) -> str:
        """``"bfloat16+sdpa"`` style name (compile and quantization added when on)."""
        parts = [self.dtype, self.attention]
        parts += [self.compile] if self.compile != "none" else []
        parts += [self.quantize] if self.quantize != "none" else []
        return "+".join(parts)


def bf16_products_available(device: torch.device) -> bool:
    """Whether :class:`memlm.models.forward.fp32_head` computes a bf16 model's float32 logits as bf16 products with
    float32 sums (exact products: both factors are bf16 values): on a CPU with AMX-BF16 (``amx_bf16``) and a torch
    whose oneDNN matmuls take ``torch.backends.mkldnn.matmul.fp32_precision`` (checked with 2.13; older ones without
    the setting keep the float32 product). AVX512-BF16 without
    AMX computes bf16 products at about half float32's rate (:func:`memlm.models.resources._cpu_has_native_bf16`), so
    the float32 product stays there. ``MEMLM_BF16_HEAD=0`` keeps the float32 product everywhere."""
    import os

    if os.environ.get("MEMLM_BF16_HEAD", "").lower() in ("0", "no", "off", "false"):
        return False
    matmul = getattr(torch.backends.mkldnn, "matmul", None)
    return (device.type == "cpu" and hasattr(matmul, "fp32_precision") and "amx_bf16" in cpu_flags()
            and bool(torch.backends.mkldnn.is_available()))  # fmt: skip


def _set_attention(model: nn.Module, attention: str) -> None:
    setter = getattr(model, "set_attn_implementation", None)
    if not callable(setter):
        raise MemlmError(
            f"{type(model).__name__} cannot switch its attention kernel (no set_attn_implementation): "
            "keep --attention sdpa or load a Hugging Face transformers model"
        )
    try:
        setter(attention)
    except (ValueError, ImportError) as e:
        raise MemlmError(f"{type(model).__name__} does not support --attention {attention}: {e}") from None


def _quantize_int8_dynamic(model: nn.Module) -> None:
    """Replace the decoder layers' ``nn.Linear`` by torch's dynamic int8 linear, in place (the head stays)."""
    try:
        from torch.ao.quantization import quantize_dynamic
    except ImportError as e:  # torch without the eager-mode quantization API
        raise MemlmError(f"--quantize int8-dynamic needs torch.ao.quantization ({e}); use --quantize none") from None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch >= 2.9 announces the move to torchao; the kernels are the same
        quantize_dynamic(find_decoder_layers(model), {nn.Linear}, dtype=torch.qint8, inplace=True)


def _compile_blocks(model: nn.Module) -> None:
    """``torch.compile`` the ``forward`` of each decoder layer's attention and feed-forward block.

    The modules stay: hooks registered on them (key capture, :class:`memlm.models.forward.fp32_head`) run around the
    compiled code, so each role's key is captured exactly where it is without compiling (:func:`compile_dynamic`: one
    graph for every window length).
    """
    for parts in decoder_layer_parts(model):
        for block in (parts.attn, parts.ffn):
            if block is not None:
                block.forward = compile_dynamic(block.forward)


def apply_compute_path(
    model: nn.Module, path: ComputePath, tokenizer: Any = None, calibration_texts: list[str] | None = None
) -> nn.Module:
    """Put ``model`` (loaded in ``path.dtype``) on ``path``, in place; returns it. Record the path on the model.

    ``--quantize int8`` calibrates on text, so it needs the model's ``tokenizer`` (``calibration_texts`` default: the
    ``wiki`` corpus' train split, :func:`memlm.models.int8.quantize_int8`)."""
    if path.quantize == "int8" and tokenizer is None:
        raise MemlmError("--quantize int8 calibrates on text: pass the model's tokenizer to apply_compute_path")
    have = str(next(iter(model.parameters())).dtype).removeprefix("torch.")
    if have != path.dtype:
        raise MemlmError(f"the model was loaded in {have}, but the compute path asks for {path.dtype}: load it so")
    if getattr(model, "memlm_compute_path", None) not in (None, ComputePath(path.dtype)):
        raise MemlmError("this model is already on another compute path: load it again to change the path")
    if path.quantize != "none":
        from memlm.models.resources import model_fingerprint

        model.memlm_fingerprint = model_fingerprint(model)  # of the weights as loaded: quantization replaces them
    current = getattr(getattr(model, "config", None), "_attn_implementation", "sdpa")
    if path.attention != current:
        _set_attention(model, path.attention)
    if path.quantize == "int8-dynamic":
        _quantize_int8_dynamic(model)
    if path.quantize == "int8":
        from memlm.models.int8 import quantize_int8

        model.memlm_int8 = quantize_int8(model, tokenizer, calibration_texts)
    if path.compile == "inductor":
        _compile_blocks(model)
    model.memlm_compute_path = path
    return model


def _model_path(model: nn.Module) -> ComputePath:
    """The path ``model`` is on: recorded by :func:`apply_compute_path`, else read from the model."""
    recorded = getattr(model, "memlm_compute_path", None)
    if isinstance(recorded, ComputePath):
        return recorded
    dtype = str(next(iter(model.parameters())).dtype).removeprefix("torch.")
    attention = getattr(getattr(model, "config", None), "_attn_implementation", None) or "sdpa"
    return ComputePath(dtype, attention if attention in ATTENTIONS else "sdpa")


def describe_compute_path(model: nn.Module) -> dict[str, Any]:
    """What a datastore's manifest records (``build.compute_path``): the path, its key error against float32, and
    what ran it (torch version, threads, oneDNN, CPU features), and how the LM's logits are computed (``head``:
    :class:`memlm.models.forward.fp32_head`'s arithmetic; it does not touch the keys)."""
    path = _model_path(model)
    device = next(iter(model.parameters())).device
    bf16_head = path.dtype == "bfloat16" and bf16_products_available(device)
    return {
        **asdict(path),
        "head": "bf16-products" if bf16_head else "float32",
        "key_error": path_key_error(asdict(path)),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "mkldnn": bool(torch.backends.mkldnn.is_available()),
        "cpu_capability": str(torch.backends.cpu.get_cpu_capability()),
        **({"int8": model.memlm_int8} if getattr(model, "memlm_int8", None) else {}),
        "machine": platform.machine(),
        "cpu_flags": cpu_flags(),
    }


def path_key_error(path: dict[str, Any]) -> float:
    """:data:`KEY_ERROR` of a recorded path (a manifest's ``compute_path``, or one with only ``dtype``)."""
    key = (str(path.get("dtype", "float32")), str(path.get("quantize", "none")))
    if key not in KEY_ERROR:
        raise MemlmError(
            f"no measured key error for compute path {key[0]} with quantization {key[1]}: "
            "build and query with --dtype float32 or bfloat16 and --quantize none"
        )
    return KEY_ERROR[key]


def check_compute_paths(built: dict[str, Any] | None, query: dict[str, Any], where: str) -> None:
    """Refuse to query keys built on path ``built`` with keys computed on ``query`` when ``e_built + e_query`` exceeds
    :data:`KEY_TOLERANCE`. ``built`` None (a datastore from before paths were recorded): nothing to check."""
    if not built:
        return
    part = lambda p: (str(p.get("dtype", "float32")), str(p.get("quantize", "none")))  # noqa: E731
    if part(built) == part(query):
        return
    total = path_key_error(built) + path_key_error(query)
    if total > KEY_TOLERANCE:
        b, q = (ComputePath(**{k: p[k] for k in ("dtype", "attention", "compile", "quantize") if k in p}).label()
                for p in (built, query))  # fmt: skip
        raise MemlmError(
            f"{where} was built on compute path {b}, this query runs on {q}: their keys differ from float32's by up "
            f"to {path_key_error(built):.3f} and {path_key_error(query):.3f} (relative error), {total:.3f} together, "
            f"over the {KEY_TOLERANCE} allowed; query with the datastore's dtype and quantization, or rebuild it "
            "on this path"
        )


def relative_key_error(keys: np.ndarray, reference: np.ndarray) -> np.ndarray:
    """Per key, ``||k - k_ref|| / ||k_ref||`` (float64), e.g. a path's keys against float32's."""
    k, r = np.asarray(keys, dtype=np.float64), np.asarray(reference, dtype=np.float64)
    if k.shape != r.shape:
        raise MemlmError(f"keys of shape {k.shape} cannot be compared with reference keys of shape {r.shape}")
    return np.linalg.norm(k - r, axis=-1) / np.maximum(np.linalg.norm(r, axis=-1), 1e-12)
