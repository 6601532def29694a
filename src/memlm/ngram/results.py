"""The ∞-gram's rows of ``memlm eval``'s result, from a per-token table (Liu et al. 2024, Sec. 5: the LM interpolated
with P∞ by λ_sparse where P∞(· | c) is sparse, λ_dense elsewhere, with the kNN term when the table has neighbours)::

    p(w | c) = (1 - λ - λ_r(c)) p_LM(w | c) + λ p_kNN(w | c) + λ_r(c) P∞(w | c),
    λ_r(c) = λ_sparse when one token follows every occurrence of the matched suffix, else λ_dense

:func:`ngram_result` (one index or several) gives eval's rows through the one report
(:func:`memlm.mixing.report.report`: each row the rule's :class:`~memlm.core.mixture.Mixture`, its interval, the
paired differences, the frequency buckets) beside the ∞-gram's own statistics
(:func:`memlm.ngram.mixture.ngram_statistics`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["multi_ngram_result", "ngram_result"]


def ngram_result(
    ts,
    memory,
    lam: float | None,
    temperature: float,
    weights: Sequence[tuple[float, float, str]],
    base: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The ∞-gram part of ``memlm eval``'s result (with the kNN term when the table has one and ``lam`` is given):
    ``ngram_ppl`` (LM + ∞-gram), ``knn_ngram_ppl`` (the three), ``ngram_only_ppl``, the weights and the statistics.
    With ``base`` (the result of :func:`memlm.knnlm.evaluate.perplexities` it joins), its ``intervals``,
    ``differences``, ``frequency_buckets`` and ``mixtures`` are returned merged with the ∞-gram's (the ∞-gram's
    buckets count each target among the index's tokens). ``weights``: each index's ``(λ_sparse, λ_dense, origin)``
    (:func:`memlm.knnlm.calibration.ngram_parameters`: as given, else the index's calibrated mixture's). Weights
    calibrated apart that sum past 1 are scaled by the rule (:func:`memlm.core.mixture.rule_mixture`);
    ``knn_ngram_weights`` records the weights it used."""
    import torch

    from memlm.core.distribution import perplexity
    from memlm.mixing.dump import rule_for, rule_weights
    from memlm.mixing.report import report
    from memlm.ngram.memory import NgramMemories
    from memlm.ngram.mixture import ngram_statistics

    if isinstance(memory, NgramMemories):
        return multi_ngram_result(ts, memory, lam, temperature, weights, base)
    ls, ld, origin = weights[0]
    rows: dict[str, Any] = {"base_ppl": torch.from_numpy(ts.lm_logprob), "ngram_ppl": rule_for(ts, {"ngram": (ls, ld)})}
    pairs = [("base_ppl", "ngram_ppl")]
    has_knn = "knn" in ts.columns and lam is not None
    if has_knn:
        rows.update(knn_ppl=rule_for(ts, {"knn": lam}), knn_ngram_ppl=rule_for(ts, {"knn": lam, "ngram": (ls, ld)}))
        scaled = lam + max(ls, ld) > 1.0  # the rule scaled the ∞-gram's weights: another ∞-gram row than ngram_ppl
        pairs += [("base_ppl", "knn_ngram_ppl"), ("knn_ppl", "knn_ngram_ppl")]
        pairs += [] if scaled else [("ngram_ppl", "knn_ngram_ppl")]
    counts = memory.token_counts(ts.targets)
    where = f"∞-gram index {memory.index.path} ({len(memory.index):,} tokens)"
    rep = report(ts, rows, pairs, counts, where, buckets=("ngram_ppl", "knn_ngram_ppl"), temperature=temperature)
    own: dict[str, Any] = {
        "ngram_ppl": rep["ngram_ppl"],
        "lambda_sparse": ls,
        "lambda_dense": ld,
        "ngram_only_ppl": perplexity(ts.logprob("ngram")),  # infinite when some target never follows its suffix
        **ngram_statistics(ts),
    }
    if has_knn:
        used = rule_weights(rows["knn_ngram_ppl"])
        own["knn_ngram_ppl"] = rep["knn_ngram_ppl"]
        own["knn_ngram_weights"] = {"lambda": used["knn"], "lambda_sparse": used["ngram"][0],
                                    "lambda_dense": used["ngram"][1],
                                    "note": "fit all of them together on a valid dump with memlm tune"}  # fmt: skip
    return {**own, **_merged(base, _without(rep, "knn_ppl")), "ngram_parameters_from": origin, **memory.describe()}


def _without(rep: dict[str, Any], row: str) -> dict[str, Any]:
    """A report's evidence and mixtures without ``row`` (eval's own row, reported by the result it joins)."""
    return {
        "bootstrap": rep["bootstrap"],
        "intervals": {k: v for k, v in rep["intervals"].items() if k != row},
        "differences": rep["differences"],
        "frequency_buckets": rep.get("frequency_buckets", {}),
        "mixtures": {k: v for k, v in rep.get("mixtures", {}).items() if k != row},
    }


def _merged(base: dict[str, Any] | None, own: dict[str, Any]) -> dict[str, Any]:
    """``bootstrap``, ``intervals``, ``differences``, ``frequency_buckets`` and ``mixtures`` (each fixed-weight row's
    rule) of eval's result with the ∞-gram's added (the result's own rows kept where both have one: base and kNN-LM
    come from the same table)."""
    base = base or {}
    return {
        "bootstrap": base.get("bootstrap", own["bootstrap"]),
        "intervals": {**own["intervals"], **base.get("intervals", {})},
        "differences": {**own["differences"], **base.get("differences", {})},
        "frequency_buckets": {**base.get("frequency_buckets", {}), **own["frequency_buckets"]},
        "mixtures": {**base.get("mixtures", {}), **own["mixtures"]},
    }


def multi_ngram_result(
    ts,
    memories,
    lam: float | None,
    temperature: float,
    weights: Sequence[tuple[float, float, str]],
    base: dict[str, Any] | None = None,
) -> dict:
    """``memlm eval`` with several ∞-gram indexes: each index alone beside the LM (its own ``weights``, as for one
    index; its row ``<component>_ppl``, e.g. ``ngram2_ppl``), and all of them together, each
    with its own λ's, mixed by the rule (:func:`memlm.core.mixture.rule_mixture`, which scales weights that sum past 1
    to leave the LM a weight > 0); with a datastore, with the kNN term too. ``multi_ngram_weights`` records the
    weights the rule used. The weights are set apart here: ``--dump`` and ``memlm tune`` fit them together. Evidence
    merged with ``base``'s as :func:`ngram_result` does."""
    import torch

    from memlm.mixing.component import component_name
    from memlm.mixing.dump import rule_for, rule_weights
    from memlm.mixing.report import report
    from memlm.ngram.mixture import ngram_statistics, reference_view

    refs, pairs_of = [], {}
    for r, (memory, (ls, ld, origin)) in enumerate(zip(memories.memories, weights, strict=True)):
        refs.append({**memory.describe(), "lambda_sparse": ls, "lambda_dense": ld,
                     **ngram_statistics(reference_view(ts, r)), "ngram_parameters_from": origin})  # fmt: skip
        pairs_of[component_name("ngram", r)] = (ls, ld)
    rows: dict[str, Any] = {"base_ppl": torch.from_numpy(ts.lm_logprob)}
    rows.update({f"{c}_ppl": rule_for(ts, {c: w}) for c, w in pairs_of.items()})
    rows["multi_ngram_ppl"] = rule_for(ts, pairs_of)
    has_knn = "knn" in ts.columns and lam is not None
    if has_knn:
        rows.update(knn_ppl=rule_for(ts, {"knn": lam}), knn_multi_ngram_ppl=rule_for(ts, {"knn": lam, **pairs_of}))
    pairs = [("base_ppl", key) for key in rows if key not in ("base_ppl", "knn_ppl")]
    pairs += [("knn_ppl", "knn_multi_ngram_ppl")] if has_knn else []
    rep = report(ts, rows, pairs, temperature=temperature)
    for ref, c in zip(refs, pairs_of, strict=True):
        ref["ngram_ppl"] = rep[f"{c}_ppl"]
    names = list(pairs_of)
    used = rule_weights(rows["multi_ngram_ppl"])
    out: dict[str, Any] = {
        "ngrams": refs,
        "multi_ngram_ppl": rep["multi_ngram_ppl"],
        "multi_ngram_weights": [used[c] for c in names],
        "multi_ngram_note": "each index's own (λ_sparse, λ_dense), scaled to sum <= 1; fit them together with "
        "memlm eval --dump on valid text and memlm tune",
    }
    if has_knn:
        both = rule_weights(rows["knn_multi_ngram_ppl"])
        out["knn_multi_ngram_ppl"] = rep["knn_multi_ngram_ppl"]
        out["knn_multi_ngram_weights"] = {"lambda": lam, "temperature": temperature,
                                          "weights": [both[c] for c in names]}  # fmt: skip
    return {**out, **_merged(base, _without(rep, "knn_ppl"))}
