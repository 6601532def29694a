"""NPM inference fast paths == the loops they replaced (issue 14): candidate spans, one search for q_start and q_end,
verbalizer matching, memoised decoding, plain-array index columns."""

from __future__ import annotations

import math

import faiss
import numpy as np
import pytest

from memlm.errors import MemlmError
from memlm.npm import inference as inf
from memlm.npm.phrase_index import PhraseIndex
from memlm.resources import load_encoder

D = 16


@pytest.fixture(scope="module")
def tok():
    return load_encoder("minilm-l6")[1]


TEXT = ("new york city is the largest city in the united states . it is a global center of finance , the arts and "
        "media . the old microfilm archive holds music and film , politics and sport . ") * 4  # fmt: skip


def random_index(tok, n_blocks=9, seed=0, faiss_index=None):
    """Blocks of random lengths (1 .. 40 tokens, some of one token) cut from TEXT, random vectors."""
    rng = np.random.default_rng(seed)
    ids = tok(TEXT, add_special_tokens=False)["input_ids"]
    tokens, block = [], []
    for b in range(n_blocks):
        n = int(rng.integers(1, 41)) if b % 4 else 1
        s = int(rng.integers(0, len(ids) - n))
        tokens += ids[s : s + n]
        block += [b] * n
    vec = rng.normal(size=(len(tokens), D)).astype(np.float32)
    pi = PhraseIndex.from_arrays(vec, tokens, block=block)
    if faiss_index is not None:
        faiss_index.train(vec)
        faiss_index.add(vec)
        pi._faiss = faiss_index
    return pi


def loop_candidate_spans(pi, starts, ends, l_max):
    """The set-building loop candidate_spans used before it was vectorised."""
    n = len(pi)
    block = np.asarray(pi.block)
    out: set[tuple[int, int]] = set()
    for s in {int(x) for x in starts}:
        for j in range(s, min(s + l_max, n)):
            if block[j] != block[s]:
                break
            out.add((s, j))
    for e in {int(x) for x in ends}:
        for i in range(e, max(e - l_max, -1), -1):
            if block[i] != block[e]:
                break
            out.add((i, e))
    return np.array(sorted(out), dtype=np.int64).reshape(-1, 2)


@pytest.mark.parametrize("seed", range(4))
def test_candidate_spans_equals_loop(tok, seed):
    pi = random_index(tok, seed=seed)
    n = len(pi)
    rng = np.random.default_rng(seed + 10)
    for l_max in (1, 2, 3, 10, 50):
        for size in (0, 1, 5, n // 3, n):
            starts = rng.integers(0, n, size=size)
            ends = rng.integers(0, n, size=int(rng.integers(0, n + 1)))
            want = loop_candidate_spans(pi, starts, ends, l_max)
            got = inf.candidate_spans(pi, starts, ends, l_max)
            assert got.dtype == want.dtype and got.shape == want.shape and np.array_equal(got, want)
    with pytest.raises(MemlmError, match="rows of the phrase index"):
        inf.candidate_spans(pi, [n], [], 3)


@pytest.mark.parametrize("kind", ["flat", "ivf"])
def test_retrieve_batch_equals_one_query_at_a_time(tok, kind):
    index = None if kind == "flat" else faiss.IndexIVFFlat(faiss.IndexFlatIP(D), D, 4, faiss.METRIC_INNER_PRODUCT)
    pi = random_index(tok, n_blocks=30, seed=1, faiss_index=index)
    if index is not None:
        index.nprobe = 2
    rng = np.random.default_rng(2)
    qs = [rng.normal(size=D).astype(np.float32) for _ in range(3 if kind == "flat" else 45)]  # > the BLAS threshold
    rows = np.arange(5, len(pi) - 7)
    for k in (1, 7, len(pi) + 3):
        for r in (None, rows, np.zeros(0, dtype=np.int64)):
            got = inf.retrieve_batch(pi, qs, k, r)
            for q, (s, i) in zip(qs, got, strict=True):
                # the old retrieve: one search of one [1, D] query
                sc, ids = pi.search(q[None], k) if r is None else _old_search_rows(pi, q[None], r, k)
                keep = ids[0] >= 0
                assert np.array_equal(i, ids[0][keep]) and np.array_equal(s, sc[0][keep] / math.sqrt(D))
            s1, i1 = inf.retrieve(pi, qs[0], k, r)
            assert np.array_equal(s1, got[0][0]) and np.array_equal(i1, got[0][1])


def _old_search_rows(pi, q, rows, k):
    out_s = np.full((1, k), -np.inf, dtype=np.float32)
    out_i = np.full((1, k), -1, dtype=np.int64)
    if rows.size == 0:
        return out_s, out_i
    scores = q @ np.asarray(pi.vectors[rows], dtype=np.float32).T
    kk = min(k, rows.size)
    top = np.argsort(-scores, axis=1, kind="stable")[:, :kk]
    out_s[:, :kk] = np.take_along_axis(scores, top, axis=1)
    out_i[:, :kk] = rows[top]
    return out_s, out_i


def old_predict_phrases(pi, tok, q_s, q_e, k, l_max, rows=None, top=None, contexts=True):
    """predict_phrases before issue 14: two searches, the span loop, the plain tokenizer."""
    _, starts = inf.retrieve(pi, q_s, k, rows)
    _, ends = inf.retrieve(pi, q_e, k, rows)
    spans = loop_candidate_spans(pi, starts, ends, l_max)
    if rows is not None and len(spans):
        allowed = np.zeros(len(pi), dtype=bool)
        allowed[np.asarray(rows, dtype=np.int64)] = True
        spans = spans[allowed[spans[:, 0]] & allowed[spans[:, 1]]]
    return inf._group(pi, tok, spans, inf.span_log_scores(pi, spans, q_s, q_e), top, contexts, 32)


@pytest.mark.parametrize("seed", range(3))
def test_predict_phrases_equals_old_path(tok, seed):
    pi = random_index(tok, n_blocks=20, seed=seed)
    rng = np.random.default_rng(seed)
    q_s, q_e = (rng.normal(scale=3.0, size=D).astype(np.float32) for _ in range(2))
    rows = pi.block_rows([1, 2, 5])
    for k, l_max, r, top in ((5, 3, None, None), (len(pi), 10, None, 3), (9, 4, rows, None), (4, 2, rows, 1)):
        for _ in range(2):  # the second call reads the decode cache
            got = inf.predict_phrases(pi, tok, q_s, q_e, k, l_max, rows=r, top=top)
            assert got == old_predict_phrases(pi, tok, q_s, q_e, k, l_max, r, top)
    # NPM SINGLE goes through the same grouping
    got = inf.predict_tokens(pi, tok, q_s, k=11, top=None)
    sims, ids = inf.retrieve(pi, q_s, 11)
    assert got == inf._group(pi, tok, np.stack([ids, ids], 1), sims.astype(np.float64), None, True, 32)


def old_closed_set_scores(pi, tok, verbalizers, q_s, q_e, k, l_max, tau, rows=None):
    keys = inf.verbalizer_sequences(tok, verbalizers)
    if q_e is None:
        sims, ids = inf.retrieve(pi, q_s, k, rows)
        spans = np.stack([ids, ids], axis=1) if len(ids) else np.zeros((0, 2), dtype=np.int64)
        logs = sims.astype(np.float64) / tau
    else:
        _, starts = inf.retrieve(pi, q_s, k, rows)
        _, ends = inf.retrieve(pi, q_e, k, rows)
        spans = loop_candidate_spans(pi, starts, ends, l_max)
        if rows is not None and len(spans):
            allowed = np.zeros(len(pi), dtype=bool)
            allowed[np.asarray(rows, dtype=np.int64)] = True
            spans = spans[allowed[spans[:, 0]] & allowed[spans[:, 1]]]
        logs = inf.span_log_scores(pi, spans, q_s, q_e, "a1", tau)
    per_label: dict[str, list[float]] = {label: [] for label in verbalizers}
    for (i, j), ls in zip(spans.tolist(), logs.tolist(), strict=True):
        label = keys.get(tuple(int(t) for t in pi.token_ids[i : j + 1]))
        if label is not None:
            per_label[label].append(ls)
    return {y: float(np.logaddexp.reduce(v)) if v else -math.inf for y, v in per_label.items()}


@pytest.mark.parametrize("seed", range(3))
def test_closed_set_equals_old_loop(tok, seed):
    pi = random_index(tok, n_blocks=24, seed=seed)
    rng = np.random.default_rng(seed)
    q_s, q_e = (rng.normal(scale=3.0, size=D).astype(np.float32) for _ in range(2))
    verb = {"place": ["New York City", "united states", "city"], "culture": ["music", "film", "the arts"],
            "other": ["politics", "sport", "zebra crossing"]}  # fmt: skip
    for single in (False, True):
        for k, r in ((len(pi), None), (7, None), (len(pi), pi.block_rows([0, 3, 4]))):
            q_end = None if single else q_e
            res = inf.closed_set(pi, tok, verb, q_s, q_end, k=k, l_max=4, tau=5.0, rows=r)
            old = old_closed_set_scores(pi, tok, verb, q_s, q_end, k, 4, 5.0, r)
            # core.distribution's per-value logsumexp sums in another order than np.logaddexp.reduce: equal to 1e-12
            assert res.log_scores.keys() == old.keys()
            for y, v in old.items():
                assert res.log_scores[y] == pytest.approx(v, rel=1e-12, abs=1e-12) or v == res.log_scores[y] == -np.inf


def test_cached_decode_is_the_tokenizer(tok):
    dec = inf._cached_decode(tok)
    assert inf._cached_decode(tok) is dec and inf._cached_decode(dec) is dec
    ids = tok(TEXT, add_special_tokens=False)["input_ids"]
    for s in range(0, 60, 3):
        for n in (1, 2, 5):
            assert dec.decode(ids[s : s + n]) == tok.decode(ids[s : s + n])
            assert dec.decode(np.array(ids[s : s + n], dtype=np.int32)) == tok.decode(ids[s : s + n])
    assert dec.decode(ids[:4], skip_special_tokens=True) == tok.decode(ids[:4], skip_special_tokens=True)
    assert dec.mask_token == tok.mask_token and dec.convert_ids_to_tokens(ids[:3]) == tok.convert_ids_to_tokens(ids[:3])
    small = inf._CachedDecode(tok, max_entries=2)
    assert [small.decode([t]) for t in ids[:5]] == [tok.decode([t]) for t in ids[:5]]
    assert len(small._texts) <= 2 and len(small._old) <= 2
    assert small.decode([ids[3]]) == tok.decode([ids[3]]) and (ids[3],) in small._texts  # an old-generation hit moves


def test_open_gives_plain_arrays(tok, tmp_path):
    from transformers import BertConfig, BertModel

    from memlm.npm.phrase_index import build_phrase_index

    cfg = BertConfig(vocab_size=len(tok), hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=32, max_position_embeddings=32)  # fmt: skip
    model = BertModel(cfg).eval()
    model.config.memlm_name = "tiny"
    build_phrase_index(model, tok, ["new york city is big", "paris is in france"], tmp_path / "i", max_length=8)
    pi = PhraseIndex.open(tmp_path / "i")
    for name in ("vectors", "token_ids", "doc", "position", "block"):
        a = getattr(pi, name)
        assert type(a) is np.ndarray and not a.flags.writeable, name
    assert np.array_equal(pi.token_ids, np.fromfile(tmp_path / "i" / "token_ids.bin", dtype=np.int32))
