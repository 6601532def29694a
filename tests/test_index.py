"""Tests for memlm.storage.index: FAISS build / save / load / search and the exact (brute-force) paths."""

from __future__ import annotations

import json
from pathlib import Path

import faiss
import numpy as np
import pytest

import memlm.storage.index as mi
from memlm.errors import MemlmError
from memlm.storage.index import (
    IndexPlan,
    build_index,
    default_factory,
    exact_scores,
    exact_search,
    index_metric,
    load_index,
    meta_path,
    plan_index,
    read_index_meta,
    search,
    validate_factory,
)

D = 32


@pytest.fixture(scope="module", autouse=True)
def _one_faiss_thread():
    """Single-threaded FAISS: k-means under OpenMP spin-waits crawls when CI shares its cores (10-100x)."""
    before = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(1)
    yield
    faiss.omp_set_num_threads(before)


def _keys(n: int, d: int = D, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, d)).astype(np.float16)


def _queries(q: int, d: int = D, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((q, d)).astype(np.float32)


def _ref_scores(keys: np.ndarray, queries: np.ndarray, metric: str) -> np.ndarray:
    """[Q, N] exact similarities in float64."""
    k = keys.astype(np.float64)
    q = queries.astype(np.float64)
    if metric == "ip":
        return q @ k.T
    return -(((q[:, None, :] - k[None, :, :]) ** 2).sum(-1))


def _ref_topk(keys: np.ndarray, queries: np.ndarray, k: int, metric: str) -> tuple[np.ndarray, np.ndarray]:
    s = _ref_scores(keys, queries, metric)
    ids = np.argsort(-s, axis=1, kind="stable")[:, :k]
    return np.take_along_axis(s, ids, 1), ids


def _assert_topk_equal(scores: np.ndarray, ids: np.ndarray, ref_s: np.ndarray, ref_i: np.ndarray) -> None:
    assert scores.dtype == np.float32 and ids.dtype == np.int64
    assert scores.shape == ids.shape == ref_s.shape
    np.testing.assert_allclose(scores, ref_s, rtol=1e-4, atol=1e-3)
    # Gaussian data has no exact ties; allow a rare float32 near-tie swap but nothing more.
    assert np.mean(ids == ref_i) > 0.99


def _recall(ids: np.ndarray, ref: np.ndarray) -> float:
    return float(np.mean([len(set(a) & set(b)) / len(b) for a, b in zip(ids, ref, strict=True)]))


@pytest.fixture(scope="module")
def data() -> tuple[np.ndarray, np.ndarray]:
    return _keys(2000), _queries(40)


# ------------------------------------------------------------------------------------------ exactness


@pytest.mark.parametrize("metric", ["l2", "ip"])
def test_flat_search_matches_numpy(tmp_path: Path, data, metric: str) -> None:
    keys, q = data
    index = build_index(keys, tmp_path / "flat.faiss", "Flat", metric=metric, progress=False)
    assert index.ntotal == len(keys) and index_metric(index) == metric
    ref_s, ref_i = _ref_topk(keys, q, 10, metric)
    _assert_topk_equal(*search(index, q, 10), ref_s, ref_i)
    # after a save/load round trip too
    _assert_topk_equal(*search(load_index(tmp_path / "flat.faiss"), q, 10), ref_s, ref_i)
    # l2 scores are negative squared distances, larger = closer
    s, _ = search(index, q, 10)
    assert np.all(np.diff(s, axis=1) <= 1e-6)
    if metric == "l2":
        assert np.all(s <= 1e-3)


@pytest.mark.parametrize("metric", ["l2", "ip"])
@pytest.mark.parametrize("chunk_size", [7, 300, 100_000])
def test_exact_search_matches_numpy(data, metric: str, chunk_size: int) -> None:
    keys, q = data
    ref_s, ref_i = _ref_topk(keys, q, 10, metric)
    _assert_topk_equal(*exact_search(keys, q, 10, metric, chunk_size=chunk_size), ref_s, ref_i)


@pytest.mark.parametrize("metric", ["l2", "ip"])
def test_exact_scores_matches_numpy(data, metric: str) -> None:
    keys, q = data
    ids = np.random.default_rng(2).integers(0, len(keys), size=(len(q), 12))
    ids[0, 3] = -1
    ids[5, :] = -1
    got = exact_scores(keys, ids, q, metric)
    ref = np.take_along_axis(_ref_scores(keys, q, metric), np.maximum(ids, 0), 1)
    ref[ids < 0] = -np.inf
    assert got.dtype == np.float32 and got.shape == ids.shape
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-4)
    assert np.isneginf(got[0, 3]) and np.isneginf(got[5]).all()


def test_exact_scores_of_flat_search_are_consistent(tmp_path: Path, data) -> None:
    keys, q = data
    index = build_index(keys, tmp_path / "i.faiss", "Flat", progress=False)
    s, i = search(index, q, 16)
    np.testing.assert_allclose(exact_scores(keys, i, q, "l2"), s, rtol=1e-4, atol=1e-3)


def test_exact_scores_rejects_foreign_ids(data) -> None:
    keys, q = data
    with pytest.raises(MemlmError, match="different datastore"):
        exact_scores(keys, np.full((len(q), 2), len(keys)), q, "l2")


@pytest.mark.parametrize("metric", ["l2", "ip"])
def test_k_larger_than_n_is_padded(tmp_path: Path, metric: str) -> None:
    keys, q = _keys(5), _queries(3)
    index = build_index(keys, tmp_path / "tiny.faiss", "Flat", metric=metric, progress=False)
    ref_s, ref_i = _ref_topk(keys, q, 5, metric)
    for s, i in (search(index, q, 8), exact_search(keys, q, 8, metric, chunk_size=2)):
        assert s.shape == i.shape == (3, 8)
        assert (i[:, 5:] == -1).all() and np.isneginf(s[:, 5:]).all()
        np.testing.assert_array_equal(i[:, :5], ref_i)
        np.testing.assert_allclose(s[:, :5], ref_s, rtol=1e-4, atol=1e-3)
        assert np.isneginf(exact_scores(keys, i, q, metric)[:, 5:]).all()


def test_ivf_missing_neighbours_are_minus_one_and_neg_inf(tmp_path: Path) -> None:
    keys, q = _keys(3000), _queries(10)
    build_index(keys, tmp_path / "ivf.faiss", "IVF64,Flat", progress=False)
    s, i = search(load_index(tmp_path / "ivf.faiss", nprobe=1), q, 500)  # one list holds < 500 keys
    missing = i == -1
    assert missing.any()
    assert np.isneginf(s[missing]).all() and np.isfinite(s[~missing]).all()


# -------------------------------------------------------------------------------------- approximate


@pytest.fixture(scope="module")
def approx_data() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    keys, q = _keys(5000), _queries(50)
    _, ref_i = _ref_topk(keys, q, 10, "l2")
    return keys, q, ref_i


@pytest.mark.parametrize(
    "factory", ["IVF64,Flat", "IVF64,PQ16", "HNSW16", "HNSW16,PQ16", "OPQ8,IVF32,PQ16", "IVF64,SQ8"]
)
def test_factories_build_and_find_neighbours(tmp_path: Path, approx_data, factory: str) -> None:
    keys, q, ref_i = approx_data
    build_index(keys, tmp_path / "a.faiss", factory, train_size=1000, progress=False)
    index = load_index(tmp_path / "a.faiss", nprobe=16, hnsw_ef_search=64)
    assert index.ntotal == len(keys)
    s, i = search(index, q, 10)
    assert ((i >= 0) & (i < len(keys))).all()
    assert np.all(np.diff(s, axis=1) <= 1e-5)
    assert _recall(i, ref_i) > 0.6, factory  # measured 0.73-0.96


def test_ivf_flat_with_all_lists_probed_is_exact(tmp_path: Path, approx_data) -> None:
    keys, q, ref_i = approx_data
    build_index(keys, tmp_path / "ivf.faiss", "IVF64,Flat", progress=False)
    index = load_index(tmp_path / "ivf.faiss", nprobe=10_000)  # capped at nlist
    assert faiss.extract_index_ivf(index).nprobe == 64
    assert _recall(search(index, q, 10)[1], ref_i) == 1.0


def test_load_index_sets_search_knobs(tmp_path: Path) -> None:
    keys = _keys(1000)
    build_index(keys, tmp_path / "ivf.faiss", "IVF16,Flat", progress=False)
    assert faiss.extract_index_ivf(load_index(tmp_path / "ivf.faiss")).nprobe == 16
    assert faiss.extract_index_ivf(load_index(tmp_path / "ivf.faiss", nprobe=4)).nprobe == 4
    build_index(keys, tmp_path / "h.faiss", "HNSW8", progress=False)
    assert faiss.downcast_index(load_index(tmp_path / "h.faiss", hnsw_ef_search=77)).hnsw.efSearch == 77


# ---------------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize("factory", ["IVF4096,PQ63", "Foo", ""])
def test_bad_factory_is_one_line_memlm_error(tmp_path: Path, factory: str) -> None:
    with pytest.raises(MemlmError) as e:
        validate_factory(factory, 576, "l2")
    msg = str(e.value)
    assert "\n" not in msg and "factory" in msg and "Flat" in msg
    with pytest.raises(MemlmError):
        build_index(_keys(300), tmp_path / "x.faiss", factory or " ", progress=False)
    assert not list(tmp_path.iterdir())


def test_bad_factory_mentions_the_reason() -> None:
    with pytest.raises(MemlmError, match="multiple of the number of subquantizers"):
        validate_factory("IVF4096,PQ63", 576, "l2")
    validate_factory("IVF4096,PQ64", 576, "l2")  # fine


def test_unknown_metric() -> None:
    with pytest.raises(MemlmError, match="unknown metric 'cos'"):
        validate_factory("Flat", 8, "cos")


def test_too_few_keys_for_nlist(tmp_path: Path) -> None:
    with pytest.raises(MemlmError, match="smaller nlist") as e:
        build_index(_keys(100), tmp_path / "x.faiss", "IVF256,Flat", progress=False)
    assert "\n" not in str(e.value) and "IVF2," in str(e.value)
    with pytest.raises(MemlmError, match="at least 256"):  # PQ's 8-bit codebooks need 256 points
        plan_index(200, D, "IVF4,PQ8")
    with pytest.raises(MemlmError, match="train_size"):
        plan_index(10_000, D, "IVF256,Flat", train_size=100)


@pytest.mark.parametrize(
    "bad", [np.zeros((0, D), np.float16), np.zeros(10, np.float16), np.zeros((2, 3, 4), np.float16)]
)
def test_empty_or_non_2d_keys(tmp_path: Path, bad: np.ndarray) -> None:
    with pytest.raises(MemlmError):
        build_index(bad, tmp_path / "x.faiss", "Flat", progress=False)


def test_query_shape_and_k_are_checked(tmp_path: Path) -> None:
    keys = _keys(50)
    index = build_index(keys, tmp_path / "x.faiss", "Flat", progress=False)
    with pytest.raises(MemlmError, match=r"\[Q, 32\]"):
        search(index, _queries(2, d=16), 4)
    with pytest.raises(MemlmError, match="k must be"):
        search(index, _queries(2), 0)
    with pytest.raises(MemlmError, match=r"\[Q, 32\]"):
        exact_search(keys, _queries(2, d=16), 4, "l2")


# ------------------------------------------------------------------------------------ save and load


def test_atomic_save_writes_sidecar_and_no_tmp(tmp_path: Path) -> None:
    out = tmp_path / "sub" / "knn.faiss"
    build_index(_keys(1000), out, "IVF16,Flat", metric="ip", seed=3, progress=False)
    assert out.is_file()
    assert sorted(p.name for p in out.parent.iterdir()) == ["knn.faiss", "knn.faiss.json"]
    meta = json.loads(meta_path(out).read_text())
    assert meta == read_index_meta(out)
    assert meta["factory"] == "IVF16,Flat" and meta["metric"] == "ip"
    assert (meta["n"], meta["d"], meta["train_size"], meta["seed"]) == (1000, D, 1000, 3)
    assert meta["faiss_version"] == faiss.__version__ and meta["build_seconds"] >= 0


def test_failed_write_leaves_no_partial_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "knn.faiss"
    build_index(_keys(100), out, "Flat", progress=False)
    before = out.read_bytes()

    def broken_write(index: faiss.Index, path: str) -> None:
        Path(path).write_bytes(b"partial")
        raise RuntimeError("Error in write at x.cpp:1: disk full")

    monkeypatch.setattr(faiss, "write_index", broken_write)
    with pytest.raises(MemlmError, match="disk full"):
        build_index(_keys(200), out, "Flat", progress=False)
    assert out.read_bytes() == before  # old index untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["knn.faiss", "knn.faiss.json"]


def test_load_missing_or_corrupt_index(tmp_path: Path) -> None:
    with pytest.raises(MemlmError, match="memlm index build"):
        load_index(tmp_path / "nope.faiss")
    good = tmp_path / "good.faiss"
    build_index(_keys(1000), good, "IVF16,Flat", progress=False)
    data = good.read_bytes()
    for name, blob in [
        ("trunc", data[: len(data) // 2]),
        ("head", data[:10]),
        ("empty", b""),
        ("junk", b"not a faiss index at all" * 10),
    ]:
        p = tmp_path / f"{name}.faiss"
        p.write_bytes(blob)
        meta_path(p).write_bytes(meta_path(good).read_bytes())
        with pytest.raises(MemlmError, match="corrupt or truncated") as e:
            load_index(p)
        assert "\n" not in str(e.value) and "memlm index build" in str(e.value)
        # a sidecar without the file's checksums (older memlm): FAISS's own reader still refuses the file
        old = json.loads(meta_path(good).read_text())
        del old["file"]
        meta_path(p).write_text(json.dumps(old))
        with pytest.raises(MemlmError, match="corrupt or truncated"):
            load_index(p)


def test_missing_stale_or_malformed_sidecar_is_refused(tmp_path: Path) -> None:
    keys = _keys(300)
    path = tmp_path / "x.faiss"
    build_index(keys, path, "Flat", metric="l2", progress=False)
    l2_meta = meta_path(path).read_bytes()
    build_index(keys, path, "Flat", metric="ip", progress=False)
    assert index_metric(load_index(path)) == "ip"
    # the l2 sidecar beside the ip index: its file checksum does not match
    meta_path(path).write_bytes(l2_meta)
    with pytest.raises(MemlmError, match="does not match"):
        load_index(path)
    with pytest.raises(MemlmError, match="does not match"):
        read_index_meta(path)  # what exact search reads for the metric
    # the same without the checksums: the FAISS header (metric ip) contradicts the sidecar (l2)
    stale = json.loads(l2_meta)
    del stale["file"]
    meta_path(path).write_text(json.dumps(stale))
    with pytest.raises(MemlmError, match="says 300 x 32 l2"):
        load_index(path)
    for blob in [b"", b"{}", b"[]", b"\x89PNG\r\n garbage", b'{"factory": "Flat", "metric": "cosine", "n": 1, "d": 8}']:
        meta_path(path).write_bytes(blob)
        with pytest.raises(MemlmError, match="x.faiss.json") as e:
            load_index(path)
        assert "\n" not in str(e.value)
    meta_path(path).unlink()
    with pytest.raises(MemlmError, match="has no x.faiss.json"):
        load_index(path)
    with pytest.raises(MemlmError, match="has no x.faiss.json"):
        read_index_meta(path)
    assert read_index_meta(tmp_path / "none.faiss") is None


def test_full_checksum_on_verify(tmp_path: Path) -> None:
    keys = _keys(40_000)  # a 1.3 MB file: larger than what the sampled checksum hashes whole
    path = tmp_path / "big.faiss"
    build_index(keys, path, "Flat", progress=False)
    data = bytearray(path.read_bytes())
    assert len(data) > 1 << 20
    data[len(data) // 2 + 2048 + 7] ^= 0x01  # one bit between two sampled blocks
    path.write_bytes(bytes(data))
    load_index(path)  # the cheap check cannot see one flipped bit between samples
    with pytest.raises(MemlmError, match="checksum mismatch"):
        load_index(path, verify=True)


# ----------------------------------------------------------------------------------- plan and chunks


def test_plan_index_numbers() -> None:
    n, d = 1_000_000, 576
    flat = plan_index(n, d, "Flat")
    assert isinstance(flat, IndexPlan)
    assert flat.memory_bytes == flat.disk_bytes == n * d * 4 and flat.train_size == 0
    pq = plan_index(n, d, "IVF1024,PQ64")
    assert pq.disk_bytes == n * (64 + 8) + 1024 * d * 4
    assert pq.memory_bytes >= pq.disk_bytes
    assert pq.train_size == 100_000 and pq.train_bytes == 100_000 * d * 4
    assert plan_index(n, d, "IVF4096,Flat").train_size == 40 * 4096
    assert plan_index(5000, d, "IVF64,Flat").train_size == 5000  # capped at n
    assert plan_index(n, d, "HNSW32").memory_bytes > flat.memory_bytes + n * 32 * 2 * 4 - 1
    opq = plan_index(n, d, "OPQ64,IVF1024,PQ64")
    assert opq.disk_bytes == pq.disk_bytes + d * d * 4 + d * 4
    text = str(pq)
    assert "\n" not in text and "IVF1024,PQ64" in text and "1,000,000" in text and "MiB" in text
    assert plan_index(n, d).factory == default_factory(n, d)


def test_default_factory() -> None:
    assert default_factory(1000, 576) == "Flat"
    assert default_factory(200_000, 576) == "Flat"
    assert default_factory(500_000, 576) == "IVF2048,Flat"  # 4 * sqrt(5e5) = 2828 -> 2^11
    assert default_factory(1_000_000, 576) == "IVF4096,Flat"
    assert default_factory(103_000_000, 1024) == "IVF32768,PQ64"
    assert default_factory(10**10, 576) == "IVF65536,PQ64"
    assert default_factory(10**8, 100) == "IVF32768,PQ50"
    assert default_factory(10**8, 97) == "IVF32768,SQ8"  # prime d
    for n, d in [(10**6, 576), (10**8, 100), (10**8, 97), (10**8, 768)]:
        validate_factory(default_factory(n, d), d, "l2")


class _SpyKeys:
    """A read-only [N, D] float16 array that records how many rows each read returns."""

    def __init__(self, arr: np.ndarray) -> None:
        self._arr = arr
        self.shape = arr.shape
        self.dtype = arr.dtype
        self.rows: list[int] = []

    def __len__(self) -> int:
        return len(self._arr)

    def __getitem__(self, item: object) -> np.ndarray:
        out = self._arr[item]
        self.rows.append(len(out))
        return out


@pytest.mark.parametrize("factory", ["Flat", "IVF16,Flat"])
def test_build_reads_keys_in_chunks(tmp_path: Path, factory: str) -> None:
    keys = _keys(1000)
    spy = _SpyKeys(keys)
    index = build_index(spy, tmp_path / "c.faiss", factory, chunk_size=96, train_size=500, progress=False)
    assert spy.rows and max(spy.rows) <= 96
    assert index.ntotal == 1000
    q = _queries(8)
    _, ref_i = _ref_topk(keys, q, 5, "l2")
    if factory == "Flat":
        assert np.mean(search(index, q, 5)[1] == ref_i) > 0.99  # ids are row numbers, in order
    spy.rows.clear()
    exact_search(spy, q, 5, "l2", chunk_size=96)
    assert max(spy.rows) <= 96


def test_build_from_memmap(tmp_path: Path) -> None:
    keys = _keys(700)
    mm = np.lib.format.open_memmap(tmp_path / "keys.npy", mode="w+", dtype=np.float16, shape=keys.shape)
    mm[:] = keys
    mm.flush()
    ro = np.load(tmp_path / "keys.npy", mmap_mode="r")
    index = build_index(ro, tmp_path / "m.faiss", "IVF8,Flat", chunk_size=128, progress=False)
    assert index.ntotal == 700
    q = _queries(5)
    np.testing.assert_allclose(
        exact_scores(ro, search(index, q, 3)[1], q, "l2"), search(index, q, 3)[0], rtol=1e-4, atol=1e-3
    )


def test_training_is_seeded(tmp_path: Path) -> None:
    keys = _keys(3000)
    a = build_index(keys, tmp_path / "a.faiss", "IVF16,Flat", train_size=1000, seed=1, progress=False)
    b = build_index(keys, tmp_path / "b.faiss", "IVF16,Flat", train_size=1000, seed=1, progress=False)
    c = build_index(keys, tmp_path / "c.faiss", "IVF16,Flat", train_size=1000, seed=2, progress=False)
    cent = [faiss.extract_index_ivf(x).quantizer.reconstruct_n(0, 16) for x in (a, b, c)]
    np.testing.assert_array_equal(cent[0], cent[1])
    assert not np.array_equal(cent[0], cent[2])


def test_progress_prints_plan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    build_index(_keys(100), tmp_path / "p.faiss", "Flat", progress=True)
    assert "index Flat (l2) over 100 x 32 keys" in capsys.readouterr().err


def test_module_exports() -> None:
    assert set(mi.__all__) <= set(dir(mi)) and mi.METRICS == ("l2", "ip")


@pytest.mark.parametrize("metric", ["l2", "ip"])
def test_flat_index_search_agrees_with_faiss_own_search(metric: str) -> None:
    """search() scores a flat index with torch (flat_vectors + exact_search) instead of FAISS's heaps: the same ids
    and, to float32 rounding, the same scores as FAISS's own IndexFlat.search, padding included."""
    rng = np.random.default_rng(3)
    keys = rng.normal(size=(3000, D)).astype(np.float32)
    queries = rng.normal(size=(50, D)).astype(np.float32)
    index = faiss.IndexFlatL2(D) if metric == "l2" else faiss.IndexFlatIP(D)
    index.add(keys)
    for k in (100, 3005):
        scores, ids = search(index, queries, k)
        dist, ref_ids = index.search(queries, min(k, 3000))
        ref = -dist if metric == "l2" else dist
        if k == 100:  # neighbours apart by more than rounding: the same order
            assert np.array_equal(ids, ref_ids)
        else:  # every key: the same set; keys within rounding of each other may swap places
            assert np.array_equal(np.sort(ids[:, :3000], axis=1), np.sort(ref_ids, axis=1))
        np.testing.assert_allclose(scores[:, :3000], ref, rtol=1e-5, atol=1e-4)
        assert (ids[:, 3000:] == -1).all() and np.isneginf(scores[:, 3000:]).all()


def test_only_plain_flat_indexes_take_the_torch_path(monkeypatch) -> None:
    rng = np.random.default_rng(4)
    keys = rng.normal(size=(2000, D)).astype(np.float32)
    flat = faiss.IndexFlatL2(D)
    flat.add(keys)
    vectors, metric = mi.flat_vectors(flat)
    assert metric == "l2" and np.array_equal(vectors, keys)
    keys[0, 0] += 1.0  # a view of the index's own memory, not a copy made now
    assert not np.array_equal(mi.flat_vectors(flat)[0][0], keys[0])
    ivf = faiss.index_factory(D, "IVF8,Flat")
    ivf.train(keys)
    ivf.add(keys)
    hnsw = faiss.index_factory(D, "HNSW8")
    hnsw.add(keys)
    idmap = faiss.IndexIDMap(faiss.IndexFlatL2(D))
    idmap.add_with_ids(keys, np.arange(len(keys)))
    assert all(mi.flat_vectors(x) is None for x in (ivf, hnsw, idmap, faiss.IndexFlatL2(D)))
    calls = []
    real = mi.exact_search
    monkeypatch.setattr(mi, "exact_search", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    blas = mi.FLAT_BATCH_QUERIES
    assert mi.blas_threshold() == blas  # FAISS 1.15's own threshold is 128,000
    search(flat, keys[:blas], 10)
    assert calls == [1]
    search(flat, keys[: blas - 1], 10)  # fewer queries: FAISS's own query-by-query path, as before
    for other in (ivf, hnsw, idmap):
        search(other, keys[:blas], 10)
    assert calls == [1]
