"""Bootstrap intervals over documents (memlm.core.bootstrap) against a plain-loop transcription of the textbook
percentile bootstrap (Efron & Tibshirani 1993, ch. 6 and 13.3), and the frequency buckets (memlm.core.frequency)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from memlm.core.bootstrap import DocumentBootstrap, evidence
from memlm.core.frequency import bucket_labels, frequency_buckets


def _reference(systems: list[np.ndarray], doc: np.ndarray, resamples: int, seed: int) -> list[list[float]]:
    """Efron & Tibshirani's nonparametric bootstrap, one replicate at a time: the sample is the list of documents
    x_1..x_n (each with its NLL and token count); a bootstrap sample x*_1..x*_n draws n of them with replacement; the
    replicate is the statistic on it (perplexity = exp(total NLL / total tokens) of each system); the percentile
    interval is the 2.5th and 97.5th percentile of the replicates. Returns, per system, its replicates."""
    ids = sorted(set(doc.tolist()))
    sample = [[(-float(sum(lp[doc == d])), int(sum(doc == d))) for d in ids] for lp in systems]
    rng = np.random.default_rng(seed)
    replicates: list[list[float]] = [[] for _ in systems]
    for _ in range(resamples):
        drawn = rng.integers(0, len(ids), size=len(ids))
        for s, docs in enumerate(sample):
            nll = sum(docs[i][0] for i in drawn)
            tokens = sum(docs[i][1] for i in drawn)
            replicates[s].append(math.exp(nll / tokens))
    return replicates


def _documents(rng: np.random.Generator, n_docs: int, lo: int = 5, hi: int = 200) -> np.ndarray:
    lengths = rng.integers(lo, hi, size=n_docs)
    return np.repeat(rng.permutation(1000)[:n_docs] * 3, lengths)  # ids neither contiguous nor sorted by position


@pytest.mark.parametrize("seed", [0, 7])
def test_intervals_equal_the_textbook_loop(seed: int) -> None:
    rng = np.random.default_rng(1)
    doc = _documents(rng, 23)
    base = -rng.gamma(2.0, 1.5, size=len(doc))
    memory = base + rng.normal(0.05, 0.8, size=len(doc))
    res = evidence({"base_ppl": base, "knn_ppl": memory}, doc, [("base_ppl", "knn_ppl")], resamples=300, seed=seed)
    ref_base, ref_mem = _reference([base, memory], doc, 300, seed)
    for name, ref in (("base_ppl", ref_base), ("knn_ppl", ref_mem)):
        row = res["intervals"][name]
        np.testing.assert_allclose([row["low"], row["high"]], np.percentile(ref, [2.5, 97.5]), rtol=1e-12)
    # the paired change: ppl_B / ppl_A - 1 on the same bootstrap sample
    change = np.array(ref_mem) / np.array(ref_base) - 1.0
    diff = res["differences"]["knn_ppl vs base_ppl"]
    np.testing.assert_allclose([diff["low"], diff["high"]], np.percentile(change, [2.5, 97.5]), rtol=1e-9)
    whole = math.exp(-memory.mean()) / math.exp(-base.mean()) - 1.0
    assert diff["relative_change"] == pytest.approx(whole, rel=1e-12)
    assert res["intervals"]["base_ppl"]["ppl"] == pytest.approx(math.exp(-base.mean()), rel=1e-12)
    assert res["bootstrap"]["documents"] == 23 and res["bootstrap"]["resamples"] == 300
    assert "note" not in res["bootstrap"]
    few = evidence({"base_ppl": base}, np.where(doc == doc[0], 0, 1), resamples=10)  # 2 documents
    assert few["bootstrap"]["documents"] == 2 and "too narrow" in few["bootstrap"]["note"]


def test_counts_in_blocks_equal_one_block(monkeypatch: pytest.MonkeyPatch) -> None:
    """The counts matrix is drawn in blocks of resamples (bounded memory): block size does not change the result."""
    import memlm.core.bootstrap as B

    rng = np.random.default_rng(3)
    doc = _documents(rng, 17)
    lp = -rng.gamma(2.0, 1.0, size=len(doc))
    whole = evidence({"base_ppl": lp}, doc, resamples=101)["intervals"]["base_ppl"]
    monkeypatch.setattr(B, "_CHUNK_CELLS", 17 * 4)  # 4 resamples per block, the last one short
    blocks = evidence({"base_ppl": lp}, doc, resamples=101)["intervals"]["base_ppl"]
    assert blocks == pytest.approx(whole, rel=1e-12)


def test_paired_interval_excludes_zero_for_a_better_system_and_not_for_noise() -> None:
    rng = np.random.default_rng(5)
    doc = _documents(rng, 40, 50, 150)
    base = -rng.gamma(2.0, 1.5, size=len(doc))
    better = base + rng.normal(0.1, 0.5, size=len(doc))  # 0.1 nats per token better, noisy
    same = base + rng.normal(0.0, 0.5, size=len(doc))  # the same system up to zero-mean noise
    res = evidence({"base_ppl": base, "knn_ppl": better, "ngram_ppl": same}, doc)
    gain = res["differences"]["knn_ppl vs base_ppl"]
    assert gain["high"] < 0 and gain["excludes_zero"] and gain["low"] < gain["relative_change"] < gain["high"]
    noise = res["differences"]["ngram_ppl vs base_ppl"]
    assert noise["low"] < 0 < noise["high"] and not noise["excludes_zero"]
    # pairing matters: the unpaired intervals of base and the better system overlap, the paired one excludes 0
    assert res["intervals"]["knn_ppl"]["high"] > res["intervals"]["base_ppl"]["low"]


def test_fewer_than_two_documents_give_a_note_not_an_interval() -> None:
    lp = np.log(np.full(50, 0.1))
    res = evidence({"base_ppl": lp, "knn_ppl": lp + 0.1}, np.zeros(50, dtype=np.int32))
    assert "at least 2" in res["bootstrap"]["note"]
    row = res["intervals"]["base_ppl"]
    assert row["ppl"] == pytest.approx(10.0) and row["low"] is None and row["high"] is None
    diff = res["differences"]["knn_ppl vs base_ppl"]
    assert diff["relative_change"] == pytest.approx(math.exp(-0.1) - 1) and diff["low"] is None
    assert not diff["excludes_zero"]


def test_infinite_perplexity_gets_a_note() -> None:
    doc = np.repeat(np.arange(4), 10)
    lp = np.full(40, -1.0)
    knn = lp.copy()
    knn[3] = -np.inf
    res = evidence({"base_ppl": lp, "knn_only_ppl": knn}, doc, [("base_ppl", "knn_only_ppl")])
    inf = res["intervals"]["knn_only_ppl"]
    assert inf["ppl"] == math.inf and "infinite" in inf["note"] and inf["low"] is None
    assert res["intervals"]["base_ppl"]["low"] == pytest.approx(math.e)  # every document has the same perplexity
    assert res["differences"]["knn_only_ppl vs base_ppl"]["relative_change"] is None


def test_bad_settings_refused() -> None:
    with pytest.raises(ValueError, match="resamples"):
        DocumentBootstrap(np.zeros(3), resamples=0)
    with pytest.raises(ValueError, match="level"):
        DocumentBootstrap(np.zeros(3), level=1.0)


def test_frequency_buckets_split_the_tokens_and_the_gain() -> None:
    rng = np.random.default_rng(9)
    doc = _documents(rng, 12, 40, 80)
    n = len(doc)
    counts = rng.choice([0, 1, 7, 10, 11, 500, 5_000, 20_000, 200_000], size=n)
    base = -rng.gamma(2.0, 1.0, size=n)
    memory = base + np.where(counts > 1000, 0.3, -0.05)  # helps frequent tokens, hurts rare ones
    rows = frequency_buckets(counts, base, memory, DocumentBootstrap(doc, resamples=200))
    assert [r["bucket"] for r in rows] == bucket_labels() == ["0", "1-10", "11-100", "101-1,000", "1,001-10,000",
                                                              "10,001-100,000", ">100,000"]  # fmt: skip
    assert sum(r["tokens"] for r in rows) == n
    assert rows[1]["tokens"] == int(np.isin(counts, [1, 7, 10]).sum())  # 10 is in 1-10, 11 in 11-100
    assert sum(r["nats_gained"] for r in rows) == pytest.approx(float(np.sum(memory - base)))
    for r in rows:
        m = (counts >= r["count_min"]) & (counts <= (r["count_max"] if r["count_max"] is not None else np.inf))
        assert r["base_ppl"] == pytest.approx(math.exp(-base[m].mean()))
        assert r["memory_ppl"] == pytest.approx(math.exp(-memory[m].mean()))
    assert rows[-1]["excludes_zero"] and rows[-1]["high"] < 0  # frequent: better
    assert rows[0]["excludes_zero"] and rows[0]["low"] > 0  # unseen: worse


def test_an_empty_bucket_has_only_its_count() -> None:
    doc = np.repeat(np.arange(3), 5)
    rows = frequency_buckets(np.full(15, 50), np.full(15, -1.0), np.full(15, -0.9), DocumentBootstrap(doc))
    assert rows[0] == {"bucket": "0", "count_min": 0, "count_max": 0, "tokens": 0}
    assert rows[2]["tokens"] == 15 and rows[2]["relative_change"] == pytest.approx(math.exp(-0.1) - 1)
