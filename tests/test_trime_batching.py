"""Tests for memlm.trime.batching: segmenting, consecutive (TrimeLM_long) and BM25 (TrimeLM_ext) batching."""

from __future__ import annotations

import numpy as np
import pytest

from memlm.errors import MemlmError
from memlm.trime.batching import (
    Segment,
    batch_purity,
    bm25_neighbors,
    chain_order,
    pack_consecutive,
    segment_documents,
)

TOPICS = {
    "cooking": "oven flour butter recipe simmer garlic onion bake whisk skillet saute pepper dough knead roast",
    "space": "orbit rocket planet galaxy astronaut telescope comet nebula lunar satellite asteroid gravity launch star",
    "football": "goal striker referee penalty midfielder offside stadium keeper tackle league corner dribble coach",
    "music": "melody guitar chord rhythm violin concert tempo orchestra piano lyrics drummer harmony album tune",
}
COMMON = "the a and of to in is was with for".split()


def _toy_corpus(seed: int = 0, per_topic: int = 8, words: int = 24) -> tuple[list[str], list[int]]:
    """``4 * per_topic`` short texts, each words from one topic's vocabulary mixed with common words, shuffled."""
    rng = np.random.default_rng(seed)
    texts, labels = [], []
    for t, vocab in enumerate(TOPICS.values()):
        topic_words = vocab.split()
        for _ in range(per_topic):
            ws = list(rng.choice(topic_words, size=words // 2)) + list(rng.choice(COMMON, size=words - words // 2))
            rng.shuffle(ws)
            texts.append(" ".join(ws))
            labels.append(t)
    perm = rng.permutation(len(texts))
    return [texts[i] for i in perm], [labels[i] for i in perm]


def _word_ids(texts: list[str]) -> list[np.ndarray]:
    vocab: dict[str, int] = {}
    return [np.array([vocab.setdefault(w, len(vocab)) for w in t.split()], dtype=np.int64) for t in texts]


def _assert_partition(batches: list[list[int]], n: int) -> None:
    flat = [i for b in batches for i in b]
    assert sorted(flat) == list(range(n)), "every segment must be used exactly once"


def pack_random(segs: list[Segment], batch_size: int, seed: int = 0) -> list[list[int]]:
    order = np.random.default_rng(seed).permutation(len(segs)).tolist()
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


def pack_bm25(segs: list[Segment], batch_size: int, seed: int = 0, **kw) -> list[list[int]]:
    """Algorithm 1: the BM25 chain over the segments cut into batches."""
    order = chain_order(bm25_neighbors(segs, **kw), seed=seed)
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


def _docs(seed: int = 0, lengths: tuple[int, ...] = (23, 5, 0, 16, 1, 40, 9)) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 50, size=n) for n in lengths]


# --- segmenting -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("segment_len", [1, 4, 8, 100])
def test_segments_cover_every_token_once_in_order(segment_len: int) -> None:
    docs = _docs()
    segs = segment_documents(docs, segment_len)
    for d, doc in enumerate(docs):
        mine = [s for s in segs if s.doc_index == d]
        assert [s.index for s in mine] == list(range(len(mine)))
        assert [s.start for s in mine] == [i * segment_len for i in range(len(mine))]
        owned = np.concatenate([s.owned for s in mine]) if mine else np.zeros(0, dtype=np.int64)
        np.testing.assert_array_equal(owned, doc)
        assert all(s.length == segment_len for s in mine[:-1])
        # next-token pairs: every token but the first is a target exactly once, from its predecessor
        targets = np.concatenate([s.targets for s in mine]) if mine else np.zeros(0, dtype=np.int64)
        np.testing.assert_array_equal(targets, doc[1:])
        inputs = np.concatenate([s.inputs for s in mine]) if mine else np.zeros(0, dtype=np.int64)
        np.testing.assert_array_equal(inputs, doc[:-1])
    # listed document by document
    assert [s.doc_index for s in segs] == sorted(s.doc_index for s in segs)


def test_segment_len_must_be_positive() -> None:
    with pytest.raises(MemlmError):
        segment_documents(_docs(), 0)


# --- random and consecutive packing -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("batch_size", "m"), [(6, 3), (8, 4), (5, 2), (4, 1), (7, 7)])
def test_pack_consecutive_groups_consecutive_segments(batch_size: int, m: int) -> None:
    segs = segment_documents(_docs(), 3)
    batches = pack_consecutive(segs, batch_size, m, seed=3)
    _assert_partition(batches, len(segs))
    for b in batches:
        assert 1 <= len(b) <= batch_size
        # the batch is made of runs of <= m consecutive segments of one document, in order, starting at multiples of m
        runs: list[list[int]] = []
        for i in b:
            if runs and segs[runs[-1][-1]].doc_index == segs[i].doc_index and segs[i].index % m != 0:
                runs[-1].append(i)
            else:
                runs.append([i])
        for run in runs:
            assert [segs[i].index for i in run] == list(range(segs[run[0]].index, segs[run[0]].index + len(run)))
            assert segs[run[0]].index % m == 0, "runs start at a multiple of m"
            assert len(run) <= m
    assert batches == pack_consecutive(segs, batch_size, m, seed=3)
    assert batches != pack_consecutive(segs, batch_size, m, seed=4)


def test_pack_consecutive_full_batches_when_runs_tile() -> None:
    docs = [np.arange(n) for n in (32, 16, 48, 16)]
    segs = segment_documents(docs, 8)  # 4 + 2 + 6 + 2 segments: all whole runs of m = 2
    batches = pack_consecutive(segs, 4, 2, seed=0)
    _assert_partition(batches, len(segs))
    assert [len(b) for b in batches] == [4, 4, 4, 2]
    assert all(segs[b[k]].doc_index == segs[b[k + 1]].doc_index for b in batches for k in range(0, len(b), 2))


def test_pack_consecutive_rejects_bad_m() -> None:
    segs = segment_documents(_docs(), 3)
    with pytest.raises(MemlmError):
        pack_consecutive(segs, 4, 5)
    with pytest.raises(MemlmError):
        pack_consecutive(segs, 4, 0)


# --- BM25 packing -----------------------------------------------------------------------------------------------------


def test_bm25_packing_is_topic_pure_on_text() -> None:
    texts, labels = _toy_corpus()
    segs = segment_documents(_word_ids(texts), 64)  # one segment per text
    assert len(segs) == 32
    batches = pack_bm25(segs, 8, texts=texts, seed=0)
    _assert_partition(batches, 32)
    assert [len(b) for b in batches] == [8, 8, 8, 8]
    assert batch_purity(batches, labels) >= 0.9
    rand = np.mean([batch_purity(pack_random(segs, 8, seed=s), labels) for s in range(5)])
    assert rand <= 0.55


def test_bm25_packing_is_topic_pure_on_token_ids() -> None:
    """Without texts the index is built over token ids; common words are not removed, IDF down-weights them."""
    texts, labels = _toy_corpus(seed=1)
    segs = segment_documents(_word_ids(texts), 64)
    for seed in range(3):
        batches = pack_bm25(segs, 8, seed=seed)
        _assert_partition(batches, 32)
        assert batch_purity(batches, labels) >= 0.9


def test_bm25_packing_deterministic_and_seeded() -> None:
    texts, _ = _toy_corpus(seed=2, per_topic=10)
    segs = segment_documents(_word_ids(texts), 5)  # several segments per text, partial last batch
    a = pack_bm25(segs, 6, seed=7)
    _assert_partition(a, len(segs))
    assert all(len(b) == 6 for b in a[:-1])
    assert a == pack_bm25(segs, 6, seed=7)
    assert a != pack_bm25(segs, 6, seed=8)


def test_bm25_neighbors_rank_by_overlap() -> None:
    docs = [np.array(x) for x in ([1, 2, 3, 4], [1, 2, 3, 9], [1, 7, 8, 9], [20, 21, 22, 23])]
    nb = bm25_neighbors(segment_documents(docs, 4), k=3)
    assert nb[0, 0] == 1  # shares 3 terms with segment 0
    assert 0 not in nb[0]  # never itself
    assert (nb[3] == -1).all()  # shares no term with anyone
    assert 3 not in nb[:3]


def test_chain_order_follows_algorithm_1() -> None:
    # 0 -> 2 -> 1 -> (0 used) -> random among unused {3, 4}; 3 -> 4
    nb = np.array([[2, 1], [0, -1], [1, 0], [4, -1], [-1, -1]])
    for seed in range(10):
        order = chain_order(nb, seed=seed)
        assert sorted(order) == list(range(5))
        for x, y in zip(order, order[1:], strict=False):
            nxt = [j for j in nb[x] if j >= 0 and j not in order[: order.index(x) + 1]]
            if nxt:
                assert y == nxt[0]


def test_empty_inputs() -> None:
    assert segment_documents([], 4) == []
    assert pack_bm25([], 4) == []
    assert pack_consecutive([], 4, 2) == []
    seg = Segment(0, 0, 0, 1, np.array([5]))
    assert pack_bm25([seg], 4) == [[0]]


def test_bm25_query_term_cap() -> None:
    texts, labels = _toy_corpus(seed=3)
    segs = segment_documents(_word_ids(texts), 64)
    full = bm25_neighbors(segs, k=5, max_query_terms=None)
    capped = bm25_neighbors(segs, k=5, max_query_terms=3)
    assert full.shape == capped.shape == (32, 5)
    lab = np.asarray(labels)
    assert (lab[full[:, 0]] == lab).all()  # the nearest neighbour is on the same topic
    assert (lab[capped[:, 0]] == lab).mean() >= 0.9  # 3 rare terms still find the topic
    _assert_partition(pack_bm25(segs, 8, max_query_terms=None), 32)
    with pytest.raises(MemlmError):
        bm25_neighbors(segs, max_query_terms=0)
