"""NPM multi-positive contrastive loss (Min et al. 2023, §3.2.2; App. A.3) against brute-force NumPy references."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from memlm.errors import MemlmError
from memlm.npm.loss import npm_contrastive_loss, npm_single_loss, npm_span_loss
from memlm.npm.masking import MaskedBatch, mask_batch, mask_batch_single


def brute_force(q: np.ndarray, c: np.ndarray, pos: np.ndarray, cand: np.ndarray) -> np.ndarray:
    """-log( sum_pos exp(q.c/sqrt(h)) / sum_cand exp(q.c/sqrt(h)) ), one query at a time, in float64."""
    out = []
    for qi in range(q.shape[0]):
        num = den = 0.0
        for ci in range(c.shape[0]):
            e = math.exp(float(q[qi] @ c[ci]) / math.sqrt(q.shape[1]))
            if cand[qi, ci]:
                den += e
            if pos[qi, ci]:
                num += e
        out.append(-math.log(num / den))
    return np.array(out)


def tiny(seed: int = 0, q_n: int = 3, c_n: int = 7, h: int = 4) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(q_n, h, generator=g, dtype=torch.float64)
    c = torch.randn(c_n, h, generator=g, dtype=torch.float64)
    cand = torch.ones(q_n, c_n, dtype=torch.bool)
    cand[0, 5:] = False  # e.g. the query's own sequence
    cand[2, :2] = False
    pos = torch.zeros(q_n, c_n, dtype=torch.bool)
    pos[0, [0, 2, 3]] = True  # multiple positives
    pos[1, [1, 6]] = True
    pos[2, 4] = True
    return q, c, pos, cand


def test_matches_brute_force_with_multiple_positives() -> None:
    q, c, pos, cand = tiny()
    ref = brute_force(q.numpy(), c.numpy(), pos.numpy(), cand.numpy())
    got = npm_contrastive_loss(q, c, pos, cand, reduction="none")
    np.testing.assert_allclose(got.numpy(), ref, rtol=1e-10)
    assert float(npm_contrastive_loss(q, c, pos, cand)) == pytest.approx(ref.sum())  # the paper sums
    assert float(npm_contrastive_loss(q, c, pos, cand, reduction="mean")) == pytest.approx(ref.mean())
    # no candidate mask: every candidate counts
    all_ref = brute_force(q.numpy(), c.numpy(), pos.numpy(), np.ones_like(cand.numpy()))
    np.testing.assert_allclose(npm_contrastive_loss(q, c, pos, None, reduction="none").numpy(), all_ref, rtol=1e-10)
    assert not np.allclose(all_ref, ref)  # the candidate mask matters on this batch


def test_single_positive_is_cross_entropy() -> None:
    q, c, _, _ = tiny(1)
    targets = torch.tensor([4, 0, 6])
    pos = F.one_hot(targets, c.shape[0]).bool()
    expected = F.cross_entropy(q @ c.T / math.sqrt(q.shape[1]), targets, reduction="sum")
    assert float(npm_contrastive_loss(q, c, pos)) == pytest.approx(float(expected), rel=1e-12)


def test_gradients_flow_and_float32() -> None:
    q, c, pos, cand = (t.float() if t.is_floating_point() else t for t in tiny(2))
    q.requires_grad_(True)
    c.requires_grad_(True)
    loss = npm_contrastive_loss(q, c, pos, cand)
    assert loss.dtype == torch.float32
    loss.backward()
    assert q.grad is not None and c.grad is not None
    assert torch.isfinite(q.grad).all() and q.grad.abs().sum(dim=1).gt(0).all()
    assert c.grad.abs().sum(dim=1).gt(0).all()
    # a candidate that no query may see gets no gradient
    q2, c2 = q.detach().clone().requires_grad_(True), c.detach().clone().requires_grad_(True)
    cand2 = cand.clone()
    cand2[:, 5] = False
    pos2 = pos & cand2
    npm_contrastive_loss(q2, c2, pos2, cand2).backward()
    assert c2.grad is not None and float(c2.grad[5].abs().sum()) == 0.0


def test_bad_inputs_raise() -> None:
    q, c, pos, cand = tiny()
    with pytest.raises(MemlmError):
        npm_contrastive_loss(q[0], c, pos, cand)  # queries not 2-D
    with pytest.raises(MemlmError):
        npm_contrastive_loss(q, c[:, :3], pos, cand)  # hidden sizes differ
    with pytest.raises(MemlmError):
        npm_contrastive_loss(q, c, pos[:, :3], cand)  # mask shape
    with pytest.raises(MemlmError):
        npm_contrastive_loss(q, c, pos, cand[:2])
    with pytest.raises(MemlmError):
        npm_contrastive_loss(q, c, pos.long(), cand)  # mask dtype
    with pytest.raises(MemlmError):
        npm_contrastive_loss(q, c, pos, cand, reduction="avg")
    bad = pos.clone()
    bad[0, 6] = True  # a positive outside the candidates
    with pytest.raises(MemlmError):
        npm_contrastive_loss(q, c, bad, cand)
    none = pos.clone()
    none[1] = False  # a query without positives
    with pytest.raises(MemlmError, match="query 1 has no positive"):
        npm_contrastive_loss(q, c, none, cand)


def _toy_masked(single: bool = False) -> MaskedBatch:
    rng = np.random.default_rng(0)
    seqs = [rng.integers(10, 40, size=n).tolist() for n in (30, 24, 27)]
    seqs[1][3:7] = seqs[0][10:14]
    seqs[2][0:3] = seqs[0][10:13]
    if single:
        return mask_batch_single(seqs, 3, np.random.default_rng(1))
    return mask_batch(seqs, 3, 4, np.random.default_rng(1))


def _pad(hidden: list[np.ndarray], h: int) -> torch.Tensor:
    out = np.zeros((len(hidden), max(len(x) for x in hidden), h))
    for i, x in enumerate(hidden):
        out[i, : len(x)] = x
    return torch.tensor(out)


def test_span_loss_matches_brute_force() -> None:
    batch = _toy_masked()
    assert any(len(s.positives) > 1 for s in batch.all_spans)  # multi-positive spans are exercised
    h, rng = 5, np.random.default_rng(3)
    masked = [rng.normal(size=(len(x), h)) for x in batch.input_ids]
    unmasked = [rng.normal(size=(len(x), h)) for x in batch.original_ids]
    expected = 0.0
    for span in batch.all_spans:
        others = [(j, m) for j in range(len(unmasked)) if j != span.seq for m in range(len(unmasked[j]))]
        c = np.stack([unmasked[j][m] for j, m in others])
        cand = np.ones((1, len(others)), dtype=bool)
        starts = {(o.seq, o.start) for o in span.positives}
        ends = {(o.seq, o.end) for o in span.positives}
        pos_s = np.array([[(j, m) in starts for j, m in others]])
        pos_e = np.array([[(j, m) in ends for j, m in others]])
        expected += brute_force(masked[span.seq][span.mask_start][None], c, pos_s, cand)[0]
        expected += brute_force(masked[span.seq][span.mask_end][None], c, pos_e, cand)[0]
    got = npm_span_loss(_pad(masked, h), _pad(unmasked, h), batch)
    assert float(got) == pytest.approx(expected, rel=1e-10)
    n = len(batch.all_spans)
    assert float(npm_span_loss(_pad(masked, h), _pad(unmasked, h), batch, reduction="mean")) == pytest.approx(
        expected / n, rel=1e-10
    )
    with pytest.raises(MemlmError):
        npm_span_loss(_pad(masked, h)[:2], _pad(unmasked, h), batch)
    with pytest.raises(MemlmError):
        npm_span_loss(_pad(masked, h)[:, :3], _pad(unmasked, h), batch)


def test_single_loss_matches_brute_force() -> None:
    batch = _toy_masked(single=True)
    h, rng = 4, np.random.default_rng(4)
    masked = [rng.normal(size=(len(x), h)) for x in batch.input_ids]
    unmasked = [rng.normal(size=(len(x), h)) for x in batch.original_ids]
    expected = 0.0
    for span in batch.all_spans:
        others = [(j, m) for j in range(len(unmasked)) if j != span.seq for m in range(len(unmasked[j]))]
        c = np.stack([unmasked[j][m] for j, m in others])
        pos = np.array([[batch.original_ids[j][m] == span.tokens[0] for j, m in others]])
        expected += brute_force(masked[span.seq][span.mask_start][None], c, pos, np.ones_like(pos))[0]
    assert float(npm_single_loss(_pad(masked, h), _pad(unmasked, h), batch)) == pytest.approx(expected, rel=1e-10)
