"""Printing a perplexity result (``memlm eval``, ``memlm tune``'s test result) with its evidence: each perplexity with
its 95% interval over documents, each difference with its paired interval, the frequency-bucket tables
(memlm.core.bootstrap, memlm.core.frequency)."""

from __future__ import annotations

from typing import Any

#: What each printed perplexity mixes (knn_ppl is not the kNN alone, knn_cache_ppl not the cache alone).
PPL_LABELS = {
    "base_ppl": "LM alone",
    "knn_ppl": "LM + kNN",
    "knn_only_ppl": "kNN alone",
    "oracle_ppl": "per token the better of LM, kNN",
    "knn_cache_ppl": "LM + kNN + cache",
    "lm_cache_ppl": "LM + cache",
    "ngram_ppl": "LM + ∞-gram",
    "knn_ngram_ppl": "LM + kNN + ∞-gram",
    "multi_ngram_ppl": "LM + every ∞-gram",
    "knn_multi_ngram_ppl": "LM + kNN + every ∞-gram",
    "multi_knn_ppl": "LM + every datastore, each its λ",
    "mixture_ppl": "the fitted mixture (memlm tune, a stored fit)",
}
EVIDENCE_KEYS = ("bootstrap", "intervals", "differences", "frequency_buckets")
RECORDED_ONLY = ("mixtures",)  # each fixed-weight row's rule (Mixture.to_dict): in the JSON, not printed


def _interval(row: dict[str, Any] | None) -> str:
    if not row or row.get("low") is None:
        return ""
    return f"  [{row['low']:.4g}, {row['high']:.4g}]"


def _percent(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:+.2f}%"


def print_result(res: dict[str, Any]) -> None:
    """Every scalar of ``res`` (perplexities with their interval), then the differences and the buckets."""
    intervals = res.get("intervals") or {}
    for k, v in res.items():
        if k in EVIDENCE_KEYS or k in RECORDED_ONLY:
            continue
        label = f"  ({PPL_LABELS[k]})" if k in PPL_LABELS else ""
        text = f"{v:.4g}" if isinstance(v, float) else f"{v}"
        print(f"{k:22s} {text}{_interval(intervals.get(k))}{label}")
    boot = res.get("bootstrap")
    if boot:
        note = f"; {boot['note']}" if boot.get("note") else ""
        print(f"intervals: {100 * boot['level']:g}% percentile bootstrap over {boot['documents']} documents "
              f"({boot['resamples']} resamples, seed {boot['seed']}){note}")  # fmt: skip
    diffs = res.get("differences") or {}
    if diffs:
        print("differences (relative change of perplexity, paired over the same resampled documents):")
    for name, d in diffs.items():
        ci = "" if d.get("low") is None else f"  [{_percent(d['low'])}, {_percent(d['high'])}]"
        note = d.get("note") or "no interval (see the intervals line)"
        verdict = ("  excludes 0" if d.get("excludes_zero") else "  includes 0") if ci else f"  ({note})"
        print(f"  {name:36s} {_percent(d.get('relative_change'))}{ci}{verdict}")
    for system, table in (res.get("frequency_buckets") or {}).items():
        print_buckets(system, table)


def print_buckets(system: str, table: dict[str, Any]) -> None:
    """One frequency-bucket table (:func:`memlm.core.frequency.frequency_buckets`)."""
    print(f"{system} vs base_ppl by frequency of the target in {table['counted_in']}:")
    print(f"  {'count':>16s} {'tokens':>7s} {'base ppl':>10s} {'memory ppl':>10s} {'change':>8s} "
          f"{'95% interval':>20s} {'nats gained':>11s}")  # fmt: skip
    for r in table["rows"]:
        if not r["tokens"]:
            print(f"  {r['bucket']:>16s} {0:7d}")
            continue
        ci = "" if r["low"] is None else f"[{_percent(r['low'])}, {_percent(r['high'])}]"
        print(f"  {r['bucket']:>16s} {r['tokens']:7d} {r['base_ppl']:10.4g} {r['memory_ppl']:10.4g} "
              f"{_percent(r['relative_change']):>8s} {ci:>20s} {r['nats_gained']:11.1f}")  # fmt: skip
