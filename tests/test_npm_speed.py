"""NPM inference fast paths == the loops they replaced: candidate spans, one search for q_start and q_end,
verbalizer matching, memoised decoding, plain-array index columns."""

from __future__ import annotations

import math

import faiss
import numpy as np
import pytest

from memlm.errors import MemlmError
from memlm.models.resources import load_encoder
from memlm.npm import inference as inf
from memlm.npm.phrase_index import PhraseIndex

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


def reference_group(pi, tok, spans, log_scores, top):
    """NPM's open-set output written from the paper (Min et al. 2023, Sec. 3.1 / App. A.1), one span at a time: a
    candidate span's phrase is the text of its tokens; a phrase's score is the sum of exp(score) over its spans, its
    probability that score over the sum for all candidates; phrases ranked by score (ties by text), each with its spans
    best first (stable in row order)."""
    by_phrase: dict[str, list[tuple[int, int, float]]] = {}
    for (i, j), ls in zip(np.asarray(spans).tolist(), np.asarray(log_scores, dtype=np.float64).tolist(), strict=True):
        text = tok.decode([int(t) for t in pi.token_ids[i : j + 1]]).strip()
        by_phrase.setdefault(text, []).append((i, j, ls))
    total = math.fsum(math.exp(ls) for rows in by_phrase.values() for _, _, ls in rows)
    score = {text: math.fsum(math.exp(ls) for _, _, ls in rows) for text, rows in by_phrase.items()}
    ranked = sorted(by_phrase, key=lambda text: (-score[text], text))
    out = []
    for text in ranked[:top] if top is not None else ranked:
        hits = sorted(by_phrase[text], key=lambda h: -h[2])  # sorted() is stable: equal scores stay in row order
        spans_of = [(i, j, pi.doc_ids[int(pi.doc[i])], int(pi.position[i]), math.exp(ls), pi.context(tok, i, j, 32))
                    for i, j, ls in hits]  # fmt: skip
        out.append((text, score[text], score[text] / total, spans_of))
    return out


def assert_same_predictions(got, want, rel=1e-5):
    """Same phrases, order, spans and contexts; scores equal to float32's precision (memlm scores in float32, the
    reference in float64)."""
    assert [p.phrase for p in got] == [w[0] for w in want]
    for p, (_, score, prob, hits) in zip(got, want, strict=True):
        assert p.score == pytest.approx(score, rel=rel) and p.prob == pytest.approx(prob, rel=rel)
        assert p.log_score == pytest.approx(math.log(score), rel=rel, abs=rel)
        assert [(h.start, h.end, h.doc_id, h.position, h.context) for h in p.spans] == [h[:4] + h[5:] for h in hits]
        assert [h.score for h in p.spans] == pytest.approx([h[4] for h in hits], rel=rel)


def reference_predict_phrases(pi, tok, q_s, q_e, k, l_max, rows=None, top=None):
    """App. A.1 with the loops the fast path replaced: two searches, the span loop, the per-span grouping above."""
    _, starts = inf.retrieve(pi, q_s, k, rows)
    _, ends = inf.retrieve(pi, q_e, k, rows)
    spans = loop_candidate_spans(pi, starts, ends, l_max)
    if rows is not None and len(spans):
        allowed = set(np.asarray(rows).tolist())
        spans = np.array([s for s in spans.tolist() if s[0] in allowed and s[1] in allowed], dtype=np.int64)
    scale = 1.0 / math.sqrt(D)  # sim = q . c / sqrt(h), span score = sim(q_start, c_i) + sim(q_end, c_j) (A.1)
    vec, qs, qe = (np.asarray(a, dtype=np.float64) for a in (pi.vectors, q_s, q_e))
    logs = [float(vec[i] @ qs) * scale + float(vec[j] @ qe) * scale for i, j in spans.tolist()]
    return reference_group(pi, tok, spans.reshape(-1, 2), logs, top)


@pytest.mark.parametrize("seed", range(3))
def test_predict_phrases_equals_old_path(tok, seed):
    pi = random_index(tok, n_blocks=20, seed=seed)
    rng = np.random.default_rng(seed)
    q_s, q_e = (rng.normal(scale=3.0, size=D).astype(np.float32) for _ in range(2))
    rows = pi.block_rows([1, 2, 5])
    for k, l_max, r, top in ((5, 3, None, None), (len(pi), 10, None, 3), (9, 4, rows, None), (4, 2, rows, 1)):
        want = reference_predict_phrases(pi, tok, q_s, q_e, k, l_max, r, top)
        assert want and (top is not None or sum(len(w[3]) for w in want) > len(want))  # some phrase has 2+ spans
        for _ in range(2):  # the second call reads the decode cache
            assert_same_predictions(inf.predict_phrases(pi, tok, q_s, q_e, k, l_max, rows=r, top=top), want)
    # NPM SINGLE (App. A.3): each retrieved token is a one-token span scored by sim(q, c)
    sims, ids = inf.retrieve(pi, q_s, 11)
    want = reference_group(pi, tok, np.stack([ids, ids], 1), sims.astype(np.float64), None)
    assert_same_predictions(inf.predict_tokens(pi, tok, q_s, k=11, top=None), want)


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
    dec = inf.cached_decoder(tok)
    assert inf.cached_decoder(tok) is dec and inf.cached_decoder(dec) is dec
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
