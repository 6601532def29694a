"""``memlm demo``'s rows: every column mixed by a stored fit (the memories' build-time calibration), each on the
columns of the test dump it reads, with its paired interval; checked against NumPy transcriptions of the formulas."""

from __future__ import annotations

import numpy as np
import pytest

from memlm.experiments import demo
from memlm.knnlm.default_mixture import combine
from memlm.knnlm.table import TokenTable
from memlm.mixing.datastore import DatastoreComponent
from memlm.mixing.report import fit_table
from memlm.ngram.step import NgramComponent

V, K = 50, 8


def _dump(seed: int, n_docs: int = 12, per_doc: int = 100) -> TokenTable:
    """A dump where the memories carry signal: the kNN neighbours and the ∞-gram often hold the target."""
    rng = np.random.default_rng(seed)
    n = n_docs * per_doc
    targets = rng.integers(0, V, n)
    logits = rng.normal(0, 1.5, (n, V))
    lm = logits - np.log(np.exp(logits).sum(1, keepdims=True))
    values = rng.integers(0, V, (n, K))
    hit = rng.random(n) < 0.5
    values[hit, rng.integers(0, K, n)[hit]] = targets[hit]
    scores = -np.sort(rng.gamma(2.0, 2.0, (n, K)), axis=1)  # best first
    sparse = rng.random(n) < 0.3
    ng = np.where(rng.random(n) < np.where(sparse, 0.8, 0.4), np.log(rng.uniform(0.05, 1.0, n)), -np.inf)
    ng[sparse & np.isfinite(ng)] = 0.0  # a sparse P∞ puts all its mass on one token
    table = TokenTable(
        targets=targets.astype(np.int64),
        lm_logprob=lm[np.arange(n), targets].astype(np.float32),
        doc_index=np.repeat(np.arange(n_docs), per_doc).astype(np.int32),
        lm_entropy=(-(np.exp(lm) * lm).sum(1)).astype(np.float32),
        lm_max_logprob=lm.max(1).astype(np.float32),
    )
    table.add(DatastoreComponent(None, K), {"scores": scores.astype(np.float32), "values": values.astype(np.int32)})
    counts, ns = rng.integers(1, 100, n).astype(np.int64), rng.integers(1, 12, n).astype(np.int32)
    table.add(NgramComponent(None), {"logprob": ng.astype(np.float32), "count": counts, "n": ns, "sparse": sparse})
    return table


def _p_knn(d: TokenTable, tau: float) -> np.ndarray:
    """Khandelwal et al. (2020) Eq. 2: softmax of the scores / τ, summed over the neighbours holding the target."""
    s = d.columns["knn"]["scores"].astype(np.float64) / tau
    w = np.exp(s - s.max(1, keepdims=True))
    return (w * (d.columns["knn"]["values"] == d.targets[:, None])).sum(1) / w.sum(1)


def _ppl(p: np.ndarray) -> float:
    return float(np.exp(-np.log(p).mean()))


def _features(d: TokenTable, tau: float) -> dict[str, np.ndarray]:
    """The gate's features by name, transcribed (memlm.mixing.inputs)."""
    s = d.columns["knn"]["scores"].astype(np.float64) / tau
    lse = np.log(np.exp(s - s.max(1, keepdims=True)).sum(1)) + s.max(1)
    top_share = (np.exp(s - lse[:, None]) * (d.columns["knn"]["values"] == d.columns["knn"]["values"][:, :1])).sum(1)
    return {
        "lm_entropy": d.lm_entropy, "lm_max_logprob": d.lm_max_logprob,
        "knn_top_score": d.columns["knn"]["scores"][:, 0],
        "knn_logsumexp": lse, "knn_top_value_share": top_share, "knn_empty": np.zeros(len(d)),
        "ngram_log_n": np.log1p(d.columns["ngram"]["n"]), "ngram_log_count": np.log1p(d.columns["ngram"]["count"]),
        "ngram_sparse": d.columns["ngram"]["sparse"].astype(np.float64),
    }  # fmt: skip


def _gate_ppl(m: dict, d: TokenTable, tau: float | None) -> float:
    """A stored mixture record on dump ``d``: standardised features, logits, softmax, the weighted components."""
    feats = _features(d, tau or 1.0)
    z = (np.stack([np.asarray(feats[f], dtype=np.float64) for f in m["feature_names"]], 1) - m["feature_mean"]) / m[
        "feature_std"
    ]
    b = np.array([-np.inf if x is None else x for x in m["b"]])
    a = z @ np.asarray(m["W"]).T + b
    lam = np.exp(a - a.max(1, keepdims=True))
    lam /= lam.sum(1, keepdims=True)
    comps = {
        "lm": np.exp(d.lm_logprob.astype(np.float64)),
        "ngram": np.exp(d.columns["ngram"]["logprob"].astype(np.float64)),
    }
    if tau is not None:
        comps["knn"] = _p_knn(d, tau)
    p = np.stack([comps[c] for c in m["components"]], 1)
    return _ppl((lam * p).sum(1))


def _fits(slice_dump: TokenTable) -> dict:
    """The stored fits as a build makes them (fit_table's guarded fit on the slice, one memory each), and their
    combination."""
    knn = fit_table(demo._view(slice_dump, "knn_ppl"), "guarded", [2.0, 5.0], K)
    ngram = fit_table(demo._view(slice_dump, "ngram_ppl"), "guarded")
    return {"knn_ppl": knn, "ngram_ppl": ngram, "knn_ngram_ppl": combine([knn, ngram], ["knn", "ngram"])}


def test_each_column_is_its_stored_fit_on_the_columns_it_reads():
    fits, test = _fits(_dump(1)), _dump(2)
    row, logprobs = demo._row(test, fits)
    assert row["base_ppl"] == pytest.approx(_ppl(np.exp(test.lm_logprob.astype(np.float64))), rel=1e-6)
    for key, fit in fits.items():
        m = fit.to_dict()["fit"]["mixture"]
        assert m["components"] == {"knn_ppl": ["lm", "knn"], "ngram_ppl": ["lm", "ngram"],
                                   "knn_ngram_ppl": ["lm", "knn", "ngram"]}[key]  # fmt: skip
        assert row[key] == pytest.approx(_gate_ppl(m, test, fit.temperature), rel=1e-5), key
        assert row[key] == pytest.approx(float(np.exp(-float(logprobs[key].mean()))), rel=1e-9)
    assert row["tokens"] == len(test) and row["documents"] == 12
    # every system has its interval and its paired change against the base LM
    for key in ("base_ppl", *demo.SYSTEMS):
        assert row["intervals"][key]["low"] <= row[key] <= row["intervals"][key]["high"]
    for ref, key in demo.CHANGES:
        d = row["differences"][f"{key} vs {ref}"]
        assert d["relative_change"] == pytest.approx(row[key] / row[ref] - 1, rel=1e-9)


def test_the_swap_is_paired_on_the_same_tokens():
    test = _dump(2)
    lp_wiki = demo._row(test, _fits(_dump(3)))[1]
    lp_imdb = demo._row(test, _fits(_dump(1)))[1]
    swap = demo._swap({("imdb", "wiki"): lp_wiki, ("imdb", "imdb"): lp_imdb}, test.doc_index)
    for key in demo.SYSTEMS:
        change = float(np.exp(-float(lp_imdb[key].mean() - lp_wiki[key].mean()))) - 1
        assert swap[key]["relative_change"] == pytest.approx(change, rel=1e-9)
        assert swap[key]["low"] <= swap[key]["relative_change"] <= swap[key]["high"]
    assert swap["bootstrap"]["documents"] == 12


def test_the_table_prints_each_change_with_its_interval(capsys):
    from memlm.knnlm.default_mixture import DefaultMixture

    fits, test = _fits(_dump(1)), _dump(2)
    row, lp = demo._row(test, fits)
    rows = [{"eval": e, "memory": m, "datastore_entries": 1000, "ngram_tokens": 5000, **row}
            for e, m in demo.ROWS]  # fmt: skip
    swap = demo._swap({("imdb", "wiki"): lp, ("imdb", "imdb"): lp}, test.doc_index)
    mixtures = {c: {k: DefaultMixture(f, f"the fit of {c}") for k, f in fits.items()} for c in demo.CORPORA}
    demo._print_table(rows, swap, mixtures)
    out = capsys.readouterr().out
    for header in ("base ppl", "kNN-LM", "∞-gram", "both", "swapping the wiki memories", "the fit of imdb"):
        assert header in out
    d = row["differences"]["knn_ppl vs base_ppl"]
    assert f"{100 * d['relative_change']:+.1f}% [{100 * d['low']:+.1f}, {100 * d['high']:+.1f}]" in out
