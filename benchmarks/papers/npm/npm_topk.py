"""What an NPM / NPM SINGLE query retrieves on the BBC closed-set task: the top-k tokens per query.

For every BBC test query (article + " The text topic is about [MASK].", as ``memlm npm eval --task bbc`` builds it)
this dumps the position of ``[MASK]`` in the query, the most frequent token strings among the top-``k`` rows retrieved
for ``q`` (NPM SINGLE) or for ``q_start`` and ``q_end`` (NPM), how many of the ``k`` rows are a single-token BBC
verbalizer (exact token id, App. A.4) and the rank of the first one. With ``--short N`` every query is built a second
time from only the first ``N`` article tokens (so ``[MASK]`` sits at a position the trainer's 128-token sequences
cover) and the same counts are dumped for it. Two checks that the index and the queries use the same encoder:
``check_encoder`` and re-encoding the index's first blocks with the model (largest absolute difference from the
stored float16 vectors).

    PYTHONPATH=src .venv/bin/python benchmarks/papers/npm/npm_topk.py --encoder minilm-l6 \
        --index runs/npm/idx-untrained --single --json docs/results/npm/topk-untrained-single.json
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
from memlm.io.fileio import atomic_write_json
from memlm.models.resources import load_encoder
from memlm.npm.encoder import encode_query, encode_sequences, masked_query
from memlm.npm.phrase_index import PhraseIndex


def verbalizer_ids(tok) -> dict[int, str]:
    """Token id -> label, for the BBC verbalizers that are one token."""
    out = {}
    for label, words in tasks.BBC_VERBALIZERS.items():
        for w in words:
            ids = tok(w, add_special_tokens=False)["input_ids"]
            if len(ids) == 1:
                out[int(ids[0])] = label
    return out


def index_consistency(pi: PhraseIndex, model, tok, blocks: int = 2) -> float:
    """Largest |stored vector - re-encoded vector| over the first ``blocks`` blocks (0 up to float16 rounding)."""
    block = np.asarray(pi.block)
    worst = 0.0
    for b in range(min(blocks, pi.n_blocks)):
        rows = np.flatnonzero(block == b)
        ids = [tok.cls_token_id, *np.asarray(pi.token_ids)[rows].tolist(), tok.sep_token_id]
        (h,) = encode_sequences(model, [ids], tok.pad_token_id)
        worst = max(worst, float(np.abs(h[1:-1] - np.asarray(pi.vectors[rows], dtype=np.float32)).max()))
    return worst


def describe(pi: PhraseIndex, tok, verb: dict[int, str], sims: np.ndarray, ids: np.ndarray, top: int) -> dict:
    """Counts over one query vector's top-k rows."""
    toks = np.asarray(pi.token_ids)[ids]
    strings = Counter(tok.convert_ids_to_tokens([int(t) for t in toks]))
    hit = [r for r, t in enumerate(toks.tolist()) if t in verb]
    return {
        "top_tokens": strings.most_common(top),
        "distinct_tokens": len(strings),
        "verbalizer_rows": len(hit),
        "verbalizer_labels": dict(Counter(verb[int(toks[r])] for r in hit)),
        "first_verbalizer_rank": hit[0] + 1 if hit else None,
        "sim_top1": float(sims[0]),
        "sim_topk": float(sims[-1]),
    }


def dump(args: argparse.Namespace) -> dict:
    model, tok = load_encoder(args.encoder, dtype="float32")
    pi = PhraseIndex.open(args.index)
    pi.check_encoder(model, tok)
    verb = verbalizer_ids(tok)
    docs = load_documents("bbc", "test")[: args.max_queries]
    limit = tasks.encoder_limit(model, tok)
    scale = 1.0 / np.sqrt(pi.dim)
    rows, overall = [], {"q": Counter(), "q_short": Counter()}
    for d in docs:
        row = {"id": d.id, "gold": tasks.bbc_label(d)}
        for key, max_tokens in (("q", 256), ("q_short", args.short)):
            if max_tokens is None:
                continue
            query = tasks.bbc_query(tok, d.text, limit, max_tokens=max_tokens)
            row[f"{key}_mask_position"] = masked_query(tok, query, single=args.single)[1]
            q_s, q_e = encode_query(model, tok, query, single=args.single)
            for side, vec in (("start", q_s),) if args.single else (("start", q_s), ("end", q_e)):
                s, i = pi.search(vec[None], args.k)
                keep = i[0] >= 0
                info = describe(pi, tok, verb, s[0][keep] * scale, i[0][keep], args.top)
                row[f"{key}_{side}"] = info
                overall[key].update(dict(info["top_tokens"]))
        rows.append(row)
    sides = ["start"] if args.single else ["start", "end"]
    summary = {}
    for key in ("q", "q_short"):
        if f"{key}_start" not in rows[0]:
            continue
        summary[key] = {
            "mask_position_median": float(np.median([r[f"{key}_mask_position"] for r in rows])),
            "queries_with_a_verbalizer": {s: sum(r[f"{key}_{s}"]["verbalizer_rows"] > 0 for r in rows) for s in sides},
            "verbalizer_rows_mean": {
                s: float(np.mean([r[f"{key}_{s}"]["verbalizer_rows"] for r in rows])) for s in sides
            },  # fmt: skip
            "most_retrieved_tokens": overall[key].most_common(args.top * 2),
        }
    ids = np.asarray(pi.token_ids)
    return {
        "encoder": args.encoder,
        "index": str(args.index),
        "inference": "npm-single" if args.single else "npm",
        "k": args.k,
        "queries": len(rows),
        "index_rows": len(pi),
        "index_verbalizer_rows": int(np.isin(ids, list(verb)).sum()),
        "index_reencode_max_abs_diff": index_consistency(pi, model, tok),
        "summary": summary,
        "per_query": rows,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--encoder", required=True)
    ap.add_argument("--index", type=Path, required=True)
    ap.add_argument("--single", action="store_true", help="NPM SINGLE inference (one [MASK] vector)")
    ap.add_argument("--k", type=int, default=1024)
    ap.add_argument("--top", type=int, default=15, help="token strings listed per query")
    ap.add_argument("--short", type=int, default=100, help="also query with only this many article tokens")
    ap.add_argument("--max-queries", type=int, default=None)
    ap.add_argument("--json", type=Path, required=True)
    args = ap.parse_args(argv)
    out = dump(args)
    atomic_write_json(args.json, out)
    print(json.dumps({k: v for k, v in out.items() if k != "per_query"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
