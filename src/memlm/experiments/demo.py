"""``memlm demo``: SmolLM2-135M with a Wikipedia memory, then adapted to movie reviews by swapping the memory.

The user story of Khandelwal et al. (2020, Sec. 5: domain adaptation by swapping the datastore, no training), on the
offline defaults, with the weights every memory brings with it:

1. for each of two corpora, wiki (Wikipedia lead sections) and imdb (IMDB / Rotten Tomatoes reviews): hold out a
   slice of its training split (:func:`memlm.knnlm.calibration.holdout_split`, 4,096 scored tokens, whole documents),
   build a datastore of the next few thousand training tokens (``ffn_in`` keys, one forward pass in non-overlapping
   blocks; exact search over all keys, no index) and an ∞-gram over the whole training split (Liu et al. 2024: a
   suffix array, no forward pass), both less the slice and less the training documents the paper's decontamination
   finds in the test sets (App. B, :func:`memlm.ngram.decontaminate.decontaminate_reference`);
2. calibrate both memories on their slice at build time, in one forward pass
   (:func:`memlm.knnlm.calibration.calibrate_shared`): each stores its guarded mixture with the LM in its manifest,
   as ``memlm datastore build`` and ``memlm ngram build`` do;
3. score the two test splits once each (windows of 512 overlapping by 128; the imdb test text is scored once for
   both memories), and mix every column with the mixture ``memlm eval`` applies when no weight is given
   (:func:`memlm.knnlm.default_mixture.default_mixture`): kNN-LM and ∞-gram, each memory's stored fit; both, the two
   fits combined at their own odds against the LM if that beats the better one alone on the calibration slice, else
   that one. Nothing is tuned on valid text.

Rows: wiki test with the wiki memories; imdb test with the wiki memories; imdb test with the imdb memories (the
swap), each with its paired 95% bootstrap interval over the test documents (:mod:`memlm.core.bootstrap`), and the
swap against the wiki memories on the same imdb tokens. Printed as a table, written as JSON with a PNG of test
perplexity vs the kNN-LM's λ at each datastore's calibrated τ (the paper's Fig. 5).

Why IMDB: among the offline corpora measured alike (``benchmarks/quality/demo_domains.py``,
``docs/results/demo/domain_candidates.json``), it is the domain where each memory's swap gains with an interval
clear of 0 and none of the gain is corpus formatting: kNN -2.5% [-3.7, -1.5], ∞-gram -8.7% [-10.3, -7.2] against
the base LM, the wiki memories near 0 there. WikiText-2 gained more (kNN -7.4%) but 13% of its test tokens are its
own tokenization artifacts (`` @-@ ``, spaced punctuation); news's kNN memory lost (+0.7%); BBC's ∞-gram and both
intervals were 3-4 times wider (34 test documents against imdb's 50).

The forward pass is most of the run (one pass per datastore entry, per slice token and per scored token;
``results.json`` records each phase's tokens and seconds under ``work``). Everything is cached under
``$MEMLM_HOME/demo`` (the model's conversion, memories with their calibrations, the slices' and the test splits'
per-token dumps), so a rerun only reloads and mixes. Each step is a public API call; read this file as a worked
example.
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
from memlm.core.config import RetrievalConfig
from memlm.core.distribution import perplexity
from memlm.core.mixture import MIN_FIT_TOKENS, rule_mixture
from memlm.core.tuning import DEFAULT_LAMBDAS
from memlm.data.corpora import corpus_fingerprint, load_documents
from memlm.data.windows import limit_documents, sliding_windows, tokenize_documents, truncate_document
from memlm.errors import MemlmError
from memlm.io.fileio import atomic_write_json, memlm_home
from memlm.io.locking import folder_lock
from memlm.knnlm.calibration import calibrate_shared, holdout_split, stored_mixture
from memlm.knnlm.default_mixture import DefaultMixture, default_mixture
from memlm.knnlm.evaluate import add_memory, add_neighbours, lm_scores
from memlm.knnlm.table import TokenTable
from memlm.knnlm.write import write_datastore
from memlm.leakage import document_record
from memlm.mixing.dump import DumpMixture
from memlm.mixing.inputs import mixture_inputs
from memlm.models.keys import KeySpec
from memlm.models.resources import default_dtype, load_causal_lm
from memlm.ngram.decontaminate import decontaminate_reference
from memlm.storage.datastore import Datastore

__all__ = ["DemoConfig", "planned_work", "run_demo", "work_totals"]


@dataclass(frozen=True)
class DemoConfig:
    model: str = "smollm2-135m"
    dtype: str = field(default_factory=default_dtype)  # bf16 only with AMX-BF16 (0.57x float32 without); keys fp16
    key: str = "ffn_in"
    # per corpus: one keys-only forward token per entry (~600 tokens/s on 2 AVX2 cores in float32). 10k entries per
    # corpus is what docs/results/demo/domain_candidates.json measured the domains with (imdb kNN -2.5%)
    datastore_tokens: int = 10_000
    # each memory's calibration slice, in scored tokens: the guarded fit's minimum (core.mixture.MIN_FIT_TOKENS), so
    # no fit warns; wiki's and imdb's documents are short, so the slice holds well over the fit's 8 documents
    holdout_tokens: int = MIN_FIT_TOKENS
    # per test split: its leading documents, each cut to doc_tokens, up to test_tokens (> 30 documents each)
    test_tokens: int = 6_000
    doc_tokens: int = 384
    window: int = 512
    min_context: int = 128  # the test windows overlap by this much (each target with >= 128 tokens of context)
    batch_size: int = 4
    # neighbours per token, at calibration and test alike: a quarter of memlm eval's default (DEFAULT_K), which a
    # datastore of 10k entries does not need; as the domain candidates were measured
    k: int = 256
    # each ∞-gram over its corpus's first 1M training tokens (wiki's whole train split is 0.95M; imdb's 6.9M would
    # cost ~40 s more of tokenizing and indexing on 2 cores)
    ngram_tokens: int | None = 1_000_000
    decontaminate: bool = True  # the ∞-gram and datastore text against both test splits (the paper's App. B)

    @classmethod
    def quick(cls) -> DemoConfig:
        return cls(datastore_tokens=3_000, test_tokens=2_000, window=256, min_context=64, ngram_tokens=300_000)

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:10]


CORPORA = ("wiki", "imdb")  # each gives a datastore and an ∞-gram
ROWS = (("wiki", "wiki"), ("imdb", "wiki"), ("imdb", "imdb"))  # (test split's corpus, memories' corpus)
SYSTEMS = {"knn_ppl": "kNN-LM", "ngram_ppl": "∞-gram", "knn_ngram_ppl": "both"}  # perplexity key -> column header
CHANGES = tuple(("base_ppl", key) for key in SYSTEMS)

_clock = {"start": time.perf_counter()}  # reset when a demo starts: each log line says how far into the run it is


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


def _decontamination_sets(cfg: DemoConfig) -> list[str]:
    """The sets the demo evaluates on: the test split of each corpus (none when ``decontaminate`` is off)."""
    return [f"{corpus}:test" for corpus in CORPORA] if cfg.decontaminate else []


def _training_text(cfg: DemoConfig, tok, corpus: str) -> tuple[list, list, list, dict[str, Any]]:
    """``(datastore documents, ∞-gram documents, calibration slice, source record)`` of ``corpus``'s train split:
    decontaminated, the slice held out of both memories, the datastore the leading ``datastore_tokens`` of the rest."""
    docs = limit_documents(load_documents(corpus, "train"), tok, cfg.ngram_tokens)
    docs, record = decontaminate_reference(docs, _decontamination_sets(cfg), tok)
    kept, held, hold = holdout_split(docs, tok, min_tokens=cfg.holdout_tokens, max_tokens=cfg.holdout_tokens,
                                     window=cfg.window, stride=cfg.window)  # fmt: skip
    source = {"corpus": corpus, "split": "train", "holdout": hold,
              **({"decontamination": record} if record is not None else {})}  # fmt: skip
    return limit_documents(kept, tok, cfg.datastore_tokens), kept, held, source


def _record(source: dict[str, Any], docs: list) -> dict[str, Any]:
    """A memory's source record: the corpus, its held-out slice, and the documents it holds (count, fingerprint and
    the hashes eval's leakage check compares, :func:`memlm.leakage.document_record`)."""
    return {**source, "documents": len(docs), "fingerprint": corpus_fingerprint(docs),
            "document_hashes": document_record(docs)}  # fmt: skip


def _cached_memories(out: Path, corpus: str):
    """``(datastore, ∞-gram memory, slice scores)`` of ``corpus`` if a previous run finished them (both calibrated,
    the slice's dump written last), else None."""
    from memlm.ngram.index import NgramIndex
    from memlm.ngram.memory import NgramMemory

    try:
        ds, ngram = Datastore.open(out / f"{corpus}-datastore"), NgramMemory(NgramIndex.open(out / f"{corpus}-ngram"))
    except MemlmError:
        return None
    path = out / f"{corpus}-slice.npz"
    if stored_mixture(ds) is None or stored_mixture(ngram) is None or not path.exists():
        return None
    return ds, ngram, TokenTable.load(path)


def _build_memories(cfg: DemoConfig, model, tok, corpus: str, out: Path, work: list):
    """``corpus``'s datastore and ∞-gram, built and calibrated in one pass over their shared slice (module
    docstring, steps 1-2); returns them with the slice's scores (the check of their fits' combination reads them)."""
    from memlm.ngram.index import build_ngram_index
    from memlm.ngram.memory import NgramMemory

    t0 = time.perf_counter()
    ds_docs, ngram_docs, held, source = _training_text(cfg, tok, corpus)
    work.append({"phase": f"{corpus}: read, decontaminate and hold out the slice", "seconds": time.perf_counter() - t0})
    t0 = time.perf_counter()
    ds = write_datastore(model, tok, ds_docs, out / f"{corpus}-datastore", key=KeySpec.parse(cfg.key),
                         window=cfg.window, min_context=cfg.min_context, stride=cfg.window,
                         batch_size=cfg.batch_size, source=_record(source, ds_docs), progress=False,
                         overwrite=True)  # fmt: skip
    work.append({"phase": f"{corpus} datastore", **_forward_work(ds_docs, tok, cfg.window, cfg.window),
                 "head": False, "seconds": time.perf_counter() - t0})  # fmt: skip
    t0 = time.perf_counter()
    index = build_ngram_index(tok, ngram_docs, out / f"{corpus}-ngram", source=_record(source, ngram_docs),
                              overwrite=True, progress=False)  # fmt: skip
    ngram = NgramMemory(index)
    work.append({"phase": f"{corpus} ∞-gram index ({int(index.manifest['tokens']):,} tokens, no forward pass)",
                 "seconds": time.perf_counter() - t0})  # fmt: skip
    t0 = time.perf_counter()
    hold = source["holdout"]
    text = {"held_out": True, "documents": hold["documents"], "ids_sha256": hold.get("ids_sha256")}
    knn_cal, ngram_cal, ts = calibrate_shared(model, tok, (ds, ngram), held, RetrievalConfig(k=cfg.k),
                                              batch_size=cfg.batch_size, progress=False, text=text)  # fmt: skip
    for owner, cal in ((ds, knn_cal), (index, ngram_cal)):
        owner.record_calibration({**cal, "holdout_ids": hold.get("ids_sha256")})
    ts.save(out / f"{corpus}-slice.npz")
    work.append({"phase": f"calibrate both {corpus} memories on their slice", "head": True,
                 **_forward_work(held, tok, cfg.window, cfg.window), "seconds": time.perf_counter() - t0})  # fmt: skip
    _log(f"{corpus} memories ready: {len(ds):,} datastore entries, ∞-gram of {int(index.manifest['tokens']):,} "
         f"tokens, calibrated on {len(ts):,} held-out tokens ({hold['documents']} documents)")  # fmt: skip
    return ds, ngram, ts


def _test_documents(cfg: DemoConfig, tok, corpus: str) -> list:
    """The leading documents of ``corpus``'s test split, each cut to ``doc_tokens`` tokens, up to ``test_tokens``."""
    docs = [truncate_document(d, tok, cfg.doc_tokens) for d in load_documents(corpus, "test")[: cfg.test_tokens // 16]]
    return limit_documents(docs, tok, cfg.test_tokens)


def planned_work(cfg: DemoConfig, tok) -> list[dict[str, Any]]:
    """What a first run of ``cfg`` runs through the model, counted without running it (the tokenizer only): each
    datastore's and each calibration slice's forward tokens, and each test split's (``head``: with the output
    projection)."""
    work = []
    for corpus in CORPORA:
        ds_docs, _, held, _ = _training_text(cfg, tok, corpus)
        work.append({"phase": f"{corpus} datastore", **_forward_work(ds_docs, tok, cfg.window, cfg.window),
                     "head": False})  # fmt: skip
        work.append({"phase": f"calibrate both {corpus} memories on their slice", "head": True,
                     **_forward_work(held, tok, cfg.window, cfg.window)})  # fmt: skip
    for corpus in dict.fromkeys(c for c, _ in ROWS):
        docs = _test_documents(cfg, tok, corpus)
        work.append({"phase": f"score {corpus}/test", "head": True,
                     **_forward_work(docs, tok, cfg.window, cfg.window - cfg.min_context)})  # fmt: skip
    return work


def _test_dumps(cfg: DemoConfig, model, tok, corpus: str, memories: dict, out: Path, work: list) -> dict:
    """One forward pass over ``corpus``'s test documents; one dump per memories' corpus (its datastore's
    neighbours and its ∞-gram's statistics), cached."""
    paths = {name: out / f"{corpus}-test-{name}.npz" for name in memories}
    if all(p.exists() for p in paths.values()):
        return {name: TokenTable.load(p) for name, p in paths.items()}
    t0 = time.perf_counter()
    docs = _test_documents(cfg, tok, corpus)
    _log(f"scoring {corpus}/test ({len(docs)} documents) for the {' and '.join(memories)} memories")
    spec = KeySpec.parse(cfg.key)
    base, queries, _ = lm_scores(model, tok, docs, [spec], cfg.window, cfg.min_context, cfg.batch_size,
                                 progress=False, meta={"corpus": corpus, "split": "test"})  # fmt: skip
    work.append({"phase": f"score {corpus}/test", "head": True, "seconds": time.perf_counter() - t0,
                 **_forward_work(docs, tok, cfg.window, cfg.window - cfg.min_context)})  # fmt: skip
    dumps = {}
    for name, (ds, ngram, _) in memories.items():
        t0 = time.perf_counter()
        ts = base.select()
        # exact search over all keys (torch matmul + top-k), as the calibration searched
        add_neighbours(ts, queries[spec], ds, k=min(cfg.k, len(ds)), search="exact", progress=False)
        add_memory(ts, ngram, docs, tok)
        ts.save(paths[name])
        dumps[name] = ts
        work.append({"phase": f"search {corpus}/test in the {name} memories", "search_pairs": len(ts) * len(ds),
                     "seconds": time.perf_counter() - t0})  # fmt: skip
    return dumps


def _mixtures(cfg: DemoConfig, ds, ngram, slice_scores: TokenTable) -> dict[str, DefaultMixture]:
    """Each column's mixture, as ``memlm eval`` chooses it with no weight flags
    (:func:`memlm.knnlm.default_mixture.default_mixture`): the datastore's stored fit, the ∞-gram's, and for both
    their combination checked on the calibration slice (scored already: no forward pass)."""
    config = RetrievalConfig(k=cfg.k)
    return {
        "knn_ppl": default_mixture(None, None, [ds], None, config),
        "ngram_ppl": default_mixture(None, None, [], ngram, config),
        "knn_ngram_ppl": default_mixture(None, None, [ds], ngram, config, slice_scores=slice_scores),
    }


def _view(ts: TokenTable, key: str) -> TokenTable:
    """The columns of ``ts`` a system reads: the datastore's (kNN-LM), the ∞-gram's, or both."""
    if key in ("knn_ppl", "ngram_ppl"):
        return ts.select(ts.names(key.removesuffix("_ppl")))
    return ts


def _row(test: TokenTable, mixtures: dict[str, DumpMixture]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """One table row: the base LM and each system of ``mixtures`` (perplexity key -> fit) mixed on ``test``, with
    the intervals and the paired changes against the base LM; and each system's per-token log-probabilities."""
    logprobs = {"base_ppl": torch.from_numpy(test.lm_logprob).double()}
    for key, fit in mixtures.items():
        logprobs[key] = fit.logprob(_view(test, key), f"the {SYSTEMS[key]} column")
    row: dict[str, Any] = {"tokens": len(test), "documents": int(len(np.unique(test.doc_index)))}
    row.update({key: perplexity(lp) for key, lp in logprobs.items()})
    row.update(evidence(logprobs, test.doc_index, pairs=[p for p in CHANGES if p[1] in mixtures]))
    return row, logprobs


def _curve(test: TokenTable, ds) -> tuple[list[float], list[float]]:
    """Test perplexity of the kNN-LM's fixed-weight rule (Eq. 3) at each λ < 1, at the τ and k of the datastore's
    calibrated mixture."""
    fit = stored_mixture(ds)
    inp = mixture_inputs(_view(test, "knn_ppl"), float(fit.temperature), int(fit.k))
    lams = [x for x in DEFAULT_LAMBDAS if x < 1]  # λ = 1 is infinite: some targets are never retrieved
    curve = [perplexity(rule_mixture(("lm", "knn"), {"knn": x}).mix(
        {c: inp.logprobs[:, j] for j, c in enumerate(inp.components)}, {})) for x in lams]  # fmt: skip
    return lams, curve


def _plot(curves: dict[str, tuple[list[float], list[float]]], path: Path) -> None:
    from memlm.experiments.plots import finish_figure, pyplot

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for label, (lams, ppls) in curves.items():
        ax.plot(lams, ppls, marker="o", markersize=3, label=label)
    ax.set_xlabel("λ (weight of the kNN distribution)")
    ax.set_ylabel("test perplexity")
    ax.set_yscale("log")
    ax.set_title("SmolLM2-135M + kNN-LM: test perplexity vs λ\n(τ as each datastore's calibration chose it)",
                 fontsize=10)  # fmt: skip
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
    out.mkdir(parents=True, exist_ok=True)
    work: list[dict[str, Any]] = []  # what each phase ran: forward tokens, scored tokens, search pairs, seconds
    memories = {c: _cached_memories(out, c) for c in CORPORA}
    tests_done = all((out / f"{c}-test-{m}.npz").exists() for c, m in ROWS)
    model = tok = None
    if not (tests_done and all(memories.values())):
        _log(f"loading {cfg.model} ({cfg.dtype})")
        t1 = time.perf_counter()
        model, tok = load_causal_lm(cfg.model, dtype=cfg.dtype)
        work.append({"phase": "load the model (a fresh home: convert it once)", "seconds": time.perf_counter() - t1})
    else:
        _log("memories and per-token dumps are cached: mixing only")
    for c in CORPORA:  # a memory pair a previous run finished is reused as it is (no forward pass, none recorded)
        memories[c] = memories[c] or _build_memories(cfg, model, tok, c, out, work)
    mixtures = {c: _mixtures(cfg, *memories[c]) for c in CORPORA}
    rows, curves, logprobs, doc_index = [], {}, {}, {}
    for corpus in dict.fromkeys(c for c, _ in ROWS):
        names = [m for c, m in ROWS if c == corpus]
        dumps = _test_dumps(cfg, model, tok, corpus, {m: memories[m] for m in names}, out, work)
        doc_index[corpus] = dumps[names[0]].doc_index
        for name in names:
            ds, ngram, _ = memories[name]
            row, logprobs[(corpus, name)] = _row(dumps[name], {k: v.fit for k, v in mixtures[name].items()})
            rows.append({"eval": f"{corpus} test", "memory": name, "datastore_entries": len(ds),
                         "ngram_tokens": int(ngram.index.manifest["tokens"]), **row,
                         "mixtures": {k: {"origin": v.origin, **v.fit.to_dict()}
                                      for k, v in mixtures[name].items()}})  # fmt: skip
            curves[f"{corpus} test, {name} datastore"] = _curve(dumps[name], ds)
    swap = _swap(logprobs, doc_index["imdb"])
    _print_table(rows, swap, mixtures)
    result = {"config": asdict(cfg), "rows": rows, "swap": swap, "work": work, "forward_tokens": work_totals(work),
              "seconds": time.perf_counter() - t0}  # fmt: skip
    atomic_write_json(out / "results.json", result)
    _plot(curves, out / "ppl_vs_lambda.png")
    _log_work(work)
    _log(f"wrote {out / 'results.json'} and {out / 'ppl_vs_lambda.png'} in {result['seconds']:.0f} s")
    return result


def _swap(logprobs: dict, doc_index: np.ndarray) -> dict[str, Any]:
    """Each system with the imdb memories against the same system with the wiki memories, on the same imdb test
    tokens: the swap's paired changes and intervals."""
    wiki, imdb = logprobs[("imdb", "wiki")], logprobs[("imdb", "imdb")]
    lp = {**{f"{k} wiki": wiki[k] for k in SYSTEMS}, **{f"{k} imdb": imdb[k] for k in SYSTEMS}}
    ev = evidence(lp, doc_index, pairs=[(f"{k} wiki", f"{k} imdb") for k in SYSTEMS])
    return {k: ev["differences"][f"{k} imdb vs {k} wiki"] for k in SYSTEMS} | {"bootstrap": ev["bootstrap"]}


def work_totals(work: list[dict[str, Any]]) -> dict[str, int]:
    """Forward tokens of the datastore builds and of the scoring (calibration slices and test splits, with the
    output projection), scored tokens, and query x key pairs searched: what the run's time is mostly made of."""

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


def _change(d: dict[str, Any] | None) -> str:
    """``-3.0% [-4.2, -2.0]``: a relative change with its paired 95% interval."""
    if d is None:
        return "n/a"
    ci = f" [{100 * d['low']:+.1f}, {100 * d['high']:+.1f}]" if d.get("low") is not None else ""
    return f"{100 * d['relative_change']:+.1f}%{ci}"


def _print_table(rows: list[dict[str, Any]], swap: dict[str, Any], mixtures: dict) -> None:
    head = (f"{'evaluated on':13s} {'memories':9s} {'tokens':>6s} {'docs':>5s} {'base ppl':>9s}"
            + "".join(f" {h:>8s}" for h in SYSTEMS.values()))  # fmt: skip
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['eval']:13s} {r['memory']:9s} {r['tokens']:6d} {r['documents']:5d} {r['base_ppl']:9.2f}"
              + "".join(f" {r[k]:8.2f}" for k in SYSTEMS))  # fmt: skip
    print("\nchange against the base LM [95% bootstrap interval over the test documents, paired]")
    print(f"{'evaluated on':13s} {'memories':9s}" + "".join(f" {h:>22s}" for h in SYSTEMS.values()))
    for r in rows:
        print(f"{r['eval']:13s} {r['memory']:9s}"
              + "".join(f" {_change(r['differences'].get(f'{k} vs base_ppl')):>22s}" for k in SYSTEMS))  # fmt: skip
    print(f"\nswapping the wiki memories for the imdb ones, on the same imdb test tokens "
          f"({swap['bootstrap']['documents']} documents, paired):")  # fmt: skip
    print(f"{'':23s}" + "".join(f" {_change(swap[k]):>22s}" for k in SYSTEMS))
    print("\nmemories (each less a held-out slice and less the training documents found in the test splits):")
    for r in {r["memory"]: r for r in rows}.values():
        print(f"  {r['memory']} train: datastore of {r['datastore_entries']:,} entries, ∞-gram of "
              f"{r['ngram_tokens']:,} tokens")  # fmt: skip
    print("mixtures (what memlm eval applies with no weight flags; from each memory's build-time calibration):")
    for corpus, chosen in mixtures.items():
        for key, dm in chosen.items():
            fit = dm.fit.fit
            print(f"  {corpus} {SYSTEMS[key]}: {dm.origin}; fitted on {fit.documents} documents")
