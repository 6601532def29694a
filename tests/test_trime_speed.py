"""TRIME external-memory fast paths: the rescoring of retrieved keys (exact_scores) with reused float32
buffers == the old code bit for bit, an index passed in, ext_scores='dot-index' == 'dot' up to float32 rounding."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import make_toy_docs
from test_datastore import build

from memlm.errors import MemlmError
from memlm.storage import index as index_lib
from memlm.storage.index import build_index, load_index
from memlm.trime import score_trime


def old_exact_scores(keys, ids, queries, metric):
    """exact_scores before its fast path: 64 MiB blocks, NumPy float16 cast, the query rows by a boolean mask."""
    q = np.ascontiguousarray(queries, dtype=np.float32)
    nq, k = ids.shape
    d = q.shape[1]
    out = np.full((nq, k), -np.inf, dtype=np.float32)
    block = max(1, 64 * 1024**2 // (k * d * 4))
    for s in range(0, nq, block):
        e = min(s + block, nq)
        bids = ids[s:e]
        valid = bids >= 0
        if not valid.any():
            continue
        uniq, inv = np.unique(bids[valid], return_inverse=True)
        kv = np.ascontiguousarray(keys[uniq], dtype=np.float32)[inv]
        qv = np.broadcast_to(q[s:e, None, :], (*bids.shape, d))[valid]
        if metric == "l2":
            diff = qv - kv
            vals = -np.einsum("nd,nd->n", diff, diff)
        else:
            vals = np.einsum("nd,nd->n", qv, kv)
        out[s:e][valid] = vals
    return out


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("metric", ["ip", "l2"])
@pytest.mark.parametrize("d,k", [(8, 1), (32, 7), (256, 1024)])
def test_exact_scores_bitwise_equal_to_old(monkeypatch, dtype, metric, d, k):
    rng = np.random.default_rng(d + k)
    n = 3000
    keys = rng.normal(size=(n, d)).astype(dtype)
    nq = 37
    q = rng.normal(size=(nq, d)).astype(np.float32)
    ids = rng.integers(0, n, size=(nq, k))
    ids[rng.random(ids.shape) < 0.1] = -1  # missing neighbours
    ids[3] = -1  # a query with none
    want = old_exact_scores(keys, ids, q, metric)
    for block_bytes in (index_lib._RESCORE_BLOCK_BYTES, k * d * 4 * 5, 1):  # several queries per block, or one
        monkeypatch.setattr(index_lib, "_RESCORE_BLOCK_BYTES", block_bytes)
        got = index_lib.exact_scores(keys, ids, q, metric)
        assert got.dtype == np.float32 and np.array_equal(got, want)
    assert np.array_equal(index_lib.exact_scores(np.asarray(keys), ids, q, metric), want)


@pytest.fixture(scope="module")
def ext_ivf(tmp_path_factory, tiny_lm):
    tmp = tmp_path_factory.mktemp("trime-speed")
    ds = build(tmp, tiny_lm, make_toy_docs(20, seed=3), window=32, min_context=8)
    build_index(ds.keys, ds.index_path, factory="IVF4,Flat", metric="l2", progress=False)
    return ds


@pytest.mark.filterwarnings("ignore")
def test_index_passed_in(tiny_lm, ext_ivf, tmp_path):
    model, tok = tiny_lm
    docs = make_toy_docs(3, seed=4)
    own = score_trime(model, tok, docs, 16, max_segments=0, datastore=ext_ivf, k=8, nprobe=3)
    index = load_index(ext_ivf.index_path, nprobe=3)
    given = score_trime(model, tok, docs, 16, max_segments=0, datastore=ext_ivf, k=8, index=index)
    assert np.array_equal(own.ext_scores, given.ext_scores) and np.array_equal(own.ext_values, given.ext_values)
    assert own.meta["nprobe"] == given.meta["nprobe"] == 3
    other = build(tmp_path, tiny_lm, make_toy_docs(2, seed=5), window=32, min_context=8)
    build_index(other.keys, other.index_path, factory="Flat", metric="l2", progress=False)
    with pytest.raises(MemlmError, match="its own index"):
        score_trime(model, tok, docs, 16, datastore=ext_ivf, k=8, index=load_index(other.index_path))


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("factory,metric", [("IVF4,Flat", "l2"), ("Flat", "l2"), ("Flat", "ip")])
def test_dot_index_equals_dot_up_to_float32_rounding(tiny_lm, tmp_path, factory, metric):
    model, tok = tiny_lm
    ds = build(tmp_path, tiny_lm, make_toy_docs(20, seed=3), window=32, min_context=8)
    build_index(ds.keys, ds.index_path, factory=factory, metric=metric, progress=False)
    docs = make_toy_docs(4, seed=11)
    kw = {"max_segments": 0, "datastore": ds, "k": 12, "nprobe": 4, "batch_size": 4}
    dot = score_trime(model, tok, docs, 16, **kw)
    fast = score_trime(model, tok, docs, 16, ext_scores="dot-index", **kw)
    assert fast.meta["ext_scores"] == "dot-index"
    valid = dot.ext_values >= 0
    assert valid.mean() > 0.9 and np.array_equal(valid, fast.ext_values >= 0)
    np.testing.assert_allclose(fast.ext_scores[valid], dot.ext_scores[valid], rtol=1e-5, atol=1e-5)
    # the same entries (rows sorted by score: near-ties may swap places)
    assert np.array_equal(np.sort(fast.ext_values, 1), np.sort(dot.ext_values, 1))
    for ts in (dot, fast):
        assert np.all(np.diff(np.where(ts.ext_values >= 0, ts.ext_scores, -np.inf), axis=1) <= 0)


def test_dot_index_refuses_compressed_index_and_exact_search(tiny_lm, ext_setup_pq):
    model, tok = tiny_lm
    with pytest.raises(MemlmError, match="exact distances"):
        score_trime(model, tok, make_toy_docs(1), 16, datastore=ext_setup_pq, k=4, ext_scores="dot-index")
    with pytest.raises(MemlmError, match="search='index'"):
        score_trime(model, tok, make_toy_docs(1), 16, datastore=ext_setup_pq, k=4, ext_scores="dot-index",
                    search="exact")  # fmt: skip


@pytest.fixture(scope="module")
def ext_setup_pq(tmp_path_factory, tiny_lm):
    ds = build(tmp_path_factory.mktemp("trime-pq"), tiny_lm, make_toy_docs(20, seed=3), window=32, min_context=8)
    build_index(ds.keys, ds.index_path, factory="IVF2,PQ4x4", metric="l2", progress=False)
    return ds
