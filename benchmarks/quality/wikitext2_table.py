"""The standard table: SmolLM2-135M on WikiText-2 test, token- and word-level perplexity, base vs kNN-LM; and the
domain-adaptation rows (IMDB test with a Wikipedia and an IMDB datastore).

Protocol: lm-evaluation-harness's ``loglikelihood_rolling`` (the ``wikitext`` task) through memlm's adapter windows
(:func:`memlm.models.forward.rolling_forward`): every article scored on its own after the BOS prefix token, sliding
windows of ``--window`` tokens with at least ``--min-context`` tokens of context, WikiText pages detokenized as lm_eval
does. Word perplexity = exp(-Σ log p / Σ words), words counted on the raw page (lm_eval's ``process_results``); token
perplexity = exp(-Σ log p / Σ tokens) over the same tokens. One forward pass per split serves every datastore; λ and
τ are tuned on (a prefix of) the valid split, per datastore, and applied to test; λ = 0.25, τ = 1 (memlm's old
defaults) is reported beside them.

Every stage is cached under ``--work`` (rerun the same command to resume); the result goes to ``--json``::

    python benchmarks/quality/wikitext2_table.py --corpus wikitext2 \\
        --datastore wt2=data/wt2/ds-wt2-train --valid-max-tokens 60000 \\
        --work logs/wt2table --json docs/results/wikitext2/table.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import re
import sys
import time
from pathlib import Path

import numpy as np
import torch

from memlm.core.distribution import mix, perplexity
from memlm.core.tuning import DEFAULT_TEMPERATURES
from memlm.data.corpora import load_documents
from memlm.io.fileio import atomic_write_json
from memlm.knnlm.calibration import stored_mixture
from memlm.knnlm.evaluate import add_neighbours, perplexities
from memlm.knnlm.table import TokenTable
from memlm.mixing.report import fit_summary, fit_table
from memlm.models.forward import rolling_forward
from memlm.models.keys import KeySpec, num_layers
from memlm.models.resources import load_causal_lm
from memlm.storage.datastore import Datastore


def _pages(corpus: str, split: str, tok, max_tokens: int | None) -> tuple[list[str], list[str]]:
    """(raw pages, texts the model reads): WikiText pages go through lm_eval's detokenizer."""
    raw = [d.text for d in load_documents(corpus, split)]
    if corpus == "wikitext2":
        from lm_eval.tasks.wikitext.preprocess_wikitext import wikitext_detokenizer

        texts = [wikitext_detokenizer({"page": p}) for p in raw]
    else:
        texts = list(raw)
    if max_tokens is not None:
        keep, total = 0, 0
        for t in texts:
            if total >= max_tokens:
                break
            total += len(tok(t, add_special_tokens=False)["input_ids"])
            keep += 1
        raw, texts = raw[:keep], texts[:keep]
    return raw, texts


def _forward(model, tok, texts, spec, args, path: Path) -> tuple[TokenTable, np.ndarray]:
    if path.with_suffix(".queries.npy").exists() and path.exists():
        return TokenTable.load(path), np.load(path.with_suffix(".queries.npy"))
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    prefix = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    t0 = time.perf_counter()
    lm, targets, docs, keys, *_ = rolling_forward(model, ids, [spec], args.window, args.min_context, args.batch_size,
                                                  prefix, pad)  # fmt: skip
    meta = {"tokens": int(len(targets)), "window": args.window, "min_context": args.min_context,
            "protocol": "lm_eval loglikelihood_rolling (BOS prefix, per article)",
            "seconds_forward": time.perf_counter() - t0}  # fmt: skip
    ts = TokenTable(targets=targets, lm_logprob=lm, doc_index=docs, meta=meta)
    queries = keys[spec].astype(np.float16)  # cached like the datastore's keys, in float16
    np.save(path.with_suffix(".queries.npy"), queries)
    ts.save(path)
    return ts, queries


def _neighbours(ts: TokenTable, queries: np.ndarray, ds: Datastore, args, path: Path) -> TokenTable:
    if path.exists():
        return TokenTable.load(path)
    out = add_neighbours(ts.select(), queries.astype(np.float32), ds, k=args.k, nprobe=args.nprobe)
    out.save(path)
    return out


def _logprob(ts: TokenTable, lam: float, tau: float) -> torch.Tensor:
    """Each test token's log p: the LM's, or the kNN-LM's (Eq. 2 mixture at ``lam``, ``tau``)."""
    lm = torch.from_numpy(ts.lm_logprob)
    if "knn" not in ts.columns or lam == 0:
        return lm
    knn = ts.logprob("knn", temperature=tau)
    return mix([lm, knn], weights=[1 - lam, lam])


def _row(ts: TokenTable, raw: list[str], lam: float, tau: float) -> dict:
    logprob = _logprob(ts, lam, tau)
    total = float(logprob.double().sum())
    words = sum(len(re.split(r"\s+", p)) for p in raw)
    nbytes = sum(len(p.encode("utf-8")) for p in raw)
    return {
        "lambda": lam,
        "temperature": tau,
        "sum_logprob": total,
        "tokens": len(ts),
        "words": words,
        "bytes": nbytes,
        "token_ppl": perplexity(logprob),
        "word_ppl": math.exp(-total / words),
        "bits_per_byte": -total / nbytes / math.log(2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--corpus", default="wikitext2")
    ap.add_argument("--datastore", action="append", default=[], help="NAME=FOLDER (repeat)")
    ap.add_argument("--valid-max-tokens", type=int, default=60000)
    ap.add_argument("--test-max-tokens", type=int, default=None)
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--min-context", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--k", type=int, default=1024)
    ap.add_argument("--nprobe", type=int, default=32)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--json", type=Path, required=True)
    args = ap.parse_args()
    t_start = time.perf_counter()
    stores = {}
    for item in args.datastore:
        name, _, folder = item.partition("=")
        stores[name] = Datastore.open(folder)
    model, tok = load_causal_lm(args.model, dtype=args.dtype)
    specs = {ds.key_spec for ds in stores.values()}
    if len(specs) > 1:
        sys.exit("all datastores must use the same key")
    spec = next(iter(specs)) if specs else KeySpec().normalized(num_layers(model))
    for ds in stores.values():
        ds.check_compatible(model, tok)
    args.work.mkdir(parents=True, exist_ok=True)
    settings = {k: v for k, v in vars(args).items() if k not in ("work", "json", "datastore")}
    tag = hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:8]
    result: dict = {"settings": settings, "command": " ".join(sys.argv), "datastores": {}, "rows": []}
    splits = {"valid": args.valid_max_tokens, "test": args.test_max_tokens}
    data = {}
    for split, limit in splits.items():
        raw, texts = _pages(args.corpus, split, tok, limit)
        print(f"[table] {args.corpus}/{split}: {len(texts)} documents", file=sys.stderr, flush=True)
        ts, q = _forward(model, tok, texts, spec, args, args.work / f"{args.corpus}-{split}-{tag}.npz")
        data[split] = (raw, ts, q)
        result[f"{split}_documents"] = len(texts)
        result[f"{split}_tokens"] = len(ts)
        result[f"{split}_base_token_ppl"] = perplexity(ts.lm_logprob)
    raw_test, ts_test, _ = data["test"]
    result["rows"].append({"datastore": None, **_row(ts_test, raw_test, 0.0, 1.0)})
    for name, ds in stores.items():
        result["datastores"][name] = {"path": str(ds.path), "entries": len(ds), "sources": ds.manifest["sources"]}
        dumps = {}
        for split, (_raw, ts, q) in data.items():
            print(f"[table] {name}: neighbours for {split}", file=sys.stderr, flush=True)
            dumps[split] = _neighbours(ts, q, ds, args, args.work / f"{args.corpus}-{split}-{tag}-{name}.npz")
        best = fit_summary(fit_table(dumps["valid"], "rule", DEFAULT_TEMPERATURES))  # λ by EM at each τ
        settings_list = [("tuned on valid", best["knn"], best["temperature"]), ("λ=0.25, τ=1", 0.25, 1.0)]
        fit = stored_mixture(ds)
        if fit is not None:  # the rule summary of the fit made at build on its held-out slice (knnlm.calibration)
            result["datastores"][name]["calibration"] = ds.manifest["calibration"]
            settings_list.append(("calibrated at build", fit.rule_weights["knn"], fit.temperature))
        for how, lam, tau in settings_list:
            row = _row(dumps["test"], raw_test, lam, tau)
            stats = perplexities(dumps["test"], lam=lam, temperature=tau)
            searched = dumps["test"].meta["components"]["knn"].get("seconds")
            result["rows"].append({"datastore": name, "params": how,
                                   "valid_ppl": perplexities(dumps["valid"], lam=lam, temperature=tau)["knn_ppl"],
                                   "target_in_neighbours": stats["target_in_neighbours"],
                                   "seconds_search_test": searched, **row})  # fmt: skip
    result["seconds"] = time.perf_counter() - t_start
    atomic_write_json(args.json, result)
    for r in result["rows"]:
        name, how = r["datastore"] or "base", r.get("params", "")
        print(f"{name:>10s} {how:>15s} λ={r['lambda']:<5g} τ={r['temperature']:<4g} "
              f"token ppl {r['token_ppl']:.3f}  word ppl {r['word_ppl']:.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
