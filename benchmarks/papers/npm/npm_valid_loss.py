"""NPM / NPM SINGLE validation loss of an encoder, exactly as ``memlm train --objective npm|npm-single`` reports it
after training (mean contrastive loss per masked span / masked token over the first ``--tokens`` validation tokens,
eval mode, the objective's deterministic masking, the same document-grouped batches).

Used by ``benchmarks/papers/npm/npm.sh`` to score the encoder *before* NPM training, so that the trained encoders' final
validation losses have a reference point:

    .venv/bin/python benchmarks/papers/npm/npm_valid_loss.py --encoder minilm-l6 --objective npm \
        --json runs/npm/valid-untrained-npm.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from memlm.errors import MemlmError
from memlm.models.resources import load_encoder
from memlm.npm.objective import npm_objective
from memlm.npm.train_npm import npm_valid_loss, npm_validation_batches


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--encoder", default="minilm-l6", help="named encoder, HF id or folder")
    ap.add_argument("--objective", choices=("npm", "npm-single"), default="npm")
    ap.add_argument("--corpus", default="wiki,news", help="validation split of these corpora")
    ap.add_argument("--tokens", type=int, default=20_000, help="validation tokens (as --valid-tokens in training)")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    try:
        model, tok = load_encoder(args.encoder, dtype="float32")
        loss_fn, _ = npm_objective(args.objective, seq_len=args.seq_len, batch_size=args.batch_size, seed=args.seed)
        loss_fn.configure(tok)
        batches = npm_validation_batches(args.corpus, tok, args.tokens, args.seq_len, args.batch_size, args.seed)
        loss = npm_valid_loss(model, loss_fn, batches)
    except MemlmError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    res = {"encoder": args.encoder, "objective": args.objective, "corpus": args.corpus, "tokens": args.tokens,
           "seq_len": args.seq_len, "batch_size": args.batch_size, "valid_loss": loss}  # fmt: skip
    print(json.dumps(res))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
