"""Argument and path checks of the ``memlm`` CLI, run before any model is loaded or forward pass starts.

Two layers, both cheap (no model, no corpus, no forward pass):

* typed ``argparse`` converters (:func:`positive_int`, :func:`probability`, :func:`positive_float`,
  :func:`output_file`, :func:`output_dir`, :func:`existing_file`, ...) reject a bad value while the command line is
  parsed;
* :func:`preflight` checks what one value alone cannot (``--min-context`` < ``--window``, ``--k`` against the
  datastore, a FAISS factory string against the key dimension, comma-separated lists) once per command.

Every failure is one line ``error: ...`` on stderr and exit status 2 (:class:`ArgumentParser` overrides
``argparse``'s multi-line usage error; :class:`memlm.errors.MemlmError` for the pre-flight checks).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from memlm.errors import MemlmError

__all__ = [
    "ArgumentParser",
    "positive_int",
    "nonneg_int",
    "finite_float",
    "positive_float",
    "nonneg_float",
    "probability",
    "nonempty_text",
    "existing_file",
    "existing_dir",
    "output_file",
    "output_dir",
    "check_factory",
    "check_against_model",
    "number_list",
    "MAX_K",
]

MAX_K = 1 << 20  # neighbours per query: beyond this the [queries, k] score arrays alone exhaust memory


class ArgumentParser(argparse.ArgumentParser):
    """``argparse`` whose usage errors are one line ``error: memlm <command>: <problem> (see --help)``, exit 2."""

    def error(self, message: str) -> NoReturn:  # noqa: D102 (argparse API)
        text = " ".join(message.split())
        print(f"error: {self.prog}: {text} (see `{self.prog} --help`)", file=sys.stderr)
        raise SystemExit(2)


# ------------------------------------------------------------------------------------------------ converters


def _int(text: str) -> int:
    try:
        return int(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def _float(text: str) -> float:
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def positive_int(text: str) -> int:
    """An integer >= 1."""
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def min_context(text: str) -> int:
    """``--min-context``: an integer >= 1 (every scored target needs a token of context from its own window)."""
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(
            f"must be at least 1, got {text!r}: every scored target needs at least one token of context from its own "
            "window (with 0 the first target of each later window would be predicted from a position that has already "
            "seen it); for non-overlapping blocks give --stride equal to --window instead"
        )
    return value


def nonneg_int(text: str) -> int:
    """An integer >= 0."""
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text!r}")
    return value


def neighbours(text: str) -> int:
    """A neighbour count ``1 <= k <= MAX_K``."""
    value = positive_int(text)
    if value > MAX_K:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_K} neighbours, got {text!r}")
    return value


def finite_float(text: str) -> float:
    """Any finite float (no NaN, no inf)."""
    return _float(text)


def positive_float(text: str) -> float:
    """A finite float > 0 (temperatures, learning rates)."""
    value = _float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
    return value


def nonneg_float(text: str) -> float:
    """A finite float >= 0."""
    value = _float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text!r}")
    return value


def probability(text: str) -> float:
    """A float in [0, 1] (interpolation weights, drop and mask probabilities)."""
    value = _float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {text!r}")
    return value


def holdout_fraction(text: str) -> float:
    """A share of the corpus in [0, 1) (0 holds nothing out)."""
    x = _float(text)
    if not 0.0 <= x < 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1) (a share of the corpus, 0 = hold nothing out), got {text}")
    return x


def nonempty_text(text: str) -> str:
    """A string with at least one non-space character."""
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return text


def torch_device(text: str) -> str:
    """A device torch names: ``cpu``, ``cuda``, ``cuda:N`` or ``mps`` (whether this machine has it is checked when the
    model is placed, :func:`memlm.cli.common.place_model`)."""
    name, _, index = text.strip().lower().partition(":")
    if name not in ("cpu", "cuda", "mps") or (index and (not index.isdigit() or name != "cuda")):
        raise argparse.ArgumentTypeError(f"{text!r} is not a device: give cpu, cuda, cuda:N or mps")
    return f"{name}:{index}" if index else name


def existing_file(text: str) -> str:
    """A path to an existing regular file."""
    path = Path(text)
    if not path.exists():
        raise argparse.ArgumentTypeError(f"{text!r} does not exist")
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"{text!r} is not a file")
    if not os.access(path, os.R_OK):
        raise argparse.ArgumentTypeError(f"{text!r} is not readable")
    return text


def existing_dir(text: str) -> str:
    """A path to an existing folder."""
    path = Path(text)
    if not path.exists():
        raise argparse.ArgumentTypeError(f"folder {text!r} does not exist")
    if not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is not a folder")
    return text


def _problem_output_file(path: Path) -> str | None:
    if not str(path).strip():
        return "empty path"
    if path.is_dir():
        return f"{str(path)!r} is a folder: give a file name"
    parent = path.parent
    if not parent.exists():
        ancestor = next((p for p in parent.parents if p.exists()), None)
        if ancestor is not None and not ancestor.is_dir():
            return f"{str(path)!r} is under {str(ancestor)!r}, which is a file"
        return f"the folder {str(parent)!r} of {str(path)!r} does not exist: create it first"
    if not parent.is_dir():
        return f"{str(path)!r} is under {str(parent)!r}, which is a file"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"the folder {str(parent)!r} is not writable"
    if path.exists() and not os.access(path, os.W_OK):
        return f"{str(path)!r} exists and is not writable"
    return None


def _problem_output_dir(path: Path) -> str | None:
    if not str(path).strip():
        return "empty path"
    if path.exists():
        if not path.is_dir():
            return f"{str(path)!r} is a file, not a folder: give a folder"
        if not os.access(path, os.W_OK | os.X_OK):
            return f"the folder {str(path)!r} is not writable"
        return None
    ancestor = next((p for p in path.parents if p.exists()), None)
    if ancestor is None:
        return None
    if not ancestor.is_dir():
        return f"{str(path)!r} is under {str(ancestor)!r}, which is a file"
    if not os.access(ancestor, os.W_OK | os.X_OK):
        return f"cannot create {str(path)!r}: the folder {str(ancestor)!r} is not writable"
    return None


def output_file(text: str) -> str:
    """A file the command will write: not a folder, its folder exists and is writable, not under a file."""
    problem = _problem_output_file(Path(text))
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return text


def output_dir(text: str) -> str:
    """A folder the command will create or fill: not a file, not under a file, creatable/writable."""
    problem = _problem_output_dir(Path(text))
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return text


def number_list(
    what: str = "a finite number", check: Callable[[float], bool] | None = None, integer: bool = False
) -> Callable[[str], tuple[float, ...]]:
    """A converter of comma-separated finite numbers, each passing ``check`` (``integer``: whole numbers, as ints)."""

    def convert(text: str) -> tuple[float, ...]:
        values = []
        for part in (p.strip() for p in text.split(",")):
            value = _float(part) if part else None
            if value is not None and ((check is not None and not check(value)) or (integer and not value.is_integer())):
                raise argparse.ArgumentTypeError(f"{part!r} is not {what}")
            values += [] if value is None else [int(value) if integer else value]
        if not values:
            raise argparse.ArgumentTypeError(f"no number in {text!r}")
        return tuple(values)

    return convert


def name_list(text: str) -> tuple[str, ...]:
    """Comma-separated names, spaces stripped (an empty string: none)."""
    return tuple(s.strip() for s in text.split(",") if s.strip())


positive_floats = number_list("> 0", lambda x: x > 0)
probabilities = number_list("in [0, 1]", lambda x: 0 <= x <= 1)
fractions = number_list("in (0, 1]", lambda x: 0 < x <= 1)
nonneg_ints = number_list("an integer >= 0", lambda x: x >= 0, integer=True)
positive_ints = number_list("a positive integer", lambda x: x >= 1, integer=True)


# ------------------------------------------------------------------------------------------------ pre-flight


def check_factory(factory: str | None, metric: str = "l2", dim: int | None = None) -> None:
    """A FAISS factory string usable on ``dim``-dim keys (syntax only when the dimension is not known yet)."""
    if factory is not None:
        from memlm.storage.index import validate_factory

        validate_factory(factory, dim, metric)


def check_against_model(args: argparse.Namespace, model: Any) -> None:
    """Checks that need the loaded model but no forward pass: ``--window`` within the model's context (beyond it GPT-2
    fails with an IndexError and RoPE models extrapolate silently), and ``datastore build --factory`` against the key
    dimension (e.g. ``PQ7`` on 32-dim keys)."""
    config = getattr(model, "config", None)
    n_pos = getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None)
    window = getattr(args, "window", None)
    if isinstance(n_pos, int) and window is not None and window > n_pos:
        raise MemlmError(
            f"--window {window} is longer than the model's context ({n_pos} positions): use --window <= {n_pos}"
        )
    if not getattr(args, "index", False) or getattr(args, "factory", None) is None:
        return
    from memlm.models.keys import KeySpec, key_dim, num_layers

    key = KeySpec.parse(args.key).normalized(num_layers(model))
    check_factory(args.factory, args.metric, key_dim(model, key))


def check_windows(args: argparse.Namespace) -> None:
    """``--min-context`` below ``--window`` (each window scores the tokens past its context)."""
    window, min_context = getattr(args, "window", None), getattr(args, "min_context", None)
    if window is not None and min_context is not None and min_context >= window:
        raise MemlmError(
            f"--min-context {min_context} must be smaller than --window {window} (each window scores "
            "window - min_context new tokens)"
        )


def check_datastore_k(path: str | None, k: int, flag: str = "--datastore") -> None:
    """``k`` larger than the datastore (beyond the default 1024) is a mistake, not a request for -1 padding."""
    if not path:
        return
    from memlm.storage.sharded import open_datastore

    n = len(open_datastore(path))  # a single or a sharded datastore
    if k > n and k > 1024:
        raise MemlmError(f"--k {k} exceeds the {n} entries of the datastore {path}: give --k <= {n}")


# ------------------------------------------------------------------------------------------------ score dumps


def labels(text: str) -> dict[str, list[str]]:
    """``'business=business,finance;sport=sports,football'`` -> label -> verbalizers (at least two labels)."""
    out: dict[str, list[str]] = {}
    for part in text.split(";"):
        if not part.strip():
            continue
        name, sep, words = part.partition("=")
        name = name.strip()
        verbal = [w.strip() for w in words.split(",") if w.strip()] if sep else [name]
        if not name or not verbal:
            raise argparse.ArgumentTypeError(f"bad entry {part!r}: write label=word,word;label=word")
        if name in out:
            raise argparse.ArgumentTypeError(f"label {name!r} is given twice")
        out[name] = verbal
    if len(out) < 2:
        raise argparse.ArgumentTypeError(f"needs at least two labels (label=word,word;label=word), got {text!r}")
    return out
