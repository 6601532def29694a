"""What the ``memlm`` commands share: argument groups, corpus and model loading, JSON output, and the wrapper that
runs a command (cross-argument checks first; a :class:`MemlmError` becomes one ``error:`` line and exit status 2).

Modules that import torch or faiss (most of memlm) are imported inside the functions that need them, here and in
every command module, so that ``memlm --help`` and argument errors answer without loading torch (about 1 s).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from memlm.cli import validate as V
from memlm.data.windows import resolve_stride
from memlm.errors import MemlmError
from memlm.io.fileio import atomic_write_json
from memlm.models import resources

DEFAULT_MODEL = "smollm2-135m"


# ---------------------------------------------------------------------------------------------- running a command


def resolve_dtype(args: argparse.Namespace) -> None:
    """``--dtype auto`` -> the dtype it means on this machine (memlm.models.resources.default_dtype), resolved once
    before the command runs, so result files and caches record the dtype actually used."""
    if getattr(args, "dtype", None) == "auto":
        args.dtype = resources.default_dtype()


def run_command(args: argparse.Namespace) -> int:
    """Run the parsed command: 0 when it succeeds, 2 after one ``error:`` line, 130 when interrupted."""
    try:
        check = getattr(args, "check", None)  # the command's cheap cross-argument checks, set with its subparser
        if check is not None:
            check(args)  # before any model, corpus or forward pass
        args.func(args)
    except MemlmError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: rerun the same command to resume", file=sys.stderr)
        return 130
    return 0


# ------------------------------------------------------------------------------------------------ inputs, outputs


def write_json(path: str | None, data: dict[str, Any]) -> None:
    if path:
        atomic_write_json(Path(path), data)
        print(f"wrote {path}", file=sys.stderr)


def check_prompt_leakage(args: argparse.Namespace, datastore, ngram, tokenizer) -> dict[str, Any]:
    """``memlm generate``: its prompt, as one evaluated document, against the memories (memlm.leakage: the same text
    as a stored document, or a near-copy by the 13-gram rule; a prompt under 13 tokens is checked for exact copies
    only), refused unless ``--allow-overlap``."""
    from memlm.data.corpora import Document
    from memlm.leakage import Evaluated, check_leakage

    prompt = Evaluated([Document("prompt", args.prompt)], label="the prompt")
    return check_leakage(prompt, datastore, ngram, tokenizer, args.allow_overlap)


def _load_model(name: str, dtype: str, path_args: argparse.Namespace | None = None):
    """The causal LM and tokenizer of a command, on the compute path its ``--attention/--compile/--quantize`` name
    (``path_args``, see :func:`add_compute_path`). Commands call it as ``common._load_model``, where tests replace it
    to check that bad arguments are refused before any model is loaded."""
    path = None
    if path_args is not None and (path_args.attention, path_args.compile, path_args.quantize) != (None, "none", "none"):
        from memlm.models.compute import ComputePath

        dtype = resources.default_dtype() if dtype == "auto" else dtype
        path = ComputePath(
            dtype, path_args.attention or "sdpa", path_args.compile, path_args.quantize
        )  # before loading
    model, tok = resources.load_causal_lm(name, dtype=dtype)
    if path is not None:
        from memlm.models.compute import apply_compute_path

        model = apply_compute_path(model, path, tokenizer=tok)
    return model, tok


def floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise MemlmError(f"expected comma-separated numbers, got {text!r}") from None


# ------------------------------------------------------------------------------------------------ argument groups


def add_device(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--device",
        type=V.torch_device,
        default="cpu",
        help="where the model's forward pass runs: cpu, cuda, cuda:N (default cpu; searches stay on the CPU)",
    )


def place_model(model, device: str):
    """``model`` moved to ``device`` (``--device``), or one clear error when that device is not on this machine."""
    if device == "cpu":
        return model
    import torch

    if device.startswith("cuda"):
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = int(device.split(":", 1)[1]) if ":" in device else 0
        missing = index >= n
        have = f"{n} CUDA device(s)"
    else:  # mps
        missing, have = not torch.backends.mps.is_available(), "no MPS device"
    if missing:
        raise MemlmError(
            f"--device {device}: this machine has {have} visible to torch {torch.__version__}; "
            "run with --device cpu or on a machine with that device"
        )
    return model.to(device)


def add_model(p: argparse.ArgumentParser, required: bool = False) -> None:
    p.add_argument(
        "--model",
        default=None if not required else DEFAULT_MODEL,
        help=f"named model (memlm models), HF id or local folder (default: {DEFAULT_MODEL})",
    )
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="model dtype for the forward pass. Default auto = bfloat16 on GPUs and on CPUs whose bf16 products are "
        "native and fast (AMX-BF16, Arm BF16), float32 elsewhere (bf16 on a CPU that emulates it is ~7x slower "
        "and says so). The output head and log-softmax always run in float32; bf16 moved SmolLM2-135M's perplexity "
        "by +0.012%% on all of WikiText-2 test (AMX): compare runs at one dtype and use float32 where exact numbers "
        "matter (docs/results/performance.md)",
    )


def add_compute_path(p: argparse.ArgumentParser) -> None:
    """How the forward pass computes beside --dtype (memlm.models.compute; recorded in a datastore's manifest and
    checked when it is queried on another path)."""
    p.add_argument(
        "--attention",
        default=None,
        choices=["sdpa", "eager"],
        help="attention kernel: sdpa (torch's fused scaled_dot_product_attention; what transformers loads by default) "
        "or eager",
    )
    p.add_argument(
        "--compile",
        default="none",
        choices=["none", "inductor"],
        help="torch.compile each layer's attention and feed-forward block (inductor; minutes of compile "
        "time first; keys are captured as without it)",
    )
    p.add_argument(
        "--quantize",
        default="none",
        choices=["none", "int8", "int8-dynamic"],
        help="int8: the decoder's linear layers (but the feed-forward down projections and the last layer) as "
        "int8 products, one scale per token and per output channel, SmoothQuant-smoothed on 2,048 tokens of the "
        "wiki corpus (needs --dtype float32; memlm.models.int8). int8-dynamic: torch's dynamic int8 linear, one "
        "activation scale per batch: a measurement option, +283%% perplexity on SmolLM2-135M. The head and "
        "log-softmax stay float32; a datastore built on one path is checked when queried on another "
        "(memlm.models.compute)",
    )


def add_corpus(p: argparse.ArgumentParser, split: str) -> None:
    p.add_argument(
        "--corpus", required=True, help="named corpus (memlm corpora), .txt/.jsonl file or folder; a,b for several"
    )
    p.add_argument(
        "--split",
        default=split,
        choices=["train", "valid", "test", "all"],
        help=f"split of a named corpus: train, valid, test, all (default {split})",
    )
    p.add_argument(
        "--max-tokens", type=V.positive_int, default=None, help="use only the leading documents up to this many tokens"
    )


def add_allow_overlap(p: argparse.ArgumentParser) -> None:
    """``--allow-overlap``: run although the memory holds the evaluated documents (memlm.leakage), recorded in the
    result's ``leakage``."""
    p.add_argument(
        "--allow-overlap",
        action="store_true",
        help="evaluate even where a datastore or ∞-gram index holds the evaluated documents (same corpus and split, "
        "--split all, the same texts, or near-copies by the 13-gram rule); refused by default, recorded in the result",
    )


def add_ray(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument(
        "--ray", default=None, metavar="ADDRESS", help=f"{what}: 'local' starts a local Ray cluster, else its address"
    )


def add_knn_weights(p: argparse.ArgumentParser) -> None:
    """``--lambda`` / ``--temperature`` (Eq. 2-3); unset, they come from the datastore (memlm.knnlm.calibration)."""
    p.add_argument(
        "--lambda",
        dest="lam",
        type=V.probability,
        default=None,
        help="interpolation weight λ of the kNN term (default: the mean weight of the datastore's calibrated mixture, "
        "fitted on its build's held-out slice; 0.25 if it has none)",
    )
    p.add_argument(
        "--temperature",
        type=V.positive_float,
        default=None,
        help="softmax temperature τ on the neighbours' scores (default: the datastore's calibrated τ; 1 if none)",
    )


def add_windows(p: argparse.ArgumentParser) -> None:
    p.add_argument("--window", type=V.positive_int, default=1024, help="tokens per forward window (default 1024)")
    p.add_argument(
        "--min-context",
        type=V.min_context,
        default=None,
        help="every scored token has at least this many tokens of context, >= 1 (default 512, as the paper)",
    )
    p.add_argument(
        "--stride",
        type=V.positive_int,
        default=None,
        help="instead of --min-context: windows advance by this many tokens (window - min_context); "
        "--stride equal to --window gives non-overlapping blocks (Hugging Face's perplexity guide, run_clm.py)",
    )
    p.add_argument(
        "--block-start",
        default="skip",
        choices=["skip", "bos"],
        help="with --stride = --window: skip the first token of every block (default, as the guide) or score it "
        "from a BOS (or EOS) token put before each block of window - 1 tokens",
    )
    p.add_argument("--batch-size", type=V.positive_int, default=4)


def window_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """window, min_context (default 512 unless --stride is given), stride and block_start for the windowing."""
    if args.min_context is not None and args.stride is not None:
        resolve_stride(args.window, args.min_context, args.stride)  # refuses a disagreement
    min_context = args.min_context if args.min_context is not None or args.stride is not None else 512
    return {"window": args.window, "min_context": min_context, "stride": args.stride, "block_start": args.block_start}
