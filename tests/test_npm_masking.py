"""NPM span masking with in-batch positives (Min et al. 2023, §3.2.1, App. A.2) and NPM SINGLE masking (App. A.3)."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest

from memlm.errors import MemlmError
from memlm.npm.masking import MaskedBatch, mask_batch, mask_batch_single, truncated_geometric_pmf

CLS, SEP, MASK_S, MASK_E = 101, 102, 1, 2
SPECIAL = (CLS, SEP)


def toy_batch(seed: int = 0, n_seqs: int = 4, length: int = 60) -> list[list[int]]:
    """Random sequences with deliberate shared n-grams (lengths 1..6) copied between sequences."""
    rng = np.random.default_rng(seed)
    seqs = [rng.integers(1000, 1200, size=length).tolist() for _ in range(n_seqs)]
    for _ in range(6 * n_seqs):
        i, j = rng.choice(n_seqs, size=2, replace=False)
        n = int(rng.integers(1, 7))
        s, t = int(rng.integers(0, length - n)), int(rng.integers(0, length - n))
        seqs[j][t : t + n] = seqs[i][s : s + n]
    return [[CLS, *s, SEP] for s in seqs]


def occurrences(seqs: list[list[int]], tokens: tuple[int, ...], exclude: int) -> set[tuple[int, int, int]]:
    n = len(tokens)
    return {
        (j, m, m + n - 1)
        for j, seq in enumerate(seqs)
        if j != exclude
        for m in range(len(seq) - n + 1)
        if tuple(seq[m : m + n]) == tokens
    }


def check_constraints(
    batch: MaskedBatch,
    seqs: list[list[int]],
    budget: float = 0.15,
    max_span: int = 10,
    max_spans: int = 128,
    max_repeat: int | None = 10,
    two_tokens: bool = True,
) -> None:
    assert batch.original_ids == seqs
    counts: Counter[tuple[int, ...]] = Counter()
    for i, seq in enumerate(seqs):
        spans = batch.spans[i]
        n_tokens = sum(t not in SPECIAL for t in seq)
        assert sum(len(s.tokens) for s in spans) <= math.floor(budget * n_tokens)  # budget, floored
        assert len(spans) <= max_spans
        prev_end = -1
        for s in spans:
            assert s.seq == i
            assert s.start > prev_end  # sorted, no overlap
            prev_end = s.end
            assert 1 <= len(s.tokens) <= max_span
            assert tuple(seq[s.start : s.end + 1]) == s.tokens
            assert not set(s.tokens) & set(SPECIAL)
            counts[s.tokens] += 1
            # in-batch positives: non-empty, in other sequences, exactly all occurrences of the span string
            assert s.positives, "every masked span needs an in-batch positive"
            got = {(o.seq, o.start, o.end) for o in s.positives}
            assert len(got) == len(s.positives)
            assert got == occurrences(seqs, s.tokens, exclude=i)
            for o in s.positives:
                assert o.seq != i
                assert tuple(seqs[o.seq][o.start : o.end + 1]) == s.tokens
        # each span is replaced by exactly [MASK_s][MASK_e] (one [MASK] for NPM SINGLE): rebuild and compare
        rebuilt: list[int] = []
        pos = 0
        for s in spans:
            rebuilt.extend(seq[pos : s.start])
            assert s.mask_start == len(rebuilt)
            rebuilt.extend([MASK_S, MASK_E] if two_tokens else [MASK_S])
            assert s.mask_end == len(rebuilt) - 1
            assert batch.input_ids[i][s.mask_start] == MASK_S
            assert batch.input_ids[i][s.mask_end] == (MASK_E if two_tokens else MASK_S)
            pos = s.end + 1
        rebuilt.extend(seq[pos:])
        assert batch.input_ids[i] == rebuilt
    if max_repeat is not None:
        assert max(counts.values(), default=0) <= max_repeat


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_mask_batch_honours_every_constraint(seed: int) -> None:
    seqs = toy_batch(seed)
    batch = mask_batch(seqs, MASK_S, MASK_E, np.random.default_rng(seed), special_ids=SPECIAL)
    check_constraints(batch, seqs)
    assert sum(len(s) for s in batch.spans) > 0
    assert all(b[0] == CLS and b[-1] == SEP for b in batch.input_ids)


def test_budget_is_spent_when_every_token_has_a_positive() -> None:
    base = np.random.default_rng(5).integers(1000, 5000, size=100).tolist()
    seqs = [[CLS, *base, SEP], [CLS, *base, SEP]]
    batch = mask_batch(seqs, MASK_S, MASK_E, np.random.default_rng(0), special_ids=SPECIAL, max_repeat=None)
    check_constraints(batch, seqs, max_repeat=None)
    for spans in batch.spans:
        assert sum(len(s.tokens) for s in spans) == 15  # floor(0.15 * 100)
    # rounding is down: 19 tokens -> floor(2.85) = 2 masked tokens at most
    short = [[CLS, *base[:19], SEP], [CLS, *base[:19], SEP]]
    b2 = mask_batch(short, MASK_S, MASK_E, np.random.default_rng(0), special_ids=SPECIAL, max_repeat=None)
    assert [sum(len(s.tokens) for s in sp) for sp in b2.spans] == [2, 2]


def test_max_spans_and_max_repeat_bind() -> None:
    base = np.random.default_rng(6).integers(1000, 5000, size=200).tolist()
    seqs = [base, base]
    batch = mask_batch(seqs, MASK_S, MASK_E, np.random.default_rng(0), max_spans=3, max_repeat=None)
    check_constraints(batch, seqs, max_spans=3, max_repeat=None)
    assert [len(s) for s in batch.spans] == [3, 3]
    # tiny vocabulary: the same strings recur everywhere, so the per-batch repeat cap is what stops masking
    rng = np.random.default_rng(7)
    small = [rng.integers(1000, 1003, size=100).tolist() for _ in range(4)]
    batch = mask_batch(small, MASK_S, MASK_E, np.random.default_rng(1), max_span=1, max_repeat=2)
    check_constraints(batch, small, max_span=1, max_repeat=2)
    counts = Counter(s.tokens for s in batch.all_spans)
    assert counts == {(1000,): 2, (1001,): 2, (1002,): 2}


def test_no_positive_no_mask() -> None:
    seqs = [[CLS, 1000, 1001, 1002, 1003, 1004, 1005, 1006, SEP] * 2, [CLS, 2000, 2001, 2002, 2003, SEP] * 3]
    batch = mask_batch(seqs, MASK_S, MASK_E, np.random.default_rng(0), special_ids=SPECIAL)
    assert batch.input_ids == seqs  # repeats inside one sequence are not in-batch positives
    assert batch.all_spans == []


def test_deterministic_with_seed() -> None:
    seqs = toy_batch(3)
    a = mask_batch(seqs, MASK_S, MASK_E, np.random.default_rng(42), special_ids=SPECIAL)
    b = mask_batch(seqs, MASK_S, MASK_E, np.random.default_rng(42), special_ids=SPECIAL)
    c = mask_batch(seqs, MASK_S, MASK_E, np.random.default_rng(43), special_ids=SPECIAL)
    assert a == b
    assert a.input_ids != c.input_ids


def test_truncated_geometric_pmf() -> None:
    pmf = truncated_geometric_pmf(0.5, 10)
    assert pmf.shape == (10,)
    assert pmf.sum() == pytest.approx(1.0)
    assert pmf[1:] / pmf[:-1] == pytest.approx(np.full(9, 0.5))
    mean = float((np.arange(1, 11) * pmf).sum())
    # closed form: sum_{k<=N} k 2^-k / (1 - 2^-N) with N = 10
    assert mean == pytest.approx(2 * (1 - 11 / 1024 + 10 / 2048) / (1 - 1 / 1024))
    assert mean == pytest.approx(1.9902, abs=1e-4)
    with pytest.raises(MemlmError):
        truncated_geometric_pmf(0.0, 10)
    with pytest.raises(MemlmError):
        truncated_geometric_pmf(0.5, 0)


def test_span_lengths_are_truncated_geometric() -> None:
    pmf = truncated_geometric_pmf(0.5, 10)
    expected_mean = float((np.arange(1, 11) * pmf).sum())
    base = np.random.default_rng(8).integers(1000, 9000, size=400).tolist()
    seqs = [base, base]  # every n-gram has a positive: lengths are limited only by the budget
    lengths = []
    for seed in range(10):
        batch = mask_batch(seqs, MASK_S, MASK_E, np.random.default_rng(seed), max_repeat=None)
        lengths += [len(s.tokens) for s in batch.all_spans]
    lengths_arr = np.array(lengths)
    assert lengths_arr.max() <= 10
    assert abs(lengths_arr.mean() - expected_mean) < 0.2
    assert abs((lengths_arr == 1).mean() - pmf[0]) < 0.08
    assert abs((lengths_arr == 2).mean() - pmf[1]) < 0.08
    assert (lengths_arr >= 4).any()


def test_bad_arguments() -> None:
    seqs = toy_batch(0)
    rng = np.random.default_rng(0)
    for kwargs in ({"budget": 0.0}, {"budget": 1.5}, {"p": 0.0}, {"max_span": 0}, {"max_repeat": 0}, {"max_spans": -1}):
        with pytest.raises(MemlmError):
            mask_batch(seqs, MASK_S, MASK_E, rng, **kwargs)
    with pytest.raises(MemlmError):
        mask_batch([["a", "b"]], MASK_S, MASK_E, rng)  # type: ignore[list-item]


@pytest.mark.parametrize("seed", [0, 1])
def test_mask_batch_single(seed: int) -> None:
    seqs = toy_batch(seed)
    batch = mask_batch_single(seqs, MASK_S, np.random.default_rng(seed), special_ids=SPECIAL)
    check_constraints(batch, seqs, max_span=1, max_repeat=None, two_tokens=False)
    assert [len(s) for s in batch.input_ids] == [len(s) for s in seqs]
    assert all(s.mask_start == s.mask_end == s.start for s in batch.all_spans)
    # the candidates here are plentiful, so each sequence spends its budget
    assert all(len(sp) == math.floor(0.15 * (len(s) - 2)) for sp, s in zip(batch.spans, seqs, strict=True))
    again = mask_batch_single(seqs, MASK_S, np.random.default_rng(seed), special_ids=SPECIAL)
    assert again == batch
