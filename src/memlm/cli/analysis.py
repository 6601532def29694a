"""``memlm analyze``: the ablations of Xu et al. 2023 (memlm.experiments.xu2023_analysis)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from memlm.cli import validate as V
from memlm.cli.common import add_model


def cmd_analyze(args: argparse.Namespace) -> None:
    from memlm.experiments.xu2023_analysis import (  # imports torch (see common.py)
        FIG5_TEMPERATURES,
        AnalysisSpec,
        run_analysis,
    )

    datastores = {role: d for role, d in (("att", args.datastore_att), ("ffn", args.datastore_ffn)) if d}
    spec = AnalysisSpec(
        model=args.model,
        datastores=datastores,
        valid=args.valid_corpus,
        test=args.test_corpus,
        max_tokens=args.max_tokens,
        window=args.window,
        min_context=args.min_context,
        batch_size=args.batch_size,
        dtype=args.dtype,
        k=args.k,
        nprobe=args.nprobe,
        factory=args.factory,
        fractions=args.fractions,
        temperatures=args.fig5_temperatures or FIG5_TEMPERATURES,
        learned_n=args.learned_n,
        learned_steps=args.learned_steps,
        learned_batch=args.learned_batch,
        learned_lr=args.learned_lr,
        learned_patience=args.learned_patience,
        seed=args.seed,
        skip=args.skip,
    )
    run_analysis(spec, args.out, log=lambda m: print(m, file=sys.stderr))
    print((Path(args.out) / "tables.md").read_text())


def check_analyze(args: argparse.Namespace) -> None:
    V.check_windows(args)
    V.check_factory(args.factory)


def add_parsers(sub) -> None:
    a = sub.add_parser("analyze", help="Xu et al. 2023 ablations: h_ds, similarity, learned W_ds, FAISS vs exact, τ")
    add_model(a, required=True)
    a.set_defaults(dtype="bfloat16")
    a.add_argument("--datastore-att", type=V.existing_dir, help="datastore with ffn_in keys (Xu's 'att')")
    a.add_argument("--datastore-ffn", type=V.existing_dir, help="datastore with final keys (Xu's 'ffn')")
    a.add_argument("--valid-corpus", default="wiki", help="held-out corpora (split valid) for tuning λ and τ")
    a.add_argument("--test-corpus", default="wiki", help="held-out corpora (split test) for the reported numbers")
    a.add_argument(
        "--max-tokens", type=V.positive_int, default=None, help="per split: leading documents up to this many tokens"
    )
    a.add_argument("--window", type=V.positive_int, default=512)
    a.add_argument("--min-context", type=V.min_context, default=128)
    a.add_argument("--batch-size", type=V.positive_int, default=4)
    a.add_argument("--k", type=V.neighbours, default=1024)
    a.add_argument("--nprobe", type=V.positive_int, default=32)
    a.add_argument("--factory", default=None, help="approximate FAISS index (default IVF<nlist>,PQ<dim/16>)")
    a.add_argument("--fractions", type=V.fractions, default="0.05,0.25,0.5,1",
                   help="datastore ratios for Fig. 2/4 and Table 3")  # fmt: skip
    a.add_argument("--fig5-temperatures", type=V.positive_floats, default=None,
                   help="τ values of Fig. 5 (default 0.1,...,3.0,3.5,4,5,6,8,10)")  # fmt: skip
    a.add_argument("--learned-n", type=V.positive_ints, default="1,2,3,6",
                   help="embeddings per word of the learned W_ds")  # fmt: skip
    a.add_argument("--learned-steps", type=V.positive_int, default=1000, help="training updates of each learned W_ds")
    a.add_argument("--learned-batch", type=V.positive_int, default=512)
    a.add_argument(
        "--learned-patience",
        type=V.positive_int,
        default=None,
        help="train each W_ds until its memory-only loss on the valid text has not improved for this many log points "
        "(every 100 updates), keeping the best weights; --learned-steps is then the most (default: a fixed "
        "--learned-steps, at most one epoch)",
    )
    a.add_argument("--learned-lr", type=V.positive_float, default=1e-3)
    a.add_argument("--seed", type=int, default=0)
    a.add_argument("--skip", type=V.name_list, default="",
                   help="comma-separated parts to skip: table1, approx, temperature, learned")  # fmt: skip
    a.add_argument("--out", type=V.output_dir, required=True, help="output folder (rerun to resume)")
    a.set_defaults(func=cmd_analyze, check=check_analyze)
