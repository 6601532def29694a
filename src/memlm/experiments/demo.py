"""``memlm demo``: SmolLM2-135M with a Wikipedia datastore, then domain adaptation to news by swapping datastores,
each beside an ∞-gram over the same corpus's whole training split.

The user story of Khandelwal et al. (2020) on the offline defaults, with no training:

1. build a datastore from Wikipedia training articles and one from news training articles (``ffn_in`` keys; one
   forward pass per entry, so a slice of each); index **all** of each corpus's training text as an ∞-gram (Liu et
   al. 2024: a suffix array, no forward pass; :mod:`memlm.ngram`, when the ``ngram`` extra is installed), less the
   documents the paper's decontamination drops against every set the demo evaluates (App. B, as ``memlm ngram
   build`` does: :func:`memlm.ngram.decontaminate.decontaminate_reference`; recorded in the index's manifest);
2. score held-out Wikipedia and held-out news once each (valid and test splits), retrieving from each memory;
3. tune on valid and apply to test: λ, τ of the kNN-LM (``memlm tune``), λ_sparse / λ_dense of LM + ∞-gram, and the
   four jointly for LM + kNN + ∞-gram; print a table, write JSON and a PNG of perplexity vs λ (the paper's Fig. 5).

Everything is cached under ``$MEMLM_HOME/demo`` (model conversion, datastores, indexes, per-token dumps), so a rerun
only reloads and re-tunes. Each step is a public API call; read this file as a worked example.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from memlm.data.corpora import corpus_fingerprint, load_documents
from memlm.data.windows import limit_documents
from memlm.errors import MemlmError
from memlm.knnlm.evaluate import DEFAULT_LAMBDAS, TokenScores, add_neighbours, lm_scores, perplexities, tune
from memlm.leakage import document_record
from memlm.models.keys import KeySpec
from memlm.models.resources import default_dtype, load_causal_lm, memlm_home
from memlm.ngram.decontaminate import EVAL_SPLITS, decontaminate_reference
from memlm.ngram.mixture import add_ngram, ngram_report, tune_ngram
from memlm.storage.datastore import Datastore, build_datastore
from memlm.storage.fileio import atomic_write_json
from memlm.storage.locking import folder_lock

__all__ = ["DemoConfig", "run_demo"]


@dataclass(frozen=True)
class DemoConfig:
    model: str = "smollm2-135m"
    dtype: str = field(default_factory=default_dtype)  # bf16 only with AMX-BF16 (0.57x float32 without); keys fp16
    key: str = "ffn_in"
    datastore_tokens: int = 50_000  # per corpus; a first run ~3.6 min on 2 CPU cores in float32 (BENCHMARKS.md)
    eval_tokens: int = 8_000
    valid_tokens: int = 4_000
    window: int = 512
    min_context: int = 128
    batch_size: int = 4
    # the datastores' forward pass in non-overlapping blocks of `window` tokens (each train token read once, the
    # context of a key 0..window-1 tokens), instead of windows overlapping by min_context: 25% fewer tokens to run
    datastore_blocks: bool = True
    k: int = 256
    ngram: bool = True  # an ∞-gram over each corpus's whole train split beside its datastore (needs memlm[ngram])
    ngram_tokens: int | None = None  # cap on the ∞-gram's training tokens (None: all of them)
    # the ∞-gram indexes decontaminated against the valid and test splits of every evaluated corpus (the paper's
    # App. B, as `memlm ngram build` does by default)
    decontaminate: bool = True

    @classmethod
    def quick(cls) -> DemoConfig:
        return cls(datastore_tokens=12_000, eval_tokens=1_500, valid_tokens=1_000, window=256, min_context=64, k=64,
                   ngram_tokens=200_000)  # fmt: skip

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:10]


PLAN = {"wiki": ["wiki"], "news": ["wiki", "news"]}  # evaluated corpus (valid and test) -> datastores to try
EVAL_CORPORA = tuple(PLAN)

_clock = {"start": time.perf_counter()}  # reset when a demo starts: each log line says how far into the run it is


def _train_source(corpus: str, docs: list) -> dict:
    """The source record of a demo memory built from ``corpus``'s train split, with the document hashes that eval's
    leakage check compares (:func:`memlm.leakage.document_record`), as ``memlm datastore build`` / ``ngram build``
    record them."""
    return {"corpus": corpus, "split": "train", "documents": len(docs), "fingerprint": corpus_fingerprint(docs),
            "document_hashes": document_record(docs)}  # fmt: skip


def _log(msg: str) -> None:
    print(f"[demo {time.perf_counter() - _clock['start']:4.0f} s] {msg}", file=sys.stderr, flush=True)


def _cached_datastore(out: Path) -> Datastore | None:
    """The datastore in ``out`` if a previous run finished it (with its index), else None."""
    try:
        ds = Datastore.open(out)
    except MemlmError:
        return None
    return ds if ds.index_problem() is None else None


def _datastore(cfg: DemoConfig, model, tok, corpus: str, out: Path) -> Datastore:
    docs = limit_documents(load_documents(corpus, "train"), tok, cfg.datastore_tokens)
    ds = build_datastore(
        model,
        tok,
        docs,
        out,
        key=KeySpec.parse(cfg.key),
        window=cfg.window,
        min_context=cfg.min_context,
        stride=cfg.window if cfg.datastore_blocks else None,
        batch_size=cfg.batch_size,
        source=_train_source(corpus, docs),
    )
    if ds.index_problem() is not None:  # missing, or not built from this datastore (e.g. an older memlm's)
        ds.build_index(metric="l2")  # Flat (exact) at this size
    _log(f"{corpus} datastore ready: {len(ds):,} entries")
    return ds


def _ngram_memory(cfg: DemoConfig, tok, corpus: str, out: Path):
    """An ∞-gram memory over all of ``corpus``'s training split (cached), or None without the ``ngram`` extra."""
    if not cfg.ngram:
        return None
    from memlm.ngram.index import NgramIndex, build_ngram_index
    from memlm.ngram.memory import NgramMemory

    path = out / f"{corpus}-ngram"
    try:
        return NgramMemory(NgramIndex.open(path))
    except MemlmError:
        pass
    try:
        from infini_gram.engine import InfiniGramEngine  # noqa: F401
    except ImportError:
        _log("no ∞-gram rows: the infini-gram engine is not installed (pip install 'memlm[ngram]')")
        return None
    if tok is None:  # a rerun from cached dumps: they were scored without an ∞-gram
        return None
    docs = load_documents(corpus, "train")
    if cfg.ngram_tokens is not None:
        docs = limit_documents(docs, tok, cfg.ngram_tokens)
    docs, record = decontaminate_reference(docs, _decontamination_sets(cfg), tok)
    if record is not None:
        _log(
            f"decontaminated {corpus} train against {', '.join(record['eval_sets'])}: dropped "
            f"{record['dropped_documents']:,} of {record['checked_documents']:,} documents"
        )
    _log(f"indexing {corpus} train as an ∞-gram ({len(docs):,} documents, no forward pass)")
    source = _train_source(corpus, docs)
    if record is not None:
        source["decontamination"] = record
    return NgramMemory(build_ngram_index(tok, docs, path, source=source))


def _decontamination_sets(cfg: DemoConfig) -> list[str]:
    """Every set the demo evaluates a memory on: the valid and test splits of each evaluated corpus (none when
    ``cfg.decontaminate`` is off)."""
    if not cfg.decontaminate:
        return []
    return [f"{corpus}:{split}" for corpus in EVAL_CORPORA for split in EVAL_SPLITS]


def _dumps(
    cfg: DemoConfig, model, tok, corpus: str, split: str, stores: dict[str, Datastore], out: Path, ngrams: dict
) -> dict[str, TokenScores]:
    """One forward pass over ``corpus/split``; one dump per datastore (cached), with its corpus's ∞-gram."""
    paths = {name: out / f"{corpus}-{split}-{name}.npz" for name in stores}
    if all(p.exists() for p in paths.values()):
        return {name: TokenScores.load(p) for name, p in paths.items()}
    n_tokens = cfg.eval_tokens if split == "test" else cfg.valid_tokens
    docs = limit_documents(load_documents(corpus, split), tok, n_tokens)
    specs = list(dict.fromkeys(ds.key_spec for ds in stores.values()))
    _log(f"scoring {corpus}/{split} ({len(docs)} documents)")
    base, queries, _ = lm_scores(
        model, tok, docs, specs, cfg.window, cfg.min_context, cfg.batch_size, meta={"corpus": corpus, "split": split}
    )
    dumps = {}
    for name, ds in stores.items():
        ts = base.lm_only()
        add_neighbours(ts, queries[ds.key_spec], ds, k=cfg.k)
        if ngrams.get(name) is not None:
            add_ngram(ts, docs, tok, ngrams[name])
        ts.save(paths[name])
        dumps[name] = ts
    return dumps


def _plot(curves: dict[str, tuple[list[float], list[float]]], path: Path) -> None:
    from memlm.experiments.plots import finish_figure, pyplot

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for label, (lams, ppls) in curves.items():
        ax.plot(lams, ppls, marker="o", markersize=3, label=label)
    ax.set_xlabel("λ (weight of the kNN distribution)")
    ax.set_ylabel("test perplexity")
    ax.set_yscale("log")
    ax.set_title(
        "SmolLM2-135M + kNN-LM: test perplexity vs λ\n(temperature tuned on valid; λ = 1 is infinite)", fontsize=10
    )
    ax.grid(True, which="both", alpha=0.3)
    finish_figure(fig, path, ax, legend_fontsize=10)


def run_demo(out: Path | None = None, quick: bool = False) -> dict[str, Any]:
    """Run the demo (see the module docstring); returns the results table as a dict and writes ``results.json``."""
    cfg = DemoConfig.quick() if quick else DemoConfig()
    out = (out or memlm_home() / "demo") / f"{'quick' if quick else 'full'}-{cfg.digest()}"
    with folder_lock(out, "run the demo"):  # one demo writer per folder (its datastores are locked too)
        return _run_demo(cfg, out)


def _run_demo(cfg: DemoConfig, out: Path) -> dict[str, Any]:
    t0 = _clock["start"] = time.perf_counter()
    _log(f"outputs in {out}")
    plan = PLAN
    dumps_done = all((out / f"{c}-{s}-{n}.npz").exists() for c, names in plan.items() for s in ("valid", "test")
                     for n in names)  # fmt: skip
    cached = {c: _cached_datastore(out / f"{c}-datastore") for c in ("wiki", "news")}
    if dumps_done and all(cached.values()):  # a rerun: nothing to compute, so the model is not even loaded
        _log("datastores and per-token dumps are cached: re-tuning only")
        model = tok = None
        stores = {c: ds for c, ds in cached.items() if ds is not None}
    else:
        _log(f"loading {cfg.model} ({cfg.dtype})")
        model, tok = load_causal_lm(cfg.model, dtype=cfg.dtype)
        stores = {c: _datastore(cfg, model, tok, c, out / f"{c}-datastore") for c in ("wiki", "news")}
    ngrams = {c: _ngram_memory(cfg, tok, c, out) for c in EVAL_CORPORA}
    rows, curves = [], {}
    lams = [lam for lam in DEFAULT_LAMBDAS if lam < 1]  # λ = 1 is infinite: some targets are never retrieved
    for corpus, names in plan.items():
        sub = {n: stores[n] for n in names}
        valid = _dumps(cfg, model, tok, corpus, "valid", sub, out, ngrams)
        test = _dumps(cfg, model, tok, corpus, "test", sub, out, ngrams)
        _log(f"tuning the weights on {corpus}/valid and scoring {corpus}/test")
        for name in names:
            best = tune(valid[name])["best"]
            res = perplexities(test[name], lam=best["lambda"], temperature=best["temperature"])
            row = {"eval": f"{corpus} test", "datastore": f"{name} train ({len(stores[name]):,} entries)", **res}
            if test[name].ngram_logprob is not None:
                row.update(_ngram_columns(valid[name], test[name], ngrams[name]))
            rows.append(row)
            curves[f"{corpus} test, {name} datastore"] = (
                lams,
                [perplexities(test[name], lam=lam, temperature=best["temperature"])["knn_ppl"] for lam in lams],
            )
    _print_table(rows)
    result = {"config": asdict(cfg), "rows": rows, "seconds": time.perf_counter() - t0}
    atomic_write_json(out / "results.json", result)
    _plot(curves, out / "ppl_vs_lambda.png")
    _log(f"wrote {out / 'results.json'} and {out / 'ppl_vs_lambda.png'} in {result['seconds']:.0f} s")
    return result


def _ngram_columns(valid: TokenScores, test: TokenScores, memory) -> dict[str, Any]:
    """LM + ∞-gram (λ_sparse, λ_dense tuned on valid) and LM + kNN + ∞-gram (the four weights tuned jointly)."""
    alone = tune_ngram(_without_neighbours(valid))["best"]
    joint = tune_ngram(valid)["best"]
    three = ngram_report(test, joint["lambda_sparse"], joint["lambda_dense"], lam=joint["lambda"],
                         temperature=joint["temperature"])  # fmt: skip
    return {
        "ngram": {**memory.describe(), "tokens_indexed": int(memory.index.manifest["tokens"])},
        "ngram_ppl": ngram_report(test, alone["lambda_sparse"], alone["lambda_dense"])["ngram_ppl"],
        "ngram_weights": {k: alone[k] for k in ("lambda_sparse", "lambda_dense")},
        "knn_ngram_ppl": three["knn_ngram_ppl"],
        "knn_ngram_weights": {k: joint[k] for k in ("lambda", "temperature", "lambda_sparse", "lambda_dense")},
        "ngram_sparse_share": three["sparse_share"],
        "ngram_median_n": three["effective_n"]["median"],
    }


def _without_neighbours(ts: TokenScores) -> TokenScores:
    """The dump's LM and ∞-gram columns only (to tune the ∞-gram alone)."""
    out = ts.lm_only()
    for f in ("ngram_logprob", "ngram_count", "ngram_n", "ngram_sparse"):
        setattr(out, f, getattr(ts, f))
    return out


def _print_table(rows: list[dict[str, Any]]) -> None:
    ngram = any("ngram_ppl" in r for r in rows)
    head = (
        f"{'evaluated on':14s} {'datastore':28s} {'tokens':>7s} {'base ppl':>9s} {'kNN-LM':>8s}"
        + (f" {'∞-gram':>8s} {'both':>8s}" if ngram else "")
        + f" {'oracle':>8s} {'λ':>5s} {'τ':>5s}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        both = f" {r.get('ngram_ppl', float('nan')):8.2f} {r.get('knn_ngram_ppl', float('nan')):8.2f}" if ngram else ""
        print(
            f"{r['eval']:14s} {r['datastore']:28s} {r['tokens']:7d} {r['base_ppl']:9.2f} {r['knn_ppl']:8.2f}{both} "
            f"{r['oracle_ppl']:8.2f} {r['lambda']:5.2f} {r['temperature']:5.1f}"
        )
    if ngram:
        ix = {r["datastore"].split()[0]: r["ngram"]["tokens_indexed"] for r in rows if "ngram" in r}
        print(
            "∞-gram: LM + an ∞-gram over the datastore corpus's whole train split ("
            + ", ".join(f"{c} {n:,} tokens" for c, n in ix.items())
            + "); both: LM + kNN + ∞-gram, the four weights tuned jointly on valid"
        )
