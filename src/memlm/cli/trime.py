"""``memlm trime-eval`` and ``memlm trime-tune``: TRIME (Zhong et al. 2022) perplexity with local, long-term and
external memory, and the choice of its parameters on a validation dump (memlm.trime)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from memlm.cli import validate as V
from memlm.cli.common import DEFAULT_MODEL, add_corpus, add_model, write_json

# memlm.trime and memlm.storage.datastore import torch: imported in the commands (see common.py)


def _print_trime_rows(rows: list[tuple[str, dict[str, Any] | None, dict[str, Any] | None]], tokens: str) -> None:
    print(f"{'memory':10s} {'M':>3s} {'tau_local':>9s} {'tau':>6s} {'lambda':>6s} {'ppl':>10s}  ({tokens})")
    for name, p, res in rows:
        if res is None:
            continue
        if p is None:
            print(f"{name:10s} {'-':>3s} {'-':>9s} {'-':>6s} {'-':>6s} {res['base_ppl']:10.4f}")
            continue
        ext = name == "external"
        m = "-" if p["segments"] is None else str(p["segments"])
        tau = f"{p['temperature']:.3g}" if ext else "-"
        lam = f"{p['lambda']:.3g}" if ext else "-"
        print(f"{name:10s} {m:>3s} {p['local_temperature']:9.3g} {tau:>6s} {lam:>6s} {res['ppl']:10.4f}")


def cmd_trime_eval(args: argparse.Namespace) -> None:
    from memlm.trime.inference import TrimeEvalConfig, run_trime_eval

    config = TrimeEvalConfig(
        seq_len=args.seq_len, max_segments=args.max_segments, local_temperatures=args.local_temperatures, k=args.k,
        search=args.search, nprobe=args.nprobe, drop_self_matches=args.drop_self_matches, context=args.context,
        stream=args.stream,
    )  # fmt: skip
    model = args.model or (None if args.datastore else DEFAULT_MODEL)
    ts, res = run_trime_eval(
        model, args.corpus, args.split, config=config, datastore=args.datastore, batch_size=args.batch_size,
        max_tokens=args.max_tokens, dtype=args.dtype, dump=args.dump,
    )  # fmt: skip
    if args.dump:
        print(f"wrote {args.dump}", file=sys.stderr)
    rows = [
        ("none", None, res),
        *((name, res[name], res[name]) for name in ("local", "long", "external") if name in res),
    ]
    _print_trime_rows(rows, f"{res['tokens']} tokens, {args.split}")
    write_json(args.json, res)


def cmd_trime_tune(args: argparse.Namespace) -> None:
    from memlm.trime.inference import TrimeScores, tune_trime_memories

    valid = TrimeScores.load(args.valid)
    test = TrimeScores.load(args.test) if args.test else None
    res = tune_trime_memories(valid, test, segments=args.segments, temperatures=args.ext_temperatures,
                              lambdas=args.ext_lambdas, knn_temperatures=args.knn_temperatures,
                              local_temperatures=args.local_temperatures)  # fmt: skip
    kinds = [k for k in ("local", "long", "external") if k in res]
    print("best on valid:")
    _print_trime_rows(
        [("none", None, res["valid"]), *((k, res[k]["best"], res[k]["best"]) for k in kinds)],
        f"{res['valid']['tokens']} tokens, valid",
    )
    if test is not None:
        print("applied to test:")
        _print_trime_rows(
            [("none", None, res["test"]), *((k, res[k]["best"], res[k]["test"]) for k in kinds)],
            f"{res['test']['tokens']} tokens, test",
        )
    write_json(args.json, res)


def check_trime_eval(args: argparse.Namespace) -> None:
    V.check_datastore_k(args.datastore, args.k)


def add_parsers(sub) -> None:
    te = sub.add_parser("trime-eval", help="TRIME perplexity with local, long-term and external memory (+ dump)")
    add_model(te)
    add_corpus(te, "test")
    te.add_argument("--seq-len", type=V.positive_int, required=True, help="tokens per segment (one forward pass each)")
    te.add_argument(
        "--max-segments", type=V.nonneg_int, default=8, help="previous segments kept for the long-term memory"
    )
    te.add_argument(
        "--context",
        type=V.nonneg_int,
        default=0,
        help="0: non-overlapping segments (default); C > 0: overlapping windows (TRIME App. D), each scoring the "
        "targets after the previous window's with C tokens of context before them",
    )
    te.add_argument(
        "--stream",
        action="store_true",
        help="read the documents as one token stream (EOS between them), as memlm eval does: with --context C the "
        "targets and contexts of memlm eval --window SEQ_LEN --min-context C+1, so TRIME and kNN-LM rows compare",
    )
    te.add_argument("--local-temperatures", type=V.positive_floats, default="1",
                    help="τ_local values kept in the dump, comma-separated")  # fmt: skip
    te.add_argument(
        "--datastore",
        type=V.existing_dir,
        default=None,
        help="external memory: a datastore with ffn_in keys of this model",
    )
    te.add_argument("--k", type=V.neighbours, default=1024, help="entries retrieved per token from the datastore")
    te.add_argument("--search", default="index", choices=["index", "exact"])
    te.add_argument("--nprobe", type=V.positive_int, default=32)
    te.add_argument("--drop-self-matches", action="store_true", help="ignore retrieved entries that are the token")
    te.add_argument("--batch-size", type=V.positive_int, default=8)
    te.add_argument(
        "--dump", type=V.output_file, default=None, help="write per-token scores (.npz) for memlm trime-tune"
    )
    te.add_argument("--json", type=V.output_file, default=None, help="write the results as JSON")
    te.set_defaults(func=cmd_trime_eval, check=check_trime_eval)
    tt = sub.add_parser("trime-tune", help="choose M, τ_local, τ, λ on a valid dump; apply to a test dump")
    tt.add_argument(
        "--valid", type=V.existing_file, required=True, help="dump from memlm trime-eval --split valid --dump"
    )
    tt.add_argument("--test", type=V.existing_file, default=None, help="dump from memlm trime-eval --split test --dump")
    tt.add_argument("--segments", type=V.nonneg_ints, default=None,
                    help="M values, comma-separated (default 0,1,2,4,8)")  # fmt: skip
    tt.add_argument("--temperatures", dest="ext_temperatures", type=V.positive_floats, default=None,
                    help="τ of the external memory (default 0.25..32)")  # fmt: skip
    tt.add_argument("--lambdas", dest="ext_lambdas", type=V.probabilities, default=None,
                    help="λ values (default 0,0.05,...,0.6)")  # fmt: skip
    tt.add_argument("--knn-temperatures", type=V.positive_floats, default=None, help="τ_kNN values (default: τ)")
    tt.add_argument("--local-temperatures", type=V.positive_floats, default=None,
                    help="τ_local values (default: all in the dump)")  # fmt: skip
    tt.add_argument("--json", type=V.output_file, default=None)
    tt.set_defaults(func=cmd_trime_tune)
