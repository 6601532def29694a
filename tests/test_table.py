"""The per-token table and the components that fill it: each memory's columns are what its own code computes
(Khandelwal et al. 2020 Eq. 2 by brute force, the ∞-gram's score_documents, the continuous cache), and a saved
table reads back to the same numbers."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from conftest import Doc, make_toy_docs
from test_ngram import corpus, index, tok  # noqa: F401 (module fixtures: an ∞-gram index over toy documents)

from memlm.errors import MemlmError
from memlm.knnlm.cache import CacheComponent, continuous_cache
from memlm.knnlm.table import TokenTable
from memlm.mixing.component import Batch, Component
from memlm.mixing.datastore import DatastoreComponent
from memlm.ngram.memory import NgramMemory
from memlm.ngram.step import NgramComponent


def _neighbours(seed: int, n: int = 40, k: int = 6, vocab: int = 9, counts: bool = False):
    rng = np.random.default_rng(seed)
    scores = -np.sort(rng.uniform(0, 8, (n, k)), axis=1).astype(np.float32)
    values = rng.integers(0, vocab, (n, k)).astype(np.int32)
    values[:3, 4:], scores[:3, 4:] = -1, -np.inf  # fewer than k entries
    values[3], scores[3] = -1, -np.inf  # nothing retrieved
    targets = rng.integers(0, vocab, n)
    columns = {"scores": scores, "values": values}
    if counts:
        columns["log_counts"] = np.log(rng.integers(1, 5, (n, k))).astype(np.float32)
    return columns, targets


@pytest.mark.parametrize("counts", [False, True])
def test_datastore_logprob_is_eq2_by_brute_force(counts):
    """p_kNN(w | c) = Σ_i 1[v_i = w] n_i exp(s_i / τ) / Σ_j n_j exp(s_j / τ) over the k' best (Eq. 2; n_i the
    merged counts of a pruned datastore), computed entry by entry in Python floats."""
    columns, targets = _neighbours(1, counts=counts)
    component = DatastoreComponent(None, 6, temperature=2.0)
    for tau, k in ((2.0, None), (0.7, 4), (5.0, 1)):
        got = component.logprob(columns, targets, temperature=tau, k=k).numpy()
        for i, target in enumerate(targets):
            top, num = (k or 6), 0.0
            den = 0.0
            for j in range(top):
                s, v = float(columns["scores"][i, j]), int(columns["values"][i, j])
                if v < 0:
                    continue
                n = math.exp(float(columns["log_counts"][i, j])) if counts else 1.0
                den += n * math.exp(s / tau)
                num += n * math.exp(s / tau) if v == target else 0.0
            want = math.log(num / den) if num > 0 else -math.inf
            assert got[i] == pytest.approx(want, rel=1e-5, abs=1e-6) if num > 0 else got[i] == -math.inf
    assert np.array_equal(component.logprob(columns, targets).numpy(),
                          component.logprob(columns, targets, temperature=2.0).numpy())  # fmt: skip


def test_ngram_component_scores_what_score_documents_gives(index, tok):  # noqa: F811
    """NgramComponent.score over a batch of targets in any order: each target's statistics are those
    NgramMemory.score_documents gives for its document and offset."""
    memory = NgramMemory(index)
    docs = {i: np.asarray(tok(d.text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id])
            for i, d in enumerate(make_toy_docs(4, seed=31))}  # fmt: skip
    doc_index = np.concatenate([np.full(len(t) - 1, i) for i, t in docs.items()])
    position = np.concatenate([np.arange(1, len(t)) for t in docs.values()])
    order = np.random.default_rng(0).permutation(len(doc_index))  # scored out of document order
    doc_index, position = doc_index[order], position[order]
    targets = np.array([docs[d][p] for d, p in zip(doc_index, position, strict=True)])
    batch = Batch(targets=targets, doc_index=doc_index, position=position, documents=docs)
    got = NgramComponent(memory).score(batch)
    for d, tokens in docs.items():
        rows = np.flatnonzero(doc_index == d)
        rows = rows[np.argsort(position[rows])]
        want = memory.score_documents([tokens], [position[rows]])
        for f in ("logprob", "count", "n", "sparse"):
            np.testing.assert_array_equal(got[f][rows], np.asarray(getattr(want, f)), err_msg=f)
    with pytest.raises(MemlmError, match="not these documents"):
        NgramComponent(memory).score(Batch(targets=targets + 1, doc_index=doc_index, position=position,
                                           documents=docs))  # fmt: skip


def test_cache_component_scores_what_continuous_cache_gives():
    rng = np.random.default_rng(2)
    keys = rng.normal(size=(50, 5)).astype(np.float32)
    targets, doc = rng.integers(0, 7, 50), np.repeat([0, 1, 2], [12, 30, 8])
    component = CacheComponent(k=4, max_len=10, metric="l2", temperature=0.5)
    got = component.score(Batch(queries={component.key_spec: keys}, targets=targets, doc_index=doc))
    scores, values = continuous_cache(keys, targets, doc, k=4, max_len=10, metric="l2")
    np.testing.assert_array_equal(got["scores"], scores)
    np.testing.assert_array_equal(got["values"], values)


def _table(n: int = 40) -> TokenTable:
    rng = np.random.default_rng(3)
    columns, targets = _neighbours(4, n=n, counts=True)
    table = TokenTable(targets=targets.astype(np.int64), doc_index=np.repeat([0, 1], n // 2).astype(np.int32),
                       lm_logprob=np.log(rng.uniform(0.01, 1, n)).astype(np.float32),
                       position=np.tile(np.arange(n // 2), 2).astype(np.int32),
                       lm_entropy=rng.uniform(0, 3, n).astype(np.float32),
                       lm_max_logprob=-rng.uniform(0, 1, n).astype(np.float32), meta={"model": "toy"})  # fmt: skip
    table.add(DatastoreComponent(None, 6, temperature=3.0), columns)
    ngram = {"logprob": np.log(rng.uniform(0, 1, n)).astype(np.float32), "count": rng.integers(1, 9, n),
             "n": rng.integers(1, 6, n).astype(np.int32), "sparse": rng.random(n) < 0.3}  # fmt: skip
    table.add(NgramComponent(None), ngram)
    second, _ = _neighbours(5, n=n)
    table.add(DatastoreComponent(None, 6, temperature=0.5), second)
    table.add(CacheComponent(k=6, temperature=1.5), _neighbours(6, n=n)[0])
    return table


def test_table_names_components_and_reads_back_the_same_numbers(tmp_path):
    """Names by kind in the order given (knn, ngram, knn2, cache); saved as one .npz with ``knn/scores``-style
    arrays and each component's record; loaded, every logprob and feature is the same, at each memory's own
    recorded settings (τ per datastore)."""
    from memlm.mixing.inputs import mixture_inputs

    table = _table()
    assert table.names() == ("knn", "ngram", "knn2", "cache") and table.names("knn") == ("knn", "knn2")
    path = tmp_path / "t.npz"
    table.save(path)
    with np.load(path) as z:
        assert {"knn/scores", "knn/log_counts", "ngram/sparse", "knn2/values", "cache/scores"} <= set(z.files)
    back = TokenTable.load(path)
    assert back.names() == table.names() and back.meta["model"] == "toy"
    assert back.meta["components"]["knn2"] == {"kind": "knn", "k": 6, "temperature": 0.5}
    for name in ("lm", *table.names()):
        np.testing.assert_array_equal(back.logprob(name).numpy(), table.logprob(name).numpy(), err_msg=name)
    assert not np.array_equal(back.logprob("knn2").numpy(), back.logprob("knn2", temperature=3.0).numpy())
    a, b = mixture_inputs(table, {"knn": 2.0, "knn2": 0.7}, 4), mixture_inputs(back, {"knn": 2.0, "knn2": 0.7}, 4)
    assert a.components == ("lm", "knn", "ngram", "knn2", "cache") and a.feature_names == b.feature_names
    np.testing.assert_array_equal(a.logprobs, b.logprobs)
    np.testing.assert_array_equal(a.features, b.features)
    np.testing.assert_array_equal(a.logprobs[:, 3], table.logprob("knn2", temperature=0.7, k=4).numpy())
    np.testing.assert_array_equal(back.sparse("ngram"), table.columns["ngram"]["sparse"])
    only = back.select(["knn2"], rename={"knn2": "knn"})
    assert only.names() == ("knn",) and np.array_equal(only.logprob("knn").numpy(), back.logprob("knn2").numpy())


def test_an_old_dump_or_an_unknown_kind_is_refused_with_the_fix(tmp_path):
    n = 5
    old = {"targets": np.zeros(n, np.int64), "lm_logprob": np.zeros(n, np.float32), "doc_index": np.zeros(n, np.int32),
           "knn_scores": np.zeros((n, 2), np.float32), "knn_values": np.zeros((n, 2), np.int32)}  # fmt: skip
    np.savez(tmp_path / "old.npz", meta=np.array(json.dumps({"k": 2})), **old)
    with pytest.raises(MemlmError, match="older memlm.*rerun memlm eval --dump"):
        TokenTable.load(tmp_path / "old.npz")

    class Mine(Component):
        kind = "mine-only-here"

    table = _table()
    table.add(Mine(), {"logprob": np.zeros(len(table), np.float32)})
    table.save(tmp_path / "mine.npz")
    assert TokenTable.load(tmp_path / "mine.npz").names()[-1] == "mine-only-here"  # its class is imported
    del Component.kinds["mine-only-here"]
    with pytest.raises(MemlmError, match="no imported class declares"):
        TokenTable.load(tmp_path / "mine.npz")


def test_score_tokens_takes_one_list_and_no_weight_or_cache_setting(tiny_lm):
    from memlm.knnlm.scoring import score_tokens

    model, tokenizer = tiny_lm
    docs = [Doc("a", "the cat sat on the mat and the cat sat again")]
    ts = score_tokens(model, tokenizer, docs, [CacheComponent(k=4)], window=16, min_context=4, progress=False)
    assert ts.names() == ("cache",) and ts.columns["cache"]["scores"].shape == (len(ts), 4)
    assert ts.meta["components"]["cache"]["seconds"] >= 0
    for setting in ({"cache": True}, {"lam": 0.25}, {"cache_lambda": 0.1}):
        with pytest.raises(MemlmError, match=f"unknown retrieval settings \\['{next(iter(setting))}'\\]"):
            score_tokens(model, tokenizer, docs, [], window=16, min_context=4, progress=False, **setting)
