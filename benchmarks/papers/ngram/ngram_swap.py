"""Replace the ∞-gram scores of a `memlm eval --memory ngram:DIR --dump` dump by those of another index (no LM pass
again).

    python benchmarks/papers/ngram/ngram_swap.py --dump T.npz --index IDX --split test --max-tokens 20000 --out T2.npz

The documents are read as `memlm eval` read them (same corpus, split and --max-tokens), so targets and positions match
(checked). Used for the all-offline-corpora row of docs/results/ngram.md.
"""

from __future__ import annotations

import argparse

from memlm.data.corpora import load_corpus_source
from memlm.knnlm.evaluate import add_memory
from memlm.knnlm.table import TokenTable
from memlm.models.resources import load_causal_lm
from memlm.ngram.index import NgramIndex
from memlm.ngram.memory import NgramMemory


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
    loaded = TokenTable.load(args.dump)
    ts = loaded.select([n for n in loaded.names() if n not in loaded.names("ngram")])
    index = NgramIndex.open(args.index)
    index.check_tokenizer(tok)
    docs, _ = load_corpus_source(args.corpus, args.split, tok, args.max_tokens)
    add_memory(ts, NgramMemory(index), docs, tok)
    ts.save(args.out)
    print(
        f"wrote {args.out}: {len(ts)} tokens, sparse {ts.columns['ngram']['sparse'].mean():.3f}, "
        f"seconds {ts.meta['components']['ngram']['seconds']:.1f}"
    )


if __name__ == "__main__":
    main()
