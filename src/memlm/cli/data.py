"""``memlm models`` and ``memlm corpora``: the named offline models and corpora."""

from __future__ import annotations

import argparse

from memlm.data.corpora import describe_corpora
from memlm.errors import MemlmError
from memlm.models.resources import MODELS


def cmd_models(args: argparse.Namespace) -> None:
    for name, spec in MODELS.items():
        print(f"{name:16s} {spec.kind:10s} {spec.description}")


def cmd_corpora(args: argparse.Namespace) -> None:
    print(f"{'name':9s} {'train':>6s} {'valid':>6s} {'test':>6s} {'chars':>11s}  description (documents per split)")
    missing = []
    for row in describe_corpora():
        if "docs" not in row:  # its data package is missing or unreadable: listed, then one error at the end
            missing.append(row)
            print(f"{row['name']:9s} {'-':>6s} {'-':>6s} {'-':>6s} {'-':>11s}  {row['description']} (unavailable)")
            continue
        d = row["docs"]
        print(
            f"{row['name']:9s} {d['train']:6d} {d['valid']:6d} {d['test']:6d} {row['chars']['all']:11,d}  "
            f"{row['description']}"
        )
    if missing:
        raise MemlmError("; ".join(f"corpus {row['name']} is unavailable: {row.get('error', '?')}" for row in missing))


def add_parsers(sub) -> None:
    sub.add_parser("models", help="list named offline models").set_defaults(func=cmd_models)
    sub.add_parser("corpora", help="list named offline corpora and their splits").set_defaults(func=cmd_corpora)
