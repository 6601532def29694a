"""Two diagnostics behind docs/results/npm.md's closed-set findings, after ``bash benchmarks/papers/npm/npm.sh all``:

1. ``verbalizer_counts``: occurrences of each BBC label's single-token verbalizers in a phrase index's token stream
   (why a BBC-train reference pulls predictions to business: App. A.4 sums over every retrieved occurrence).
2. ``bm25``: with BM25 restriction to the top 3 passages, how many tokens those passages hold (vs k), how many labels
   have any verbalizer among the candidates, and how often NPM, NPM SINGLE and the untrained encoder predict the same
   label (why the three get the same accuracy).

    .venv/bin/python benchmarks/papers/npm/npm_diagnostics.py --runs runs/npm --json docs/results/npm/diagnostics.json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

import numpy as np

from memlm.data.corpora import load_documents
from memlm.experiments import npm_tasks as tasks
from memlm.models.resources import load_encoder
from memlm.npm.encoder import encode_query
from memlm.npm.inference import closed_set, restrict_rows
from memlm.npm.phrase_index import PhraseIndex

ENCODERS = {  # name -> (encoder, index, NPM SINGLE inference)
    "npm": ("{runs}/npm/final", "{runs}/idx-npm", False),
    "npm-single": ("{runs}/npm-single/final", "{runs}/idx-npm-single", True),
    "untrained": ("minilm-l6", "{runs}/idx-untrained", False),
}


def verbalizer_counts(index: Path, tokenizer) -> dict[str, int]:
    ids = np.asarray(PhraseIndex.open(index).token_ids)
    counts = {}
    for label, words in tasks.BBC_VERBALIZERS.items():
        single = [t[0] for t in (tokenizer(w, add_special_tokens=False)["input_ids"] for w in words) if len(t) == 1]
        counts[label] = int(np.isin(ids, single).sum())
    return counts


def bm25_agreement(runs: Path, k: int, passages: int) -> dict:
    docs = load_documents("bbc", "test")
    preds, out = {}, {}
    for name, (enc, idx, single) in ENCODERS.items():
        model, tok = load_encoder(enc.format(runs=runs), dtype="float32")
        pi = PhraseIndex.open(idx.format(runs=runs))
        pi.check_encoder(model, tok)
        labels, sizes, supported = [], [], []
        for d in docs:
            q = tasks.bbc_query(tok, d.text, tasks.encoder_limit(model, tok))
            rows = restrict_rows(pi, tok, q, passages)  # one BM25 search: its size and the restricted scoring
            sizes.append(len(rows))
            q_s, q_e = encode_query(model, tok, q, single=single)
            r = closed_set(pi, tok, tasks.BBC_VERBALIZERS, q_s, None if single else q_e, k=k, rows=rows)
            labels.append(r.label if r.matched else None)
            supported.append(sum(v > -np.inf for v in r.log_scores.values()))
        preds[name] = labels
        out[name] = {"passage_tokens_median": float(np.median(sizes)), "passage_tokens_max": int(max(sizes)),
                     "labels_supported": dict(sorted(Counter(supported).items()))}  # fmt: skip
    names = list(preds)
    out["same_prediction"] = {f"{a} vs {b}": sum(x == y for x, y in zip(preds[a], preds[b], strict=True))
                              for i, a in enumerate(names) for b in names[i + 1:]}  # fmt: skip
    out["queries"] = len(docs)
    out["k"] = k
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=Path, default=Path("runs/npm"))
    ap.add_argument("--k", type=int, default=1024)
    ap.add_argument("--passages", type=int, default=3)
    ap.add_argument("--json", type=Path, default=Path("docs/results/npm/diagnostics.json"))
    args = ap.parse_args(argv)
    _, tok = load_encoder("minilm-l6")
    res = {
        "command": "python " + " ".join(sys.argv),
        "verbalizer_counts": {idx: verbalizer_counts(args.runs / idx, tok) for idx in ("idx-npm", "idx-npm-bbc")},
        "bm25": bm25_agreement(args.runs, args.k, args.passages),
    }
    print(json.dumps(res, indent=2))
    args.json.write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
