"""``memlm demo``'s rows (issue 35 part 3): every system mixed through one ``Mixture`` on the test dump, with the
weights tuned (and the gate fitted) on the valid dump only; checked against NumPy transcriptions of the formulas."""

from __future__ import annotations

import numpy as np
import pytest

from memlm.experiments import demo
from memlm.knnlm.evaluate import tune
from memlm.knnlm.table import TokenTable
from memlm.mixing.datastore import DatastoreComponent
from memlm.ngram.mixture import tune_ngram
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


def test_rows_mix_as_the_papers_formulas_with_weights_from_valid():
    valid, test = _dump(1), _dump(2)
    cfg = demo.DemoConfig(k=K)
    row, (lams, curve) = demo._row(valid, test, cfg)
    # the weights are the ones memlm tune / the ∞-gram tuning pick on valid (the same grids as before issue 35)
    best = tune(valid)["best"]
    alone, joint = tune_ngram(demo._without_neighbours(valid))["best"], tune_ngram(valid)["best"]
    assert (row["lambda"], row["temperature"]) == (best["lambda"], best["temperature"]) and best["lambda"] > 0
    assert row["ngram_weights"] == {k: alone[k] for k in ("lambda_sparse", "lambda_dense")}
    assert row["knn_ngram_weights"] == {k: joint[k] for k in ("lambda", "temperature", "lambda_sparse", "lambda_dense")}
    p_lm, p_ng = np.exp(test.lm_logprob.astype(np.float64)), np.exp(test.columns["ngram"]["logprob"].astype(np.float64))
    lam, knn = row["lambda"], _p_knn(test, row["temperature"])
    assert row["base_ppl"] == pytest.approx(_ppl(p_lm), rel=1e-6)
    assert row["knn_ppl"] == pytest.approx(_ppl((1 - lam) * p_lm + lam * knn), rel=1e-6)  # Eq. 3
    assert row["oracle_ppl"] == pytest.approx(_ppl(np.maximum(p_lm, knn)), rel=1e-6)
    # Liu et al. (2024) Sec. 5: λ∞ = λ_sparse where P∞ is sparse, else λ_dense; both: beside λ p_kNN
    w = row["ngram_weights"]
    lam_inf = np.where(test.columns["ngram"]["sparse"], w["lambda_sparse"], w["lambda_dense"])
    assert row["ngram_ppl"] == pytest.approx(_ppl((1 - lam_inf) * p_lm + lam_inf * p_ng), rel=1e-6)
    w3 = row["knn_ngram_weights"]
    lam3 = np.where(test.columns["ngram"]["sparse"], w3["lambda_sparse"], w3["lambda_dense"])
    p3 = (1 - w3["lambda"] - lam3) * p_lm + w3["lambda"] * _p_knn(test, w3["temperature"]) + lam3 * p_ng
    assert row["knn_ngram_ppl"] == pytest.approx(_ppl(p3), rel=1e-6)
    # the curve: Eq. 3 at each λ < 1, at the tuned τ
    assert lams and max(lams) < 1
    for x, ppl in zip(lams, curve, strict=True):
        assert ppl == pytest.approx(_ppl((1 - x) * p_lm + x * knn), rel=1e-6)
    # every system has its interval and its paired change against the base LM
    for key in ("base_ppl", *demo.SYSTEMS):
        assert row["intervals"][key]["low"] <= row[key] <= row["intervals"][key]["high"]
    for ref, key in demo.CHANGES:
        d = row["differences"][f"{key} vs {ref}"]
        assert d["relative_change"] == pytest.approx(row[key] / row[ref] - 1, rel=1e-9)


def test_the_gate_is_fitted_on_valid_only_and_mixed_on_test():
    """The learned row: fitted on valid (a quarter of its documents kept apart), never on the reported tokens: the
    same valid dump gives the same gate whatever the test dump, and its test perplexity is that gate's mixture there
    (softmax of W z + b over the components, z the standardised features)."""
    valid, test = _dump(1), _dump(2)
    row, _ = demo._row(valid, test, demo.DemoConfig(k=K))
    other, _ = demo._row(valid, _dump(3), demo.DemoConfig(k=K))
    assert row["mixture"]["fit"] == other["mixture"]["fit"]
    fit = row["mixture"]
    assert fit["fit_tokens"] == len(valid) and fit["form"] in ("gate", "constant", "lm")
    assert fit["temperature"] == row["knn_ngram_weights"]["temperature"]
    # the gate, transcribed: features of the test dump by name, standardised, logits, softmax, the weighted mixture
    m = fit["fit"]["fit"]["mixture"]
    tau = fit["temperature"]
    s = test.columns["knn"]["scores"].astype(np.float64) / tau
    knn = _p_knn(test, tau)
    lse = np.log(np.exp(s - s.max(1, keepdims=True)).sum(1)) + s.max(1)
    top_share = (
        np.exp(s - lse[:, None]) * (test.columns["knn"]["values"] == test.columns["knn"]["values"][:, :1])
    ).sum(1)
    neighbours, ngram = test.columns["knn"], test.columns["ngram"]
    feats = {
        "lm_entropy": test.lm_entropy, "lm_max_logprob": test.lm_max_logprob,
        "knn_top_score": neighbours["scores"][:, 0],
        "knn_logsumexp": lse, "knn_top_value_share": top_share, "knn_empty": np.zeros(len(test)),
        "ngram_log_n": np.log1p(ngram["n"]), "ngram_log_count": np.log1p(ngram["count"]),
        "ngram_sparse": ngram["sparse"].astype(np.float64),
    }  # fmt: skip
    assert m["feature_names"] == list(feats) and m["components"] == ["lm", "knn", "ngram"]
    z = (np.stack([np.asarray(feats[f], dtype=np.float64) for f in m["feature_names"]], 1) - m["feature_mean"]) / m[
        "feature_std"
    ]
    b = np.array([-np.inf if x is None else x for x in m["b"]])
    a = z @ np.asarray(m["W"]).T + b
    lam = np.exp(a - a.max(1, keepdims=True))
    lam /= lam.sum(1, keepdims=True)
    p = np.stack(
        [np.exp(test.lm_logprob.astype(np.float64)), knn, np.exp(test.columns["ngram"]["logprob"].astype(np.float64))],
        1,
    )
    assert row["mixture_ppl"] == pytest.approx(_ppl((lam * p).sum(1)), rel=1e-5)


def test_the_table_prints_each_change_with_its_interval(capsys):
    valid, test = _dump(1), _dump(2)
    row, _ = demo._row(valid, test, demo.DemoConfig(k=K))
    row = {"eval": "wiki test", "datastore": "wiki train (1,000 entries)", "ngram": {"tokens_indexed": 5}, **row}
    demo._print_table([row])
    out = capsys.readouterr().out
    for header in ("base ppl", "kNN-LM", "∞-gram", "both", "gate", "oracle"):
        assert header in out
    d = row["differences"]["knn_ppl vs base_ppl"]
    assert f"{100 * d['relative_change']:+.1f}% [{100 * d['low']:+.1f}, {100 * d['high']:+.1f}]" in out
    assert f"({row['bootstrap']['documents']} documents)" in out
    plain, _ = demo._row(valid.select(["knn"]), test.select(["knn"]), demo.DemoConfig(k=K))
    assert "ngram_ppl" not in plain and {"knn_ppl", "mixture_ppl"} <= set(plain)
    assert plain["mixture"]["fit"]["fit"]["mixture"]["components"] == ["lm", "knn"]
