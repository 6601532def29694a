"""The ∞-gram beside the LM (and the kNN-LM): per-token statistics in the dump, the interpolation, tuning, calibration.

Liu et al. (2024, Sec. 5) interpolate the ∞-gram with a neural LM with one weight for sparse estimates (P∞ puts all
its mass on one token) and one for the rest, both tuned on validation data::

    P(w | c) = λ_∞(c) P∞(w | c) + (1 - λ_∞(c)) P_LM(w | c),     λ_∞(c) = λ_sparse if P∞(· | c) is sparse else λ_dense

With a kNN-LM datastore too, memlm mixes the three with one weight per memory (Khandelwal et al.'s Eq. 3 extended the
way the continuous cache is, Table 1)::

    P(w | c) = (1 - λ - λ_∞(c)) P_LM(w | c) + λ P_kNN(w | c) + λ_∞(c) P∞(w | c)

and tunes λ, τ, λ_sparse and λ_dense jointly on a dump: for every (λ, τ) of the kNN grid, sparse and dense tokens are
separate sums of the log-likelihood, so the best λ_sparse and λ_dense are found on each subset alone (exactly the
optimum of the full four-dimensional grid, at the cost of two one-dimensional ones). The weights found are applied,
in every report, by the fixed-weight rule's :class:`~memlm.core.mixture.Mixture`
(:func:`memlm.core.mixture.rule_mixture`: a gate on the sparse flag, which also scales weights calibrated apart that
sum past 1), the one mixture eval, tune and generation use (:func:`memlm.mixing.dump.rule_logprob`).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from memlm.core.bootstrap import evidence
from memlm.core.distribution import mix, perplexity
from memlm.core.tuning import grid_search
from memlm.errors import MemlmError

__all__ = [
    "per_index_lambdas",
    "ngram_refs",
    "multi_ngram_report",
    "tune_ngrams",
    "refs_logprob",
    "tune_multi_ngram",
    "NGRAM_LAMBDAS",
    "DEFAULT_LAMBDA_SPARSE",
    "DEFAULT_LAMBDA_DENSE",
    "ngram_parameters",
    "ngram_report",
    "ngram_logprobs",
    "tune_ngram",
]

# fine below 0.1 (where WikiText-2-sized references put λ_dense) and up to 1 (sparse estimates can take most weight)
NGRAM_LAMBDAS = (0.0, 0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.06, 0.07, 0.08, 0.09, 0.1, 0.125, 0.15, 0.175,
                 0.2, 0.25, 0.3, 0.35, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99)  # fmt: skip
DEFAULT_LAMBDA_SPARSE, DEFAULT_LAMBDA_DENSE = 0.1, 0.03  # the fallback when an index records no calibration


def per_index_lambdas(
    lambda_sparse, lambda_dense, n: int, names: tuple[str, str] = ("λ_sparse", "λ_dense")
) -> list[tuple[float | None, float | None]]:
    """Each of ``n`` indexes' ``(λ_sparse, λ_dense)`` as given: ``None`` (not given: the index's calibration, see
    :func:`ngram_parameters`), one value for every index, or a sequence of one value per index, in order."""
    pairs = []
    for name, values in zip(names, (lambda_sparse, lambda_dense), strict=True):
        values = [values] if values is None or isinstance(values, int | float | str) else list(values)
        if len(values) not in (1, n):
            raise MemlmError(f"{name} got {len(values)} values for {n} ∞-gram indexes: give one, or one per index")
        pairs.append([None if v is None else float(v) for v in values] * (n if len(values) == 1 else 1))
    return list(zip(*pairs, strict=True))


def _arrays(ts, name: str = "ngram") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The LM's log p, the ∞-gram ``name``'s log P∞ and its sparse flag per target of a per-token table."""
    if name not in ts.columns:
        raise MemlmError("this table has no ∞-gram scores; rerun memlm eval with --memory ngram:DIR --dump")
    cols = ts.columns[name]
    return (
        torch.from_numpy(ts.lm_logprob),
        torch.from_numpy(np.asarray(cols["logprob"])),
        torch.from_numpy(np.asarray(cols["sparse"])),
    )


def _knn(ts, temperature: float, k: int | None) -> torch.Tensor:
    return ts.logprob("knn", temperature=temperature, k=k)


def ngram_report(
    ts,
    lambda_sparse: float,
    lambda_dense: float,
    lam: float | None = None,
    temperature: float = 1.0,
    k: int | None = None,
    mask: np.ndarray | None = None,
) -> dict[str, Any]:
    """Perplexities with the ∞-gram (and, when the dump has neighbours and ``lam`` is given, the three-way mixture)
    and the ∞-gram's own statistics beside the paper's (sparse share, effective n); ``mask`` keeps only some tokens
    (e.g. without WikiText's formatting tokens). ``intervals`` / ``differences`` / ``bootstrap``: each perplexity's
    95% interval over the dump's documents and the paired interval of each relative change
    (:func:`memlm.core.bootstrap.evidence`)."""
    _, ng, sp = _arrays(ts)
    rows, mixtures = ngram_logprobs(ts, (lambda_sparse, lambda_dense), lam, temperature, k)
    lm, mixed = rows["base_ppl"], rows["ngram_ppl"]
    keep = torch.ones(len(lm), dtype=torch.bool) if mask is None else torch.as_tensor(mask, dtype=torch.bool)
    n = np.asarray(ts.columns["ngram"]["n"])[keep.numpy()]
    sparse = sp[keep]
    hits = torch.isfinite(ng[keep])
    out: dict[str, Any] = {
        "tokens": int(keep.sum()),
        "base_ppl": perplexity(lm[keep]),
        "ngram_ppl": perplexity(mixed[keep]),
        "lambda_sparse": lambda_sparse,
        "lambda_dense": lambda_dense,
        "ngram_only_ppl": perplexity(ng[keep]),  # infinite when some target never follows its suffix
        "ngram_target_nonzero": float(hits.float().mean()),
        "ngram_target_above_half": float((ng[keep] > math.log(0.5)).float().mean()),  # the paper's 47% (Sec. 4.1)
        "sparse_share": float(sparse.float().mean()),
        "sparse_correct": float(torch.isfinite(ng[keep][sparse]).float().mean()) if bool(sparse.any()) else None,
        "effective_n": {
            "median": float(statistics.median(n.tolist())) if len(n) else None,
            "mean": float(n.mean()) if len(n) else None,
            "histogram": {
                str(v): int(c) for v, c in zip(*np.unique(np.minimum(n, 16), return_counts=True), strict=True)
            },
            "histogram_note": "16 = 16 or more",
        },
        "ngram_beats_lm": float((ng[keep] > lm[keep]).float().mean()),
    }
    if "knn_ngram_ppl" in rows:
        out.update(
            knn_ngram_ppl=perplexity(rows["knn_ngram_ppl"][keep]),
            knn_ppl=perplexity(rows["knn_ppl"][keep]),
            **{"lambda": lam, "temperature": temperature},
        )
    out["mixtures"] = mixtures
    out.update(evidence(rows, ts.doc_index, mask=keep.numpy()))  # intervals over documents, paired differences
    return out


def ngram_logprobs(
    ts, lambdas: tuple[float, float], lam: float | None = None, temperature: float = 1.0, k: int | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """log P(target) per token of each system :func:`ngram_report` scores, by its perplexity key: ``base_ppl`` (the
    LM), ``ngram_ppl`` (LM + ∞-gram), and, when the dump has neighbours and ``lam`` is given, ``knn_ppl`` (LM + kNN)
    and ``knn_ngram_ppl`` (the three-way mixture); ``lambdas`` = (λ_sparse, λ_dense). Each mixed row is the rule's
    :class:`~memlm.core.mixture.Mixture` (:func:`memlm.mixing.dump.rule_rows`), returned beside the rows
    (``Mixture.to_dict()`` by key). The intervals of :mod:`memlm.core.bootstrap` are computed on the rows."""
    from memlm.mixing.dump import rule_rows

    specs: dict[str, dict[str, Any]] = {"ngram_ppl": {"ngram": tuple(lambdas)}}
    if "knn" in ts.columns and lam is not None:
        specs.update(knn_ppl={"knn": lam}, knn_ngram_ppl={"knn": lam, "ngram": tuple(lambdas)})
    rows, mixtures = rule_rows(ts, specs, temperature, k)
    return {"base_ppl": _arrays(ts)[0], **rows}, mixtures


def _best_weight(lm, ng, knn, lam: float, lambdas: Sequence[float]) -> tuple[float, float]:
    """The ∞-gram weight ``w`` among ``lambdas`` (those with λ + w <= 1) whose mixture ``(1 - λ - w) p_LM + w P∞
    (+ λ p_kNN)`` has the lowest perplexity on these tokens, and that perplexity: what :func:`grid_search` picks over
    :func:`memlm.core.distribution.mix` (the first of equal ones; nan never wins), every candidate in one ``[W, n]``
    pass (a grid of weightings)."""
    cands = [w for w in lambdas if lam + w <= 1.0 + 1e-9]
    comps, rows = [lm, ng], [[1.0 - lam - w for w in cands], cands]
    if knn is not None:
        comps.append(knn)
        rows.append([lam] * len(cands))
    nll = -mix(comps, weights=[torch.tensor(r, dtype=torch.float64)[:, None] for r in rows]).double().sum(-1)
    ppl = torch.exp(nll / max(1, lm.shape[0]))
    ppl = torch.where(torch.isnan(ppl), math.inf, ppl)
    best = int(torch.argmin(ppl))  # the first of equal minima, as grid_search
    return float(cands[best]), float(ppl[best])


def tune_ngram(
    ts,
    lambdas: Sequence[float] = NGRAM_LAMBDAS,
    knn_lambdas: Sequence[float] | None = None,
    temperatures: Sequence[float] | None = None,
    k: int | None = None,
) -> dict[str, Any]:
    """Grid-search λ_sparse and λ_dense (and, when the dump has kNN neighbours, λ and τ jointly with them) for the
    lowest perplexity of the mixture on a dump (see the module docstring). Returns ``{"best", "grid"}`` as
    :func:`memlm.core.tuning.grid_search` (the grid over (λ, τ), each point with its best λ_sparse, λ_dense)."""
    from memlm.core.tuning import DEFAULT_LAMBDAS, DEFAULT_TEMPERATURES

    lm, ng, sp = _arrays(ts)
    has_knn = "knn" in ts.columns
    knn_lambdas = (DEFAULT_LAMBDAS if knn_lambdas is None else knn_lambdas) if has_knn else (0.0,)
    temperatures = (DEFAULT_TEMPERATURES if temperatures is None else temperatures) if has_knn else (1.0,)
    cache: dict[float, torch.Tensor] = {}
    inner: dict[tuple[float, float], dict[str, float]] = {}
    n = len(lm)

    def best_for(lam: float, temperature: float) -> float:
        knn = None
        if has_knn:
            if temperature not in cache:
                cache[temperature] = _knn(ts, temperature, k)
            knn = cache[temperature]
        total, point = 0.0, {}
        for name, mask in (("lambda_sparse", sp), ("lambda_dense", ~sp)):
            if not bool(mask.any()):
                point[name] = 0.0
                continue
            weight, ppl = _best_weight(lm[mask], ng[mask], None if knn is None else knn[mask], lam, lambdas)
            point[name] = weight
            total += math.log(ppl) * int(mask.sum())
        inner[(lam, temperature)] = point
        return math.exp(total / n)

    res = grid_search(
        lambda **p: best_for(p["lambda"], p["temperature"]),
        {"lambda": list(knn_lambdas), "temperature": list(temperatures)},
    )
    for p in [res["best"], *res["grid"]]:
        p.update(inner[(p["lambda"], p["temperature"])])
    return res


def ngram_parameters(
    index, lambda_sparse: float | None = None, lambda_dense: float | None = None, announce: bool = True
) -> tuple[float, float, str]:
    """``(λ_sparse, λ_dense, origin)``: the values given, else the index's calibration, else the fallback."""
    import sys

    cal = index.manifest.get("calibration")
    if lambda_sparse is not None and lambda_dense is not None:
        origin = "given"
    elif cal is not None:
        lambda_sparse = float(cal["lambda_sparse"]) if lambda_sparse is None else lambda_sparse
        lambda_dense = float(cal["lambda_dense"]) if lambda_dense is None else lambda_dense
        origin = (
            f"calibrated on {cal['tokens']:,} held-out tokens of the index's corpus (ppl {cal['base_ppl']:.3f} "
            f"-> {cal['ngram_ppl']:.3f}), recorded in {index.path}/manifest.json"
        )
    else:
        lambda_sparse = DEFAULT_LAMBDA_SPARSE if lambda_sparse is None else lambda_sparse
        lambda_dense = DEFAULT_LAMBDA_DENSE if lambda_dense is None else lambda_dense
        origin = (
            "memlm's fallback defaults (the index records no calibration: tune on your valid text with "
            "`memlm eval --memory DIR --dump` + `memlm tune`)"
        )
    if announce:
        print(f"∞-gram parameters: λ_sparse={lambda_sparse:g}, λ_dense={lambda_dense:g}: {origin}", file=sys.stderr)
    return float(lambda_sparse), float(lambda_dense), origin


def refs_logprob(
    lm: torch.Tensor,
    refs: Sequence[tuple[torch.Tensor, torch.Tensor]],
    weights: Sequence[Sequence[float]],
    knn: torch.Tensor | None = None,
    lam: float = 0.0,
) -> torch.Tensor:
    """``log P(target)`` of the fixed-weight rule (:func:`memlm.mixing.dump.mix_by_rule`) over the LM, a kNN
    term at weight ``lam`` and ∞-gram references ``refs`` (``(log P∞_r(target), sparse_r)``, components ngram,
    ngram2, ...) with their ``(λ_sparse, λ_dense)`` in ``weights``: what :func:`tune_multi_ngram` scores."""
    from memlm.mixing.component import component_name
    from memlm.mixing.dump import mix_by_rule

    names = [component_name("ngram", r) for r in range(len(refs))]
    comps = {"lm": lm, **({"knn": knn} if knn is not None else {})}
    comps.update({c: ng for c, (ng, _) in zip(names, refs, strict=True)})
    rule = {**({"knn": lam} if knn is not None else {}), **{c: tuple(w) for c, w in zip(names, weights, strict=True)}}
    return mix_by_rule(comps, rule, {c: sp for c, (_, sp) in zip(names, refs, strict=True)})


def tune_multi_ngram(
    lm: torch.Tensor,
    refs: Sequence[tuple[torch.Tensor, torch.Tensor]],
    knn: torch.Tensor | None = None,
    lam: float = 0.0,
    lambdas: Sequence[float] = NGRAM_LAMBDAS,
    sweeps: int = 10,
) -> dict[str, Any]:
    """Each reference's ``(λ_sparse, λ_dense)`` for the lowest perplexity of the rule over the LM, the references
    ``refs`` (``(log P∞_r(target), sparse_r)``) and a kNN term (``knn``, which keeps its λ) beside them
    (:func:`memlm.mixing.dump.mix_by_rule`; sums past 1 are skipped, not scaled): coordinate descent over
    the grid ``lambdas``, one weight at a time, started from every reference's own best weights with the others at 0
    (so the result on the tuning text is never worse than the best single reference), until a sweep changes
    nothing. Returns ``{"weights", "ppl", "starts"}``."""

    def ppl(ws: list[tuple[float, float]]) -> float:
        if lam + sum(max(w) for w in ws) > 1.0 + 1e-9:
            return math.inf
        return perplexity(refs_logprob(lm, refs, ws, knn, lam))

    starts = []
    for r, (ng, sp) in enumerate(refs):
        best_w = (0.0, 0.0)
        for j, mask in enumerate((sp, ~torch.as_tensor(sp, dtype=torch.bool))):
            mask = torch.as_tensor(mask, dtype=torch.bool)
            if not bool(mask.any()):
                continue
            pick, _ = _best_weight(lm[mask], ng[mask], None if knn is None else knn[mask], lam, lambdas)
            best_w = (pick, best_w[1]) if j == 0 else (best_w[0], pick)
        ws = [(0.0, 0.0)] * len(refs)
        ws[r] = best_w
        starts.append(ws)
    best_ws, best_ppl, tried = None, math.inf, []
    for start in starts:
        ws, cur = list(start), ppl(list(start))
        for _ in range(sweeps):
            changed = False
            for r in range(len(refs)):
                for j in (0, 1):
                    for w in lambdas:
                        cand = list(ws)
                        cand[r] = (w, cand[r][1]) if j == 0 else (cand[r][0], w)
                        p = ppl(cand)
                        if p < cur - 1e-12:
                            ws, cur, changed = cand, p, True
            if not changed:
                break
        tried.append({"start": [list(w) for w in start], "weights": [list(w) for w in ws], "ppl": cur})
        if cur < best_ppl:
            best_ws, best_ppl = ws, cur
    return {"weights": [list(w) for w in best_ws], "ppl": best_ppl, "starts": tried}


# ------------------------------------------------------------------------------------------ several ∞-gram references


def ngram_refs(ts) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(log P∞_r(target), sparse_r)`` of every ∞-gram reference of a per-token table (components ngram, ngram2,
    ..., in the order given)."""
    names = ts.names("ngram")
    if not names:
        raise MemlmError("this table has no ∞-gram scores; rerun memlm eval with --memory ngram:DIR --dump")
    return [_arrays(ts, name)[1:] for name in names]


def reference_view(ts, r: int):
    """The table with one ∞-gram reference, the ``r``-th (0 = the first), named ``ngram`` beside the other kinds'
    memories, for the one-reference functions (:func:`ngram_report`, :func:`tune_ngram`)."""
    name = ts.names("ngram")[r]
    return ts.select([n for n in ts.names() if ts.components[n].kind != "ngram" or n == name], rename={name: "ngram"})


def multi_ngram_report(
    ts,
    weights: Sequence[Sequence[float]],
    lam: float | None = None,
    temperature: float = 1.0,
    k: int | None = None,
) -> dict[str, Any]:
    """Perplexities with every ∞-gram reference of a dump at ``weights`` (and, with ``lam``, the kNN term too), and
    each reference's own statistics (sparse share, effective n); intervals as :func:`ngram_report`'s, each mixed row
    by the rule (:func:`memlm.mixing.dump.rule_rows`, recorded under ``mixtures``)."""
    from memlm.mixing.component import component_name
    from memlm.mixing.dump import rule_rows

    lm = torch.from_numpy(ts.lm_logprob)
    refs = {component_name("ngram", r): tuple(map(float, w)) for r, w in enumerate(weights)}
    specs: dict[str, dict[str, Any]] = {"ngram_ppl": refs}
    if lam is not None and "knn" in ts.columns:
        specs.update(knn_ngram_ppl={"knn": lam, **refs}, knn_ppl={"knn": lam})
    mixed, mixtures = rule_rows(ts, specs, temperature, k)
    rows = {"base_ppl": lm, **mixed}
    out: dict[str, Any] = {
        "tokens": len(lm),
        "base_ppl": perplexity(lm),
        "ngram_weights": [list(map(float, w)) for w in weights],
        "ngram_ppl": perplexity(rows["ngram_ppl"]),
        "references": [],
    }
    for r in range(len(weights)):
        v = reference_view(ts, r).columns["ngram"]
        out["references"].append(
            {
                "sparse_share": float(np.mean(v["sparse"])),
                "effective_n_median": float(np.median(v["n"])) if len(v["n"]) else None,
                "ngram_target_nonzero": float(np.isfinite(v["logprob"]).mean()),
            }
        )
    if "knn_ppl" in rows:
        out.update(
            knn_ngram_ppl=perplexity(rows["knn_ngram_ppl"]),
            knn_ppl=perplexity(rows["knn_ppl"]),
            **{"lambda": lam, "temperature": temperature},
        )
    out["mixtures"] = mixtures
    out.update(evidence(rows, ts.doc_index))
    return out


def tune_ngrams(
    ts,
    lambdas: Sequence[float] = NGRAM_LAMBDAS,
    knn_lambdas: Sequence[float] | None = None,
    temperatures: Sequence[float] | None = None,
    k: int | None = None,
) -> dict[str, Any]:
    """Every ∞-gram reference of a dump with its own ``(λ_sparse, λ_dense)``, tuned jointly by
    :func:`tune_multi_ngram`. With datastore neighbours in the dump, λ and τ of the kNN term come first: each
    reference alone with the kNN term (:func:`tune_ngram`, the exact optimum over λ, τ, λ_sparse, λ_dense), the
    (λ, τ) of the best of them; then every reference's weights beside that kNN term. Returns ``{"weights", "ppl",
    "lambda", "temperature", "alone", "starts"}`` (``alone``: each reference's own best, as :func:`tune_ngram`)."""
    refs = ngram_refs(ts)
    alone = [tune_ngram(reference_view(ts, r), lambdas, knn_lambdas, temperatures, k)["best"] for r in range(len(refs))]
    knn, lam, temperature = None, 0.0, 1.0
    if "knn" in ts.columns:
        pick = min(alone, key=lambda b: b["ppl"])
        lam, temperature = float(pick["lambda"]), float(pick["temperature"])
        knn = _knn(ts, temperature, k)
    res = tune_multi_ngram(torch.from_numpy(ts.lm_logprob), refs, knn=knn, lam=lam, lambdas=lambdas)
    return {**res, "lambda": lam, "temperature": temperature, "alone": alone}
