"""Sliding windows: every target scored exactly once, each with at least min_context tokens of context."""

import numpy as np
import pytest

from memlm.data.windows import TokenChunk, sliding_windows
from memlm.errors import MemlmError


def chunks(lengths):
    pos = 0
    for i, n in enumerate(lengths):
        yield TokenChunk(np.arange(pos, pos + n, dtype=np.int64), i, 1000 + i)
        pos += n


@pytest.mark.parametrize("lengths", [[1], [5], [3, 4, 100, 2], [7] * 50, [64]])
@pytest.mark.parametrize("window,min_context", [(16, 8), (16, 1), (16, 15), (8, 4)])
def test_every_target_once_with_enough_context(lengths, window, min_context):
    total = sum(lengths)
    seen = []
    for w in sliding_windows(chunks(lengths), window, min_context):
        assert len(w.input_ids) <= window
        # tokens are stream positions here, so the stream position of input j is input_ids[j]
        assert np.all(np.diff(w.input_ids) == 1)
        for j in range(w.score_from, len(w.input_ids)):
            t = int(w.input_ids[j])
            seen.append(t)
            # the context of target t is exactly the stream from the start of the window whose scored part holds
            # t (computed independently: windows start every stride tokens and score their last stride positions)
            stride = window - min_context
            start = 0 if t < window else (t - min_context) // stride * stride
            assert int(w.input_ids[0]) == start and j == t - start
            assert j >= min(min_context, t)  # hence at least min_context tokens (or all of the stream before t)
    assert seen == list(range(1, total))


def test_provenance_follows_documents():
    ws = list(sliding_windows(chunks([3, 4]), 16, 4))
    assert len(ws) == 1
    np.testing.assert_array_equal(ws[0].doc_index, [0, 0, 0, 1, 1, 1, 1])
    np.testing.assert_array_equal(ws[0].offset, [0, 1, 2, 0, 1, 2, 3])
    np.testing.assert_array_equal(ws[0].doc_hash, [1000] * 3 + [1001] * 4)


def test_bad_window_settings():
    with pytest.raises(MemlmError):
        list(sliding_windows(chunks([10]), 8, 8))
    with pytest.raises(MemlmError):
        list(sliding_windows(chunks([10]), 1, 0))


def test_min_context_zero_is_refused():
    # with 0, every later window scored its first target from a position that had already seen it
    with pytest.raises(MemlmError, match="at least one token of context"):
        list(sliding_windows(chunks([40]), 16, 0))


def _brute_force(model, stream, start, t):
    """One forward pass over stream[start:t] alone: log p(stream[t] | stream[start:t]), ffn_in and final keys."""
    import torch

    got = {}
    mlp = model.transformer.h[-1].mlp
    handle = mlp.register_forward_pre_hook(lambda _m, args: got.__setitem__("ffn_in", args[0][0, -1].clone()))
    try:
        with torch.no_grad():
            out = model(input_ids=torch.tensor([stream[start:t]]), output_hidden_states=True)
    finally:
        handle.remove()
    lp = torch.log_softmax(out.logits[0, -1].double(), -1)[stream[t]].item()
    return lp, got["ffn_in"].numpy(), out.hidden_states[-1][0, -1].numpy()


@pytest.mark.parametrize("window,min_context", [(16, 1), (16, 5)])
def test_later_windows_match_one_forward_pass_per_target(tmp_path, tiny_lm, toy_docs, window, min_context):
    """LM log-probs, queries and datastore keys of every target (most in later windows) at batch sizes 1, 2, 3
    equal one unbatched forward pass per target over exactly the context its window gives it."""
    from memlm.data.windows import tokenize_documents
    from memlm.knnlm.evaluate import lm_scores
    from memlm.knnlm.write import write_datastore
    from memlm.models.keys import KeySpec

    model, tok = tiny_lm
    docs = toy_docs[:4]
    stream = np.concatenate([c.tokens for c in tokenize_documents(docs, tok)]).tolist()
    stride = window - min_context
    specs = [KeySpec("ffn_in", -1), KeySpec("final", -1).normalized(2)]
    expected = []
    for t in range(1, len(stream)):
        start = 0 if t < window else (t - min_context) // stride * stride  # the window whose scored part holds t
        expected.append(_brute_force(model, stream, start, t))
    lp_ref = np.array([e[0] for e in expected])
    ffn_ref, final_ref = (np.stack([e[i] for e in expected]) for i in (1, 2))
    assert len(stream) > 4 * window  # most targets sit in later windows
    for batch_size in (1, 2, 3):
        ts, queries, _ = lm_scores(model, tok, docs, specs, window, min_context, batch_size, progress=False)
        np.testing.assert_array_equal(ts.targets, stream[1:])
        np.testing.assert_allclose(ts.lm_logprob, lp_ref, atol=1e-4, rtol=0)
        np.testing.assert_allclose(queries[specs[0]], ffn_ref, atol=1e-4, rtol=1e-4)
        np.testing.assert_allclose(queries[specs[1]], final_ref, atol=1e-4, rtol=1e-4)
        ds = write_datastore(
            model, tok, docs, tmp_path / f"ds{batch_size}", specs[0], window, min_context, batch_size, progress=False
        )
        np.testing.assert_array_equal(ds.values, stream[1:])
        np.testing.assert_allclose(ds.keys.astype(np.float32), ffn_ref, atol=2e-3, rtol=2e-3)  # stored in fp16


@pytest.mark.parametrize("lengths", [[5], [3, 4, 100, 2], [16, 16], [7] * 9])
def test_non_overlapping_blocks(lengths):
    total = sum(lengths)
    skip = list(sliding_windows(chunks(lengths), 16, stride=16))
    assert [int(w.input_ids[0]) for w in skip] == list(range(0, total, 16))  # blocks start every 16 tokens
    assert all(w.score_from == 1 and len(w.input_ids) <= 16 for w in skip)
    seen = [int(t) for w in skip for t in w.targets]
    assert seen == [t for t in range(total) if t % 16]  # every token but each block's first
    bos = list(sliding_windows(chunks(lengths), 16, stride=16, block_start="bos", bos_id=-7))
    assert all(w.input_ids[0] == -7 and w.score_from == 1 and len(w.input_ids) <= 16 for w in bos)
    assert [int(w.input_ids[1]) for w in bos] == list(range(0, total, 15))  # 15 stream tokens after the BOS
    assert [int(t) for w in bos for t in w.targets] == list(range(total))  # every token, the first included
    assert all(w.doc_index[0] == -1 and w.offset[0] == -1 for w in bos)


def test_stride_settings_are_checked():
    assert len(list(sliding_windows(chunks([40]), 16, stride=12))) == len(list(sliding_windows(chunks([40]), 16, 4)))
    for kw in ({"stride": 17}, {"stride": 0}, {"stride": 12, "min_context": 5}, {"stride": 16, "block_start": "bos"}):
        with pytest.raises(MemlmError):
            list(sliding_windows(chunks([40]), 16, **kw))


@pytest.mark.parametrize("block_start", ["skip", "bos"])
def test_blocks_match_one_forward_pass_per_block(tiny_lm, toy_docs, block_start):
    """Non-overlapping blocks: each target's log-prob and query equal a forward pass over its block alone
    (with the EOS before it for "bos"; GPT-2's BOS is its EOS), at batch sizes 1 and 3."""
    from memlm.data.windows import tokenize_documents
    from memlm.knnlm.evaluate import lm_scores
    from memlm.models.keys import KeySpec

    model, tok = tiny_lm
    docs = toy_docs[:3]
    stream = np.concatenate([c.tokens for c in tokenize_documents(docs, tok)]).tolist()
    window = 16
    span = window - 1 if block_start == "bos" else window
    prefix = [tok.eos_token_id] if block_start == "bos" else []
    targets, expected = [], []
    for t in range(len(stream)):
        b = t // span * span  # the block holding t
        if t == b and block_start == "skip":
            continue
        ctx = prefix + stream[b:t]
        targets.append(stream[t])
        expected.append(_brute_force(model, ctx + [stream[t]], 0, len(ctx)))
    spec = KeySpec("ffn_in", -1)
    for batch_size in (1, 3):
        ts, queries, _ = lm_scores(
            model, tok, docs, [spec], window, None, batch_size, False, stride=window, block_start=block_start
        )
        np.testing.assert_array_equal(ts.targets, targets)
        np.testing.assert_allclose(ts.lm_logprob, [e[0] for e in expected], atol=1e-4, rtol=0)
        np.testing.assert_allclose(queries[spec], np.stack([e[1] for e in expected]), atol=1e-4, rtol=1e-4)
        assert ts.meta["stride"] == window and ts.meta["block_start"] == block_start
