"""The memories and the mixture of ``memlm generate`` and ``memlm lm-eval``: ``--memory SPEC`` (given again for more,
joined; :mod:`memlm.knnlm.memories`), fixed weights from ``--lambda`` / ``--temperature`` / ``--ngram-lambda-sparse``
/ ``--ngram-lambda-dense`` (built into one fixed-weight mixture, :func:`memlm.mixing.weights.fixed_mixture`; a weight
not given is the memory's calibrated one), or ``--mixture`` (a fit's JSON file, ``stored``, or weights
``knn=0.25;ngram=0.5/0.1``); none of them: the memories' stored fits."""

from __future__ import annotations

import argparse
import sys
from types import SimpleNamespace
from typing import Any

from memlm.cli import validate as V
from memlm.cli.common import add_knn_weights
from memlm.errors import MemlmError

_WEIGHT_FLAGS = (
    ("--lambda", "lam"),
    ("--temperature", "temperature"),
    ("--ngram-lambda-sparse", "ngram_lambda_sparse"),
    ("--ngram-lambda-dense", "ngram_lambda_dense"),
)


def add_memory_args(p: argparse.ArgumentParser) -> None:
    """``--memory`` (repeatable), the fixed weights and ``--mixture``."""
    p.add_argument(
        "--memory",
        action="append",
        default=None,
        metavar="SPEC",
        help="memories to mix: a datastore or ∞-gram index folder, or a spec 'knn:DS?k=64&temperature=2;ngram:IDX' "
        "(kinds knn, ngram, cache; docs/guides/generation.md); again for more",
    )
    add_knn_weights(p)
    for flag, where in (("--ngram-lambda-sparse", "where it is sparse"), ("--ngram-lambda-dense", "elsewhere")):
        p.add_argument(
            flag,
            type=V.probability,
            nargs="+",
            default=None,
            metavar="λ",
            help=f"weight of an ∞-gram's P∞ {where}: one value, or one per ∞-gram memory in order (default: each "
            "index's calibration)",
        )
    p.add_argument(
        "--mixture",
        default=None,
        metavar="MIXTURE",
        help="the weights instead: a fit of memlm tune --json FIT.json (the memories it was fitted on, "
        "in order; its τ and k set the kNN terms), 'stored' (the memories' stored fits, the default), or fixed "
        "weights 'knn=0.25;ngram=0.5/0.1'",
    )


def memory_spec_of(args: argparse.Namespace) -> str:
    """The ``--memory`` specs as one spec string (empty without any)."""
    return ";".join(s for s in args.memory or [] if s.strip())


def given_weights(args: argparse.Namespace) -> list[str]:
    """The weight flags given on the command line."""
    return [flag for flag, name in _WEIGHT_FLAGS if getattr(args, name, None) is not None]


def checked_mixture(args: argparse.Namespace) -> Any:
    """``--mixture`` before anything is loaded: refused beside weight flags; a fit is read and checked against the
    kinds of ``--memory`` (one line says what it is). Returns what :func:`cli_mixture` takes."""
    from memlm.knnlm.memories import parse_spec
    from memlm.mixing.component import component_names
    from memlm.mixing.step import check_components
    from memlm.mixing.weights import is_weights

    if not args.mixture:
        return None
    given = given_weights(args)
    if given:
        raise MemlmError(f"--mixture {args.mixture} sets every memory's weight (a fit also the kNN term's τ and k): "
                         f"leave out {', '.join(given)}")  # fmt: skip
    if args.mixture == "stored" or is_weights(args.mixture):
        return args.mixture
    from memlm.core.mixture import Mixture
    from memlm.mixing.step import load_fit

    fit = load_fit(args.mixture)
    kinds = [SimpleNamespace(kind=kind) for kind, _, _ in parse_spec(memory_spec_of(args))]
    check_components(fit if isinstance(fit, Mixture) else fit.mixture, component_names(kinds))
    if isinstance(fit, Mixture):
        print(f"mixture: {fit.form} from {args.mixture}", file=sys.stderr)
        return fit
    f = fit.fit
    print(f"mixture: {f.form} from {args.mixture}, fitted on {f.tokens:,} tokens of {f.documents:,} documents"
          + (f"; kNN term τ={fit.temperature}, k={fit.k}" if fit.temperature is not None else ""),
          file=sys.stderr)  # fmt: skip
    return fit


def cli_mixture(args: argparse.Namespace, components: list, mixture: Any) -> Any:
    """The mixture of the run: with weight flags the fixed-weight rule of those weights (``--temperature`` sets each
    datastore's τ; a weight not given is the memory's calibrated one), else ``mixture`` (:func:`checked_mixture`)."""
    if not given_weights(args):
        return mixture
    from memlm.knnlm.default_mixture import calibrated_weights
    from memlm.mixing.component import component_names
    from memlm.mixing.weights import fixed_mixture, weights_text
    from memlm.ngram.mixture import per_index_lambdas

    if args.temperature is not None:
        for c in components:
            if c.kind == "knn":
                c.temperature = float(args.temperature)
    weights = calibrated_weights(components)
    names = component_names(components)[1:]
    ngrams = [n for n, c in zip(names, components, strict=True) if c.kind == "ngram"]
    pairs = per_index_lambdas(args.ngram_lambda_sparse, args.ngram_lambda_dense, len(ngrams),
                              ("--ngram-lambda-sparse", "--ngram-lambda-dense")) if ngrams else []  # fmt: skip
    for name, (ls, ld) in zip(ngrams, pairs, strict=True):
        weights[name] = (weights[name][0] if ls is None else ls, weights[name][1] if ld is None else ld)
    if args.lam is not None:
        weights.update({n: float(args.lam) for n, c in zip(names, components, strict=True) if c.kind == "knn"})
    print(f"mixture: the fixed-weight rule {weights_text(weights)} ({', '.join(given_weights(args))} given, the "
          "others calibrated)", file=sys.stderr)  # fmt: skip
    return fixed_mixture(components, weights)
