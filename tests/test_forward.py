"""forward_windows' scoring path: logits only for the positions a batch scores, and the LM features per target.

References are brute force: the model run on the whole window with every position's logits, then a float64 NumPy
log-softmax, entropy and max over the vocabulary.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from memlm.data.windows import TokenChunk, batched, sliding_windows
from memlm.models.forward import forward_windows, lm_entropy
from memlm.models.keys import KeySpec


def _reference(model, window) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """log p(target), H(p), max log p for each scored target of ``window``, from all-position logits in float64."""
    ids = torch.from_numpy(np.asarray(window.input_ids, dtype=np.int64))[None]
    with torch.inference_mode():
        logits = model(input_ids=ids).logits[0].double().numpy()
    rows = np.arange(window.score_from - 1, len(window.input_ids) - 1)
    z = logits[rows]
    logp = z - z.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    target_lp = logp[np.arange(len(rows)), window.targets]
    return target_lp, -(np.exp(logp) * logp).sum(-1), logp.max(-1)


def _windows(n_tokens: int, window: int, min_context: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    chunks = [TokenChunk(rng.integers(0, 50257, size=n, dtype=np.int64), i, 0) for i, n in enumerate(n_tokens)]
    return list(sliding_windows(chunks, window, min_context))


@pytest.mark.parametrize("per_window", [True, False])
@pytest.mark.parametrize("batch_size", [1, 3])
def test_scored_logits_match_all_position_logits(tiny_lm, batch_size, per_window, monkeypatch):
    """Windows that score from position 16 (and a document's first window, from 1, in the same batch) give the
    log-probabilities, entropies and maxima of the full [window, vocab] logits, while the model is asked for fewer:
    with a model that slices by a boolean mask (transformers' ``slice_logits_to_keep``), exactly each window's scored
    positions; else (older or remote code) the positions from the first any window of the batch scores."""
    import memlm.models.forward as fw

    model, _ = tiny_lm
    if not per_window:
        monkeypatch.setattr(fw, "slices_logits_by_mask", lambda m: False)
    windows = _windows([90, 45], window=32, min_context=16)
    assert {w.score_from for w in windows} >= {1, 16}
    asked: list[object] = []
    forward = model.forward

    @functools.wraps(forward)  # keeps forward's signature (forward_windows reads it)
    def recording_forward(*args, **kwargs):
        out = forward(*args, **kwargs)
        asked.append((kwargs.get("logits_to_keep"), tuple(out.logits.shape[:-1])))
        return out

    model.forward = recording_forward
    try:
        outputs = [o for batch in forward_windows(model, batched(windows, batch_size)) for o in batch]
    finally:
        del model.forward
    assert len(outputs) == len(windows)
    for o in outputs:
        lp, ent, mx = _reference(model, o.window)
        np.testing.assert_allclose(o.lm_logprob, lp, rtol=0, atol=2e-5)
        np.testing.assert_allclose(o.lm_entropy, ent, rtol=0, atol=2e-5)
        np.testing.assert_allclose(o.lm_max_logprob, mx, rtol=0, atol=2e-5)
    for batch, (keep, logits_shape) in zip(batched(windows, batch_size), asked, strict=True):
        first = min(w.score_from for w in batch) - 1
        padded = max(len(w.input_ids) for w in batch)
        if per_window:  # a mask of the scored positions; the logits are theirs alone, flattened
            expected = torch.zeros(len(batch), padded, dtype=torch.bool)
            for b, w in enumerate(batch):
                expected[b, w.score_from - 1 : len(w.input_ids) - 1] = True
            assert torch.equal(keep, expected)
            assert logits_shape == (sum(w.n_targets for w in batch),)
        elif first == 0:
            assert keep is None and logits_shape == (len(batch), padded)
        else:  # the positions from the first scored one
            assert torch.equal(keep, torch.arange(first, padded))
            assert logits_shape == (len(batch), padded - first)


def test_final_key_keeps_every_position(tiny_lm):
    """The ``final`` key is captured at the head's input, so scoring with it computes every position's logits and the
    keys are the full window's hidden states at the scored positions."""
    model, _ = tiny_lm
    windows = _windows([70], window=32, min_context=16)[1:]  # windows scoring from 16 only
    spec = KeySpec("final", -1)
    outputs = [o for batch in forward_windows(model, batched(windows, 2), [spec]) for o in batch]
    for o in outputs:
        ids = torch.from_numpy(np.asarray(o.window.input_ids, dtype=np.int64))[None]
        with torch.inference_mode():
            hidden = model(input_ids=ids, output_hidden_states=True).hidden_states[-1][0].numpy()
        rows = np.arange(o.window.score_from - 1, len(o.window.input_ids) - 1)
        np.testing.assert_allclose(o.keys[spec], hidden[rows], rtol=0, atol=1e-5)
        np.testing.assert_allclose(o.lm_logprob, _reference(model, o.window)[0], rtol=0, atol=2e-5)


def test_lm_entropy_against_numpy_with_masked_tokens():
    """H(p) = -sum p log p with 0 log 0 = 0, also in rows where some tokens have log-probability -inf."""
    rng = np.random.default_rng(1)
    z = rng.normal(size=(6, 50)) * 3
    z[1, :10] = -np.inf  # a model that masks tokens
    z[4, 5] = -np.inf
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    p = np.exp(logp)
    expected = -np.where(p > 0, p * np.where(p > 0, logp, 0.0), 0.0).sum(-1)
    got = lm_entropy(torch.from_numpy(logp)).numpy()
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-12)


def test_logprob_statistics_block_by_block_equal_the_whole_tensor():
    """log p(target), max log p and H(p) computed row block by row block are the same numbers as on the whole [n, V]
    at once (every operation is per row), also for rows with masked (-inf) tokens and a last block that is short."""
    from memlm.models.forward import _Buffers, logprob_statistics

    rng = np.random.default_rng(3)
    logits = torch.from_numpy((rng.normal(size=(37, 300)) * 4).astype(np.float32))
    logits[5, :40] = -torch.inf
    targets = torch.from_numpy(rng.integers(40, 300, size=37))
    logp = torch.log_softmax(logits, -1)
    whole = (logp.gather(-1, targets[:, None]).squeeze(-1).numpy(), logp.amax(-1).numpy(), lm_entropy(logp).numpy())
    buffers = _Buffers()
    for block in (1, 8, 37, 64):
        got = logprob_statistics(logits, targets, buffers, rows_per_block=block)
        for g, w in zip(got, whole, strict=True):
            np.testing.assert_array_equal(g, w)
    ref = logits.double().log_softmax(-1)  # and they are the float64 values to float32 rounding
    np.testing.assert_allclose(got[0], ref.gather(-1, targets[:, None]).squeeze(-1).numpy(), rtol=0, atol=2e-6)


class _Head(torch.nn.Module):
    """A bf16 output projection with logits of 10-30 (as a trained LM's), for fp32_head."""

    def __init__(self, bias: bool) -> None:
        super().__init__()
        self.lm_head = torch.nn.Linear(64, 500, bias=bias)
        with torch.no_grad():
            self.lm_head.weight.normal_(0, 0.6)
            if bias:
                self.lm_head.bias.normal_(0, 1.0)
        self.lm_head.to(torch.bfloat16)

    def get_output_embeddings(self) -> torch.nn.Linear:
        return self.lm_head


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("bf16_products", [False, True])
def test_fp32_head_logits_against_float64(bf16_products, bias, monkeypatch):
    """fp32_head's logits of a bf16 head equal ``h W^T + b`` in float64 (W the bf16 weights, h the bf16 input) to
    float32 rounding, in both arithmetics: a float32 product, or bf16 products with float32 sums (exact products).
    bf16 logits are off by ~1e-2 of their size (checked). The original bf16 head does not run, the logits go to one
    buffer reused between calls (2-D and 3-D inputs, a row count that is not a multiple of the row block), and
    leaving the block restores the head."""
    from memlm.models.forward import fp32_head

    model = _Head(bias)
    head = model.lm_head
    h = (torch.randn(3, 23, 64) * 1.5).bfloat16()
    ref = h.double() @ head.weight.detach().double().T + (head.bias.detach().double() if bias else 0)
    with torch.inference_mode():
        bf16_logits = head(h).double()
    scale = float(ref.abs().max())
    assert 10 < scale < 60
    assert (bf16_logits - ref).abs().max() > 1e-3 * scale  # what fp32_head is for
    calls = []
    monkeypatch.setattr(torch.nn.Linear, "forward", lambda self, x: calls.append(1) or torch.zeros(()))
    monkeypatch.setattr(fp32_head, "rows_per_block", 16)
    hook = fp32_head(model, reuse_output=True, bf16_products=bf16_products)
    assert hook.arithmetic == ("bf16-products" if bf16_products else "float32")
    with torch.inference_mode(), hook:
        z3 = head(h)
        assert z3.dtype == torch.float32 and z3.shape == (3, 23, 500)
        np.testing.assert_allclose(z3.double().numpy(), ref.numpy(), rtol=0, atol=1e-6 * scale)
        z2 = head(h[1])  # the same buffer, overwritten
        assert z2.data_ptr() == z3.data_ptr()
        np.testing.assert_allclose(z2.double().numpy(), ref[1].numpy(), rtol=0, atol=1e-6 * scale)
    assert not calls  # the bf16 head never ran
    assert "forward" not in head.__dict__
    assert head(h[0]).shape == ()  # the class's forward (patched here) again
