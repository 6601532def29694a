"""NPM training objective for the shared trainer: loss = npm_contrastive_loss on captured vectors, batches."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from transformers import BertConfig, BertModel

from memlm.errors import MemlmError
from memlm.models.resources import load_encoder
from memlm.npm.loss import npm_contrastive_loss, npm_span_targets
from memlm.npm.objective import NpmObjective, npm_batches, npm_objective
from memlm.training.loop import TrainConfig, train

DOCS = [
    "new york city is a big city . many people live in new york city and work in new york city .",
    "the cat sat on the mat . the cat liked the mat and the cat slept on the mat all day .",
    "paris is the capital of france . paris has many museums and paris is visited by many people .",
    "the river runs through the old town . the old town has a river and a bridge over the river .",
]


@pytest.fixture(scope="module")
def tok():
    return load_encoder("minilm-l6")[1]


def tiny_bert(tok, seed=0):
    torch.manual_seed(seed)
    cfg = BertConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=64)  # fmt: skip
    return BertModel(cfg)


def first_batch(tok, seq_len=12, batch_size=4, seed=0):
    return next(iter(npm_batches(DOCS, tok, seq_len=seq_len, batch_size=batch_size, seed=seed)(0)))


def test_loss_equals_contrastive_on_captured_vectors(tok):
    model = tiny_bert(tok).train()
    obj = NpmObjective("npm", tok, budget=0.3)
    batch = first_batch(tok)
    torch.manual_seed(1)
    loss = obj(model, batch)
    torch.manual_seed(1)  # same dropout
    mb, masked, unmasked = obj.forward(model, batch)
    assert mb.all_spans, "the toy batch must mask something"
    for s in mb.all_spans:
        assert mb.input_ids[s.seq][s.mask_start] == tok.mask_token_id == mb.input_ids[s.seq][s.mask_end]
        assert s.mask_end == s.mask_start + 1
    seq, qs, qe, spos, epos, cand = npm_span_targets(mb, unmasked.shape[1])
    cands = unmasked.reshape(-1, unmasked.shape[2])
    want = npm_contrastive_loss(masked[seq, qs], cands, spos, cand) + npm_contrastive_loss(
        masked[seq, qe], cands, epos, cand
    )
    assert loss.item() == pytest.approx(want.item(), rel=1e-5)
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and any(float(g.abs().sum()) > 0 for g in grads)
    assert float(model.embeddings.word_embeddings.weight.grad[tok.mask_token_id].abs().sum()) > 0
    # masks are a function of (seed, batch): same batch -> same masking
    assert obj.mask(batch) == mb


def test_single_variant(tok):
    model = tiny_bert(tok).eval()
    obj = NpmObjective("npm-single", tok, budget=0.3)
    batch = first_batch(tok)
    loss = obj(model, batch)
    mb, masked, unmasked = obj.forward(model, batch)
    assert mb.all_spans and all(s.mask_start == s.mask_end and s.start == s.end for s in mb.all_spans)
    seq, qpos, _, pos, _, cand = npm_span_targets(mb, unmasked.shape[1])
    want = npm_contrastive_loss(masked[seq, qpos], unmasked.reshape(-1, unmasked.shape[2]), pos, cand)
    assert loss.item() == pytest.approx(want.item(), rel=1e-5)


def test_batches_grouped_and_deterministic(tok):
    b = npm_batches(DOCS, tok, seq_len=12, batch_size=3, seed=5)
    again = npm_batches(DOCS, tok, seq_len=12, batch_size=3, seed=5)
    assert b.plan(0) == again.plan(0) and b.plan(1) == again.plan(1)
    # the plan depends on the epoch and on the seed (both, not either)
    assert b.plan(0) != b.plan(1)
    assert b.plan(0) != npm_batches(DOCS, tok, seq_len=12, batch_size=3, seed=6).plan(0)
    # brute force of the documented rule: shuffle documents, lay out their sequences, cut, shuffle the batches
    for epoch in (0, 1, 2):
        rng = np.random.default_rng([5, epoch, 0x4E504D])
        order = [i for d in rng.permutation(len(b.doc_seqs)).tolist() for i in b.doc_seqs[d]]
        cut = [order[i : i + 3] for i in range(0, len(order), 3)]
        assert b.plan(epoch) == [cut[i] for i in rng.permutation(len(cut)).tolist()]
    for x, y in zip(b(1), again(1), strict=True):
        assert all(torch.equal(x[k], y[k]) for k in x)
    for plan in (b.plan(0), b.plan(3)):
        assert sorted(i for batch in plan for i in batch) == list(range(len(b.sequences)))
        # document order: every batch is a run of consecutive sequences of the epoch's document order
        for batch in plan:
            docs = [b.seq_doc[i] for i in batch]
            changes = sum(docs[r] != docs[r + 1] for r in range(len(docs) - 1))
            assert len(set(docs)) == changes + 1  # each document is one contiguous run (no interleaving)
    first = next(iter(b(0)))
    assert first["input_ids"].shape[1] <= 12 and int(first["input_ids"][0, 0]) == tok.cls_token_id
    with pytest.raises(MemlmError):
        npm_objective("npm", bogus=1)
    with pytest.raises(MemlmError):
        npm_objective("mlm")


@pytest.mark.parametrize("name", ["npm", "npm-single"])
def test_train_three_updates(tok, tmp_path, name):
    model = tiny_bert(tok)
    loss_fn, factory = npm_objective(name, seq_len=16, batch_size=4, seed=0, budget=0.3)
    batches = factory(DOCS, tok)
    cfg = TrainConfig(lr=1e-3, max_steps=3, batch_size=4, seq_len=16, warmup_steps=0, dtype="float32")
    res = train(model, cfg, batches, loss_fn=loss_fn, out_dir=tmp_path / name, warmup_loss=None, progress=False)
    assert len(res.losses) == 3 and all(math.isfinite(x) for x in res.losses)
