"""The ∞-gram's end-of-text rule, effective n and next-token counts against brute-force scans written from the paper
(Liu et al. 2024, Sec. 3): a literal EOS inside a document is one of its tokens in the index and in the query (no
matched suffix spans two documents), and P∞ over the vocabulary is exact where the engine samples (a suffix seen more
than ``max_support`` times), or says what it left out."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

pytest.importorskip("infini_gram")

from conftest import Doc, gpt2_tokenizer  # noqa: E402
from test_ngram import Brute, _check, _ids  # noqa: E402

from memlm.ngram.index import build_ngram_index  # noqa: E402
from memlm.ngram.memory import NgramMemory  # noqa: E402

COLOURS = (
    "red green blue black white brown pink gray gold silver big small old new hot cold fast slow good bad tall "
    "short long wide high low dark light soft hard dry wet rich poor full empty clean quiet loud safe"
).split()
EOT = "<|endoftext|>"  # GPT-2's EOS, typed into the text: the tokenizer reads it as the EOS id


@pytest.fixture(scope="module")
def tok():
    return gpt2_tokenizer()


def _per_document_follow(docs_tokens: list[list[int]], suffix: list[int], eos: int, start: int) -> list[int]:
    """What follows each occurrence of ``suffix`` inside one document (``[start, *tokens]``, searched one document at
    a time, so nothing can span two), EOS at a document's end."""
    out = []
    for d in docs_tokens:
        seq = [start, *d]
        for i in range(len(seq) - len(suffix) + 1):
            if seq[i : i + len(suffix)] == suffix:
                j = i + len(suffix)
                out.append(seq[j] if j < len(seq) else eos)
    return out


def test_literal_eos_inside_documents_is_cut_the_same_way_in_index_and_query(tok, tmp_path):
    """Documents with a literal end-of-text token inside, in the index and in the scored text: every target's
    count, P∞, effective n and sparse flag equal a brute force that searches each reference document alone (so a
    suffix crossing a document boundary is impossible in it), and the longest suffix never spans two documents: e.g.
    after "... a lake" + EOS + "North wind blew" the old query (EOS read as a document start inside the query) matched
    the end of one reference document followed by the start of the next."""
    eos = tok.eos_token_id
    assert _ids(tok, f"a{EOT}b")[1] == eos  # the literal is the EOS id in the index's and the query's tokens
    rng = random.Random(0)
    words = "the a river park bird sang ran dog cat lake north wind blew over under".split()
    docs = [Doc(f"r{i}", " ".join(rng.choice(words) for _ in range(rng.randint(3, 15)))) for i in range(30)]
    docs += [Doc("end", "we walked by the quiet lake"), Doc("next", "North wind blew cold"),
             Doc("inner", f"the quiet lake{EOT}North wind blew warm"), Doc("tail", f"sang ran{EOT}")]  # fmt: skip
    ix = build_ngram_index(tok, docs, tmp_path / "ix", progress=False)
    memory = NgramMemory(ix)
    brute = Brute(tok, docs)
    queries = [f"by the quiet lake{EOT}North wind blew cold{EOT}", f"{EOT}the quiet lake{EOT}North wind",
               f"sang ran{EOT}the dog", "we walked by the quiet lake"]  # fmt: skip
    pick = rng.choice
    queries += [f"{pick(words)} {pick(words)}{EOT}{pick(words)} {pick(words)}" for _ in range(8)]
    toks = [np.array([*_ids(tok, q), eos]) for q in queries]
    got = _check(memory, brute, toks)  # count, P∞, effective n, sparse at every position
    # the same from a scan of each reference document on its own: no suffix spans two documents
    refs = [_ids(tok, d.text) for d in docs]
    start = -7
    i = 0
    for d in toks:
        for p in range(len(d)):
            q = [start, *map(int, d[:p])]
            length = max(n for n in range(len(q) + 1) if n == 0 or _per_document_follow(refs, q[len(q) - n :], eos,
                                                                                          start))  # fmt: skip
            nxt = _per_document_follow(refs, q[len(q) - length :], eos, start) if length else None
            if nxt is not None:
                assert got.count[i] == len(nxt)
                assert math.isclose(math.exp(got.logprob[i]), nxt.count(int(d[p])) / len(nxt), rel_tol=1e-6)
            i += 1
    # the crafted crossing: after "...lake<EOS>North wind" the longest suffix stays inside "inner"
    ids = _ids(tok, f"by the quiet lake{EOT}North wind blew cold")
    p = len(_ids(tok, f"by the quiet lake{EOT}North wind blew"))
    one = memory.score_documents([np.array(ids)], [np.array([p])])
    assert one.count[0] == 1 and one.logprob[0] == -math.inf  # only "inner" holds it, followed by "warm"


def test_search_applies_the_same_rule_and_drops_leading_padding(tok, tmp_path):
    """next_tokens (generation, lm_eval's greedy check): a context's leading EOS run (left padding, an empty
    context's prefix token) marks the document start; an EOS after it is the document's own token, as in
    score_documents; the row's effective n is the target's there."""
    eos = tok.eos_token_id
    docs = [Doc("a", f"one two three{EOT}four five"), Doc("b", "four five six"), Doc("c", "one two three four")]
    memory = NgramMemory(build_ngram_index(tok, docs, tmp_path / "ix", progress=False))
    brute = Brute(tok, docs)
    ctx = _ids(tok, f"one two three{EOT}four five")
    for padded in (ctx, [eos, eos, *ctx]):
        nt = memory.next_tokens([padded], k=16)
        r = nt.retrieved
        row = {int(v): round(math.exp(s)) for s, v in zip(r.scores[0], r.values[0], strict=True) if v >= 0}
        nxt = brute.follow([Brute.START, *ctx])  # the whole document so far, EOS inside it a token
        assert nxt and sum(row.values()) == len(nxt) and all(row[w] == nxt.count(w) for w in set(nxt))
        assert row == {eos: 1} and nt.sparse[0] and nt.missing[0] == 0.0  # only "a" holds it: it ends there
        scored = memory.score_documents([np.array([*ctx, eos])], [np.array([len(ctx)])])
        assert int(nt.retrieved.ids[0, 0]) == scored.n[0] == len(ctx) + 1


def _brute_counts(brute: Brute, context: list[int]) -> tuple[list[int], list[int]]:
    """(longest suffix of START + context that occurs, the tokens after its occurrences)."""
    ctx = [Brute.START, *context]
    for length in range(len(ctx), -1, -1):
        nxt = brute.follow(ctx[len(ctx) - length :]) if length else brute.follow_all()
        if nxt:
            return ctx[len(ctx) - length :], nxt
    raise AssertionError


def test_next_token_distribution_is_exact_past_max_support(tok, tmp_path):
    """A suffix seen more often than ``max_support`` (forced small): the engine samples its next-token counts;
    next_token_distribution gives P∞(w) = cnt(suffix · w) / cnt(suffix) for every w exactly (the brute-force scan),
    rare next tokens included, and the exact sparse flag; with more distinct next tokens than the recount takes, the
    listed tokens stay exact and the row says how much mass it left out."""
    from memlm.ngram.generate import next_token_distribution

    rng = random.Random(2)
    names = [f" {w}" for w in COLOURS]
    assert all(len(_ids(tok, w)) == 1 for w in names)
    docs = [Doc(f"d{i}", "the cat" + rng.choice(names[:6]) + " sat") for i in range(60)]  # 6 common continuations
    docs += [Doc(f"r{j}", "the cat" + names[6 + j]) for j in range(3)]  # and 3 rare ones (one occurrence each)
    docs += [Doc(f"m{j}", "a dog" + names[j]) for j in range(40)] + [Doc("m", "a dog" + "".join(names[:8]))]
    docs += [Doc(f"s{i}", "one more time") for i in range(30)]  # a sparse suffix seen 30 times
    memory = NgramMemory(build_ngram_index(tok, docs, tmp_path / "ix", progress=False))
    brute = Brute(tok, docs)
    vocab = len(tok)
    contexts = [_ids(tok, "the cat"), _ids(tok, "one more"), _ids(tok, "a dog")]
    memory.max_support = 8
    engine = memory.engine.infgram_ntd([memory.sep, *contexts[0]], max_support=8)
    assert engine["approx"]  # the engine samples here ...
    sampled = {int(t): r["cont_cnt"] for t, r in engine["result_by_token_id"].items()}
    _, nxt = _brute_counts(brute, contexts[0])
    assert sampled != {w: nxt.count(w) for w in set(nxt)}  # ... and its counts are not the true ones
    logp, sparse, nt = next_token_distribution(memory, contexts[:2], vocab)
    for row, ctx in enumerate(contexts[:2]):
        suffix, nxt = _brute_counts(brute, ctx)
        want = np.zeros(vocab)
        for w in set(nxt):
            want[w] = nxt.count(w) / len(nxt)
        np.testing.assert_allclose(logp[row].exp().numpy(), want, rtol=1e-6, atol=0)
        assert bool(sparse[row]) == (len(set(nxt)) == 1) and nt.count[row] == len(nxt)
        assert nt.sampled[row] and nt.missing[row] == 0.0
    assert nt.approximate() is None
    assert bool(sparse[1]) and not bool(sparse[0])
    # 40 distinct continuations of "a dog": the recount stops after max_support finds past the engine's sample
    logp, sparse, nt = next_token_distribution(memory, contexts[2:], vocab)
    suffix, nxt = _brute_counts(brute, contexts[2])
    p = logp[0].exp().numpy()
    listed = np.flatnonzero(p > 0)
    assert 0 < len(listed) < len(set(nxt)) and nt.missing[0] > 0
    for w in listed:
        assert math.isclose(p[w], nxt.count(w) / len(nxt), rel_tol=1e-6)
    assert math.isclose(1.0 - p.sum(), nt.missing[0], rel_tol=1e-5)
    assert nt.approximate()["rows"] == 1 and not bool(sparse[0])
    # k smaller than the number of next tokens: the rest is unassigned, not spread over the listed ones
    memory.max_support = 1000
    logp, _, nt = next_token_distribution(memory, contexts[:1], vocab, k=3)
    top = sorted(set(nxt := _brute_counts(brute, contexts[0])[1]), key=lambda w: (-nxt.count(w), w))[:3]
    np.testing.assert_allclose(logp[0].exp().numpy()[top], [nxt.count(w) / len(nxt) for w in top], rtol=1e-6)
    assert math.isclose(nt.missing[0], 1 - sum(nxt.count(w) for w in top) / len(nxt), rel_tol=1e-6)
    assert torch.isinf(logp[0]).sum() == vocab - 3


def test_lm_eval_ngram_reads_the_whole_request_and_marks_what_is_approximate(tiny_lm, tmp_path):
    """loglikelihood with a context longer than max_length: the LM reads the last max_length tokens, P∞ (and the
    sparse flag) the whole context, as the brute force over the whole context says; an empty context's prefix token
    is no part of the ∞-gram's document; a greedy check that left P∞ mass unassigned is counted in
    memory_settings["approximate"], and an exact one is not."""
    pytest.importorskip("lm_eval")
    from test_ngram import _brute_p_inf

    from memlm.lmeval.model import MemlmLM

    model, tok = tiny_lm
    long_doc = " ".join(COLOURS)  # 40 words, one token each
    docs = [
        Doc("long", long_doc),
        Doc("other", " ".join(COLOURS[15:25]) + " dog cat"),
        Doc("o2", " ".join(COLOURS[15:25]) + " bird"),
    ]  # the cut context's words, followed otherwise: fmt: skip
    ix = build_ngram_index(tok, docs, tmp_path / "ix", progress=False)
    brute = Brute(tok, docs)
    ls, ld = 0.6, 0.3
    lm = MemlmLM(model=model, tokenizer=tok, memories=str(ix.path), mixture=f"ngram={ls}/{ld}", window=64,
                 min_context=32, max_length=8)  # fmt: skip
    words = _ids(tok, long_doc)
    ctx, cont = words[:25], words[25:27]
    (ll, _), = lm._loglikelihood_tokens([(("x", "y"), ctx, cont)])  # fmt: skip
    seq = (ctx + cont)[-8:]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([seq])).logits[0].double()
    want = 0.0
    for j, pos in enumerate(range(len(seq) - 1 - len(cont), len(seq) - 1)):
        p_lm = torch.softmax(logits[pos], -1).numpy()
        p_inf, sparse = _brute_p_inf(brute, (ctx + cont)[: len(ctx) + j], len(p_lm))  # the whole context
        lam = ls if sparse else ld
        want += math.log((1 - lam) * p_lm[seq[pos + 1]] + lam * p_inf[seq[pos + 1]])
    assert ll == pytest.approx(want, rel=1e-5)
    cut = _brute_p_inf(brute, seq[:-2], len(tok))  # what the cut context would say: the long document not found
    assert cut[1] is False and _brute_p_inf(brute, ctx, len(tok))[1] is True
    assert lm.memory_settings["approximate"] is None
    # an empty context: lm_eval's prefix token (here EOS) is not a token of the ∞-gram's document
    first = _ids(tok, COLOURS[0])
    (ll0, _), = lm._loglikelihood_tokens([(("", COLOURS[0]), [lm.prefix_token_id], first)])  # fmt: skip
    with torch.no_grad():
        p_lm = torch.softmax(model(input_ids=torch.tensor([[lm.prefix_token_id]])).logits[0, 0].double(), -1).numpy()
    p_inf, sparse = _brute_p_inf(brute, [], len(p_lm))  # the document start
    lam = ls if sparse else ld
    assert ll0 == pytest.approx(math.log((1 - lam) * p_lm[first[0]] + lam * p_inf[first[0]]), rel=1e-5)
    # the greedy check over the vocabulary with a tiny recount budget: noted as approximate
    for m in lm.ngrams:
        m.max_support = 1
    lm._loglikelihood_tokens([(("x", "y"), _ids(tok, " ".join(COLOURS[20:25])), _ids(tok, " dog"))])
    note = lm.memory_settings["approximate"]
    assert note["loglikelihood greedy flag"]["requests"] == 1 and "max_support" in note["loglikelihood greedy flag"][
        "reason"]  # fmt: skip


def test_generation_step_reads_its_prefix_and_says_when_p_inf_was_approximate(tok, tmp_path):
    """The generation step: with a prefix (the context lm_eval cut off for the LM) its P∞ is that of prefix + row;
    its steps are counted, and those that left P∞ mass unassigned are reported (approximate(), approximation_note),
    an exact run reports nothing."""
    from memlm.mixing.component import Batch
    from memlm.ngram.generate import approximation_note, next_token_distribution
    from memlm.ngram.step import NgramComponent

    docs = [Doc(f"m{j}", "so a dog " + w) for j, w in enumerate(COLOURS)] + [Doc("x", "big red a dog " + COLOURS[3])]
    memory = NgramMemory(build_ngram_index(tok, docs, tmp_path / "ix", progress=False))
    step = NgramComponent(memory)
    row = torch.tensor([_ids(tok, " a dog")])
    batch = Batch(make_contexts=lambda: [row[0].tolist()], vocab=len(tok))
    step.step(batch)
    assert step.approximate() is None and approximation_note(step) is None and step.steps == 1
    step.set_prefix(_ids(tok, "big red"))
    p, _, sparse = step.step(batch)
    want, want_sparse, _ = next_token_distribution(memory, [_ids(tok, "big red a dog")], len(tok))
    assert _ids(tok, "big red a dog") == [*_ids(tok, "big red"), *row[0].tolist()]
    assert torch.equal(p, want) and bool(sparse[0]) and bool(want_sparse[0])  # only "x" continues the whole prefix
    memory.max_support = 2
    step.set_prefix(())
    step.step(batch)
    a = step.approximate()
    assert a["steps"] == 1 and a["of"] == 3 and 0 < a["max_missing_mass"] < 1
    assert "1 of 3" in approximation_note(step)
