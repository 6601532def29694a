"""``memlm demo``: SmolLM2-135M-Instruct (smollm2-135m) with wiki memories, then imdb ones (memlm.experiments.demo)."""

from __future__ import annotations

import argparse
from pathlib import Path

from memlm.cli import validate as V


def cmd_demo(args: argparse.Namespace) -> None:
    from memlm.experiments.demo import run_demo  # imports torch (see common.py)

    run_demo(out=Path(args.out) if args.out else None, quick=args.quick)


def add_parsers(sub) -> None:
    d = sub.add_parser(
        "demo", help="SmolLM2-135M-Instruct + a wiki memory, then an imdb one (domain swap), on the offline defaults"
    )
    d.add_argument("--out", type=V.output_dir, default=None, help="output folder (default $MEMLM_HOME/demo)")
    d.add_argument("--quick", action="store_true", help="a much smaller run (tests use it)")
    d.set_defaults(func=cmd_demo)
