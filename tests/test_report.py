"""memlm.mixing.report: rows of mixtures over a per-token table give the perplexities, intervals and paired
differences of memlm.core.bootstrap, computed here by hand on a small case."""

from __future__ import annotations

import numpy as np
import pytest

from memlm.core.bootstrap import DocumentBootstrap
from memlm.core.mixture import rule_mixture
from memlm.knnlm.table import TokenTable
from memlm.mixing.datastore import DatastoreComponent
from memlm.mixing.report import report


def _table() -> TokenTable:
    rng = np.random.default_rng(7)
    n, k = 60, 4
    targets = rng.integers(0, 5, n)
    values = rng.integers(0, 5, (n, k)).astype(np.int32)
    values[::3, 0] = targets[::3]  # the target among the neighbours on every third token
    scores = -np.sort(rng.uniform(0, 3, (n, k)), axis=1).astype(np.float32)
    table = TokenTable(targets=targets.astype(np.int64), doc_index=np.repeat(np.arange(6), 10).astype(np.int32),
                       lm_logprob=np.log(rng.uniform(0.05, 0.5, n)).astype(np.float32))  # fmt: skip
    table.add(DatastoreComponent(None, k), {"scores": scores, "values": values})
    return table


def test_report_of_a_rule_row_is_the_formula_with_the_bootstraps_intervals():
    table = _table()
    lam, tau = 0.3, 2.0
    rule = rule_mixture(["lm", "knn"], {"knn": lam})
    res = report(table, {"base_ppl": table.logprob("lm"), "knn_ppl": rule}, temperature=tau)
    # by hand: (1 - λ) p_LM + λ p_kNN (Khandelwal et al. 2020, Eq. 3), p_kNN by Eq. 2 at τ
    s, v = table.columns["knn"]["scores"].astype(np.float64), table.columns["knn"]["values"]
    w = np.exp(s / tau)
    p_knn = (w * (v == table.targets[:, None])).sum(1) / w.sum(1)
    mixed = np.log((1 - lam) * np.exp(table.lm_logprob.astype(np.float64)) + lam * p_knn)
    lm = table.lm_logprob.astype(np.float64)
    assert res["tokens"] == 60 and res["knn_ppl"] == pytest.approx(np.exp(-mixed.mean()), rel=1e-6)
    assert res["base_ppl"] == pytest.approx(np.exp(-lm.mean()), rel=1e-6)
    assert res["mixtures"] == {"knn_ppl": rule.to_dict()}
    want = DocumentBootstrap(table.doc_index).intervals({"base_ppl": lm, "knn_ppl": mixed},
                                                        [("base_ppl", "knn_ppl")])  # fmt: skip
    for key in ("base_ppl", "knn_ppl"):
        assert res["intervals"][key]["low"] == pytest.approx(want["intervals"][key]["low"], rel=1e-6)
        assert res["intervals"][key]["high"] == pytest.approx(want["intervals"][key]["high"], rel=1e-6)
    d, e = res["differences"]["knn_ppl vs base_ppl"], want["differences"]["knn_ppl vs base_ppl"]
    assert d["relative_change"] == pytest.approx(res["knn_ppl"] / res["base_ppl"] - 1, rel=1e-6)
    assert (d["low"], d["high"]) == pytest.approx((e["low"], e["high"]), rel=1e-6)
    # frequency buckets of the row named, over the counts given
    counts = np.bincount(table.targets, minlength=5)[table.targets]
    res = report(table, {"base_ppl": table.logprob("lm"), "knn_ppl": rule}, target_counts=counts, temperature=tau)
    rows = res["frequency_buckets"]["knn_ppl"]["rows"]
    assert sum(r["tokens"] for r in rows) == len(table)
