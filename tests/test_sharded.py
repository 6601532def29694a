"""Sharded datastores without Ray: the plan, sharded build == one-process build, sharded search == one index."""

from __future__ import annotations

import json

import faiss
import numpy as np
import pytest
from conftest import make_toy_docs

from memlm.errors import MemlmError
from memlm.knnlm.scoring import score_tokens
from memlm.knnlm.write import build_sharded, write_datastore
from memlm.storage.datastore import Datastore
from memlm.storage.index import build_index, exact_search, load_index, search
from memlm.storage.sharded import ShardedArray, ShardedDatastore, open_datastore, plan_shards, shard_name
from memlm.storage.sharded_index import ShardedSearcher, build_sharded_index, merge_topk

W, C = 32, 12  # small windows: many of them, and cuts inside windows


@pytest.fixture(scope="module")
def docs():
    return make_toy_docs(24, seed=3)


@pytest.fixture(scope="module")
def single(tiny_lm, docs, tmp_path_factory):
    model, tok = tiny_lm
    return write_datastore(
        model, tok, docs, tmp_path_factory.mktemp("one") / "ds", window=W, min_context=C, batch_size=3, progress=False
    )


@pytest.fixture(scope="module")
def sharded(tiny_lm, docs, tmp_path_factory):
    model, tok = tiny_lm
    out = tmp_path_factory.mktemp("sharded") / "ds"
    return build_sharded(model, docs, out, 3, tokenizer=tok, window=W, min_context=C, batch_size=2, progress=False)


def test_plan_covers_every_target_once():
    lengths = [5, 40, 3, 17, 60, 2, 9, 30]
    plans = plan_shards(lengths, 3, window=16, min_context=6)
    total = sum(lengths)
    assert plans[0].target_lo == 1 and plans[-1].target_hi == total
    for a, b in zip(plans, plans[1:], strict=False):
        assert a.target_hi == b.target_lo and a.doc_hi == b.doc_lo  # contiguous documents and targets
    starts = np.concatenate([[0], np.cumsum(lengths)])
    for p in plans:
        assert p.target_hi == starts[p.doc_hi]  # cuts at document boundaries
        first = p.first_window * 10  # stride 10
        assert starts[p.read_doc] + p.read_skip == first
        # the first window scores the first target and no earlier window does
        assert first + (1 if p.first_window == 0 else 6) <= p.target_lo < first + 16
    with pytest.raises(MemlmError, match="cannot split"):
        plan_shards([3, 4], 3, 16, 6)


def test_sharded_build_equals_one_process_build(single, sharded):
    assert len(sharded.shards) == 3 and len(sharded) == len(single)
    assert all(len(s) > 0 for s in sharded.shards)
    np.testing.assert_array_equal(sharded.values[:], single.values)
    np.testing.assert_array_equal(sharded.doc_hash[:], single.doc_hash)
    np.testing.assert_array_equal(sharded.offset[:], single.offset)
    a, b = sharded.keys[:].astype(np.float32), np.asarray(single.keys, dtype=np.float32)
    # equal up to float16 rounding of float32 keys that differ by batching/padding noise
    np.testing.assert_allclose(a, b, rtol=2e-3, atol=2e-3)
    assert np.mean(a == b) > 0.95
    # each shard is a normal datastore; its entries are the global ones at its offset
    for s, off in zip(sharded.shards, sharded.offsets, strict=True):
        again = Datastore.open(s.path)
        np.testing.assert_array_equal(again.values, single.values[off : off + len(again)])


def test_sharded_array_indexing(sharded, single):
    ids = np.array([[len(single) - 1, 0, 5], [7, 7, len(single) // 2]])
    np.testing.assert_array_equal(sharded.values[ids], single.values[ids])
    np.testing.assert_array_equal(sharded.keys[ids], sharded.keys[:][ids])
    assert sharded.values[3] == single.values[3] and sharded.values[-1] == single.values[-1]
    n0 = len(sharded.shards[0])
    np.testing.assert_array_equal(sharded.values[n0 - 2 : n0 + 3], single.values[n0 - 2 : n0 + 3])
    with pytest.raises(IndexError):
        sharded.values[np.array([len(single)])]
    arr = ShardedArray([np.arange(3), np.arange(3, 5)])
    np.testing.assert_array_equal(arr[np.array([4, 0, 3])], [4, 0, 3])


def test_rerun_skips_finished_shards_and_resumes_one(tiny_lm, docs, tmp_path, sharded, monkeypatch):
    import memlm.knnlm.write as write_mod

    model, tok = tiny_lm
    out = tmp_path / "ds"
    real = write_mod.forward_windows
    calls = []

    def dying(*args, **kw):  # the second shard's build dies after its first batch (a killed worker)
        calls.append(1)
        for i, batch in enumerate(real(*args, **kw)):
            if len(calls) == 2 and i == 1:
                raise RuntimeError("worker killed")
            yield batch

    monkeypatch.setattr(write_mod, "forward_windows", dying)
    with pytest.raises(RuntimeError, match="killed"):
        build_sharded(model, docs, out, 3, tokenizer=tok, window=W, min_context=C, batch_size=2, progress=False)
    monkeypatch.setattr(write_mod, "forward_windows", real)
    progress = json.loads((out / shard_name(1) / "progress.json").read_text())
    assert progress["windows_done"] == 2 and progress["count"] > 0  # one batch of two windows kept
    assert not (out / shard_name(2)).exists()
    with pytest.raises(MemlmError, match="unfinished"):
        ShardedDatastore.open(out)
    mtime0 = (out / shard_name(0) / "keys.bin").stat().st_mtime_ns
    again = build_sharded(model, docs, out, 3, tokenizer=tok, window=W, min_context=C, batch_size=2, progress=False)
    assert (out / shard_name(0) / "keys.bin").stat().st_mtime_ns == mtime0  # the finished shard is not redone
    np.testing.assert_array_equal(again.values[:], sharded.values[:])
    np.testing.assert_array_equal(again.offset[:], sharded.offset[:])
    np.testing.assert_array_equal(again.keys[:], sharded.keys[:])  # same batches as an uninterrupted build


def test_changed_settings_are_refused(tiny_lm, docs, sharded):
    model, tok = tiny_lm
    with pytest.raises(MemlmError, match="other settings"):
        build_sharded(model, docs, sharded.path, 2, tokenizer=tok, window=W, min_context=C, progress=False)


def test_sharded_exact_search_equals_brute_force(sharded, single):
    build_sharded_index(sharded, factory="Flat", progress=False)
    rng = np.random.default_rng(0)
    q = np.asarray(single.keys[rng.choice(len(single), 20)], dtype=np.float32) + rng.normal(0, 0.1, (20, single.dim))
    q = q.astype(np.float32)
    k = 10
    ref_s, ref_i = exact_search(single.keys, q, k, "l2")
    for workers in (1, 3):
        with ShardedSearcher.open(sharded, workers=workers) as searcher:
            sc, ids = searcher.search(q, k)
        np.testing.assert_array_equal(ids, ref_i)
        np.testing.assert_allclose(sc, ref_s, rtol=1e-4, atol=1e-4)
    # k larger than the datastore: padded like memlm.storage.index.search
    with ShardedSearcher.open(sharded) as searcher:
        sc, ids = searcher.search(q[:2], len(single) + 3)
    assert (ids[:, -3:] == -1).all() and np.isneginf(sc[:, -3:]).all()
    assert sorted(ids[0, :-3]) == list(range(len(single)))


def test_sharded_ivf_equals_single_ivf_with_same_quantizer(sharded, single, tmp_path):
    desc = build_sharded_index(sharded, factory="IVF8,Flat", name="ivf.faiss", progress=False)
    assert desc["shards"] == [f"{shard_name(i)}/ivf.faiss" for i in range(3)]
    # one index over all entries with the very same trained quantizer
    one = faiss.read_index(str(sharded.path / "ivf.faiss.trained"))
    one.add(np.asarray(single.keys, dtype=np.float32))
    faiss.extract_index_ivf(one).nprobe = 2  # a bare FAISS index: load_index wants memlm's sidecar
    rng = np.random.default_rng(1)
    q = np.asarray(single.keys[rng.choice(len(single), 30)], dtype=np.float32)
    with ShardedSearcher.open(sharded, sharded.path / "ivf.faiss", nprobe=2) as searcher:
        sc, ids = searcher.search(q, 8)
    ref_s, ref_i = search(one, q, 8)
    np.testing.assert_array_equal(ids, ref_i)
    np.testing.assert_allclose(sc, ref_s, rtol=1e-5)
    # each shard is a normal datastore with a normal index: load_index accepts it (its sidecar names the shard)
    for shard in sharded.shards:
        assert load_index(shard.path / "ivf.faiss", nprobe=2).ntotal == len(shard)
    # and the quantizer is the one build_index trains on the concatenated keys (same sample, same seed)
    build_index(single.keys, tmp_path / "ref.faiss", factory="IVF8,Flat", progress=False)
    ref_index = faiss.read_index(str(tmp_path / "ref.faiss"))
    mine_index = faiss.read_index(str(sharded.path / "ivf.faiss.trained"))
    a = faiss.extract_index_ivf(ref_index).quantizer.reconstruct_n(0, 8)
    b = faiss.extract_index_ivf(mine_index).quantizer.reconstruct_n(0, 8)
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_merge_topk_keeps_the_best():
    a = (np.array([[5.0, 1.0, -np.inf]]), np.array([[0, 1, -1]]))
    b = (np.array([[4.0, 3.0, 2.0]]), np.array([[10, 11, 12]]))
    sc, ids = merge_topk([a, b], 3)
    np.testing.assert_array_equal(ids, [[0, 10, 11]])
    np.testing.assert_array_equal(sc, [[5.0, 4.0, 3.0]])


def test_eval_takes_a_sharded_datastore_like_a_single_one(tiny_lm, sharded, single, tmp_path):
    model, tok = tiny_lm
    build_sharded_index(sharded, factory="Flat", progress=False)
    if not single.index_path.exists():
        build_index(single.keys, single.index_path, factory="Flat", progress=False)
    eval_docs = make_toy_docs(4, seed=9)
    opened = open_datastore(sharded.path)
    assert isinstance(opened, ShardedDatastore) and isinstance(open_datastore(single.path), Datastore)
    kw = {"k": 8, "window": W, "min_context": C, "progress": False}
    a = score_tokens(model, tok, eval_docs, opened, **kw)
    b = score_tokens(model, tok, eval_docs, single, **kw)
    np.testing.assert_array_equal(a.columns["knn"]["values"], b.columns["knn"]["values"])
    np.testing.assert_allclose(a.columns["knn"]["scores"], b.columns["knn"]["scores"], rtol=1e-3, atol=1e-3)
    c = score_tokens(model, tok, eval_docs, opened, search="exact", scores="exact", **kw)
    np.testing.assert_array_equal(c.columns["knn"]["values"], b.columns["knn"]["values"])


def test_mmap_index_searches_like_the_loaded_one(tiny_lm, single, tmp_path):
    from memlm.storage.sharded_index import load_index_mmap

    build_index(single.keys, tmp_path / "ivf.faiss", factory="IVF4,Flat", progress=False)
    mapped = load_index_mmap(tmp_path / "ivf.faiss", nprobe=2)
    lists = faiss.downcast_InvertedLists(faiss.extract_index_ivf(mapped).invlists)
    assert isinstance(lists, faiss.OnDiskInvertedLists)  # the lists stay in the file
    q = np.asarray(single.keys[:16], np.float32)
    np.testing.assert_array_equal(search(mapped, q, 5)[1], search(load_index(tmp_path / "ivf.faiss", 2), q, 5)[1])
    ds = open_datastore(single.path, mmap_index=True)
    if not ds.index_path.exists():
        build_index(single.keys, single.index_path, factory="Flat", progress=False)
    flat = ds.searcher()
    np.testing.assert_array_equal(flat.search(q, 5)[1], search(load_index(single.index_path), q, 5)[1])


def test_faiss_gpu_detection_on_a_cpu_build():
    from memlm.storage.sharded_index import faiss_gpus, to_gpu_if_available

    index = faiss.IndexFlatL2(4)
    if faiss_gpus() == 0:  # the CPU wheel: auto keeps the CPU index, an explicit cuda request is refused clearly
        assert to_gpu_if_available(index, "auto") is index
        with pytest.raises(MemlmError, match="faiss-gpu"):
            to_gpu_if_available(index, "cuda")
    assert to_gpu_if_available(index, "cpu") is index


def test_generation_processor_takes_a_sharded_datastore(tiny_lm, sharded, single):
    import torch

    from memlm.knnlm.generate import MixtureLogitsProcessor

    model, tok = tiny_lm
    build_sharded_index(sharded, factory="Flat", progress=False)
    if not single.index_path.exists():
        build_index(single.keys, single.index_path, factory="Flat", progress=False)
    ids = tok("the cat sat on the", return_tensors="pt")["input_ids"]
    outs = []
    for ds in (open_datastore(sharded.path), single):
        with MixtureLogitsProcessor(model, f"{ds.path}?k=8", "knn=0.5") as knn, torch.no_grad():
            logits = model(ids).logits[:, -1]
            outs.append(knn(ids, logits))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-3, atol=1e-3)
    assert not torch.allclose(outs[0], torch.log_softmax(logits, -1))  # the datastore changed the distribution


def test_cli_eval_takes_a_sharded_datastore(tiny_lm_dir, tmp_path, capsys):
    """The README's sharded path on the command line: `memlm datastore build --shards 2`, then `memlm eval
    --memory SHARDED` passes the pre-flight checks (--k against the entries of all shards) and scores."""
    from test_train_lm import write_jsonl

    from memlm.cli import main

    train = write_jsonl(tmp_path / "train.jsonl", make_toy_docs(12, seed=4))
    valid = write_jsonl(tmp_path / "valid.jsonl", make_toy_docs(4, seed=9))
    ds = tmp_path / "ds"
    window = ["--window", str(W), "--min-context", str(C)]
    build = ["datastore", "build", "--model", str(tiny_lm_dir), "--corpus", str(train), "--out", str(ds),
             "--shards", "2", "--factory", "Flat", *window]  # fmt: skip
    assert main(build) == 0, capsys.readouterr().err
    n = len(open_datastore(ds))
    out = tmp_path / "eval.json"
    argv = ["eval", "--model", str(tiny_lm_dir), "--corpus", str(valid), "--memory", str(ds), "--k", "8",
            *window, "--json", str(out)]  # fmt: skip
    assert main(argv) == 0, capsys.readouterr().err
    res = json.loads(out.read_text())
    assert res["tokens"] > 0 and res["datastore"] == str(ds) and res["target_in_neighbours"] > 0
    capsys.readouterr()
    assert main([*argv, "--k", str(n + 1025)]) == 2  # --k beyond all shards' entries: refused
    assert f"exceeds the {n} entries" in capsys.readouterr().err


def test_cli_sharded_build_with_default_windows_equals_one_process_build(tmp_path, capsys):
    """README's `memlm datastore build ... --shards 8` gives no --window / --min-context: the defaults (1024, 512)
    reach the shard plan resolved, as for a one-process build (before: min_context None, a TypeError in plan_shards).
    A --stride equal to --window (blocks, which shards do not build) is refused with one line."""
    import torch
    from conftest import gpt2_tokenizer
    from test_train_lm import write_jsonl
    from transformers import AutoModelForCausalLM, GPT2Config

    from memlm.cli import main

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=1, n_embd=16, n_head=2, n_positions=1024, vocab_size=50257)
    lm = tmp_path / "lm1024"
    AutoModelForCausalLM.from_config(cfg).eval().save_pretrained(lm)
    gpt2_tokenizer().save_pretrained(lm)
    train = write_jsonl(tmp_path / "train.jsonl", make_toy_docs(80, seed=5))
    common = ["datastore", "build", "--model", str(lm), "--corpus", str(train), "--factory", "Flat", "--holdout", "0"]
    assert main([*common, "--out", str(tmp_path / "one")]) == 0, capsys.readouterr().err
    assert main([*common, "--out", str(tmp_path / "two"), "--shards", "2"]) == 0, capsys.readouterr().err
    one, two = open_datastore(tmp_path / "one"), open_datastore(tmp_path / "two")
    assert len(two.shards) == 2 and len(one) == len(two) > 1024  # more than one window
    assert one.manifest["min_context"] == 512 and one.manifest["window"] == 1024
    np.testing.assert_array_equal(np.asarray(one.values[:]), np.asarray(two.values[:]))
    np.testing.assert_allclose(np.asarray(one.keys[:], np.float32), np.asarray(two.keys[:], np.float32), atol=1e-5)
    assert main(["index", "build", str(tmp_path / "two"), "--factory", "IVF8,Flat"]) == 0, capsys.readouterr().err
    assert json.loads((tmp_path / "two" / "index.faiss.json").read_text())["factory"] == "IVF8,Flat"  # README's rebuild
    capsys.readouterr()
    assert main([*common, "--out", str(tmp_path / "blocks"), "--shards", "2", "--stride", "1024"]) == 2
    assert "non-overlapping blocks" in capsys.readouterr().err


# ------------------------------------------------------- every consumer takes a sharded datastore through its searcher


@pytest.fixture(scope="module")
def sharded_and_copy(sharded, tmp_path_factory):
    """The sharded datastore with a Flat sharded index, and its rows written as one folder (identical keys) with a
    Flat index: each consumer must give the same result on both."""
    build_sharded_index(sharded, factory="Flat", progress=False)
    copy = sharded.write_rows(tmp_path_factory.mktemp("copy") / "ds", np.arange(len(sharded)), {})
    build_index(copy.keys, copy.index_path, factory="Flat", progress=False)
    return open_datastore(sharded.path), Datastore.open(copy.path)


def test_one_searcher_per_datastore_kind(sharded_and_copy):
    from memlm.storage.searcher import ExactSearcher, FaissSearcher, RescoredSearcher, Searcher, open_searcher

    shard, one = sharded_and_copy
    assert isinstance(shard.searcher(), ShardedSearcher) and isinstance(one.searcher(), FaissSearcher)
    q = np.asarray(one.keys[:20], np.float32) + 0.01
    want = exact_search(one.keys, q, 6, "l2")
    for ds in (shard, one):
        for mode, scores, kind in (("index", "index", None), ("exact", "exact", ExactSearcher),
                                   ("index", "exact", RescoredSearcher)):  # fmt: skip
            s = open_searcher(ds, mode, scores)
            assert isinstance(s, Searcher) and (kind is None or isinstance(s, kind))
            sc, ids = s.search(q, 6)
            np.testing.assert_array_equal(ids, want[1])
            np.testing.assert_allclose(sc, want[0], rtol=1e-4, atol=1e-3)
            assert s.describe()["metric"] == "l2"


def test_prune_takes_a_sharded_datastore(sharded_and_copy, tmp_path):
    from memlm.knnlm.prune import load_counts, prune_datastore

    shard, one = sharded_and_copy
    a = prune_datastore(shard, tmp_path / "a", k_merge=4, progress=False)
    b = prune_datastore(one, tmp_path / "b", k_merge=4, progress=False)
    assert len(a) < len(shard)
    np.testing.assert_array_equal(np.asarray(a.values), np.asarray(b.values))
    np.testing.assert_array_equal(np.asarray(a.doc_hash), np.asarray(b.doc_hash))
    np.testing.assert_array_equal(load_counts(a), load_counts(b))


def test_pointer_reuse_takes_a_sharded_datastore(tiny_lm, sharded_and_copy):
    from memlm.knnlm.evaluate import lm_scores
    from memlm.knnlm.pointer import retrieve_with_pointers

    model, tok = tiny_lm
    shard, one = sharded_and_copy
    ts, queries, _ = lm_scores(model, tok, make_toy_docs(3, seed=11), [one.key_spec], W, C, progress=False)
    q = queries[one.key_spec]
    a = retrieve_with_pointers(shard, q, ts.targets, ts.doc_index, 8, min_survivors=2)
    b = retrieve_with_pointers(one, q, ts.targets, ts.doc_index, 8, min_survivors=2)
    np.testing.assert_array_equal(a[1], b[1])
    np.testing.assert_array_equal(a[2], b[2])
    assert 0 < a[2].mean() < 1  # some tokens reused pointers, some searched
    np.testing.assert_allclose(a[0], b[0], rtol=1e-5)


def test_lm_eval_adapter_takes_a_sharded_datastore(tiny_lm, sharded_and_copy):
    from memlm.lmeval.model import MemlmLM

    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance

    model, tok = tiny_lm
    shard, one = sharded_and_copy
    pairs = [("the cat sat on", " the mat"), ("a dog ran", " in the park")]
    reqs = [Instance(request_type="loglikelihood", doc={}, arguments=p, idx=i) for i, p in enumerate(pairs)]
    kw = {"model": model, "tokenizer": tok, "mixture": "knn=0.5"}
    got = [MemlmLM(**kw, memories=f"{ds.path}?k=8&temperature=3").loglikelihood(reqs) for ds in (shard, one)]
    bare = MemlmLM(model=model, tokenizer=tok).loglikelihood(reqs)
    for a, b, c in zip(*got, bare, strict=True):
        assert a[0] == pytest.approx(b[0], rel=1e-5) and a[0] != pytest.approx(c[0], rel=1e-3)


def test_trime_external_memory_takes_a_sharded_datastore(tiny_lm, sharded_and_copy):
    from memlm.trime.inference import score_trime

    model, tok = tiny_lm
    shard, one = sharded_and_copy
    docs = make_toy_docs(3, seed=12)
    a, b = (score_trime(model, tok, docs, 16, max_segments=1, datastore=ds, k=8, batch_size=4) for ds in (shard, one))
    np.testing.assert_array_equal(a.ext_values, b.ext_values)
    np.testing.assert_allclose(a.ext_scores, b.ext_scores, rtol=1e-5)
    assert (a.ext_values >= 0).any()
