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
    "check_output_file",
    "check_output_dir",
    "check_factory",
    "check_against_model",
    "float_list",
    "preflight",
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


def check_output_file(path: str | Path, flag: str) -> None:
    """:func:`output_file` as a :class:`MemlmError` naming ``flag``."""
    problem = _problem_output_file(Path(path))
    if problem:
        raise MemlmError(f"{flag}: {problem}")


def check_output_dir(path: str | Path, flag: str) -> None:
    """:func:`output_dir` as a :class:`MemlmError` naming ``flag``."""
    problem = _problem_output_dir(Path(path))
    if problem:
        raise MemlmError(f"{flag}: {problem}")


def float_list(
    text: str | None, flag: str, check: Callable[[float], bool] | None = None, what: str = ""
) -> tuple[float, ...] | None:
    """A comma-separated list of finite numbers (``None`` stays ``None``); each must pass ``check``."""
    if text is None:
        return None
    values = []
    for part in text.split(","):
        if not part.strip():
            continue
        try:
            value = float(part)
        except ValueError:
            raise MemlmError(f"{flag}: expected comma-separated numbers, got {text!r}") from None
        if not math.isfinite(value) or (check is not None and not check(value)):
            raise MemlmError(f"{flag}: {part.strip()!r} is not {what or 'a finite number'}")
        values.append(value)
    if not values:
        raise MemlmError(f"{flag}: no number in {text!r}")
    return tuple(values)


def _is_int(x: float) -> bool:
    return float(x).is_integer()


# ------------------------------------------------------------------------------------------------ pre-flight

_FACTORY_PROBE_DIM = 20160  # 2^6 3^2 5 7: divisible by every usual PQ/OPQ/PCA size, so only real syntax errors fail


def check_factory(factory: str | None, metric: str = "l2", dim: int | None = None) -> None:
    """A FAISS factory string usable on ``dim``-dim keys (syntax only when the dimension is not known yet)."""
    if factory is None:
        return
    if not factory.strip():
        raise MemlmError("--factory is empty: give a FAISS factory string such as Flat, IVF1024,PQ32 or HNSW32")
    from memlm.index import validate_factory

    if dim is not None:
        validate_factory(factory, dim, metric)
        return
    try:
        validate_factory(factory, _FACTORY_PROBE_DIM, metric)
    except MemlmError as e:  # the probe dimension is not the user's: leave it out of the message
        raise MemlmError(str(e).replace(f" for {_FACTORY_PROBE_DIM}-dim keys", "")) from None


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
    from memlm.keys import KeySpec, key_dim, num_layers

    key = KeySpec.parse(args.key).normalized(num_layers(model))
    check_factory(args.factory, args.metric, key_dim(model, key))


def _windows(args: argparse.Namespace) -> None:
    window, min_context = getattr(args, "window", None), getattr(args, "min_context", None)
    if window is not None and min_context is not None and min_context >= window:
        raise MemlmError(
            f"--min-context {min_context} must be smaller than --window {window} (each window scores "
            "window - min_context new tokens)"
        )


def _datastore_k(path: str | None, k: int, flag: str = "--datastore") -> None:
    """``k`` larger than the datastore (beyond the default 1024) is a mistake, not a request for -1 padding."""
    if not path:
        return
    from memlm.sharded import open_datastore

    n = len(open_datastore(path))  # a single or a sharded datastore
    if k > n and k > 1024:
        raise MemlmError(f"--k {k} exceeds the {n} entries of the datastore {path}: give --k <= {n}")


def _pre_datastore_build(args: argparse.Namespace) -> None:
    from memlm.keys import KeySpec

    KeySpec.parse(args.key)
    _windows(args)
    if args.index:
        check_factory(args.factory, args.metric)


def _pre_index_build(args: argparse.Namespace) -> None:
    from memlm.sharded import open_datastore

    ds = open_datastore(args.dir)  # a single or a sharded datastore (README: `memlm index build ds/wiki-8`)
    check_factory(args.factory, args.metric, ds.dim)


def _pre_eval(args: argparse.Namespace) -> None:
    _windows(args)
    if args.key:
        from memlm.keys import KeySpec

        KeySpec.parse(args.key)
    _datastore_k(args.datastore, args.k)
    fast = [f for f, on in (("--adaptive", args.adaptive), ("--pointer-min", args.pointer_min)) if on]
    if args.pipeline and fast:
        raise MemlmError(f"--pipeline searches each batch as it comes, {fast[0]} needs every query first: use one")
    if getattr(args, "pointer_rule", None) and not args.pointer_min:
        raise MemlmError("--pointer-rule chooses what pointer reuse does where it searches: give --pointer-min N too")
    if args.adaptive_fraction is not None and args.adaptive is None:
        raise MemlmError("--adaptive-fraction needs --adaptive GATE (a gate from memlm gate train)")
    if (args.adaptive or args.pointer_min or args.pipeline or args.index) and not args.datastore:
        raise MemlmError("--adaptive, --pointer-min, --pipeline and --index need a --datastore to search")
    if args.index:
        _index_of_datastore(args.index, args.datastore)


def _index_of_datastore(index: str, datastore: str) -> None:
    """``--index`` must have been built from ``--datastore``'s keys (its sidecar records the datastore's identity):
    an index from another datastore returns ids of other entries (a wrong perplexity, or an IndexError when it has
    more entries). Cheap: the sidecar and the manifest, not the FAISS file."""
    from memlm.sharded import is_sharded, open_datastore

    if is_sharded(datastore):  # a sharded index description: its searcher checks each shard's index
        return
    problem = open_datastore(datastore).index_problem(index)
    if problem is not None:
        raise MemlmError(
            f"--index: {problem}; give an index built from it (`memlm index build {datastore} --out FILE`)"
        )


def _pre_train(args: argparse.Namespace) -> None:
    if args.from_scratch is not None and not args.from_scratch.strip():
        raise MemlmError("--from-scratch is empty: give a size such as 5m or 6x384")
    if not args.corpus.strip(", "):
        raise MemlmError("--corpus is empty: give a named corpus, a file or a folder")
    if args.warmup >= 1 and args.warmup > args.steps:
        raise MemlmError(f"--warmup {args.warmup:g} updates exceed --steps {args.steps}")


def _pre_analyze(args: argparse.Namespace) -> None:
    _windows(args)
    float_list(args.fractions, "--fractions", lambda x: 0 < x <= 1, "in (0, 1]")
    float_list(args.fig5_temperatures, "--fig5-temperatures", lambda x: x > 0, "> 0")
    float_list(args.learned_n, "--learned-n", lambda x: x >= 1 and _is_int(x), "a positive integer")
    check_factory(args.factory)
    from memlm.xu2023.analysis import check_skip

    check_skip(tuple(s.strip() for s in args.skip.split(",") if s.strip()), "--skip")
    for flag in ("datastore_att", "datastore_ffn"):
        value = getattr(args, flag)
        if value is not None:
            existing_dir_error(value, "--" + flag.replace("_", "-"))


def existing_dir_error(path: str, flag: str) -> None:
    """:func:`existing_dir` as a :class:`MemlmError` naming ``flag``."""
    try:
        existing_dir(path)
    except argparse.ArgumentTypeError as e:
        raise MemlmError(f"{flag}: {e}") from None


def _pre_npm_index(args: argparse.Namespace) -> None:
    check_factory(args.factory, "ip")


def _pre_npm_query(args: argparse.Namespace) -> None:
    for q in args.query:
        if not q.strip():
            raise MemlmError("a query is empty: give text with exactly one [MASK]")


def _pre_npm_classify(args: argparse.Namespace) -> None:
    _pre_npm_query(args)
    parse_labels(args.labels)


def _pre_trime_eval(args: argparse.Namespace) -> None:
    float_list(args.local_temperatures, "--local-temperatures", lambda x: x > 0, "> 0")
    _datastore_k(args.datastore, args.k)


def _pre_trime_tune(args: argparse.Namespace) -> None:
    float_list(args.segments, "--segments", lambda x: x >= 0 and _is_int(x), "an integer >= 0")
    float_list(args.ext_temperatures, "--temperatures", lambda x: x > 0, "> 0")
    float_list(args.ext_lambdas, "--lambdas", lambda x: 0 <= x <= 1, "in [0, 1]")
    float_list(args.knn_temperatures, "--knn-temperatures", lambda x: x > 0, "> 0")
    float_list(args.local_temperatures, "--local-temperatures", lambda x: x > 0, "> 0")


_PREFLIGHT: dict[str, Callable[[argparse.Namespace], None]] = {
    "cmd_datastore_build": _pre_datastore_build,
    "cmd_index_build": _pre_index_build,
    "cmd_eval": _pre_eval,
    "cmd_train": _pre_train,
    "cmd_analyze": _pre_analyze,
    "cmd_npm_index": _pre_npm_index,
    "cmd_npm_predict": _pre_npm_query,
    "cmd_npm_classify": _pre_npm_classify,
    "cmd_trime_eval": _pre_trime_eval,
    "cmd_trime_tune": _pre_trime_tune,
}


def preflight(args: argparse.Namespace) -> None:
    """The command's cross-argument checks (cheap; raise :class:`MemlmError`) before it loads anything heavy."""
    func: Any = getattr(args, "func", None)
    check = _PREFLIGHT.get(getattr(func, "__name__", ""))
    if check is not None:
        check(args)


# ------------------------------------------------------------------------------------------------ score dumps


def parse_labels(text: str) -> dict[str, list[str]]:
    """``'business=business,finance;sport=sports,football'`` -> label -> verbalizers."""
    labels: dict[str, list[str]] = {}
    for part in text.split(";"):
        if not part.strip():
            continue
        name, sep, words = part.partition("=")
        name = name.strip()
        verbal = [w.strip() for w in words.split(",") if w.strip()] if sep else [name]
        if not name or not verbal:
            raise MemlmError(f"bad --labels entry {part!r}: write label=word,word;label=word")
        if name in labels:
            raise MemlmError(f"label {name!r} is given twice in --labels")
        labels[name] = verbal
    if len(labels) < 2:
        raise MemlmError(f"--labels needs at least two labels (label=word,word;label=word), got {text!r}")
    return labels
