"""The effective n of docs/results/ngram.md's WikiText-2 rows under the paper's definition (words only) beside the
one those
rows were recorded with (the document-start separator counted as a token): which targets change, and the median and
mean under each.

    python benchmarks/papers/ngram/ngram_effective_n.py --index data/wt2-train \\
        --out docs/results/ngram/effective_n_words.json

The rows' ∞-gram: WikiText-2 train (``memlm ngram build --corpus wikitext2 --holdout 0``, built here from the tokenizer
alone when ``--index`` does not hold it yet), scored on the first 20,000 SmolLM2 tokens of WikiText-2 test (4 articles,
19,711 targets: every token of the stream but its first), as ``benchmarks/papers/ngram/ngram.sh``'s ``memlm eval``
scored them.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from transformers import AutoTokenizer

import memlm.ngram.memory as ngram_memory
from memlm.data.corpora import load_documents
from memlm.data.windows import limit_documents, tokenize_documents
from memlm.errors import MemlmError
from memlm.io.fileio import atomic_write_json
from memlm.ngram.index import NgramIndex, build_ngram_index


def _summary(n: np.ndarray) -> dict:
    hist = {str(k): int((np.minimum(n, 16) == k).sum()) for k in range(1, 17)}
    return {"median": float(np.median(n)), "mean": float(n.mean()), "histogram": hist, "histogram_note": "16 = 16+"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--index", required=True)
    ap.add_argument("--tokenizer", default=str(Path.home() / ".cache/memlm/models/smollm2-135m"))
    ap.add_argument("--max-tokens", type=int, default=20000)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    try:
        index = NgramIndex.open(args.index)
    except MemlmError:
        index = build_ngram_index(tok, load_documents("wikitext2", "train"), args.index, source={"corpus": "wikitext2"})
    memory = ngram_memory.NgramMemory(index)
    docs = limit_documents(load_documents("wikitext2", "test"), tok, args.max_tokens)
    chunks = [c.tokens for c in tokenize_documents(docs, tok)]
    positions = [np.arange(1 if i == 0 else 0, len(c)) for i, c in enumerate(chunks)]  # the stream's first: no target
    words = memory.score_documents(chunks, positions).n
    paper = ngram_memory.effective_n
    ngram_memory.effective_n = lambda length, query_len: length + 1  # the recorded rows' definition
    try:
        with_separator = memory.score_documents(chunks, positions).n
    finally:
        ngram_memory.effective_n = paper
    changed = np.flatnonzero(words != with_separator)
    atomic_write_json(
        Path(args.out),
        {
            "command": f"python benchmarks/papers/ngram/ngram_effective_n.py --index {args.index} --out {args.out}",
            "index_tokens": int(index.manifest["tokens"]),
            "documents": len(chunks),
            "targets": int(len(words)),
            "words_only": _summary(words),
            "separator_counted": _summary(with_separator),
            "targets_changed": int(len(changed)),
            "changed_by": sorted({int(x) for x in (with_separator - words)[changed]}),
        },
    )
    print(f"{args.out}: {len(changed)} of {len(words)} targets change")


if __name__ == "__main__":
    main()
