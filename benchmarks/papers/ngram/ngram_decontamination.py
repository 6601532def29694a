"""How many documents of the offline train splits does the infini-gram paper's decontamination rule find in the
evaluation text? (docs/results/ngram.md, "Decontamination")

    python benchmarks/papers/ngram/ngram_decontamination.py --index data/ngram/all-train \\
        --out docs/results/ngram/decontamination.json

The rule of Liu et al. (2024, App. B; :mod:`memlm.ngram.decontaminate`): a reference document is dropped whole when at
least 80% of its 13-grams (Unicode word tokens, lowercased) occur in the evaluation documents. Checked: every train
document of ``--corpora`` (the all-offline ∞-gram's reference) against WikiText-2 test and IMDB test (the whole
splits, and the prefixes the perplexity rows of docs/results/ngram.md evaluate: the first 24,000 SmolLM2 tokens of
WikiText-2
test, which hold the 20,000- and 24,000-token rows, and the first 30,000 of IMDB test), per corpus. ``--index``: the
all-offline index the rows used; its source fingerprint is compared with these documents' (built with ``--holdout 0``,
it holds every one of them).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
from transformers import AutoTokenizer

from memlm.data.corpora import corpus_fingerprint, load_documents
from memlm.data.windows import limit_documents
from memlm.io.fileio import atomic_write_json
from memlm.models.resources import tokenizer_fingerprint
from memlm.ngram.decontaminate import RULE, overlap_fractions
from memlm.ngram.index import NgramIndex


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpora", default="wiki,news,brown,bbc,wikitext2,imdb")
    ap.add_argument("--index", default=None, help="the all-offline ∞-gram index the perplexity rows used")
    ap.add_argument("--tokenizer", default=str(Path.home() / ".cache/memlm/models/smollm2-135m"))
    ap.add_argument("--n", type=int, default=13)
    ap.add_argument("--threshold", type=float, default=0.8)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    names = [c.strip() for c in args.corpora.split(",")]
    by_corpus = {c: load_documents(c, "train") for c in names}
    docs = [d for c in names for d in by_corpus[c]]
    label = [c for c in names for _ in by_corpus[c]]
    wt2, imdb = load_documents("wikitext2", "test"), load_documents("imdb", "test")
    evals = {
        "wikitext2:test": wt2,
        "imdb:test": imdb,
        "wikitext2:test, first 24,000 tokens (the rows)": limit_documents(wt2, tok, 24_000),
        "imdb:test, first 30,000 tokens (the rows)": limit_documents(imdb, tok, 30_000),
    }
    res = overlap_fractions(docs, evals, n=args.n, progress=True)
    frac = {k: np.nan_to_num(v, nan=0.0) for k, v in res["fraction"].items()}
    # the paper's one filter over every evaluation set: the two full test sets (the prefixes are parts of them)
    union_full = frac["all"]
    drop = union_full >= args.threshold

    def tokens(idx) -> int:
        return tokens_of(tok, [docs[i] for i in idx])

    per_corpus = {}
    for c in names:
        m = np.array([x == c for x in label])
        row = {"documents": int(m.sum()), "dropped_by_both_test_sets": int((drop & m).sum())}
        for name in evals:
            hit = (frac[name] >= args.threshold) & m
            row[name] = {
                "dropped_documents": int(hit.sum()),
                "dropped_tokens": tokens(np.flatnonzero(hit)),
                "overlap_at_least_0.5": int(((frac[name] >= 0.5) & m).sum()),
                "max_overlap": float(frac[name][m].max()) if m.any() else None,
            }
        per_corpus[c] = row
    dropped = [
        {
            "corpus": label[i],
            "id": str(docs[i].id),
            "tokens": tokens([i]),
            "words": int(res["tokens"][i]),
            "overlap": {name: round(float(frac[name][i]), 6) for name in evals},
        }
        for i in np.flatnonzero(drop).tolist()
    ]
    index = None
    if args.index:
        m = NgramIndex.open(args.index).manifest
        src = m["sources"][0]
        index = {
            "path": args.index,
            "documents": m["documents"],
            "source_fingerprint": src.get("fingerprint"),
            "these_documents_fingerprint": corpus_fingerprint(docs),
            "holdout_documents": src.get("holdout", {}).get("documents"),
            "tokenizer_matches": m["tokenizer"]["fingerprint"] == tokenizer_fingerprint(tok),
        }
        index["holds_every_checked_document"] = (
            index["source_fingerprint"] == index["these_documents_fingerprint"]
            and index["holdout_documents"] == 0
            and index["documents"] == len(docs)
        )
    out = {
        "command": " ".join(["python", *sys.argv]),
        "rule": RULE,
        "n": args.n,
        "threshold": args.threshold,
        "min_n": 5,
        "lowercase": True,
        "reference": {"corpora": names, "split": "train", "documents": len(docs)},
        "eval_sets": {
            name: {"documents": len(d), "tokens": tokens_of(tok, d), "distinct_ngrams": res["eval_ngrams"][name]}
            for name, d in evals.items()
        },
        "dropped_by_both_test_sets": {
            "documents": int(drop.sum()),
            "tokens": tokens(np.flatnonzero(drop)),
            "at_exactly_threshold": int((union_full == args.threshold).sum()),
        },
        "per_corpus": per_corpus,
        "dropped": dropped,
        "index_used_by_the_rows": index,
        "seconds": time.perf_counter() - t0,
        "seconds_note": "on the loaded 2-core machine: indicative only",
    }
    atomic_write_json(Path(args.out), out)
    print(json.dumps({k: v for k, v in out.items() if k not in ("dropped", "rule")}, indent=1))


def tokens_of(tok, docs) -> int:
    if not docs:
        return 0
    return int(sum(len(x) for x in tok([d.text for d in docs], add_special_tokens=False)["input_ids"]))


if __name__ == "__main__":
    main()
