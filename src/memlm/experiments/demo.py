"""``memlm demo``: SmolLM2-135M with a Wikipedia datastore, then domain adaptation to news by swapping datastores,
each beside an ∞-gram over the same corpus's whole training split.

The user story of Khandelwal et al. (2020) on the offline defaults, with no training:

1. build a datastore from Wikipedia training articles and one from news training articles (``ffn_in`` keys; one
   forward pass per entry, in non-overlapping blocks, so a slice of each); index **all** of each corpus's training
   text as an ∞-gram (Liu et al. 2024: a suffix array, no forward pass; :mod:`memlm.ngram`, when the ``ngram`` extra
   is installed), less the documents the paper's decontamination drops against every set the demo evaluates
   (App. B, as ``memlm ngram build`` does: :func:`memlm.ngram.decontaminate.decontaminate_reference`; recorded in
   the index's manifest);
2. score held-out Wikipedia and held-out news once each (valid and test splits, each target with at least 128
   tokens of context), retrieving from each memory by exact search over all its keys;
3. on valid: tune λ, τ of the kNN-LM (``memlm tune``), λ_sparse / λ_dense of LM + ∞-gram, the four jointly for
   LM + kNN + ∞-gram, and fit the learned gate over the same memories (:func:`memlm.mixing.dump.fit_dump`,
   memlm.core.mixture); on test: every row mixes through one :class:`memlm.core.mixture.Mixture` (the fixed weights as
   :func:`memlm.core.mixture.rule_mixture`, the gate as fitted), with 95% bootstrap intervals over documents
   (:mod:`memlm.core.bootstrap`); print a table, write JSON and a PNG of perplexity vs λ (the paper's Fig. 5).

The forward pass is most of the run (one pass per datastore entry and per scored token; ``results.json`` records the
tokens and seconds of each phase under ``work``). Everything is cached under ``$MEMLM_HOME/demo`` (model
conversion, datastores, indexes, per-token dumps), so a rerun only reloads and re-tunes. Each step is a public API
call; read this file as a worked example.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from memlm.core.bootstrap import evidence
from memlm.core.distribution import perplexity
from memlm.core.mixture import Mixture, rule_mixture, sparse_state_features
from memlm.core.tuning import DEFAULT_LAMBDAS
from memlm.data.corpora import corpus_fingerprint, load_documents
from memlm.data.windows import limit_documents, sliding_windows, tokenize_documents
from memlm.errors import MemlmError
from memlm.io.fileio import atomic_write_json, memlm_home
from memlm.io.locking import folder_lock
from memlm.knnlm.evaluate import add_memory, add_neighbours, lm_scores, tune
from memlm.knnlm.table import TokenTable
from memlm.knnlm.write import write_datastore
from memlm.leakage import document_record
from memlm.mixing.dump import DumpMixture, fit_dump
from memlm.mixing.inputs import MixtureInputs, mixture_inputs
from memlm.models.keys import KeySpec
from memlm.models.resources import default_dtype, load_causal_lm
from memlm.ngram.decontaminate import EVAL_SPLITS, decontaminate_reference
from memlm.ngram.mixture import tune_ngram
from memlm.storage.datastore import Datastore

__all__ = ["DemoConfig", "planned_work", "run_demo", "work_totals"]


@dataclass(frozen=True)
class DemoConfig:
    model: str = "smollm2-135m"
    dtype: str = field(default_factory=default_dtype)  # bf16 only with AMX-BF16 (0.57x float32 without); keys fp16
    key: str = "ffn_in"
    # per corpus: one keys-only forward token per entry, the largest share of the run (~1,000 tokens/s on 2 idle
    # cores in float32, docs/results/demo_full_fresh_home_50k_datastores.log; 50k a round ago: the run took 217 s)
    datastore_tokens: int = 32_000
    eval_tokens: int = 8_000
    # >= 4,096 scored wiki tokens: the size below which the learned gate's fit warns (core.mixture.MIN_FIT_TOKENS)
    valid_tokens: int = 4_400
    window: int = 512
    min_context: int = 128  # overlapping windows only (datastore_blocks / eval_blocks off)
    batch_size: int = 4
    # the datastores' forward pass in non-overlapping blocks of `window` tokens (each train token read once, the
    # context of a key 0..window-1 tokens), instead of windows overlapping by min_context: 25% fewer tokens to run
    datastore_blocks: bool = True
    # the valid and test splits scored in windows overlapping by min_context (each target with >= 128 tokens of
    # context; 1.33x the forward tokens of blocks). In blocks (True) the first tokens of each block have little
    # context: base perplexity rose 14% (wiki 14.73 -> 16.76, news 27.08 -> 30.24) and every memory's gain grew with
    # it, docs/results/speed/demo_blocks_loaded.log, so the demo keeps the overlap
    eval_blocks: bool = False
    k: int = 256
    ngram: bool = True  # an ∞-gram over each corpus's whole train split beside its datastore (needs memlm[ngram])
    ngram_tokens: int | None = None  # cap on the ∞-gram's training tokens (None: all of them)
    # the ∞-gram indexes decontaminated against the valid and test splits of every evaluated corpus (the paper's
    # App. B, as `memlm ngram build` does by default)
    decontaminate: bool = True

    @classmethod
    def quick(cls) -> DemoConfig:
        return cls(datastore_tokens=8_000, eval_tokens=1_500, valid_tokens=1_000, window=256, min_context=64, k=64,
                   ngram_tokens=200_000)  # fmt: skip

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:10]

    def stride(self, blocks: bool) -> int:
        """The windows' stride: the window (non-overlapping blocks) or ``window - min_context``."""
        return self.window if blocks else self.window - self.min_context


PLAN = {"wiki": ["wiki"], "news": ["wiki", "news"]}  # evaluated corpus (valid and test) -> datastores to try
EVAL_CORPORA = tuple(PLAN)
# the systems of each row, by perplexity key, with their column headers (each mixed through one Mixture)
SYSTEMS = {"knn_ppl": "kNN-LM", "ngram_ppl": "∞-gram", "knn_ngram_ppl": "both", "mixture_ppl": "gate"}
CHANGES = tuple(("base_ppl", key) for key in SYSTEMS) + (("knn_ngram_ppl", "mixture_ppl"),)

_clock = {"start": time.perf_counter()}  # reset when a demo starts: each log line says how far into the run it is


def _train_source(corpus: str, docs: list) -> dict:
    """The source record of a demo memory built from ``corpus``'s train split, with the document hashes that eval's
    leakage check compares (:func:`memlm.leakage.document_record`), as ``memlm datastore build`` / ``ngram build``
    record them."""
    return {"corpus": corpus, "split": "train", "documents": len(docs), "fingerprint": corpus_fingerprint(docs),
            "document_hashes": document_record(docs)}  # fmt: skip


def _log(msg: str) -> None:
    print(f"[demo {time.perf_counter() - _clock['start']:4.0f} s] {msg}", file=sys.stderr, flush=True)


def _forward_work(docs: list, tok, window: int, stride: int) -> dict[str, int]:
    """What one forward pass over ``docs`` in these windows runs: ``forward_tokens`` (positions through the model),
    ``targets`` (scored tokens, or datastore entries), ``windows`` (the windows of :func:`sliding_windows`, which
    the pass itself cuts the same way)."""
    n = {"windows": 0, "forward_tokens": 0, "targets": 0}
    for w in sliding_windows(tokenize_documents(docs, tok), window, stride=stride):
        n["windows"] += 1
        n["forward_tokens"] += len(w.input_ids)
        n["targets"] += w.n_targets
    return n


def _documents(cfg: DemoConfig, tok, corpus: str, split: str) -> list:
    """The leading documents of ``corpus/split`` the demo reads: a datastore's train slice, or a scored split."""
    n = {"train": cfg.datastore_tokens, "valid": cfg.valid_tokens, "test": cfg.eval_tokens}[split]
    return limit_documents(load_documents(corpus, split), tok, n)


def planned_work(cfg: DemoConfig, tok) -> list[dict[str, Any]]:
    """What a first run of ``cfg`` computes, counted without running it (the tokenizer only): each datastore build's
    and each scored split's forward tokens (``head``: with the output projection), and each exact search's query x
    key pairs."""
    work = []
    entries = {}
    for corpus in ("wiki", "news"):
        n = _forward_work(_documents(cfg, tok, corpus, "train"), tok, cfg.window, cfg.stride(cfg.datastore_blocks))
        entries[corpus] = n["targets"]
        work.append({"phase": f"{corpus} datastore", **n, "head": False})
    for corpus, names in PLAN.items():
        for split in ("valid", "test"):
            n = _forward_work(_documents(cfg, tok, corpus, split), tok, cfg.window, cfg.stride(cfg.eval_blocks))
            work.append({"phase": f"score {corpus}/{split}", **n, "head": True})
            work += [{"phase": f"search {corpus}/{split} in {name}", "search_pairs": n["targets"] * entries[name]}
                     for name in names]  # fmt: skip
    return work


def _cached_datastore(out: Path) -> Datastore | None:
    """The datastore in ``out`` if a previous run finished it, else None (the manifest is written last)."""
    try:
        return Datastore.open(out)
    except MemlmError:
        return None


def _datastore(cfg: DemoConfig, model, tok, corpus: str, out: Path, work: list) -> Datastore:
    """A keys-only datastore of ``corpus``'s leading train tokens, searched exactly (all keys): no FAISS index."""
    t0 = time.perf_counter()
    docs = _documents(cfg, tok, corpus, "train")
    stride = cfg.stride(cfg.datastore_blocks)
    ds = write_datastore(model, tok, docs, out, key=KeySpec.parse(cfg.key), window=cfg.window,
                         min_context=cfg.min_context, stride=cfg.window if cfg.datastore_blocks else None,
                         batch_size=cfg.batch_size, source=_train_source(corpus, docs))  # fmt: skip
    work.append({"phase": f"{corpus} datastore", **_forward_work(docs, tok, cfg.window, stride), "head": False,
                 "seconds": time.perf_counter() - t0})  # fmt: skip
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
    cfg: DemoConfig,
    model,
    tok,
    corpus: str,
    split: str,
    stores: dict[str, Datastore],
    out: Path,
    ngrams: dict,
    work: list,
) -> dict[str, TokenTable]:
    """One forward pass over ``corpus/split``; one dump per datastore (cached), with its corpus's ∞-gram."""
    paths = {name: out / f"{corpus}-{split}-{name}.npz" for name in stores}
    if all(p.exists() for p in paths.values()):
        return {name: TokenTable.load(p) for name, p in paths.items()}
    t0 = time.perf_counter()
    docs = _documents(cfg, tok, corpus, split)
    specs = list(dict.fromkeys(ds.key_spec for ds in stores.values()))
    stride = cfg.stride(cfg.eval_blocks)
    _log(f"scoring {corpus}/{split} ({len(docs)} documents)")
    base, queries, _ = lm_scores(model, tok, docs, specs, cfg.window, cfg.min_context, cfg.batch_size,
                                 meta={"corpus": corpus, "split": split},
                                 stride=cfg.window if cfg.eval_blocks else None)  # fmt: skip
    seconds = time.perf_counter() - t0
    work.append({"phase": f"score {corpus}/{split}", **_forward_work(docs, tok, cfg.window, stride), "head": True,
                 "seconds": seconds})  # fmt: skip
    dumps = {}
    for name, ds in stores.items():
        ts = base.select()
        # exact search over all keys (torch matmul + top-k): the neighbours of a Flat index, without building one
        add_neighbours(ts, queries[ds.key_spec], ds, k=cfg.k, search="exact")
        work.append({"phase": f"search {corpus}/{split} in {name}", "search_pairs": len(ts) * len(ds),
                     "seconds": ts.meta["components"]["knn"]["seconds"]})  # fmt: skip
        if ngrams.get(name) is not None:
            t1 = time.perf_counter()
            add_memory(ts, ngrams[name], docs, tok)
            work.append({"phase": f"∞-gram lookups {corpus}/{split} in {name}", "seconds": time.perf_counter() - t1})
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
    work: list[dict[str, Any]] = []  # what each phase ran: forward tokens, scored tokens, search pairs, seconds
    dumps_done = all((out / f"{c}-{s}-{n}.npz").exists() for c, names in plan.items() for s in ("valid", "test")
                     for n in names)  # fmt: skip
    cached = {c: _cached_datastore(out / f"{c}-datastore") for c in ("wiki", "news")}
    if dumps_done and all(cached.values()):  # a rerun: nothing to compute, so the model is not even loaded
        _log("datastores and per-token dumps are cached: re-tuning only")
        model = tok = None
        stores = {c: ds for c, ds in cached.items() if ds is not None}
    else:
        _log(f"loading {cfg.model} ({cfg.dtype})")
        t1 = time.perf_counter()
        model, tok = load_causal_lm(cfg.model, dtype=cfg.dtype)
        work.append({"phase": "load the model (a fresh home: convert it once)", "seconds": time.perf_counter() - t1})
        # a datastore a previous run finished is reused as it is (no forward pass, none recorded)
        stores = {c: cached[c] or _datastore(cfg, model, tok, c, out / f"{c}-datastore", work)
                  for c in ("wiki", "news")}  # fmt: skip
    t1 = time.perf_counter()
    ngrams = {c: _ngram_memory(cfg, tok, c, out) for c in EVAL_CORPORA}
    work.append({"phase": "∞-gram indexes (no forward pass)", "seconds": time.perf_counter() - t1})
    rows, curves = [], {}
    for corpus, names in plan.items():
        sub = {n: stores[n] for n in names}
        valid = _dumps(cfg, model, tok, corpus, "valid", sub, out, ngrams, work)
        test = _dumps(cfg, model, tok, corpus, "test", sub, out, ngrams, work)
        t1 = time.perf_counter()
        _log(f"tuning the weights and fitting the gate on {corpus}/valid, scoring {corpus}/test")
        for name in names:
            row, curves[f"{corpus} test, {name} datastore"] = _row(valid[name], test[name], cfg)
            row = {"eval": f"{corpus} test", "datastore": f"{name} train ({len(stores[name]):,} entries)", **row}
            if ngrams[name] is not None and "ngram_ppl" in row:
                memory = ngrams[name]
                row["ngram"] = {**memory.describe(), "tokens_indexed": int(memory.index.manifest["tokens"])}
            rows.append(row)
        work.append({"phase": f"tune and fit on {corpus}/valid, mix {corpus}/test", "seconds":
                     time.perf_counter() - t1})  # fmt: skip
    _print_table(rows)
    result = {"config": asdict(cfg), "rows": rows, "work": work, "forward_tokens": work_totals(work),
              "seconds": time.perf_counter() - t0}  # fmt: skip
    atomic_write_json(out / "results.json", result)
    _plot(curves, out / "ppl_vs_lambda.png")
    _log_work(work)
    _log(f"wrote {out / 'results.json'} and {out / 'ppl_vs_lambda.png'} in {result['seconds']:.0f} s")
    return result


class _TestMixer:
    """One test dump's components and features by name (:func:`mixture_inputs`, per kNN temperature), mixed through
    :meth:`Mixture.mix`: every row of the table goes through this one path."""

    def __init__(self, ts: TokenTable, k: int) -> None:
        self.ts, self.k, self._inputs = ts, k, {}

    def inputs(self, temperature: float) -> MixtureInputs:
        if temperature not in self._inputs:
            self._inputs[temperature] = mixture_inputs(self.ts, temperature, self.k)
        return self._inputs[temperature]

    def component(self, name: str, temperature: float = 1.0) -> torch.Tensor:
        inp = self.inputs(temperature)
        return torch.from_numpy(inp.logprobs[:, inp.components.index(name)])

    def logprob(self, mixture: Mixture, temperature: float = 1.0) -> torch.Tensor:
        """``log P(target)`` per token of ``mixture`` with the kNN term at ``temperature``."""
        inp = self.inputs(temperature)
        logprobs = {c: inp.logprobs[:, inp.components.index(c)] for c in mixture.components}
        features = {f: inp.features[:, j] for j, f in enumerate(inp.feature_names)}
        if "ngram" in self.ts.columns:  # the rule's λ_sparse / λ_dense is a gate on the sparse flag's state
            features.update(sparse_state_features({"ngram": self.ts.sparse("ngram")}))
        return mixture.mix(logprobs, features)


def _row(valid: TokenTable, test: TokenTable, cfg: DemoConfig) -> tuple[dict[str, Any], tuple[list, list]]:
    """One table row: the weights tuned (and the gate fitted) on ``valid``, every system mixed on ``test`` through
    its :class:`Mixture`, with the intervals; and the curve of test perplexity vs λ at the tuned τ."""
    mixer = _TestMixer(test, cfg.k)
    best = tune(valid)["best"]
    lam, tau = best["lambda"], best["temperature"]
    lm, knn = mixer.component("lm", tau), mixer.component("knn", tau)
    logprobs = {"base_ppl": lm, "knn_ppl": mixer.logprob(rule_mixture(("lm", "knn"), {"knn": lam}), tau),
                "oracle_ppl": torch.maximum(lm, knn)}  # fmt: skip
    row: dict[str, Any] = {"tokens": len(test), "lambda": lam, "temperature": tau, "k": cfg.k,
                           "target_in_neighbours": float(torch.isfinite(knn).float().mean())}  # fmt: skip
    gate_tau = tau
    if "ngram" in test.columns:
        alone = tune_ngram(_without_neighbours(valid))["best"]
        joint = tune_ngram(valid)["best"]
        pair = {w: (r["lambda_sparse"], r["lambda_dense"]) for w, r in (("alone", alone), ("joint", joint))}
        logprobs["ngram_ppl"] = mixer.logprob(rule_mixture(("lm", "ngram"), {"ngram": pair["alone"]}))
        both = rule_mixture(("lm", "knn", "ngram"), {"knn": joint["lambda"], "ngram": pair["joint"]})
        logprobs["knn_ngram_ppl"] = mixer.logprob(both, joint["temperature"])
        row.update(ngram_weights={k: alone[k] for k in ("lambda_sparse", "lambda_dense")},
                   knn_ngram_weights={k: joint[k] for k in ("lambda", "temperature", "lambda_sparse", "lambda_dense")},
                   ngram_sparse_share=float(np.mean(test.columns["ngram"]["sparse"])),
                   ngram_median_n=float(np.median(test.columns["ngram"]["n"])))  # fmt: skip
        gate_tau = joint["temperature"]
    # the learned gate over the same memories, fitted on valid only (a quarter of its documents kept apart to check
    # it beats the constant weights there, else those or the LM alone), at the τ the rule of the same memories chose
    fit = fit_dump(valid, [gate_tau], cfg.k)
    logprobs["mixture_ppl"] = mixer.logprob(fit.mixture, fit.temperature or 1.0)
    row["mixture"] = _fit_record(fit)
    row.update({key: perplexity(lp) for key, lp in logprobs.items()})
    row.update(evidence(logprobs, test.doc_index, pairs=CHANGES))
    lams = [x for x in DEFAULT_LAMBDAS if x < 1]  # λ = 1 is infinite: some targets are never retrieved
    curve = [perplexity(mixer.logprob(rule_mixture(("lm", "knn"), {"knn": x}), tau)) for x in lams]
    return row, (lams, curve)


def _fit_record(fit: DumpMixture) -> dict[str, Any]:
    """What the table and results.json say of a gate fit: its form, τ, sizes, held-out log-likelihoods, mean
    weights, warnings, and the mixture itself."""
    f = fit.fit
    return {"form": f.form, "temperature": fit.temperature, "k": fit.k, "fit_tokens": f.tokens,
            "fit_documents": f.documents, "kept_tokens": f.kept_tokens, "heldout_loglik": f.heldout_loglik,
            "mean_weights": dict(zip(f.mixture.components, f.mean_weights, strict=True)), "warnings": f.warnings,
            "fit": fit.to_dict()}  # fmt: skip


def _without_neighbours(ts: TokenTable) -> TokenTable:
    """The table's LM and ∞-gram columns only (to tune the ∞-gram alone)."""
    return ts.select(ts.names("ngram"))


def work_totals(work: list[dict[str, Any]]) -> dict[str, int]:
    """Forward tokens of the datastore builds and of the scoring (with the output projection), scored tokens, and
    query x key pairs searched: what the run's time is mostly made of."""

    def total(what: str, head: bool | None = None) -> int:
        return int(sum(w.get(what, 0) for w in work if head is None or w.get("head") is head))

    return {"datastores": total("forward_tokens", False), "entries": total("targets", False),
            "scoring": total("forward_tokens", True), "scored": total("targets", True),
            "search_pairs": total("search_pairs")}  # fmt: skip


def _log_work(work: list[dict[str, Any]]) -> None:
    if not work:
        return
    for w in work:
        tokens = f"{w['forward_tokens']:,} forward tokens, " if "forward_tokens" in w else ""
        pairs = f"{w['search_pairs']:,} query x key pairs, " if "search_pairs" in w else ""
        _log(f"  {w['phase']}: {tokens}{pairs}{w['seconds']:.1f} s")
    t = work_totals(work)
    _log(f"forward tokens: datastores {t['datastores']:,} (keys only), scoring {t['scoring']:,} ({t['scored']:,} "
         f"scored); exact search: {t['search_pairs']:,} query x key pairs")  # fmt: skip


def _change(row: dict[str, Any], key: str, ref: str = "base_ppl") -> str:
    """``-3.0% [-4.2, -2.0]``: the relative change of ``key`` against ``ref`` with its paired 95% interval."""
    d = row.get("differences", {}).get(f"{key} vs {ref}")
    if d is None:
        return "n/a"
    ci = f" [{100 * d['low']:+.1f}, {100 * d['high']:+.1f}]" if d.get("low") is not None else ""
    return f"{100 * d['relative_change']:+.1f}%{ci}"


def _print_table(rows: list[dict[str, Any]]) -> None:
    ngram = any("ngram_ppl" in r for r in rows)
    keys = [k for k in SYSTEMS if k != "ngram_ppl" and k != "knn_ngram_ppl" or ngram]
    head = (f"{'evaluated on':14s} {'datastore':28s} {'tokens':>7s} {'base ppl':>9s}"
            + "".join(f" {SYSTEMS[k]:>8s}" for k in keys) + f" {'oracle':>8s} {'λ':>5s} {'τ':>5s}")  # fmt: skip
    print(head)
    print("-" * len(head))
    for r in rows:
        cells = "".join(f" {r.get(k, float('nan')):8.2f}" for k in keys)
        print(f"{r['eval']:14s} {r['datastore']:28s} {r['tokens']:7d} {r['base_ppl']:9.2f}{cells} "
              f"{r['oracle_ppl']:8.2f} {r['lambda']:5.2f} {r['temperature']:5.1f}")  # fmt: skip
    print("\nchange against the base LM, [95% bootstrap interval over the test documents, paired]")
    print(f"{'evaluated on':14s} {'datastore':28s}" + "".join(f" {SYSTEMS[k]:>22s}" for k in keys))
    for r in rows:
        print(f"{r['eval']:14s} {r['datastore']:28s}" + "".join(f" {_change(r, k):>22s}" for k in keys)
              + f"   ({r['bootstrap']['documents']} documents)")  # fmt: skip
    if ngram:
        ix = {r["datastore"].split()[0]: r["ngram"]["tokens_indexed"] for r in rows if "ngram" in r}
        print(
            "∞-gram: LM + an ∞-gram over the datastore corpus's whole train split ("
            + ", ".join(f"{c} {n:,} tokens" for c, n in ix.items())
            + "); both: LM + kNN + ∞-gram, the four weights tuned jointly on valid"
        )
    forms = ", ".join(f"{r['eval'].split()[0]}/{r['datastore'].split()[0]}: {r['mixture']['form']}" for r in rows)
    print(
        f"gate: the learned mixture of the same memories, fitted on valid with a quarter of its documents "
        f"kept apart, falling back to constant weights or the LM alone where it does not beat them there ({forms})"
    )
    warned = {w for r in rows for w in r["mixture"]["warnings"]}
    for w in sorted(warned):
        print(f"  gate fit: {w}")
