"""Which test document each near-copy in a train split repeats (docs/results/ngram.md, "Decontamination").

For every train document of ``--corpus`` with at least ``--at-least`` of its 13-grams in the corpus's test split
(the infini-gram paper's overlap, :func:`memlm.ngram.decontaminate.overlap_fractions`), the test documents holding
its 13-grams, each with the share of the train document's 13-grams it holds, and the word-level differences between
the train document and the test document holding most (whitespace-separated words, :mod:`difflib`).

    python benchmarks/papers/ngram/ngram_near_copies.py --corpus imdb --out docs/results/ngram/near_copies_imdb.json
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys

import numpy as np

from memlm.data.corpora import corpus_fingerprint, load_documents
from memlm.io.fileio import atomic_write_json
from memlm.ngram.decontaminate import RULE, overlap_fractions


def word_differences(a: str, b: str) -> list[dict]:
    """The word-level edits that turn ``a`` into ``b``."""
    wa, wb = a.split(), b.split()
    ops = difflib.SequenceMatcher(a=wa, b=wb, autojunk=False).get_opcodes()
    return [
        {"op": op, "train": " ".join(wa[i1:i2]), "test": " ".join(wb[j1:j2])}
        for op, i1, i2, j1, j2 in ops
        if op != "equal"
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", default="imdb")
    ap.add_argument("--at-least", type=float, default=0.5)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    train, test = load_documents(args.corpus, "train"), load_documents(args.corpus, "test")
    frac = np.nan_to_num(overlap_fractions(train, {"test": test}, progress=True)["fraction"]["test"], nan=0.0)
    found = []
    for i in np.flatnonzero(frac >= args.at_least):
        doc = train[int(i)]
        # test documents sharing any 13-gram with it, then the share of its 13-grams each one holds
        shared = np.nan_to_num(overlap_fractions(test, {"doc": [doc]})["fraction"]["doc"], nan=0.0)
        cands = [test[int(j)] for j in np.flatnonzero(shared > 0)]
        held = overlap_fractions([doc], {t.id: [t] for t in cands})["fraction"] if cands else {}
        holders = sorted(({"id": t.id, "share": float(held[t.id][0])} for t in cands), key=lambda h: -h["share"])
        best = next(t for t in cands if t.id == holders[0]["id"])
        found.append(
            {
                "id": doc.id,
                "overlap_with_test": float(frac[i]),
                "train_words": len(doc.text.split()),
                "test_holders": holders,
                "closest_test_words": len(best.text.split()),
                "word_differences_to_closest": word_differences(doc.text, best.text),
            }
        )
    out = {
        "command": f"python benchmarks/papers/ngram/ngram_near_copies.py --corpus {args.corpus} --out {args.out}",
        "rule": RULE,
        "corpus": args.corpus,
        "fingerprints": {"train": corpus_fingerprint(train), "test": corpus_fingerprint(test)},
        "train_documents": len(train),
        "test_documents": len(test),
        "at_least": args.at_least,
        "near_copies": sorted(found, key=lambda f: -f["overlap_with_test"]),
    }
    atomic_write_json(args.out, out)
    json.dump(out["near_copies"], sys.stdout, indent=1, ensure_ascii=False)


if __name__ == "__main__":
    main()
