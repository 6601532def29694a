"""How many epochs of wiki+news train the TRIME / analysis-(a) models saw (docs/results/trime.md,
docs/results/xu2023.md).

Retrains the run's tokenizer exactly as ``memlm train --tokenizer bpe:8192`` does (deterministic), cuts the train
stream into 256-token chunks as :func:`memlm.training.loop.lm_batches` does, and divides the tokens trained on (16 x 256
per update) by the chunks per epoch:

    python benchmarks/papers/trime/trime_epochs.py --json docs/results/trime/epochs.json
"""

from __future__ import annotations

import argparse

import numpy as np

from memlm.data.corpora import load_corpora
from memlm.data.windows import tokenize_documents
from memlm.io.fileio import atomic_write_json
from memlm.models.tokenizer import make_tokenizer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", required=True)
    args = p.parse_args()
    docs = load_corpora("wiki,news", "train")
    tok = make_tokenizer("bpe:8192", [d.text for d in docs])
    tokens = int(sum(len(c.tokens) for c in tokenize_documents(docs, tok)))
    chunks = tokens // 256
    per_update = 16 * 256
    res = {
        "command": f"python benchmarks/papers/trime/trime_epochs.py --json {args.json}",
        "train_documents": len(docs),
        "train_tokens_with_eos": tokens,
        "chunks_of_256": chunks,
        "updates_per_epoch": float(np.ceil(chunks / 16)),
        "epochs": {str(u): u * per_update / (chunks * 256) for u in (400, 2000)},
    }
    print(res)
    atomic_write_json(args.json, res)


if __name__ == "__main__":
    main()
