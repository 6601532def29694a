"""Which domain shows the demo's row "adapt to a new domain by swapping the memory": candidates measured alike.

SmolLM2-135M in float32 (the demo's model), for each candidate domain D among the offline corpora:

- the base LM on D's held-out test split (each document cut to its first ``--doc-tokens`` tokens, so that a corpus
  of long articles such as WikiText-2 still gives >= 30 documents to resample; the leading documents up to
  ``--test-tokens``), scored in windows of 512 overlapping by 128 (the demo's);
- LM + a kNN datastore (``ffn_in`` keys, the demo's) over D's first ``--datastore-tokens`` training tokens, exact
  search over all keys, k = 256 (Khandelwal et al. 2020, Eq. 2-3);
- LM + an ∞-gram over all of D's training split (Liu et al. 2024: λ_sparse / λ_dense), decontaminated against D's
  valid and test splits (App. B, :func:`memlm.ngram.decontaminate.decontaminate_reference`);
- LM + both, the four weights tuned jointly;
- the same three rows with the *wiki* memories (a datastore over wiki's first ``--datastore-tokens`` training tokens
  and an ∞-gram over all of wiki train, decontaminated against the valid and test splits of the candidates run):
  the memory not swapped.

Every weight is fixed, fitted on D's valid split (its leading ``--valid-tokens``) by
:func:`memlm.mixing.report.fit_table` (the rule by EM, τ the most likely), and applied unchanged on test. Each row
has its paired 95% bootstrap interval over the test documents
(:func:`memlm.core.bootstrap.evidence`) against the base LM and against the same system with the wiki memory. The
JSON records the seconds of each phase, the load average before the run, and the CPU (``lscpu``): the demo must fit
its budget on 2 cores, and the forward pass dominates. Memories and per-token dumps are cached under
``$MEMLM_HOME/demo_domains``, so a rerun recomputes only the table::

    PYTHONPATH=src HF_HUB_OFFLINE=1 python benchmarks/quality/demo_domains.py wikitext2 imdb bbc
    PYTHONPATH=src HF_HUB_OFFLINE=1 python benchmarks/quality/demo_domains.py news

(each run adds its candidates to ``docs/results/demo/domain_candidates.json``; a candidate run again from its cached
memories and dumps keeps its first run's phase times, and records the rerun's under ``rerun_seconds``).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from memlm.core.bootstrap import evidence
from memlm.core.distribution import perplexity
from memlm.core.tuning import DEFAULT_TEMPERATURES
from memlm.data.corpora import corpus_fingerprint, load_documents
from memlm.data.windows import limit_documents, truncate_document
from memlm.errors import MemlmError
from memlm.io.fileio import atomic_write_json
from memlm.knnlm.evaluate import add_memory, add_neighbours, lm_scores
from memlm.knnlm.table import TokenTable
from memlm.knnlm.write import write_datastore
from memlm.mixing.report import fit_summary, fit_table
from memlm.models.keys import KeySpec
from memlm.models.resources import load_causal_lm, memlm_home
from memlm.ngram.decontaminate import decontaminate_reference
from memlm.ngram.index import NgramIndex, build_ngram_index
from memlm.ngram.memory import NgramMemory
from memlm.storage.datastore import Datastore

MODEL, DTYPE, KEY, K = "smollm2-135m", "float32", "ffn_in", 256
WINDOW, MIN_CONTEXT, BATCH = 512, 128, 4
# the candidates this script knows (corpus names of memlm.data.corpora)
CANDIDATES = ("wikitext2", "imdb", "bbc", "news")
SYSTEMS = ("knn", "ngram", "both")


def _log(msg: str, t0: float) -> None:
    print(f"[{time.perf_counter() - t0:6.0f} s] {msg}", flush=True)


def _cpu() -> dict[str, Any]:
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return {}
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    flags = fields.get("Flags", "").split()
    return {"model_name": fields.get("Model name", "").strip(), "cpus": os.cpu_count(), "flags": flags,
            "avx2": "avx2" in flags, "avx512f": "avx512f" in flags, "amx_bf16": "amx_bf16" in flags}  # fmt: skip


def _eval_documents(corpus: str, split: str, tok, tokens: int, doc_tokens: int) -> list:
    """The leading documents of ``corpus/split``, each cut to ``doc_tokens`` tokens, up to ``tokens`` in all."""
    docs = [truncate_document(d, tok, doc_tokens) for d in load_documents(corpus, split)[: tokens // 16 + 1]]
    return limit_documents(docs, tok, tokens)


def _datastore(model, tok, corpus: str, out: Path, tokens: int, phases: dict) -> Datastore:
    try:
        return Datastore.open(out)
    except MemlmError:
        pass
    t = time.perf_counter()
    docs = limit_documents(load_documents(corpus, "train"), tok, tokens)
    ds = write_datastore(model, tok, docs, out, key=KeySpec.parse(KEY), window=WINDOW, min_context=MIN_CONTEXT,
                         stride=WINDOW, batch_size=BATCH, progress=False, overwrite=True,
                         source={"corpus": corpus, "split": "train", "documents": len(docs),
                                 "fingerprint": corpus_fingerprint(docs)})  # fmt: skip
    phases[f"{corpus} datastore ({len(ds):,} entries)"] = time.perf_counter() - t
    return ds


def _ngram(tok, corpus: str, out: Path, against: list[str], phases: dict) -> NgramMemory:
    try:
        return NgramMemory(NgramIndex.open(out))
    except MemlmError:
        pass
    t = time.perf_counter()
    docs, record = decontaminate_reference(load_documents(corpus, "train"), against, tok)
    phases[f"{corpus} ∞-gram decontamination"] = time.perf_counter() - t
    t = time.perf_counter()
    source = {"corpus": corpus, "split": "train", "documents": len(docs), "fingerprint": corpus_fingerprint(docs),
              "decontamination": record}  # fmt: skip
    memory = NgramMemory(build_ngram_index(tok, docs, out, source=source, overwrite=True))
    phases[f"{corpus} ∞-gram index ({int(memory.index.manifest['tokens']):,} tokens)"] = time.perf_counter() - t
    return memory


def _dumps(model, tok, docs, split, stores, ngrams, cache: Path, phases: dict) -> dict[str, TokenTable]:
    """One forward pass over ``docs``; one dump per memory name (its datastore's neighbours and its ∞-gram)."""
    paths = {name: cache / f"{split}-{name}.npz" for name in stores}
    if all(p.exists() for p in paths.values()):
        return {name: TokenTable.load(p) for name, p in paths.items()}
    t = time.perf_counter()
    specs = list(dict.fromkeys(ds.key_spec for ds in stores.values()))
    base, queries, _ = lm_scores(model, tok, docs, specs, WINDOW, MIN_CONTEXT, BATCH, progress=False,
                                 meta={"split": split})  # fmt: skip
    phases[f"score {split} ({len(base):,} tokens, {len(docs)} documents)"] = time.perf_counter() - t
    out = {}
    for name, ds in stores.items():
        ts = base.select()
        t = time.perf_counter()
        add_neighbours(ts, queries[ds.key_spec], ds, k=K, search="exact")
        phases[f"search {split} in {name} datastore"] = time.perf_counter() - t
        t = time.perf_counter()
        add_memory(ts, ngrams[name], docs, tok)
        phases[f"∞-gram lookups {split} in {name}"] = time.perf_counter() - t
        ts.save(paths[name])
        out[name] = ts
    return out


def _lm_and_ngram(ts: TokenTable) -> TokenTable:
    return ts.select(["ngram"])


def _systems(valid: TokenTable, test: TokenTable) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Each system's test log-probabilities with its weights fitted on ``valid`` (the rule by EM, τ the most likely:
    :func:`memlm.mixing.report.fit_table`): kNN (λ, τ), ∞-gram (λ_sparse, λ_dense), both (together)."""
    views = {"knn": lambda ts: ts.select(["knn"]), "ngram": _lm_and_ngram, "both": lambda ts: ts}
    fits = {name: fit_table(view(valid), "rule", DEFAULT_TEMPERATURES, K) for name, view in views.items()}
    logprobs = {name: fits[name].logprob(view(test), f"the {name} row") for name, view in views.items()}
    return logprobs, {name: fit_summary(dm) for name, dm in fits.items()}


def _formatting_tokens(ts: TokenTable, tok) -> np.ndarray:
    """Targets that are corpus formatting rather than words: a lone punctuation mark after a space (WikiText's
    `` , `` and `` . ``), or an ``@`` (its `` @-@ ``)."""
    out = np.zeros(len(ts), dtype=bool)
    for i, t in enumerate(ts.targets):
        text = tok.decode([int(t)])
        mark = text.startswith(" ") and len(text.strip()) == 1 and not text.strip().isalnum()
        out[i] = mark or "@" in text
    return out


def _interval(d: dict[str, Any]) -> dict[str, Any]:
    return {k: d[k] for k in ("relative_change", "low", "high", "excludes_zero")}


def run_candidate(name: str, args, model, tok, wiki: tuple[Datastore, NgramMemory], t0: float) -> dict[str, Any]:
    cache = memlm_home() / "demo_domains" / name
    cache.mkdir(parents=True, exist_ok=True)
    phases: dict[str, float] = {}
    load = os.getloadavg()
    t = time.perf_counter()
    test_docs = _eval_documents(name, "test", tok, args.test_tokens, args.doc_tokens)
    valid_docs = _eval_documents(name, "valid", tok, args.valid_tokens, args.doc_tokens)
    phases["read and cut the eval documents"] = time.perf_counter() - t
    store = _datastore(model, tok, name, cache / "datastore", args.datastore_tokens, phases)
    _log(f"{name}: datastore {len(store):,} entries", t0)
    ngram = _ngram(tok, name, cache / "ngram", [f"{name}:valid", f"{name}:test"], phases)
    _log(f"{name}: ∞-gram ready", t0)
    stores, ngrams = {"domain": store, "wiki": wiki[0]}, {"domain": ngram, "wiki": wiki[1]}
    valid = _dumps(model, tok, valid_docs, "valid", stores, ngrams, cache, phases)
    test = _dumps(model, tok, test_docs, "test", stores, ngrams, cache, phases)
    _log(f"{name}: scored valid and test", t0)
    t = time.perf_counter()
    logprobs: dict[str, torch.Tensor] = {}
    weights: dict[str, Any] = {}
    for memory in ("domain", "wiki"):
        lp, w = _systems(valid[memory], test[memory])
        logprobs.update({f"{s}_{memory}": v for s, v in lp.items()})
        weights[memory] = w
    logprobs["base"] = torch.from_numpy(np.asarray(test["domain"].lm_logprob, dtype=np.float32))
    pairs = [("base", f"{s}_{m}") for s in SYSTEMS for m in ("domain", "wiki")]
    pairs += [(f"{s}_wiki", f"{s}_domain") for s in SYSTEMS]
    ev = evidence(logprobs, test["domain"].doc_index, pairs=pairs)
    fmt = _formatting_tokens(test["domain"], tok)
    base_lp = logprobs["base"].double().numpy()
    gained = {key: float((lp.double().numpy() - base_lp).sum()) for key, lp in logprobs.items() if key != "base"}
    phases["tune on valid, mix test, bootstrap"] = time.perf_counter() - t
    diffs = ev["differences"]
    rows = {}
    for s in SYSTEMS:
        for m in ("domain", "wiki"):
            key = f"{s}_{m}"
            rows[key] = {
                "ppl": perplexity(logprobs[key]),
                "weights": weights[m][s],
                "vs_base": _interval(diffs[f"{key} vs base"]),
                "nats_gained": gained[key],
                "nats_gained_on_formatting": float((logprobs[key].double().numpy() - base_lp)[fmt].sum()),
            }
            # fmt: skip
        rows[f"{s}_domain"]["vs_wiki_memory"] = _interval(diffs[f"{s}_domain vs {s}_wiki"])
    return {
        "corpus": name,
        "tokens": len(test["domain"]),
        "documents": int(len(np.unique(test["domain"].doc_index))),
        "valid_tokens": len(valid["domain"]),
        "valid_documents": int(len(np.unique(valid["domain"].doc_index))),
        "base_ppl": perplexity(logprobs["base"]),
        "base_interval": ev["intervals"]["base"],
        "rows": rows,
        "datastore_entries": {"domain": len(store), "wiki": len(wiki[0])},
        "ngram_tokens": {"domain": int(ngram.index.manifest["tokens"]), "wiki": int(wiki[1].index.manifest["tokens"])},
        "bootstrap": ev["bootstrap"],
        # a lone punctuation mark after a space, or an @: how much of a gain is the corpus's formatting
        "formatting_token_share": float(fmt.mean()),
        "seconds": phases,
        "load_average_before": list(load),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("candidates", nargs="+", choices=CANDIDATES)
    ap.add_argument("--out", type=Path, default=Path("docs/results/demo/domain_candidates.json"))
    ap.add_argument("--datastore-tokens", type=int, default=10_000)
    ap.add_argument("--test-tokens", type=int, default=12_000)
    ap.add_argument("--valid-tokens", type=int, default=4_000)
    ap.add_argument("--doc-tokens", type=int, default=384, help="each valid/test document cut to this many tokens")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    result: dict[str, Any] = args.__dict__ | {"out": str(args.out), "model": MODEL, "dtype": DTYPE, "key": KEY,
                                              "k": K, "window": WINDOW, "min_context": MIN_CONTEXT}  # fmt: skip
    result["cpu"] = _cpu()
    result["load_average_before"] = list(os.getloadavg())
    if args.out.exists():  # keep the candidates of earlier runs
        import json

        previous = json.loads(args.out.read_text())
        result["results"] = previous.get("results", {})
        result["shared_seconds"] = previous.get("shared_seconds")
    result.setdefault("results", {})
    phases: dict[str, float] = {}
    t = time.perf_counter()
    model, tok = load_causal_lm(MODEL, dtype=DTYPE)
    phases["load the model"] = time.perf_counter() - t
    home = memlm_home() / "demo_domains" / "wiki"
    home.mkdir(parents=True, exist_ok=True)
    store = _datastore(model, tok, "wiki", home / "datastore", args.datastore_tokens, phases)
    # decontaminated against the valid and test splits of the candidates run (one index per set of candidates)
    against = [f"{c}:{s}" for c in sorted(args.candidates) for s in ("valid", "test")]
    wiki = (store, _ngram(tok, "wiki", home / f"ngram-{'-'.join(sorted(args.candidates))}", against, phases))
    result["shared_seconds"] = phases if len(phases) > 1 else result.get("shared_seconds") or phases
    _log(f"wiki memories ready: {len(store):,} entries", t0)
    for name in args.candidates:
        before = result["results"].get(name, {})
        result["results"][name] = run_candidate(name, args, model, tok, wiki, t0)
        if before.get("seconds") and not any("score" in p for p in result["results"][name]["seconds"]):
            # a rerun from cached memories and dumps: keep the first run's phase times and load beside this one's
            result["results"][name]["rerun_seconds"] = result["results"][name]["seconds"]
            for key in ("seconds", "load_average_before"):
                result["results"][name][key] = before[key]
        r = result["results"][name]
        _log(f"{name}: {r['tokens']:,} tokens, {r['documents']} documents, base ppl {r['base_ppl']:.2f}", t0)
        for key, row in r["rows"].items():
            d = row["vs_base"]
            extra = ""
            if "vs_wiki_memory" in row:
                w = row["vs_wiki_memory"]
                extra = (f"  vs wiki memory {100 * w['relative_change']:+.1f}% "
                         f"[{100 * w['low']:+.1f}, {100 * w['high']:+.1f}]")  # fmt: skip
            print(f"  {key:13s} ppl {row['ppl']:8.2f}  vs base {100 * d['relative_change']:+.1f}% "
                  f"[{100 * d['low']:+.1f}, {100 * d['high']:+.1f}]{extra}", flush=True)  # fmt: skip
        result["seconds"] = time.perf_counter() - t0
        args.out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(args.out, result)


if __name__ == "__main__":
    main()
