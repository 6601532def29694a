"""Sliding windows: every target scored exactly once, each with at least min_context tokens of context."""

import numpy as np
import pytest

from memlm.errors import MemlmError
from memlm.windows import TokenChunk, sliding_windows


def chunks(lengths):
    pos = 0
    for i, n in enumerate(lengths):
        yield TokenChunk(np.arange(pos, pos + n, dtype=np.int64), i, 1000 + i)
        pos += n


@pytest.mark.parametrize("lengths", [[1], [5], [3, 4, 100, 2], [7] * 50, [64]])
@pytest.mark.parametrize("window,min_context", [(16, 8), (16, 0), (16, 15), (8, 4)])
def test_every_target_once_with_enough_context(lengths, window, min_context):
    total = sum(lengths)
    seen = []
    for w in sliding_windows(chunks(lengths), window, min_context):
        assert len(w.input_ids) <= window
        # tokens are stream positions here, so the stream position of input j is input_ids[j]
        for j in range(w.score_from, len(w.input_ids)):
            t = int(w.input_ids[j])
            seen.append(t)
            assert j >= min(min_context, t)  # context of target t: j tokens (or all of the stream before it)
        assert np.all(np.diff(w.input_ids) == 1)
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
