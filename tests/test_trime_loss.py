"""TRIME's Eq. 5 (Zhong et al. 2022) with local, long-term and external in-batch memory vs a brute-force NumPy loop."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from memlm.errors import MemlmError
from memlm.trime import (
    memory_visibility,
    sample_drop_local,
    segment_layout,
    trime_logprob,
    trime_loss,
)

B, T, V, D = 3, 4, 7, 5


def make_batch(seed: int = 0, dtype: torch.dtype = torch.float64):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=g, dtype=dtype)
    keys = torch.randn(B, T, D, generator=g, dtype=dtype) * 2.0  # large enough that memory matters
    targets = torch.randint(0, 3, (B, T), generator=g)  # few values: entries share values with targets
    return logits, keys, targets


def sees(kind, b, t, b2, t2, seg_doc, seg_idx, drop_local):
    """The visibility rules of TRIME Sec. 4, written out per pair (segment b, step t) -> entry (b2, t2)."""
    same_seg = b == b2
    if kind == "local":  # Eq. 2: earlier positions of the same segment
        return same_seg and t2 < t
    if kind == "long":  # Eq. 3: earlier segments of the same document, and earlier positions of this one
        if seg_doc[b] != seg_doc[b2]:
            return False
        return seg_idx[b2] < seg_idx[b] or (seg_idx[b2] == seg_idx[b] and t2 < t)
    # external (Sec. 4.3): everything in the other segments; own segment's earlier positions unless dropped
    return (not same_seg) or (t2 < t and not drop_local)


def reference_loss(logits, keys, targets, kind, seg_doc=None, seg_idx=None, drop_local=False, ignore=-100):
    """-mean log((exp(E_w f) + sum_{vis j, x_j=w} exp(g.g_j/sqrt d)) / (sum_v exp(E_v f) + sum_{vis j} exp(...)))."""
    lg, k, y = logits.detach().numpy(), keys.detach().numpy(), targets.numpy()
    seg_doc = list(range(B)) if seg_doc is None else seg_doc
    seg_idx = [0] * B if seg_idx is None else seg_idx
    total, count = 0.0, 0
    for b in range(B):
        for t in range(T):
            w = y[b, t]
            if w == ignore:
                continue
            num = math.exp(lg[b, t, w])
            den = sum(math.exp(lg[b, t, v]) for v in range(V))
            for b2 in range(B):
                for t2 in range(T):
                    if y[b2, t2] == ignore or not sees(kind, b, t, b2, t2, seg_doc, seg_idx, drop_local):
                        continue
                    e = math.exp(float(np.dot(k[b, t], k[b2, t2])) / math.sqrt(D))
                    den += e
                    if y[b2, t2] == w:
                        num += e
            total += -math.log(num / den)
            count += 1
    return total / count


def flat_loss(logits, keys, targets, kind, seg_doc=None, seg_idx=None, drop_local=False):
    seg, pos, doc = segment_layout(
        B, T, None if seg_doc is None else torch.tensor(seg_doc), None if seg_idx is None else torch.tensor(seg_idx)
    )
    vis = memory_visibility(kind, seg, pos, doc, drop_local=drop_local)
    q = keys.reshape(B * T, D)
    y = targets.reshape(-1)
    return trime_loss(logits.reshape(B * T, V), q, q, y, vis, y)


CASES = [
    ("local", None, None, False),
    ("long", [0, 0, 0], [0, 1, 2], False),  # one document, three consecutive segments
    ("long", [5, 5, 9], [1, 2, 0], False),  # doc 5 (segments 1, 2) and doc 9 (segment 0)
    ("external", None, None, False),
    ("external", None, None, True),  # local memory dropped
]


@pytest.mark.parametrize("kind,seg_doc,seg_idx,drop", CASES)
def test_matches_bruteforce(kind, seg_doc, seg_idx, drop):
    logits, keys, targets = make_batch(1)
    got = flat_loss(logits, keys, targets, kind, seg_doc, seg_idx, drop)
    want = reference_loss(logits, keys, targets, kind, seg_doc, seg_idx, drop)
    assert got.item() == pytest.approx(want, rel=1e-10)
    # the memory makes a difference (else the test could not fail on a wrong mask)
    assert abs(want - F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1)).item()) > 1e-3


def test_dropout_is_deterministic():
    draws = [sample_drop_local(0.9, torch.Generator().manual_seed(s)) for s in range(200)]
    assert draws == [sample_drop_local(0.9, torch.Generator().manual_seed(s)) for s in range(200)]
    assert 0.8 < sum(draws) / len(draws) < 0.97


def test_visibility_indices():
    seg, pos, doc = segment_layout(2, 3, torch.tensor([4, 4]), torch.tensor([0, 1]))
    assert seg.tolist() == [0, 0, 0, 1, 1, 1] and pos.tolist() == [0, 1, 2, 3, 4, 5] and doc.tolist() == [4] * 6
    local = memory_visibility("local", seg, pos)
    assert not local.diagonal().any()  # an entry holds its own target: never visible to itself
    assert local[2].tolist() == [True, True, False, False, False, False]
    assert memory_visibility("long", seg, pos, doc)[3].tolist() == [True, True, True, False, False, False]
    assert memory_visibility("external", seg, pos)[1].tolist() == [True, False, False, True, True, True]
    assert memory_visibility("external", seg, pos, drop_local=True)[1].tolist() == [False] * 3 + [True] * 3


def test_empty_memory_is_cross_entropy():
    logits, keys, targets = make_batch(3, torch.float32)
    x, y = logits.reshape(-1, V), targets.reshape(-1)
    q = keys.reshape(-1, D)
    none = torch.zeros(B * T, B * T, dtype=torch.bool)
    assert torch.allclose(trime_loss(x, q, q, y, none, y), F.cross_entropy(x, y), atol=1e-6)
    # no entries at all (M = 0), and entries that are visible but empty slots (value -1)
    empty = torch.zeros(0, D)
    nothing = torch.zeros(B * T, 0, dtype=torch.bool)
    lp = trime_logprob(x, q, empty, torch.zeros(0, dtype=torch.long), nothing, y)
    assert torch.allclose(lp, -F.cross_entropy(x, y, reduction="none"), atol=1e-6)
    all_vis = torch.ones(B * T, B * T, dtype=torch.bool)
    q = q.clone().requires_grad_(True)
    trime_loss(x, q, q, y, none, y).backward()  # rows with no memory: finite (zero) gradient, no nan
    assert q.grad is not None and torch.equal(q.grad, torch.zeros_like(q))
    assert torch.allclose(trime_loss(x, q, q, torch.full_like(y, -1), all_vis, y), F.cross_entropy(x, y), atol=1e-6)


def test_gradients_reach_memory_and_queries():
    logits, keys, targets = make_batch(4, torch.float32)
    logits.requires_grad_(True)
    x, y = logits.reshape(-1, V), targets.reshape(-1)
    queries = keys.reshape(-1, D).clone().requires_grad_(True)
    mem = keys.reshape(-1, D).clone().requires_grad_(True)
    seg, pos, _ = segment_layout(B, T)
    trime_loss(x, queries, mem, y, memory_visibility("external", seg, pos), y).backward()
    assert mem.grad is not None and mem.grad.abs().sum() > 0
    assert queries.grad is not None and queries.grad.abs().sum() > 0
    assert logits.grad is not None and logits.grad.abs().sum() > 0
    # shared representations (the in-batch case): one tensor is both query and memory
    shared = keys.clone().requires_grad_(True)
    flat_loss(logits.detach(), shared, targets, "local").backward()
    assert shared.grad is not None and torch.isfinite(shared.grad).all() and shared.grad[:, :-1].abs().sum() > 0


def test_ignore_index():
    logits, keys, targets = make_batch(5)
    targets = targets.clone()
    targets[0, 1] = -100
    targets[2, 3] = -100
    for kind in ("local", "external"):
        got = flat_loss(logits, keys, targets, kind).item()
        assert got == pytest.approx(reference_loss(logits, keys, targets, kind), rel=1e-10)
    lp = trime_logprob(
        logits.reshape(-1, V),
        keys.reshape(-1, D),
        keys.reshape(-1, D),
        targets.reshape(-1),
        torch.ones(B * T, B * T, dtype=torch.bool),
        targets.reshape(-1),
    )
    assert lp[1] == 0 and lp[11] == 0 and torch.isfinite(lp).all()
    all_ignored = torch.full((B, T), -100)
    assert flat_loss(logits, keys, all_ignored, "local").item() == 0.0


def test_temperature_and_scale():
    logits, keys, targets = make_batch(6)
    x, y, q = logits.reshape(-1, V), targets.reshape(-1), keys.reshape(-1, D)
    vis = torch.ones(B * T, B * T, dtype=torch.bool)
    # Eq. 6: sim / tau; tau = 2 is the same as scale = 1 / (2 sqrt(D))
    a = trime_logprob(x, q, q, y, vis, y, temperature=2.0)
    b = trime_logprob(x, q, q, y, vis, y, scale=1 / (2 * math.sqrt(D)))
    assert torch.allclose(a, b)
    assert not torch.allclose(a, trime_logprob(x, q, q, y, vis, y))


def test_errors():
    logits, keys, targets = make_batch(7)
    x, y, q = logits.reshape(-1, V), targets.reshape(-1), keys.reshape(-1, D)
    vis = torch.ones(B * T, B * T, dtype=torch.bool)
    with pytest.raises(MemlmError, match="logits"):
        trime_loss(logits, q, q, y, vis, y)
    with pytest.raises(MemlmError, match="mem_keys"):
        trime_loss(x, q, q[:, :2], y, vis, y)
    with pytest.raises(MemlmError, match="visible"):
        trime_loss(x, q, q, y, vis.float(), y)
    with pytest.raises(MemlmError, match="mem_values"):
        trime_loss(x, q, q, y.float(), vis, y)
    with pytest.raises(MemlmError, match="targets"):
        trime_loss(x, q, q, y, vis, y[:-1])
    with pytest.raises(MemlmError, match="out of range"):
        trime_loss(x, q, q, y, vis, y + V)
    with pytest.raises(MemlmError, match="temperature"):
        trime_loss(x, q, q, y, vis, y, temperature=0.0)
    seg, pos, doc = segment_layout(B, T)
    with pytest.raises(MemlmError, match="unknown memory kind"):
        memory_visibility("global", seg, pos)  # type: ignore[arg-type]
    with pytest.raises(MemlmError, match="doc_ids"):
        memory_visibility("long", seg, pos)
    with pytest.raises(MemlmError, match="drop_local"):
        memory_visibility("local", seg, pos, drop_local=True)
    with pytest.raises(MemlmError, match="probability"):
        sample_drop_local(1.5)


def test_batched_groups_equal_one_call_per_group():
    """A leading group dim G computes G independent memories: the same values (and gradients) as G separate calls,
    with a [G, N, M] visibility or one [N, M] shared by all groups."""
    torch.manual_seed(3)
    g, n, m = 3, 6, 5
    x = torch.randn(g, n, V, requires_grad=True)
    q = torch.randn(g, n, D, requires_grad=True)
    k = torch.randn(g, m, D, requires_grad=True)
    vals = torch.randint(0, V, (g, m))
    vals[1, 2] = -1  # an empty slot
    y = torch.randint(0, V, (g, n))
    y[2, 0] = -100  # an ignored target
    vis = torch.rand(g, n, m) > 0.4
    batched = trime_logprob(x, q, k, vals, vis, y, temperature=1.5)
    single = torch.stack([trime_logprob(x[i], q[i], k[i], vals[i], vis[i], y[i], temperature=1.5) for i in range(g)])
    torch.testing.assert_close(batched, single)
    gb = torch.autograd.grad(batched.sum(), (x, q, k))
    gs = torch.autograd.grad(single.sum(), (x, q, k))
    for a, b in zip(gb, gs, strict=True):
        torch.testing.assert_close(a, b)
    shared = trime_logprob(x, q, k, vals, vis[0], y)
    torch.testing.assert_close(shared[1], trime_logprob(x[1], q[1], k[1], vals[1], vis[0], y[1]))
    with pytest.raises(MemlmError, match="visible"):
        trime_logprob(x, q, k, vals, vis[:2], y)
    with pytest.raises(MemlmError, match="mem_values"):
        trime_logprob(x, q, k, vals[0], vis, y)
