"""The infini-gram paper's metrics beside memlm's (docs/results/ngram.md,
benchmarks/papers/ngram/ngram_paper_metrics.py).

The paper's relative improvement (Liu et al. 2024, arXiv 2401.17377 v4, Sec. 5.1) is checked against the figures
its Table 1 prints in parentheses, transcribed from the paper; its agreement statistic (Sec. 4.1: P∞(actual next
token) > 0.5) against a count in NumPy on a hand-made dump.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks" / "papers" / "ngram"))
import ngram_paper_metrics as pm  # noqa: E402

from memlm.knnlm.table import TokenTable  # noqa: E402
from memlm.ngram.mixture import ngram_statistics  # noqa: E402
from memlm.ngram.step import NgramComponent  # noqa: E402

# (neural, + ∞-gram, printed %) from the paper's Table 1, test columns of GPT-2 117M, GPT-Neo 1.3B, Llama-2 70B with
# Pile-train, and Llama-2 70B with Pile-train + RedPajama, and the valid column of Llama-2 70B with Pile-train
TABLE1 = [(22.86, 13.58, 42), (8.61, 7.36, 16), (4.65, 4.20, 12), (4.65, 3.95, 19), (4.59, 4.21, 11)]


@pytest.mark.parametrize(("base", "new", "printed"), TABLE1)
def test_gap_closed_gives_the_papers_table1_figures(base, new, printed):
    assert round(100 * pm.gap_closed(base, new)) == printed
    # memlm's relative change is another number on the same perplexities (42% closed is a 40.6% lower perplexity)
    assert round(100 * -pm.relative_change(base, new)) != printed


def test_every_transcribed_table1_row_matches_its_printed_figure():
    rows = pm.paper_rows()
    assert len(rows) == 14
    assert all(r[s]["matches_printed"] for r in rows for s in ("valid", "test"))


def test_gap_closed_ends():
    assert pm.gap_closed(20.0, 20.0) == 0.0
    assert pm.gap_closed(20.0, 1.0) == 1.0  # perfect language modeling closes the whole gap
    assert pm.relative_change(20.0, 10.0) == -0.5


def _dump() -> TokenTable:
    p = np.array([0.0, 0.3, 0.5, 0.5000001, 0.7, 1.0, 1.0, 0.0, 0.9, 1.0])
    sparse = np.array([0, 0, 0, 0, 0, 1, 1, 1, 0, 0], bool)  # P∞ is 1 or 0 on a sparse estimate
    with np.errstate(divide="ignore"):
        ngram = np.log(p).astype(np.float32)
    n = len(p)
    table = TokenTable(
        targets=np.arange(n, dtype=np.int64),
        lm_logprob=np.full(n, math.log(0.2), np.float32),
        doc_index=np.zeros(n, np.int32),
        position=np.arange(n, dtype=np.int32),
    )
    table.add(NgramComponent(None), {"logprob": ngram, "count": np.ones(n, np.int64), "n": np.full(n, 3, np.int32),
                                     "sparse": sparse})  # fmt: skip
    return table


def test_ngram_statistics_give_the_papers_agreement_beside_nonzero():
    ts = _dump()
    p = np.exp(ts.columns["ngram"]["logprob"].astype(np.float64))
    rep = ngram_statistics(ts)
    assert rep["ngram_target_above_half"] == pytest.approx(np.mean(p > 0.5))  # 0.5 itself is not above
    assert rep["ngram_target_above_half"] == pytest.approx(0.6)
    assert rep["ngram_target_nonzero"] == pytest.approx(np.mean(p > 0))
    assert rep["sparse_correct"] == pytest.approx(np.mean(p[ts.columns["ngram"]["sparse"]] > 0.5))
    keep = np.arange(len(p)) < 5
    masked = ngram_statistics(ts, mask=keep)
    assert masked["ngram_target_above_half"] == pytest.approx(np.mean(p[keep] > 0.5))


def test_the_script_reads_the_same_statistics_from_a_dump_file(tmp_path):
    ts = _dump()
    ts.save(tmp_path / "t.npz")
    got = pm.agreement(str(tmp_path / "t.npz"))
    rep = ngram_statistics(ts)
    assert got["tokens"] == len(ts)
    assert got["target_above_half"] == pytest.approx(rep["ngram_target_above_half"])
    assert got["target_nonzero"] == pytest.approx(rep["ngram_target_nonzero"])
    assert got["sparse_correct"] == pytest.approx(rep["sparse_correct"])
    assert got["sparse_above_half"] == pytest.approx(got["sparse_correct"])
