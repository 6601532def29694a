"""The ∞-gram's rows of ``memlm eval``'s and ``memlm tune``'s results, from a per-token dump (Liu et al. 2024, Sec. 5:
the LM interpolated with P∞ by λ_sparse where P∞(· | c) is sparse, λ_dense elsewhere, with the kNN term when the dump
has neighbours)::

    p(w | c) = (1 - λ - λ_r(c)) p_LM(w | c) + λ p_kNN(w | c) + λ_r(c) P∞(w | c),
    λ_r(c) = λ_sparse when one token follows every occurrence of the matched suffix, else λ_dense

:func:`ngram_result` (one index or several) gives eval's rows with their intervals, differences, frequency buckets
and mixtures; :func:`tune_ngram_dump` tunes the weights on a valid dump (with the cache and further datastores beside
them) and reports a test dump under them. The command line parses, calls these and prints.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["NgramTuneGrids", "multi_ngram_result", "ngram_result", "tune_ngram_dump"]


NOT_NGRAM = {"tokens", "base_ppl", "knn_ppl", "lambda", "temperature"}  # what eval reports apart


def ngram_result(
    ts,
    memory,
    lam: float | None,
    temperature: float,
    base: dict[str, Any] | None = None,
    given: Sequence[tuple[float | None, float | None]] | None = None,
) -> dict[str, Any]:
    """The ∞-gram part of ``memlm eval``'s result (with the kNN term when the dump has one). With ``base`` (the
    result of :func:`memlm.knnlm.evaluate.perplexities` it joins), its ``intervals``, ``differences``,
    ``frequency_buckets`` and ``mixtures`` are returned merged with the ∞-gram's (the ∞-gram's buckets count each
    target among the index's tokens). ``given``: each index's ``(λ_sparse, λ_dense)`` as the user gave them (None:
    the index's calibration; :func:`memlm.ngram.mixture.per_index_lambdas`). Weights calibrated apart that sum past
    1 are scaled by the rule (:func:`memlm.core.mixture.rule_mixture`); ``knn_ngram_weights`` records the weights it
    used."""
    from memlm.core.mixture import Mixture
    from memlm.mixing.dump import rule_weights
    from memlm.ngram.memory import NgramMemories
    from memlm.ngram.mixture import ngram_logprobs, ngram_parameters, ngram_report

    if isinstance(memory, NgramMemories):
        return multi_ngram_result(ts, memory, lam, temperature, base, given)
    ls, ld, origin = ngram_parameters(memory.index, *(given or [(None, None)])[0])
    has_knn = "knn" in ts.columns and lam is not None
    rep = ngram_report(ts, ls, ld, lam=lam if has_knn else None, temperature=temperature)
    rows, _ = ngram_logprobs(ts, (ls, ld), lam if has_knn else None, temperature)
    rows.pop("knn_ppl", None)  # eval's own row (base)
    if has_knn:
        used = rule_weights(Mixture.from_dict(rep["mixtures"]["knn_ngram_ppl"]))
        rep["knn_ngram_weights"] = {
            "lambda": used["knn"],
            "lambda_sparse": used["ngram"][0],
            "lambda_dense": used["ngram"][1],
            "note": "tune all four jointly on a valid dump with memlm tune",
        }
        scaled = lam + max(ls, ld) > 1.0  # the rule scaled the ∞-gram's weights: another ∞-gram row than ngram_ppl
        refs = ("base_ppl", "knn_ppl") + (() if scaled else ("ngram_ppl",))
        rep["differences"] = {k: v for k, v in rep["differences"].items()
                              if v["system"] != "knn_ngram_ppl" or v["reference"] in refs}  # fmt: skip
        rep["mixtures"].pop("knn_ppl")  # eval's own row (base)
    buckets = _bucket_tables(ts, rows, memory)
    own = {k: v for k, v in rep.items() if k not in NOT_NGRAM}
    return {**own, **_merged(base, own, buckets), "ngram_parameters_from": origin, **memory.describe()}


def _bucket_tables(ts, rows: dict[str, Any], memory) -> dict[str, Any]:
    """Each ∞-gram mixture's change against the LM by frequency of the target among the index's tokens."""
    from memlm.core.frequency import bucket_table

    counts = memory.token_counts(ts.targets)
    where = f"∞-gram index {memory.index.path} ({len(memory.index):,} tokens)"
    return {k: bucket_table(ts, v, counts, where) for k, v in rows.items() if k != "base_ppl" and k != "knn_ppl"}


def _merged(base: dict[str, Any] | None, own: dict[str, Any], buckets: dict[str, Any]) -> dict[str, Any]:
    """``intervals``, ``differences``, ``frequency_buckets`` and ``mixtures`` (each fixed-weight row's rule) of
    eval's result with the ∞-gram's added (the result's own rows kept where both have one: base and kNN-LM come
    from the same dump)."""
    base = base or {}
    return {
        "intervals": {**own.get("intervals", {}), **base.get("intervals", {})},
        "differences": {**own.get("differences", {}), **base.get("differences", {})},
        "frequency_buckets": {**base.get("frequency_buckets", {}), **buckets},
        "mixtures": {**base.get("mixtures", {}), **own.get("mixtures", {})},
    }


def multi_ngram_result(
    ts,
    memories,
    lam: float | None,
    temperature: float,
    base: dict[str, Any] | None = None,
    given: Sequence[tuple[float | None, float | None]] | None = None,
) -> dict:
    """``memlm eval`` with several ∞-gram indexes: each index alone beside the LM (its own λ's: ``given``, else its
    calibration, as for one index), and all of them together, each with its own λ's, mixed by the rule
    (:func:`memlm.core.mixture.rule_mixture`, which scales weights that sum past 1 to leave the LM a weight > 0);
    with a datastore, with the kNN term too. ``multi_ngram_weights`` records the weights the rule used. The weights
    are set apart here: ``--dump`` and ``memlm tune`` tune them jointly. Intervals of the combined rows (each
    index's own rows have theirs under ``ngrams``) merged with ``base``'s as :func:`ngram_result` does."""
    from memlm.core.bootstrap import evidence
    from memlm.core.distribution import perplexity
    from memlm.core.mixture import Mixture
    from memlm.mixing.component import component_name
    from memlm.mixing.dump import rule_rows, rule_weights
    from memlm.ngram.mixture import ngram_parameters, ngram_report, reference_view

    refs, weights = [], {}
    given = given or [(None, None)] * len(memories.memories)
    for r, memory in enumerate(memories.memories):
        ls, ld, origin = ngram_parameters(memory.index, *given[r])
        rep = ngram_report(reference_view(ts, r), ls, ld)
        refs.append({**memory.describe(), **{k: v for k, v in rep.items() if k not in NOT_NGRAM},
                     "ngram_parameters_from": origin})  # fmt: skip
        weights[component_name("ngram", r)] = (ls, ld)
    specs = {"multi_ngram_ppl": weights}
    has_knn = "knn" in ts.columns and lam is not None
    if has_knn:
        specs["knn_multi_ngram_ppl"] = {"knn": lam, **weights}
    if base is not None and "knn_ppl" in (base.get("intervals") or {}) and "lambda" not in ts.columns["knn"]:
        specs["knn_ppl"] = {"knn": base["lambda"]}  # the kNN-LM's row, for its difference
    mixed, mixtures = rule_rows(ts, specs, temperature)
    used = {key: rule_weights(Mixture.from_dict(m)) for key, m in mixtures.items()}
    names = list(weights)
    out: dict[str, Any] = {
        "ngrams": refs,
        "multi_ngram_ppl": perplexity(mixed["multi_ngram_ppl"]),
        "multi_ngram_weights": [used["multi_ngram_ppl"][c] for c in names],
        "multi_ngram_note": "each index's own (λ_sparse, λ_dense), scaled to sum <= 1; tune them jointly with "
        "memlm eval --dump on valid text and memlm tune",
    }
    if has_knn:
        out["knn_multi_ngram_ppl"] = perplexity(mixed["knn_multi_ngram_ppl"])
        out["knn_multi_ngram_weights"] = {"lambda": lam, "temperature": temperature,
                                          "weights": [used["knn_multi_ngram_ppl"][c] for c in names]}  # fmt: skip
    mixtures.pop("knn_ppl", None)  # eval's own row (base)
    own = {**evidence({"base_ppl": ts.lm_logprob, **mixed}, ts.doc_index), "mixtures": mixtures}
    return {**out, **_merged(base, own, {})}


@dataclass(frozen=True)
class NgramTuneGrids:
    """``memlm tune``'s candidates on an ∞-gram dump (None: the defaults): ``ngram_lambdas`` for λ_sparse / λ_dense
    (:data:`memlm.ngram.mixture.NGRAM_LAMBDAS`), ``lambdas`` / ``temperatures`` / ``k`` of the kNN term
    (:data:`memlm.core.tuning.DEFAULT_LAMBDAS`, :data:`~memlm.core.tuning.DEFAULT_TEMPERATURES`, every neighbour
    dumped), ``cache_lambdas`` / ``cache_temperatures`` of the cache (tuned beside the rule when one is above 0)."""

    ngram_lambdas: Sequence[float] | None = None
    lambdas: Sequence[float] | None = None
    temperatures: Sequence[float] | None = None
    k: int | None = None
    cache_lambdas: Sequence[float] = (0.0,)
    cache_temperatures: Sequence[float] = (1.0,)

    def tuner(self) -> dict[str, Any]:
        """The keywords of :func:`memlm.ngram.mixture.tune_ngram` / :func:`~memlm.ngram.mixture.tune_ngrams`."""
        from memlm.ngram.mixture import NGRAM_LAMBDAS

        return {"lambdas": self.ngram_lambdas or NGRAM_LAMBDAS, "knn_lambdas": self.lambdas,
                "temperatures": self.temperatures, "k": self.k}  # fmt: skip


def tune_ngram_dump(valid, test=None, grids: NgramTuneGrids = NgramTuneGrids()) -> dict[str, Any]:
    """``memlm tune`` on a dump with ∞-gram scores: λ_sparse, λ_dense (and λ, τ of its kNN term) tuned jointly on
    ``valid`` (several indexes: :func:`_tune_ngrams`); the cache's λc, τc beside the rule found, and with several
    datastores each further one's λ_j, τ_j beside it (:func:`memlm.mixing.dump.tune_datastores_beside`). ``test``
    (checked by the caller against ``valid``: the same model and memories) is reported under the weights found.
    Returns ``{"valid": {"best", ...}, "test"?, "grid"?}``."""
    from memlm.mixing.dump import tune_datastores_beside
    from memlm.ngram.mixture import ngram_report, tune_ngram

    if len(valid.names("ngram")) > 1:
        return _tune_ngrams(valid, test, grids)
    result = tune_ngram(valid, **grids.tuner())
    best = result["best"]
    has_knn = "knn" in valid.columns
    weights = {**({"knn": best["lambda"]} if has_knn else {}), "ngram": (best["lambda_sparse"], best["lambda_dense"])}
    best.update(_tune_cache(valid, weights, best, grids))
    if has_knn and len(valid.names("knn")) > 1:  # several datastores: the others beside this rule
        from memlm.core.tuning import DEFAULT_LAMBDAS, DEFAULT_TEMPERATURES

        grid = (grids.lambdas or DEFAULT_LAMBDAS, grids.temperatures or DEFAULT_TEMPERATURES)
        rule = {**weights, **({"cache": best["cache_lambda"]} if best.get("cache_lambda") else {})}
        best["datastores"] = tune_datastores_beside(valid, rule, grid, best.get("temperature") or 1.0, grids.k,
                                                    best.get("cache_temperature") or 1.0)  # fmt: skip

    def report(ts) -> dict[str, Any]:
        lam = best["lambda"] if has_knn else None
        rep = ngram_report(ts, best["lambda_sparse"], best["lambda_dense"], lam=lam,
                           temperature=best["temperature"], k=grids.k)  # fmt: skip
        return _with_cache_row(ts, rep, weights, best, grids.k)

    out: dict[str, Any] = {"valid": {"best": best, "grid_points": len(result["grid"]), "report": report(valid)}}
    if test is not None:
        out["test"] = report(test)
    out["grid"] = result["grid"]
    return out


def _tune_ngrams(valid, test, grids: NgramTuneGrids) -> dict[str, Any]:
    """:func:`tune_ngram_dump` on a dump with several ∞-gram indexes (``memlm eval --memory A --memory B --dump``):
    each index's (λ_sparse, λ_dense) tuned jointly (:func:`~memlm.ngram.mixture.tune_ngrams`, coordinate descent of
    :func:`~memlm.ngram.mixture.tune_multi_ngram`), with λ, τ of the kNN term when the dump has neighbours."""
    from memlm.mixing.component import component_name
    from memlm.ngram.mixture import multi_ngram_report, tune_ngrams

    result = tune_ngrams(valid, **grids.tuner())
    has_knn = "knn" in valid.columns
    lam = result["lambda"] if has_knn else None
    weights = result["weights"]
    recorded = valid.meta.get("components") or {}
    described = [{k: v for k, v in recorded.get(name, {}).items() if k.startswith("ngram")}
                 for name in valid.names("ngram")]  # fmt: skip
    best = {
        "ngrams": [{**d, "lambda_sparse": w[0], "lambda_dense": w[1]} for d, w in zip(described, weights, strict=True)],
        "weights": weights,
        **({"lambda": result["lambda"], "temperature": result["temperature"]} if has_knn else {}),
        "ppl": result["ppl"],
    }
    rule = {
        **({"knn": lam} if has_knn else {}),
        **{component_name("ngram", r): tuple(w) for r, w in enumerate(weights)},
    }
    best.update(_tune_cache(valid, rule, best, grids))

    def report(ts) -> dict[str, Any]:
        return _with_cache_row(ts, multi_ngram_report(ts, weights, lam, result["temperature"], grids.k), rule, best,
                               grids.k)  # fmt: skip

    out: dict[str, Any] = {
        "valid": {"best": best, "alone": result["alone"], "starts": result["starts"], "report": report(valid)}
    }
    if test is not None:
        out["test"] = report(test)
    return out


def _tune_cache(valid, weights: dict[str, Any], best: dict[str, Any], grids: NgramTuneGrids) -> dict[str, Any]:
    """The cache's λc and τc tuned beside the ∞-gram rule found on ``valid`` (its ``weights`` fixed;
    :func:`memlm.mixing.dump.tune_beside`): ``{"cache_lambda", "cache_temperature", "cache_ppl"}``, or {} when no
    cache weight above 0 is asked (or the dump has no cache)."""
    from memlm.mixing.dump import tune_beside

    if not any(grids.cache_lambdas) or "cache" not in valid.columns:
        return {}
    grid = (grids.cache_lambdas, grids.cache_temperatures)
    b = tune_beside(valid, weights, "cache", grid, best.get("temperature") or 1.0, grids.k)["best"]
    return {"cache_lambda": b["lambda"], "cache_temperature": b["temperature"], "cache_ppl": b["ppl"]}


def _with_cache_row(ts, rep: dict[str, Any], weights: dict[str, Any], best: dict[str, Any], k) -> dict[str, Any]:
    """``rep`` (an ∞-gram report of ``ts``) with ``cache_rule_ppl``, the tuned rule plus the cache at ``best``'s λc,
    τc, its interval, its differences against the base LM and the rule without the cache, and its mixture."""
    from memlm.core.bootstrap import evidence
    from memlm.core.distribution import perplexity
    from memlm.mixing.dump import rule_rows

    if not best.get("cache_lambda"):
        return rep
    ref = "knn_ngram_ppl" if "knn" in weights else "ngram_ppl"
    rows, mixtures = rule_rows(ts, {ref: weights, "cache_rule_ppl": {**weights, "cache": best["cache_lambda"]}},
                               best.get("temperature") or 1.0, k, best["cache_temperature"])  # fmt: skip
    ev = evidence({"base_ppl": ts.lm_logprob, **rows}, ts.doc_index, pairs=[("base_ppl", "cache_rule_ppl"),
                                                                          (ref, "cache_rule_ppl")])  # fmt: skip
    rep.update(cache_rule_ppl=perplexity(rows["cache_rule_ppl"]), cache_lambda=best["cache_lambda"],
               cache_temperature=best["cache_temperature"])  # fmt: skip
    rep["intervals"]["cache_rule_ppl"] = ev["intervals"]["cache_rule_ppl"]
    rep["differences"].update(ev["differences"])
    rep["mixtures"]["cache_rule_ppl"] = mixtures["cache_rule_ppl"]
    return rep
