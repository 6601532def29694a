"""NPM inference: phrase index build/resume/refusal, span assembly and scoring, NPM SINGLE, closed set, BM25."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from transformers import BertConfig, BertModel

from memlm.errors import MemlmError
from memlm.models.resources import load_encoder
from memlm.npm import inference as inf
from memlm.npm import phrase_index as pix
from memlm.npm.phrase_index import PhraseIndex, build_phrase_index

D = 8


@pytest.fixture(scope="module")
def tok():
    return load_encoder("minilm-l6")[1]


def tiny_bert(tok, seed=0):
    torch.manual_seed(seed)
    cfg = BertConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=64)  # fmt: skip
    model = BertModel(cfg).eval()
    model.config.memlm_name = f"tiny-bert-{seed}"
    return model


def toy_index(tok, texts):
    """One block per text; vectors: 'new' -> e0, 'city' -> e1, other tokens small random."""
    ids, block = [], []
    for b, t in enumerate(texts):
        enc = tok(t, add_special_tokens=False)["input_ids"]
        ids += enc
        block += [b] * len(enc)
    rng = np.random.default_rng(0)
    vec = rng.normal(scale=0.01, size=(len(ids), D)).astype(np.float32)
    new, city = tok.convert_tokens_to_ids(["new", "city"])
    for r, t in enumerate(ids):
        if t == new:
            vec[r, 0] = 1.0
        if t == city:
            vec[r, 1] = 1.0
    return PhraseIndex.from_arrays(vec, ids, block=block), np.array(ids)


def q(axis, scale=20.0):
    v = np.zeros(D, dtype=np.float32)
    v[axis] = scale
    return v


TEXTS = ["i moved to new york city last year", "the old road to new york city is long", "a cat sat on the mat"]


def test_exact_multitoken_span_and_sum_per_phrase(tok):
    pi, ids = toy_index(tok, TEXTS)
    preds = inf.predict_phrases(pi, tok, q(0), q(1), k=4, l_max=5, top=None)
    best = preds[0]
    assert best.phrase == "new york city"
    assert len(best.spans) == 2 and {h.doc_id for h in best.spans} == {"0", "1"}
    # score = sum over the two occurrences of exp(sim(q_s, c_i) + sim(q_e, c_j)) (App. A.1), sim = q.c / sqrt(D)
    want = 0.0
    for h in best.spans:
        assert pi.span_text(tok, h.start, h.end) == "new york city"
        s = float(pi.vectors[h.start] @ q(0)) / math.sqrt(D) + float(pi.vectors[h.end] @ q(1)) / math.sqrt(D)
        assert h.score == pytest.approx(math.exp(s), rel=1e-5)
        want += math.exp(s)
    assert best.score == pytest.approx(want, rel=1e-5)
    assert sum(p.prob for p in preds) == pytest.approx(1.0)
    assert "[[new york city]]" in best.spans[0].context
    # the "sum" reading of §3.1 ranks the same phrase first
    assert inf.predict_phrases(pi, tok, q(0), q(1), k=4, l_max=5, combine="sum")[0].phrase == "new york city"


def test_candidate_set_lmax_and_blocks(tok):
    pi, _ = toy_index(tok, TEXTS)
    _, starts = inf.retrieve(pi, q(0), 2)
    _, ends = inf.retrieve(pi, q(1), 2)
    spans = inf.candidate_spans(pi, starts, ends, l_max=2)
    assert len(spans) and all(j - i + 1 <= 2 for i, j in spans)
    assert all(pi.same_block(int(i), int(j)) for i, j in spans)
    assert all(int(i) in set(starts) or int(j) in set(ends) for i, j in spans)
    preds = inf.predict_phrases(pi, tok, q(0), q(1), k=2, l_max=2, top=None)
    assert "new york city" not in {p.phrase for p in preds}
    # a span never crosses a block: the last token of block 0 and the first of block 1 never pair up
    big = inf.candidate_spans(pi, np.arange(len(pi)), [], l_max=50)
    assert all(pi.block[i] == pi.block[j] for i, j in big)


def test_single_tokens_sum_per_string(tok):
    pi, ids = toy_index(tok, TEXTS)
    preds = inf.predict_tokens(pi, tok, q(0), k=3, top=None)
    assert preds[0].phrase == "new" and len(preds[0].spans) == 2
    sims = [float(pi.vectors[h.start] @ q(0)) / math.sqrt(D) for h in preds[0].spans]
    assert preds[0].score == pytest.approx(sum(math.exp(s) for s in sims), rel=1e-5)


def test_closed_set(tok):
    pi, _ = toy_index(tok, TEXTS)
    verb = {"place": ["New York City", "NYC"], "animal": ["cat", "dog"]}
    res = inf.closed_set(pi, tok, verb, q(0), q(1), k=8, l_max=4)
    assert res.matched and res.label == "place"
    assert sum(res.probs.values()) == pytest.approx(1.0)
    # tau = 5: log score of "place" = logsumexp over both occurrences of (sim_s + sim_e) / 5
    spans = [(i, j) for i, j in inf.candidate_spans(pi, *[inf.retrieve(pi, v, 8)[1] for v in (q(0), q(1))], 4)
             if pi.span_text(tok, i, j) == "new york city"]  # fmt: skip
    logs = inf.span_log_scores(pi, np.array(spans), q(0), q(1), tau=5.0)
    assert res.log_scores["place"] == pytest.approx(float(np.logaddexp.reduce(logs)), rel=1e-6)
    single = inf.closed_set(pi, tok, {"a": ["cat"], "b": ["mat", "rug"]}, q(0), None, k=len(pi))
    assert single.matched and sum(single.probs.values()) == pytest.approx(1.0)
    none = inf.closed_set(pi, tok, {"x": ["zebra"], "y": ["giraffe"]}, q(0), q(1), k=4)
    assert not none.matched and none.probs == {"x": 0.5, "y": 0.5}


def test_closed_set_matches_exact_token_ids(tok):
    """App. A.4 scores c with I[c in f(y)] on tokens: "music ." / ", film" / "( politics )" and the word piece
    "##film" of "microfilm" are not verbalizer hits (the old rule compared normalised decoded text and counted them)."""
    texts = ["she likes music . a lot", "a new , film by him", "talk ( politics ) here", "old microfilm archive"]
    pi, ids = toy_index(tok, texts)
    verb = {"ent": ["music", "film"], "pol": ["Politics"]}  # upper case: the uncased WordPiece has one id
    want = {(tok.convert_tokens_to_ids("music"),): "ent", (tok.convert_tokens_to_ids("film"),): "ent",
            (tok.convert_tokens_to_ids("politics"),): "pol"}  # fmt: skip
    assert inf.verbalizer_sequences(tok, verb) == want
    rng = np.random.default_rng(3)
    qs, qe = rng.normal(scale=30.0, size=D).astype(np.float32), rng.normal(scale=30.0, size=D).astype(np.float32)
    block = np.asarray(pi.block)
    every = [(i, j) for i in range(len(pi)) for j in range(i, min(i + 3, len(pi))) if block[i] == block[j]]
    old_hits = [(i, j) for i, j in every if inf.normalize_text(tok.decode(ids[i : j + 1].tolist())) in
                {"music", "film", "politics"}]  # fmt: skip
    for single in (False, True):
        res = inf.closed_set(pi, tok, verb, qs, None if single else qe, k=len(pi), l_max=3)
        spans = [(i, i) for i in range(len(pi))] if single else every  # k = every row: C~* is every short span
        hits = {"ent": [], "pol": []}
        for i, j in spans:
            y = want.get(tuple(int(t) for t in ids[i : j + 1]))
            if y is not None:
                s = float(pi.vectors[i].astype(np.float32) @ qs) / math.sqrt(D)
                if not single:
                    s += float(pi.vectors[j].astype(np.float32) @ qe) / math.sqrt(D)
                hits[y].append(s / 5.0)
        assert len(hits["ent"]) == 2 and len(hits["pol"]) == 1  # "music", "film"; not "##film"
        assert len([h for h in old_hits if not single or h[0] == h[1]]) > 3  # the fixture holds the old false hits
        for y in ("ent", "pol"):
            assert res.log_scores[y] == pytest.approx(float(np.logaddexp.reduce(hits[y])), rel=1e-5)
    with pytest.raises(MemlmError, match="both"):
        inf.verbalizer_sequences(tok, {"a": ["Film"], "b": ["film"]})


def test_bm25_restriction(tok):
    pi, _ = toy_index(tok, TEXTS)
    blocks = pi.bm25_blocks(tok, "the old road is long", n=1)
    assert blocks == [1]
    rows = inf.restrict_rows(pi, tok, "the old road [MASK] is long", 1)
    preds = inf.predict_phrases(pi, tok, q(0), q(1), k=8, l_max=5, rows=rows, top=None)
    assert preds[0].phrase == "new york city"
    assert all(pi.block[h.start] == 1 and pi.block[h.end] == 1 for p in preds for h in p.spans)


DOCS = ["new york city is a big city in the united states", "she moved to new york city in may",
        "the cat sat on the mat near the door of the house", "paris is the capital of france"]  # fmt: skip


def test_build_resume_refuse_and_predict(tok, tmp_path, monkeypatch):
    model = tiny_bert(tok)
    ref = build_phrase_index(model, tok, DOCS, tmp_path / "ref", max_length=8, batch_size=2)
    assert ref.manifest["block_tokens"] == 6 and len(ref) == sum(len(tok(d)["input_ids"]) - 2 for d in DOCS)
    assert ref.vectors.dtype == np.float16 and ref.manifest["index"]["factory"] == "Flat"

    calls = {"n": 0}
    real = pix.encode_sequences

    def flaky(*a, **kw):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real(*a, **kw)

    monkeypatch.setattr(pix, "encode_sequences", flaky)
    with pytest.raises(KeyboardInterrupt):
        build_phrase_index(model, tok, DOCS, tmp_path / "idx", max_length=8, batch_size=2)
    monkeypatch.setattr(pix, "encode_sequences", real)
    with pytest.raises(MemlmError, match="unfinished"):
        PhraseIndex.open(tmp_path / "idx")
    with pytest.raises(MemlmError, match="other settings"):
        build_phrase_index(tiny_bert(tok, 1), tok, DOCS, tmp_path / "idx", max_length=8, batch_size=2)
    got = build_phrase_index(model, tok, DOCS, tmp_path / "idx", max_length=8, batch_size=2)
    for name in ("vectors", "token_ids", "doc", "position", "block"):
        assert np.array_equal(np.asarray(getattr(got, name)), np.asarray(getattr(ref, name))), name

    other = tiny_bert(tok, 1)
    with pytest.raises(MemlmError, match="encoder"):
        PhraseIndex.open(tmp_path / "idx", other, tok)
    with pytest.raises(MemlmError, match="encoder"):
        inf.npm_predict(other, tok, got, "she lives in [MASK] now")
    with pytest.raises(MemlmError, match="encoder"):
        build_phrase_index(other, tok, DOCS, tmp_path / "idx", max_length=8)

    pi = PhraseIndex.open(tmp_path / "idx", model, tok)
    preds = inf.npm_predict(model, tok, pi, "she lives in [MASK] now", k=8, l_max=3, top=None)
    assert preds and all(h.end - h.start < 3 and pi.same_block(h.start, h.end) for p in preds for h in p.spans)
    assert sum(p.prob for p in preds) == pytest.approx(1.0)
    single = inf.npm_single_predict(model, tok, pi, "she lives in [MASK] now", k=5)
    assert single and all(len(p.spans[0].context) > 0 for p in single)
    res = inf.npm_classify(model, tok, pi, "the [MASK] sat on the mat", {"animal": ["cat"], "city": ["paris"]}, k=64)
    assert sum(res.probs.values()) == pytest.approx(1.0)
    rows = inf.restrict_rows(pi, tok, "capital of france [MASK]", 1)
    allowed = set(rows.tolist())
    preds = inf.npm_predict(model, tok, pi, "the capital of france is [MASK]", k=8, bm25_passages=1, top=None)
    assert preds and all(h.start in allowed and h.end in allowed for p in preds for h in p.spans)
    with pytest.raises(MemlmError, match="exactly one"):
        inf.npm_predict(model, tok, pi, "no mask here")
