"""Which tokens NPM SINGLE's training masks: the training batches of ``benchmarks/papers/npm/npm.sh``
(wiki+news train, 32 x 128 tokens, seed 0, document-grouped), masked as ``memlm train --objective npm-single`` does
(:class:`memlm.npm.objective.NpmObjective`, 15% of the tokens that have an in-batch positive), once with the
objective's ``max_repeat`` and once with App. A.2's cap (a span -- here a token -- masked at most 10 times per batch).
NPM's span masking (cap 10) is shown beside them. For each: masked tokens per batch, distinct token ids, the share
of masked tokens that are punctuation or one of the 20 most frequent ids of the batches, and the most masked tokens.

    PYTHONPATH=src .venv/bin/python benchmarks/papers/npm/npm_masking_stats.py \\
        --json docs/results/npm/masking-stats.json
"""

from __future__ import annotations

import argparse
import json
import string
import sys
from collections import Counter
from itertools import islice
from pathlib import Path

from memlm.data.corpora import load_corpora
from memlm.io.fileio import atomic_write_json
from memlm.models.resources import load_encoder
from memlm.npm.objective import NpmObjective, npm_batches


def stats(obj: NpmObjective, batches: list[dict], tok, frequent: set[int]) -> dict:
    masked: Counter = Counter()
    for b in batches:
        mb = obj.mask(b)
        for s in mb.all_spans:
            masked[int(mb.original_ids[s.seq][s.start])] += 1  # the first token of each masked span
    n = sum(masked.values())
    punct = sum(c for t, c in masked.items() if all(ch in string.punctuation for ch in tok.convert_ids_to_tokens(t)))
    return {
        "max_repeat": obj.max_repeat,
        "masked_per_batch": n / len(batches),
        "distinct_ids": len(masked),
        "share_punctuation": punct / n,
        "share_top20_frequent": sum(c for t, c in masked.items() if t in frequent) / n,
        "most_masked": [(tok.convert_ids_to_tokens(t), round(c / n, 4)) for t, c in masked.most_common(15)],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, default=8)
    ap.add_argument("--json", type=Path, required=True)
    args = ap.parse_args(argv)
    tok = load_encoder("minilm-l6")[1]
    nb = npm_batches(load_corpora("wiki,news", "train"), tok, seq_len=128, batch_size=32, seed=0)
    batches = list(islice(nb(0), args.batches))
    counts: Counter = Counter()
    for b in batches:
        counts.update(int(t) for t in b["input_ids"][b["attention_mask"].bool()].tolist())
    special = set(tok.all_special_ids)
    frequent = {t for t, _ in Counter({t: c for t, c in counts.items() if t not in special}).most_common(20)}
    out = {
        "batches": len(batches),
        "top20_frequent_ids": tok.convert_ids_to_tokens(sorted(frequent, key=lambda t: -counts[t])),
        "npm-single (objective default)": stats(NpmObjective("npm-single", tok), batches, tok, frequent),
        "npm-single, max_repeat 10": stats(NpmObjective("npm-single", tok, max_repeat=10), batches, tok, frequent),
        "npm (spans, max_repeat 10)": stats(NpmObjective("npm", tok), batches, tok, frequent),
    }
    atomic_write_json(args.json, out)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
