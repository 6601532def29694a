"""Replace the ∞-gram scores of a `memlm eval --ngram --dump` dump by those of another index (no LM pass again).

    python benchmarks/papers/ngram/ngram_swap.py --dump T.npz --index IDX --split test --max-tokens 20000 --out T2.npz

The documents are read as `memlm eval` read them (same corpus, split and --max-tokens), so targets and positions match
(checked). Used for the all-offline-corpora row of docs/results/ngram.md.
"""

from __future__ import annotations

import argparse

from memlm.data.corpora import load_corpus_source
from memlm.knnlm.evaluate import TokenScores
from memlm.models.resources import load_causal_lm
from memlm.ngram.index import NgramIndex
from memlm.ngram.memory import NgramMemory
from memlm.ngram.mixture import add_ngram


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dump", required=True)
    ap.add_argument("--index", required=True)
    ap.add_argument("--corpus", default="wikitext2")
    ap.add_argument("--split", required=True)
    ap.add_argument("--max-tokens", type=int, default=None)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    _, tok = load_causal_lm(args.model, dtype="float32")
    ts = TokenScores.load(args.dump)
    index = NgramIndex.open(args.index)
    index.check_tokenizer(tok)
    docs, _ = load_corpus_source(args.corpus, args.split, tok, args.max_tokens)
    add_ngram(ts, docs, tok, NgramMemory(index))
    ts.save(args.out)
    print(
        f"wrote {args.out}: {len(ts)} tokens, sparse {ts.ngram_sparse.mean():.3f}, "
        f"seconds {ts.meta['seconds_ngram']:.1f}"
    )


if __name__ == "__main__":
    main()
