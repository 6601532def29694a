"""``memlm`` command line: a thin layer over the Python API (every command maps to one or two library calls).

One module per area, each with ``add_parsers(subparsers)`` registering its commands and their functions:
data (models, corpora), datastore (datastore build|info, index build), knnlm (eval, tune, generate), lmeval
(lm-eval), train, analysis (analyze), npm, trime (trime-eval, trime-tune), demo; common holds what they share.

Commands load models through ``memlm.cli.common._load_model`` (looked up when called, so tests can replace it to check
that bad arguments are refused before any model loads).
"""

from __future__ import annotations

import argparse
import os

from memlm.cli import analysis, data, datastore, demo, knnlm, lmeval, ngram, npm, train, trime
from memlm.cli import validate as V
from memlm.cli.analysis import cmd_analyze
from memlm.cli.common import DEFAULT_MODEL, resolve_dtype, run_command
from memlm.cli.data import cmd_corpora, cmd_models
from memlm.cli.datastore import cmd_datastore_build, cmd_datastore_info, cmd_index_build
from memlm.cli.demo import cmd_demo
from memlm.cli.knnlm import cmd_eval, cmd_generate, cmd_tune
from memlm.cli.lmeval import cmd_lm_eval
from memlm.cli.npm import cmd_npm_classify, cmd_npm_eval, cmd_npm_index, cmd_npm_predict
from memlm.cli.train import cmd_train
from memlm.cli.trime import cmd_trime_eval, cmd_trime_tune
from memlm.errors import command_line

__all__ = [
    "DEFAULT_MODEL",
    "build_parser",
    "cmd_analyze",
    "cmd_corpora",
    "cmd_datastore_build",
    "cmd_datastore_info",
    "cmd_demo",
    "cmd_eval",
    "cmd_generate",
    "cmd_index_build",
    "cmd_lm_eval",
    "cmd_models",
    "cmd_npm_classify",
    "cmd_npm_eval",
    "cmd_npm_index",
    "cmd_npm_predict",
    "cmd_train",
    "cmd_trime_eval",
    "cmd_trime_tune",
    "cmd_tune",
    "main",
]

_AREAS = (data, datastore, ngram, knnlm, lmeval, train, analysis, npm, trime, demo)  # the order of `memlm --help`


def build_parser() -> argparse.ArgumentParser:
    parser = V.ArgumentParser(prog="memlm", description="Memory-augmented language models on any HF model.")
    sub = parser.add_subparsers(dest="command", required=True)
    for area in _AREAS:
        area.add_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "train" and args.objective == "lm" and not (args.from_scratch or args.model):
        args.train_parser.error("one of the arguments --from-scratch --model is required")  # as before --objective
    with command_line():  # errors name --flags, not the Python arguments (memlm.errors.option)
        resolve_dtype(args)
        return run_command(args)
