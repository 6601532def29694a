"""TRIME objectives and batches for the trainer: Eq. 5 vs a brute-force loop, gradients into memory, batch
determinism and grouping, short training runs with exact resume."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import gpt2_tokenizer, make_toy_docs
from transformers import GPT2Config, GPT2LMHeadModel

from memlm.errors import MemlmError
from memlm.models.keys import KeyCapture, KeySpec
from memlm.training.loop import TrainConfig, causal_lm_loss, train
from memlm.trime import TrimeBatches, TrimeObjective, trime_batches, trime_loss, trime_objective
from memlm.trime.batching import batch_purity
from memlm.trime.training import next_token_targets

V = 100


def tiny_model(seed: int = 0, dropout: float = 0.0) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    cfg = GPT2Config(
        n_layer=2,
        n_embd=32,
        n_head=2,
        vocab_size=V,
        n_positions=64,
        bos_token_id=0,
        eos_token_id=0,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
    )
    return GPT2LMHeadModel(cfg)


def token_docs(n: int = 12, seed: int = 0, low: int = 3, high: int = 40, vocab: int = 12) -> list[np.ndarray]:
    """Random documents over a small alphabet (ids 1..vocab), so that memory values often match targets."""
    rng = np.random.default_rng(seed)
    return [rng.integers(1, vocab + 1, int(rng.integers(low, high))) for _ in range(n)]


def captured(model, batch):
    """(logits [B, T, V], g [B, T, D]) of one plain forward pass, detached, in float64."""
    with torch.no_grad(), KeyCapture(model, KeySpec("ffn_in", -1)) as cap:
        logits = model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask")).logits
    return logits.double(), cap.keys.double()


def brute_force_loss(model, batch, kind: str, drop_local: bool = False) -> float:
    """TRIME Eq. 5 per position with the memory rules of Sec. 4 written out pair by pair (float64 loops)."""
    logits, g = captured(model, batch)
    ids = batch["input_ids"]
    b, t = ids.shape
    mask = batch.get("attention_mask", torch.ones_like(ids))
    doc = batch.get("segment_doc", torch.arange(b))
    idx = batch.get("segment_index", torch.zeros(b, dtype=torch.long))

    def target(r, s):  # next token inside the row, None when there is none
        return int(ids[r, s + 1]) if s + 1 < t and mask[r, s + 1] else None

    def sees(r, s, r2, s2):
        if kind == "local":
            return r == r2 and s2 < s
        if kind == "long":
            return doc[r] == doc[r2] and (idx[r2] < idx[r] or (idx[r2] == idx[r] and s2 < s))
        return r != r2 or (s2 < s and not drop_local)

    d = g.shape[-1]
    total, count = 0.0, 0
    for r in range(b):
        for s in range(t):
            y = target(r, s)
            if y is None:
                continue
            num = [float(logits[r, s, y])]
            den = torch.logsumexp(logits[r, s], 0).item()
            mem = []
            for r2 in range(b):
                for s2 in range(t):
                    v = target(r2, s2)
                    if v is None or not sees(r, s, r2, s2):
                        continue
                    score = float(g[r, s] @ g[r2, s2]) / math.sqrt(d)
                    mem.append(score)
                    if v == y:
                        num.append(score)
            den = float(np.logaddexp(den, np.logaddexp.reduce(mem))) if mem else den
            total -= float(np.logaddexp.reduce(num)) - den
            count += 1
    return total / count


def long_batch(seq_len: int = 8) -> dict[str, torch.Tensor]:
    """Rows: doc 0 segments 0-2 (the last one short: padding), doc 1 segments 0-1, doc 2 segment 0."""
    docs = [np.arange(1, 20) % 9 + 1, np.arange(5, 20) % 7 + 1, np.array([3, 4, 3, 5, 3])]
    tb = TrimeBatches("long", docs, seq_len=seq_len, batch_size=8, segments_per_doc=4)
    key = {(s.doc_index, s.index): i for i, s in enumerate(tb.segments)}
    batch = tb.collate([key[0, 0], key[0, 1], key[1, 0], key[0, 2], key[1, 1], key[2, 0]])
    assert bool((batch["attention_mask"] == 0).any())  # some padding
    return batch


# ---------------------------------------------------------------------------------------------------------------
# The loss


@pytest.mark.parametrize("kind", ["local", "long", "external"])
def test_objective_matches_brute_force_eq5(kind):
    model = tiny_model().eval()
    batch = long_batch()
    objective = TrimeObjective(kind)
    loss = objective(model, batch)
    ref = brute_force_loss(model, batch, kind)
    assert loss.item() == pytest.approx(ref, rel=1e-5, abs=1e-5)
    ce = causal_lm_loss(model, batch).item()
    assert abs(ref - ce) > 1e-3  # the memory actually changes the loss
    if kind == "external":  # local memory dropped for this batch (batch override; training draws it)
        dropped = objective(model, {**batch, "drop_local": True}).item()
        assert dropped == pytest.approx(brute_force_loss(model, batch, kind, drop_local=True), rel=1e-5, abs=1e-5)
        assert abs(dropped - loss.item()) > 1e-4


def test_objective_equals_trime_loss_on_captured_tensors():
    model = tiny_model().eval()
    batch = long_batch()
    logits, g = captured(model, batch)
    y = next_token_targets(batch["input_ids"], batch["attention_mask"]).reshape(-1)
    n = y.numel()
    q = g.reshape(n, -1)
    vis = TrimeObjective("long").visibility(batch)
    direct = trime_loss(logits.reshape(n, -1), q, q, y, vis, y)
    assert TrimeObjective("long")(model, batch).item() == pytest.approx(direct.item(), rel=1e-5)


def test_without_memory_it_is_causal_ce():
    model = tiny_model().eval()
    batch = long_batch()

    class NoMemory(TrimeObjective):
        def visibility(self, batch, drop_local=False):
            n = batch["input_ids"].numel()
            return torch.zeros(n, n, dtype=torch.bool)

    ce = causal_lm_loss(model, batch).item()
    assert NoMemory("local")(model, batch).item() == pytest.approx(ce, rel=1e-5)  # same targets, padding ignored
    one_row = {k: v[:1] for k, v in batch.items()}  # external memory of a single segment, local part dropped
    ext = TrimeObjective("external")(model, {**one_row, "drop_local": True}).item()
    assert ext == pytest.approx(causal_lm_loss(model, one_row).item(), rel=1e-5)
    # plain chunks without any extra field (the `trime` objective's batches): a first position has no memory
    chunk = {"input_ids": batch["input_ids"][:2, :2]}
    assert TrimeObjective("local")(model, chunk).item() == pytest.approx(causal_lm_loss(model, chunk).item(), rel=1e-5)


def test_drop_local_is_drawn_per_batch_in_training_only():
    model = tiny_model()
    batch = long_batch()
    always = TrimeObjective("external", drop_local_p=1.0)
    never = TrimeObjective("external", drop_local_p=0.0)
    assert always.drop_local(model.train(), batch) and not never.drop_local(model, batch)
    assert not always.drop_local(model.eval(), batch)  # evaluation keeps the local memory
    gen = torch.Generator().manual_seed(0)
    half = TrimeObjective("external", drop_local_p=0.5, generator=gen)
    draws = [half.drop_local(model.train(), batch) for _ in range(200)]
    assert 60 < sum(draws) < 140
    assert not TrimeObjective("long", drop_local_p=1.0).drop_local(model, batch)


def _grads(model, loss) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    loss.backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])


@pytest.mark.parametrize("kind", ["local", "long", "external"])
def test_gradients_reach_memory_representations(kind):
    model = tiny_model().eval()
    batch = long_batch()
    objective = TrimeObjective(kind)
    full = _grads(model, objective(model, batch))
    ce = _grads(model, causal_lm_loss(model, batch))
    assert full.abs().sum() > 0 and not torch.allclose(full, ce, atol=1e-6)

    # the same loss with the memory keys cut from the graph: only the query side gets gradients
    logits, g = objective.forward(model, batch)
    n = batch["input_ids"].numel()
    y = next_token_targets(batch["input_ids"], batch["attention_mask"]).reshape(-1)
    q = g.reshape(n, -1)
    vis = objective.visibility(batch)
    same = trime_loss(logits.reshape(n, -1), q, q, y, vis, y)
    assert torch.allclose(_grads(model, same), full, atol=1e-6)
    logits, g = objective.forward(model, batch)
    q = g.reshape(n, -1)
    detached = _grads(model, trime_loss(logits.reshape(n, -1), q, q.detach(), y, vis, y))
    assert (full - detached).abs().max() > 1e-5  # the memory terms send gradients into the memory keys

    # App. G's ablation "w/o back-prop to memory": same loss value, the gradient of the detached-keys loss
    ablation = TrimeObjective(kind, detach_memory=True)
    assert ablation(model, batch).item() == pytest.approx(objective(model, batch).item(), rel=1e-6)
    assert torch.allclose(_grads(model, ablation(model, batch)), detached, atol=1e-6)


def test_long_memory_sends_gradients_to_earlier_segments():
    """Row 0 (doc 0, segment 0) has no earlier segment, so its own loss terms are the same under the local and the
    long-term memory; its g still gets other gradients under the long-term memory: from the later segments of doc 0
    (rows 1 and 3, which never attend to row 0) that use it as memory."""
    model = tiny_model().eval()
    batch = long_batch()
    stored = {}

    def keep(_m, args):
        args[0].retain_grad()
        stored["g"] = args[0]

    handle = model.transformer.h[-1].mlp.register_forward_pre_hook(keep)
    try:
        grads = {}
        for kind in ("local", "long"):
            TrimeObjective(kind)(model, batch).backward()
            grads[kind] = stored["g"].grad.clone()
    finally:
        handle.remove()
    diff = (grads["long"] - grads["local"]).abs().sum(dim=-1)  # [B, T]
    assert diff[0].sum() > 1e-4 and diff[2].sum() > 1e-4  # first segments of docs 0 and 1: used by later ones
    assert diff[5].sum() == pytest.approx(0.0, abs=1e-7)  # doc 2 has one segment: long == local there


# ---------------------------------------------------------------------------------------------------------------
# Batches


def _as_lists(batches):
    return [{k: v.tolist() for k, v in b.items()} for b in batches]


@pytest.mark.parametrize(("kind", "packing"), [("long", "bm25"), ("external", "bm25"), ("external", "random")])
def test_batches_deterministic_per_seed_and_epoch(kind, packing):
    docs = token_docs(16)
    make = lambda seed=0: TrimeBatches(kind, docs, 8, 4, seed=seed, segments_per_doc=2, packing=packing)  # noqa: E731
    a, b = make(), make()
    assert _as_lists(a(0)) == _as_lists(b(0)) == _as_lists(a(0))
    assert _as_lists(a(1)) == _as_lists(b(1))
    assert _as_lists(a(0)) != _as_lists(a(1))
    assert _as_lists(make(1)(0)) != _as_lists(a(0))
    for e in (0, 1):  # every segment exactly once per epoch
        seen = sorted(i for batch in a.plan(e) for i in batch)
        assert seen == list(range(len(a.segments)))
        assert all(len(batch) <= 4 for batch in a.plan(e))


def test_local_batches_are_plain_chunks():
    docs = token_docs(10)
    lb = trime_batches("local", docs, seq_len=8, batch_size=3, seed=5)
    stream = np.concatenate(docs)
    chunks = sorted(tuple(row) for batch in lb(0) for row in batch["input_ids"].tolist())
    assert chunks == sorted(tuple(stream[i : i + 8]) for i in range(0, len(stream) // 8 * 8, 8))
    assert _as_lists(lb(2)) == _as_lists(lb(2)) != _as_lists(lb(3))


def test_long_batches_hold_consecutive_segments_of_a_document():
    docs = token_docs(9, low=10, high=60)
    seq_len = 8
    tb = trime_batches("long", docs, seq_len=seq_len, batch_size=6, seed=1, segments_per_doc=3)
    for batch in tb(0):
        ids, mask = batch["input_ids"], batch["attention_mask"]
        docs_in = batch["segment_doc"].tolist()
        index = batch["segment_index"].tolist()
        for d in set(docs_in):
            rows = [r for r, x in enumerate(docs_in) if x == d]
            got = [index[r] for r in rows]
            assert got == list(range(got[0], got[0] + len(got)))  # consecutive, in order
        for r, (d, k) in enumerate(zip(docs_in, index, strict=True)):
            want = docs[d][k * (seq_len - 1) : k * (seq_len - 1) + seq_len]  # owned tokens + the next one
            n = int(mask[r].sum())
            assert ids[r, :n].tolist() == want.tolist()
    # runs of m=3: segments 0-2 of a document share a batch
    for plan in tb.plan(0):
        segs = [tb.segments[i] for i in plan]
        for s in segs:
            run_start = s.index - s.index % 3
            for k in range(run_start, s.index):
                assert any(o.doc_index == s.doc_index and o.index == k for o in segs)


def test_ext_bm25_batches_group_lexically_similar_segments():
    rng = np.random.default_rng(0)
    topics, per_topic = 4, 8
    docs, labels = [], []
    for k in range(topics):  # topic k draws from its own 20 token ids
        for _ in range(per_topic):
            docs.append(rng.integers(1 + 20 * k, 21 + 20 * k, 15))
            labels.append(k)
    bm25 = TrimeBatches("external", docs, seq_len=16, batch_size=4, seed=0, packing="bm25")
    rand = TrimeBatches("external", docs, seq_len=16, batch_size=4, seed=0, packing="random")
    seg_labels = [labels[s.doc_index] for s in bm25.segments]

    def purity(tb, epoch):
        return batch_purity(tb.plan(epoch), seg_labels)

    assert purity(bm25, 0) >= 0.9 and purity(bm25, 1) >= 0.9
    assert purity(rand, 0) < 0.7


def test_text_documents_go_through_the_tokenizer():
    tok = gpt2_tokenizer()
    docs = make_toy_docs(6)
    tb = trime_batches("external", docs, tok, seq_len=16, batch_size=4, packing="random")
    got = {}
    for batch in tb(0):
        for r in range(len(batch["input_ids"])):
            n = int(batch["attention_mask"][r].sum())
            got[(int(batch["segment_doc"][r]), int(batch["segment_index"][r]))] = batch["input_ids"][r, :n].tolist()
    for d, doc in enumerate(docs):
        ids = tok(doc.text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        rebuilt = got[(d, 0)][:1]  # the first token, then every segment's targets (a 1-token tail is dropped)
        k = 0
        while (d, k) in got:
            rebuilt.extend(got[(d, k)][1:])
            k += 1
        assert rebuilt == ids


def test_objective_options_are_checked():
    with pytest.raises(MemlmError, match="unknown training objective"):
        trime_objective("trime-xl")
    with pytest.raises(MemlmError, match="unknown option"):
        trime_objective("trime", seqlen=8)
    with pytest.raises(MemlmError, match="only applies"):
        trime_objective("trime-ext", segments_per_doc=2)
    with pytest.raises(MemlmError, match="only applies"):
        trime_objective("ce", drop_local_p=0.5)
    with pytest.raises(MemlmError, match="drop_local_p"):
        trime_objective("trime-ext", drop_local_p=1.5)
    with pytest.raises(MemlmError, match="packing"):
        trime_objective("trime-ext", packing="tfidf")
    with pytest.raises(MemlmError, match="TRIME objectives"):
        trime_objective("ce", detach_memory=True)
    with pytest.raises(MemlmError, match="detach_memory"):
        trime_objective("trime", detach_memory="yes")
    assert trime_objective("trime-long", detach_memory=True).loss_fn.detach_memory
    assert not trime_objective("trime-long").loss_fn.detach_memory
    with pytest.raises(MemlmError, match="segments_per_doc"):
        trime_objective("trime-long", batch_size=4, segments_per_doc=5)
    with pytest.raises(MemlmError, match="seq_len"):
        trime_objective("trime", seq_len=1)
    with pytest.raises(MemlmError, match="segment_doc"):  # long memory on plain chunks
        TrimeObjective("long")(tiny_model(), {"input_ids": torch.ones(2, 4, dtype=torch.long)})
    with pytest.raises(MemlmError, match="no segment"):
        trime_batches("long", [np.array([5])], seq_len=8, batch_size=2)
    loss_fn, _ = trime_objective("trime-ext", drop_local_p=None, packing=None, seq_len=8)  # None = not given
    assert loss_fn.drop_local_p == 0.9
    assert trime_objective("ce").loss_fn is causal_lm_loss


# ---------------------------------------------------------------------------------------------------------------
# Training


def _run(name, out, stop_after=None, **options):
    cfg = TrainConfig(
        lr=3e-3, warmup_steps=1, max_steps=5, batch_size=4, seq_len=16, warmup_loss_steps=1, seed=0, max_grad_norm=1.0
    )
    loss_fn, batches = trime_objective(name, seq_len=16, batch_size=4, seed=3, **options)
    model = tiny_model(0, dropout=0.1)
    result = train(
        model,
        cfg,
        batches(token_docs(10, low=10, high=50), None),
        loss_fn=loss_fn,
        out_dir=out,
        warmup_loss=causal_lm_loss,
        stop_after=stop_after,
        progress=False,
    )
    return model, result


@pytest.mark.parametrize(
    ("name", "options"),
    [("ce", {}), ("trime", {}), ("trime-long", {"segments_per_doc": 2}), ("trime-ext", {"packing": "random"})],
)
def test_short_training_runs(tmp_path, name, options):
    _, result = _run(name, tmp_path, **options)
    assert result.step == 5 and len(result.losses) == 5
    assert all(math.isfinite(x) and x > 0 for x in result.losses)


@pytest.mark.parametrize(
    ("name", "options"),
    [("trime-ext", {"drop_local_p": 0.5}), ("trime-long", {"segments_per_doc": 2})],
)
def test_resume_gives_the_same_weights(tmp_path, name, options):
    full, _ = _run(name, tmp_path / "full", **options)
    _, first = _run(name, tmp_path / "split", stop_after=3, **options)
    assert first.step == 3 and first.final_dir is None
    resumed, result = _run(name, tmp_path / "split", **options)
    assert result.step == 5
    for (k, a), b in zip(full.state_dict().items(), resumed.state_dict().values(), strict=True):
        assert torch.equal(a, b), k
