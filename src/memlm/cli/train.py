"""``memlm train``: one driver (memlm.training.driver) for every objective of memlm.registry: a causal LM
(``--objective lm``, ``--loss`` ce or a TRIME loss) or an NPM / MLM encoder; resumable."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

from memlm.cli import validate as V
from memlm.errors import MemlmError

# memlm.training.loop, .train_driver, .objectives import torch: imported in the commands (see common.py)
if TYPE_CHECKING:
    from memlm.training.loop import TrainConfig


def _train_config(args: argparse.Namespace, **changes: Any) -> TrainConfig:
    """The ``TrainConfig`` of ``memlm train``'s flags, one place for every objective (``changes`` override)."""
    from memlm.training.loop import TrainConfig

    settings = {"lr": args.lr, "weight_decay": args.weight_decay, "warmup_steps": args.warmup, "max_steps": args.steps,
                "batch_size": args.batch_size, "grad_accum": args.grad_accum, "seq_len": args.seq_len,
                "dtype": args.dtype, "eval_every": args.eval_every, "save_every": args.save_every, "seed": args.seed,
                "device": args.device}  # fmt: skip
    return TrainConfig(**{**settings, **changes})


def _lm_objective(args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    """``--objective lm``: the objective of ``--loss`` (``ce`` is ``lm``) and its options from the TRIME flags."""
    if args.loss == "ce":
        return "lm", {}
    options: dict[str, Any] = {}
    if args.loss == "trime-long":
        options["segments_per_doc"] = args.segments_per_doc
    if args.loss == "trime-ext":
        options.update(drop_local_p=args.drop_local_p, packing=args.packing)
    if args.detach_memory:
        options["detach_memory"] = True
    return args.loss, options


def _encoder_objective(args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    """``--objective npm|npm-single|mlm``: its options from the masking flags; causal-LM flags are refused."""
    if args.loss != "ce":
        raise MemlmError(f"--loss {args.loss} is for causal LMs; --objective {args.objective} has its own loss")
    if args.objective == "mlm":
        if args.max_span is not None:
            raise MemlmError("--max-span is for NPM's span masking; --objective mlm masks single tokens")
        return "mlm", {"prob": args.mask_budget}
    return args.objective, {"budget": args.mask_budget, "max_span": args.max_span}


def cmd_train(args: argparse.Namespace) -> None:
    from memlm.registry import make_objective
    from memlm.training.driver import TrainSetup, train_objective

    if args.detach_memory and (args.objective != "lm" or args.loss == "ce"):
        raise MemlmError("--detach-memory is a TRIME ablation: use it with --loss trime, trime-long or trime-ext")
    encoder = args.objective != "lm"
    name, options = _encoder_objective(args) if encoder else _lm_objective(args)
    objective = make_objective(name, **options)
    changes = {"eval_every": 0} if encoder else {"warmup_loss_steps": args.ce_warmup if name != "lm" else 0}
    setup = TrainSetup(args.out, args.corpus, _train_config(args, **changes), scratch=args.from_scratch,
                       model=args.model, tokenizer=args.tokenizer, valid_corpus=args.valid_corpus,
                       valid_tokens=args.valid_tokens, n_positions=args.n_positions, dropout=args.dropout,
                       resume=not args.no_resume, stop_after=args.stop_after)  # fmt: skip
    result = train_objective(objective, setup)
    if result.final_dir is None:
        print(f"stopped at update {result.step}: rerun the same command to continue", file=sys.stderr)
        return
    if not encoder:
        ppl = result.valid_ppl
        print(f"trained {result.step} updates -> {result.final_dir}" + (f" (valid ppl {ppl:.3f})" if ppl else ""))
        return
    vl = result.valid_loss
    unit = "masked token" if args.objective != "npm" else "masked span"
    print(
        f"trained {result.step} updates ({args.objective}) -> {result.final_dir}"
        + (f" (valid loss {vl:.4f} per {unit})" if vl is not None else "")
    )


def check_train(args: argparse.Namespace) -> None:
    if args.from_scratch is not None and not args.from_scratch.strip():
        raise MemlmError("--from-scratch is empty: give a size such as 5m or 6x384")
    if not args.corpus.strip(", "):
        raise MemlmError("--corpus is empty: give a named corpus, a file or a folder")
    if args.warmup >= 1 and args.warmup > args.steps:
        raise MemlmError(f"--warmup {args.warmup:g} updates exceed --steps {args.steps}")


def add_parsers(sub) -> None:
    t = sub.add_parser("train", help="train a causal LM from scratch or continue a pretrained one (resumable)")
    out_help = "run folder; rerun the same command to resume; model in OUT/final"
    t.add_argument("--out", type=V.output_dir, required=True, help=out_help)
    t.add_argument("--corpus", required=True, help="training corpora, comma-separated (split train), e.g. wiki,news")
    t.add_argument("--valid-corpus", default=None, help="validation corpora (split valid; default: --corpus)")
    t.add_argument(
        "--valid-tokens", type=V.nonneg_int, default=200_000, help="validation tokens scored (0: no validation)"
    )
    t.add_argument(
        "--objective",
        default="lm",
        choices=["lm", "npm", "npm-single", "mlm"],
        help="lm: causal LM (--loss picks CE or TRIME); npm / npm-single: NPM on a BERT-like encoder (Min et al. "
        "2023); mlm: the same encoder with a masked-LM head (NPM's parametric baseline)",
    )
    init = t.add_mutually_exclusive_group()
    init.add_argument(
        "--from-scratch",
        metavar="SIZE",
        help="GPT-2-style model: 5m..50m or <layers>x<dim> (6x384); npm: a BERT of that size",
    )
    init.add_argument(
        "--model",
        help="continue training this pretrained model (named, HF id or folder); npm: the encoder (default minilm-l6)",
    )
    t.add_argument(
        "--tokenizer",
        default=None,
        help="from scratch: bpe:<vocab> (trained here; default bpe:8192), gpt2 or folder; npm: the encoder whose "
        "tokenizer to use (default minilm-l6)",
    )
    t.add_argument("--n-positions", type=V.positive_int, default=1024, help="from scratch: maximum positions")
    t.add_argument("--dropout", type=V.probability, default=0.1, help="from scratch: dropout")
    t.add_argument("--steps", type=V.positive_int, default=1000, help="optimizer updates")
    t.add_argument("--batch-size", type=V.positive_int, default=8, help="sequences per micro-batch")
    t.add_argument("--grad-accum", type=V.positive_int, default=1, help="micro-batches per update")
    t.add_argument("--seq-len", type=V.positive_int, default=512)
    t.add_argument("--lr", type=V.positive_float, default=6e-4, help="peak learning rate (AdamW)")
    t.add_argument("--weight-decay", type=V.nonneg_float, default=0.1)
    t.add_argument("--warmup", type=V.nonneg_float, default=0.05, help="warm-up updates, or a fraction of --steps")
    t.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"], help="bfloat16: autocast")
    for flag, what in (("--eval-every", "validation"), ("--save-every", "checkpoint")):
        t.add_argument(flag, type=V.nonneg_int, default=200, help=f"{what} every N updates (0: only at the end)")
    t.add_argument(
        "--loss",
        default="ce",
        choices=["ce", "trime", "trime-long", "trime-ext"],
        help="ce (plain LM); TRIME with local memory, + long-term (consecutive segments), + external (BM25 batches)",
    )
    t.add_argument(
        "--ce-warmup", type=V.probability, default=0.05, help="TRIME: plain CE for this fraction of updates first"
    )
    t.add_argument(
        "--segments-per-doc", type=V.positive_int, default=None, help="trime-long: consecutive segments per batch"
    )
    t.add_argument(
        "--drop-local-p", type=V.probability, default=0.9, help="trime-ext: drop the local memory with prob. p"
    )
    t.add_argument("--packing", default="bm25", choices=["bm25", "random"], help="trime-ext: batch packing")
    t.add_argument(
        "--detach-memory",
        action="store_true",
        help="TRIME ablation (App. G): no back-propagation into the memory keys, only into the queries",
    )
    t.add_argument(
        "--mask-budget", type=V.probability, default=None, help="npm, mlm: fraction of tokens masked (default 0.15)"
    )
    t.add_argument("--max-span", type=V.positive_int, default=None, help="npm: longest masked span (default 10)")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--device", default="auto", help="auto (a CUDA GPU when there is one, else CPU), cpu, cuda, cuda:N")
    t.add_argument("--stop-after", type=V.positive_int, default=None, help="stop (resumably) after this many updates")
    t.add_argument("--no-resume", action="store_true", help="ignore existing checkpoints in --out")
    t.set_defaults(func=cmd_train, check=check_train, train_parser=t)
