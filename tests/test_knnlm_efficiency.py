"""kNN-LM efficiency methods (memlm.knnlm): greedy-merge pruning (He et al. 2021 Sec. 5.2), OPQ / PCA indexes
(Sec. 6), adaptive retrieval (Sec. 4) and RetoMaton's pointers (Alon et al. 2022), each against a brute-force
reference on tiny synthetic datastores."""

from __future__ import annotations

import json

import faiss
import numpy as np
import pytest
import torch

from memlm.core.distribution import knn_distribution, mix
from memlm.errors import MemlmError
from memlm.knnlm.adaptive import (
    AdaptiveGate,
    gate_features,
    gate_lambdas,
    threshold_for_fraction,
    train_gate,
)
from memlm.knnlm.pointer import pointer_retrieve, retrieve_with_pointers
from memlm.knnlm.prune import greedy_merge, load_counts, neighbour_log_counts, prune_datastore
from memlm.storage.datastore import FILES, FORMAT_VERSION, Datastore, _publish
from memlm.storage.index import exact_scores, exact_search, load_index, plan_index, search, validate_factory


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Single-threaded FAISS and torch (k-means under OpenMP and small matmuls crawl on shared cores)."""
    before = faiss.omp_get_max_threads(), torch.get_num_threads()
    faiss.omp_set_num_threads(1)
    torch.set_num_threads(1)
    yield
    faiss.omp_set_num_threads(before[0])
    torch.set_num_threads(before[1])


def make_datastore(path, keys, values, doc_hash=None, offset=None, vocab=1000) -> Datastore:
    """A memlm datastore folder written straight from arrays (no model): the manifest a build would seal."""
    path.mkdir(parents=True, exist_ok=True)
    n, d = keys.shape
    doc_hash = np.zeros(n, np.int64) if doc_hash is None else doc_hash
    offset = np.arange(n) if offset is None else offset
    for name, arr in (("keys", keys), ("values", values), ("doc_hash", doc_hash), ("offset", offset)):
        np.ascontiguousarray(arr, dtype=FILES[name]).tofile(path / f"{name}.bin")
    manifest = {
        "format_version": FORMAT_VERSION,
        "model": {"name": "synthetic", "fingerprint": "0" * 16},
        "tokenizer": {"fingerprint": "0" * 16, "vocab_size": vocab},
        "key": {"role": "ffn_in", "layer": 0, "dim": d},
        "count": n,
        "dtypes": dict(FILES),
        "window": 64,
        "min_context": 0,
        "sources": [{"corpus": "synthetic"}],
    }
    _publish(manifest, path)
    return Datastore.open(path)


# --------------------------------------------------------------------------------------- greedy merging


def reference_greedy_merge(values, neighbour_ids, order):
    """He et al. 2021 Sec. 5.2 as their ``greedy_merge.py`` runs it, transcribed from its loop: every weight starts at
    1; the entries are visited in ``order`` (theirs: ``random.shuffle``); an entry whose weight is 0 (merged away) is
    skipped; otherwise each listed neighbour ``v`` that is not the entry itself, still has weight 1 (neither merged
    nor absorbed anything) and has the same value is merged: ``weights[v] = 0``, ``weights[i] += 1``. The kept
    entries are those with weight > 0, carrying their weights. (-1 slots, absent from their retrieval files, are
    passed over.)"""
    weights = [1] * len(values)
    for i in order:
        if weights[i] <= 0:
            continue
        for v in neighbour_ids[i]:
            if v >= 0 and v != i and weights[v] == 1 and values[v] == values[i]:
                weights[v] = 0
                weights[i] += 1
    keep = [i for i, w in enumerate(weights) if w > 0]
    return np.array(keep), np.array([weights[i] for i in keep])


@pytest.mark.parametrize("seed", range(6))
def test_greedy_merge_equals_the_authors_loop(seed):
    rng = np.random.default_rng(seed)
    n, k = 300, 6
    values = rng.integers(0, 4, size=n)  # few values: many merges, chains of merges
    nb = rng.integers(-1, n, size=(n, k))  # arbitrary neighbour lists, -1 slots, self and repeats included
    nb[::7, 0] = np.arange(0, n, 7)
    order = rng.permutation(n) if seed >= 2 else np.arange(n)
    keep, c = greedy_merge(values, nb, order=None if seed < 2 else order)
    ref_keep, ref_c = reference_greedy_merge(values, nb, order)
    np.testing.assert_array_equal(keep, ref_keep)
    np.testing.assert_array_equal(c, ref_c)
    assert c.sum() == n and len(keep) < n
    with pytest.raises(MemlmError, match="out of range"):
        greedy_merge(values, np.full((n, 1), n))
    with pytest.raises(MemlmError, match="permutation"):
        greedy_merge(values, nb, order=np.zeros(n, int))


def test_a_kept_entry_that_absorbed_nothing_is_merged_later():
    """Their rule, where memlm's earlier one differed: entry 0 is visited first, finds no same-valued neighbour and
    stays with weight 1; entry 1, visited next, lists 0 and 2 and absorbs both (the earlier rule never merged an entry
    visited before)."""
    values = np.array([5, 5, 5, 7])
    nb = np.array([[3, -1], [0, 2], [1, 3], [2, 0]])
    keep, c = greedy_merge(values, nb)
    assert keep.tolist() == [1, 3] and c.tolist() == [3, 1]
    # an entry that absorbed something is never merged into another: 1 has weight 2 when 2 is visited
    nb = np.array([[3, -1], [0, -1], [1, 0], [2, 0]])
    keep, c = greedy_merge(values, nb)
    assert keep.tolist() == [1, 2, 3] and c.tolist() == [2, 1, 1]


def test_pruning_a_pruned_datastore_adds_its_counts():
    """Counts from an earlier pruning: an entry that absorbed nothing in this pass is merged with its whole count."""
    values = np.array([1, 1, 1, 2])
    nb = np.array([[1, 2], [0, 2], [0, 1], [0, 1]])
    keep, c = greedy_merge(values, nb, counts=np.array([3, 2, 4, 1]))
    assert keep.tolist() == [0, 3] and c.tolist() == [9, 1]


def _duplicated_datastore(tmp_path, groups=40, dup=3, d=8, seed=0):
    """``groups`` distinct random keys, each stored ``dup`` times with the same value, rows shuffled."""
    rng = np.random.default_rng(seed)
    base = rng.normal(size=(groups, d)).astype(np.float16)
    vals = rng.integers(0, 5, size=groups)
    perm = rng.permutation(groups * dup)
    keys, values = np.repeat(base, dup, 0)[perm], np.repeat(vals, dup)[perm]
    return make_datastore(tmp_path / "full", keys, values), base


@pytest.mark.parametrize("temperature", [0.3, 2.0])
def test_pruning_exact_duplicates_keeps_the_knn_distribution(tmp_path, temperature):
    """Merged entries that are exact duplicates + counts = exactly the unpruned p_kNN, at every k that keeps whole
    groups (k_pruned groups <-> dup * k_pruned entries; duplicates tie, so the unpruned top-k holds whole groups)."""
    dup = 3
    full, base = _duplicated_datastore(tmp_path, dup=dup)
    pruned = prune_datastore(full, tmp_path / "pruned", k_merge=dup - 1, search="exact", progress=False)
    counts = load_counts(pruned)
    assert len(pruned) == len(base) and counts.tolist() == [dup] * len(base) and load_counts(full) is None
    # every kept row is one of the original rows, keys and values intact
    assert {tuple(r) for r in pruned.keys.tolist()} == {tuple(r) for r in base.tolist()}
    q = np.random.default_rng(1).normal(size=(9, base.shape[1])).astype(np.float32)

    def dist(ds, ids):  # scores in float64 from the stored keys: a duplicate's score is bit-identical to its kept copy
        s = -((q[:, None, :].astype(np.float64) - ds.keys[ids].astype(np.float64)) ** 2).sum(-1)
        return torch.from_numpy(s), torch.from_numpy(ds.values[ids].astype(np.int64))

    for kp in (1, 4, len(base)):
        p_full = knn_distribution(*dist(full, exact_search(full.keys, q, dup * kp, "l2")[1]), 5, temperature)
        i_pr = exact_search(pruned.keys, q, kp, "l2")[1]
        logc = torch.from_numpy(np.log(counts[i_pr].astype(np.float64)))
        p_pr = knn_distribution(*dist(pruned, i_pr), 5, temperature, log_counts=logc)
        np.testing.assert_allclose(p_pr.exp().numpy(), p_full.exp().numpy(), rtol=1e-12, atol=1e-15)
        np.testing.assert_allclose(neighbour_log_counts(counts, i_pr), logc.numpy(), rtol=1e-6)
    # the manifest says where it came from; pruning the pruned datastore again keeps the totals
    assert pruned.manifest["pruned"]["of_count"] == len(full) and pruned.manifest["pruned"]["k_merge"] == dup - 1
    again = prune_datastore(pruned, tmp_path / "again", k_merge=4, search="exact", progress=False)
    assert load_counts(again).sum() == len(full)


def test_prune_with_its_index_and_counts_are_checked(tmp_path):
    rng = np.random.default_rng(0)
    keys = rng.normal(size=(400, 8)).astype(np.float16)
    keys[200:] = keys[:200]  # the second half duplicates the first: half of it merges away
    values = np.tile(rng.integers(0, 50, size=200), 2)
    full = make_datastore(tmp_path / "full", keys, values)
    full.build_index("Flat", progress=False)
    pruned = prune_datastore(full, tmp_path / "p", k_merge=3, seed=5, progress=False)
    nb = exact_search(keys, keys.astype(np.float32), 4, "l2")[1]  # k_merge + 1 nearest, usually the entry first
    ref_keep, ref_c = reference_greedy_merge(values, nb, np.random.default_rng(5).permutation(len(keys)))
    np.testing.assert_array_equal(pruned.values, values[ref_keep])
    np.testing.assert_array_equal(load_counts(pruned, verify=True), ref_c)
    assert len(pruned) <= 200 and load_counts(pruned).sum() == 400
    Datastore.open(pruned.path, verify=True)
    # the counts belong to this datastore: a changed, missing or foreign counts file is refused
    np.save(pruned.path / "counts.npy", np.ones(len(pruned), np.int64))
    with pytest.raises(MemlmError, match="does not match"):
        load_counts(pruned)
    (pruned.path / "counts.json").unlink()
    with pytest.raises(MemlmError, match="missing"):
        load_counts(pruned)
    with pytest.raises(MemlmError, match="into itself"):
        prune_datastore(full, full.path, progress=False)
    assert pruned.manifest["pruned"]["seed"] == 5 and pruned.manifest["pruned"]["order"] == "random (seed 5)"
    # a finished datastore in the output folder is replaced only when asked (fails on the earlier code)
    other = make_datastore(tmp_path / "other", keys[:10], values[:10])
    with pytest.raises(MemlmError, match="already holds a datastore"):
        prune_datastore(full, other.path, k_merge=3, progress=False)
    assert len(Datastore.open(other.path)) == 10
    replaced = prune_datastore(full, other.path, k_merge=3, progress=False, overwrite=True)
    assert replaced.manifest["pruned"]["of_count"] == len(full) and load_counts(replaced).sum() == len(full)


def test_self_matches_on_a_pruned_datastore_take_only_the_tokens_own_share(tmp_path):
    """--drop-self-matches on a pruned datastore: the evaluated token's entry may have been merged into a neighbour
    (its mass stays in that count) or kept with others merged into it (dropping the entry drops theirs too). Each
    loses exactly one from its count: over exact duplicates the pruned datastore then gives the unpruned datastore's
    self-dropped distribution. Fails on the earlier code."""
    from memlm.retrieval import DatastoreMemory

    dup, groups, d = 3, 30, 8
    rng = np.random.default_rng(3)
    base = rng.normal(size=(groups, d)).astype(np.float16)
    vals = rng.integers(0, 5, size=groups)
    perm = rng.permutation(groups * dup)
    keys, values = np.repeat(base, dup, 0)[perm], np.repeat(vals, dup)[perm]
    doc_hash, offset = np.repeat(np.arange(10), 9), np.tile(np.arange(9), 10)
    full = make_datastore(tmp_path / "full", keys, values, doc_hash, offset)
    pruned = prune_datastore(full, tmp_path / "pruned", k_merge=dup - 1, search="exact", progress=False)
    assert len(pruned) == groups
    rows = np.arange(len(full))  # every original entry evaluated as its own token
    q = keys.astype(np.float32)
    prov = {"doc_hash": doc_hash[rows], "offset": offset[rows]}
    kept = np.isin(rows, [r for r in rows if ((pruned.doc_hash == doc_hash[r]) & (pruned.offset == offset[r])).any()])
    assert kept.any() and (~kept).any()  # both cases occur
    for kp in (1, 3):
        r_full = DatastoreMemory(full, search="exact").search(q, dup * kp, prov)
        r_pr = DatastoreMemory(pruned, search="exact").search(q, kp, prov)
        for t in (0.5, 3.0):
            p_full = knn_distribution(*_t(r_full.scores, r_full.values), 5, t)
            p_pr = knn_distribution(*_t(r_pr.scores, r_pr.values), 5, t, log_counts=torch.from_numpy(r_pr.log_counts))
            np.testing.assert_allclose(p_pr.exp().numpy(), p_full.exp().numpy(), rtol=1e-5, atol=1e-7)
    # a datastore pruned before memlm recorded the merged entries: refused, not silently wrong
    (tmp_path / "pruned" / "absorbed.npy").unlink()
    with pytest.raises(MemlmError, match="absorbed.npy"):
        DatastoreMemory(pruned, search="exact").search(q, 2, prov)


def _t(scores, values):
    return torch.from_numpy(scores.astype(np.float64)), torch.from_numpy(values.astype(np.int64))


# ------------------------------------------------------------------------- dimension reduction, OPQ (Sec. 6)


@pytest.mark.parametrize(
    ("factory", "d", "train_size"),
    [("OPQ32,IVF64,PQ32", 64, 256), ("OPQ16_32,IVF16,PQ16", 64, 256), ("PCA128,IVF64,PQ32", 256, None),
     ("PCAR32,Flat", 64, None)],
)  # fmt: skip
def test_opq_and_pca_factories_build_and_search(tmp_path, factory, d, train_size):
    """He et al.'s dimension reduction (Sec. 6) as FAISS factory strings through memlm's index builder (what
    ``memlm index build DS --factory ...`` calls), searched after a save/load round trip. (OPQ trains in ~0.2 s on
    256 keys, ~10 s on 2048: the smallest sample its 8-bit PQ accepts keeps the test fast.)"""
    rng = np.random.default_rng(0)
    n = 1024
    centers = rng.normal(size=(32, d))
    keys = (centers[rng.integers(0, 32, n)] + 0.3 * rng.normal(size=(n, d))).astype(np.float16)
    ds = make_datastore(tmp_path / "ds", keys, rng.integers(0, 100, n))
    ds.build_index(factory, train_size=train_size, progress=False)
    index = ds.load_index(nprobe=16)
    assert index.ntotal == n and index.d == d
    q = keys[:50].astype(np.float32)
    s, ids = search(index, q, 5)
    assert ((ids >= 0) & (ids < n)).all() and np.all(np.diff(s, axis=1) <= 1e-4)
    # each query's own key is found among its 5 nearest (measured: all 50)
    assert np.mean([i in row for i, row in enumerate(ids.tolist())]) >= 0.9
    meta = json.loads((tmp_path / "ds" / "index.faiss.json").read_text())
    assert (meta["factory"], meta["d"]) == (factory, d)
    assert load_index(tmp_path / "ds" / "index.faiss").ntotal == n


def test_pca_factory_errors_are_caught_before_training():
    """A PCA that would output more dimensions than its input, or than it has training keys, fails in FAISS only
    after the training sample is read, with a message about neither; memlm refuses it while planning."""
    with pytest.raises(MemlmError, match="PCA128 cannot output more dimensions than its 64 inputs"):
        validate_factory("PCA128,IVF16,PQ16", 64)
    with pytest.raises(MemlmError, match="needs at least 128 keys"):
        plan_index(100, 256, "PCA128,Flat")
    with pytest.raises(MemlmError, match="reduced dimension"):
        validate_factory("PCA32,IVF16,PQ64", 64)
    assert plan_index(1000, 256, "PCA128,IVF16,PQ32").train_size == 1000


# ------------------------------------------------------------------------------- adaptive retrieval (Sec. 4)


def test_gated_logprob_is_the_per_token_mixture():
    rng = np.random.default_rng(0)
    n = 200
    p_lm = rng.uniform(1e-4, 1, n)
    p_knn = rng.uniform(0, 1, n)
    p_knn[::5] = 0.0  # targets not retrieved: log p_kNN = -inf
    lam = rng.uniform(0, 1, n)
    lam[::7], lam[1::7] = 0.0, 1.0
    knn = np.log(np.where(p_knn > 0, p_knn, 1.0))
    knn[p_knn == 0] = -np.inf
    skipped = (lam == 0) & (np.arange(n) % 2 == 0)
    knn_garbage = np.where(skipped, np.nan, knn)  # a skipped search leaves nothing meaningful behind
    lam_t = torch.tensor(lam)
    got = mix([torch.tensor(np.log(p_lm)), torch.tensor(knn_garbage)], weights=[1 - lam_t, lam_t]).numpy()
    with np.errstate(divide="ignore"):
        ref = np.log((1 - lam) * p_lm + lam * p_knn)
    np.testing.assert_allclose(got, ref, rtol=1e-12, atol=1e-12)
    assert np.isneginf(got[(lam == 1) & (p_knn == 0)]).all() and np.isfinite(got[lam < 1]).all()
    np.testing.assert_array_equal(got[lam == 0], np.log(p_lm)[lam == 0])  # exactly the LM
    with pytest.raises(MemlmError, match="sum to 1"):
        mix([torch.zeros(2), torch.zeros(2)], weights=[torch.tensor([0.5, -0.5]), torch.tensor([0.5, 1.5])])


@pytest.mark.parametrize("lam", [0.0, 0.25, 0.9, 1.0])
def test_constant_gate_equals_the_constant_mixture(lam):
    rng = np.random.default_rng(1)
    feats = gate_features(rng.uniform(0, 6, 50), -rng.uniform(0, 5, 50), rng.integers(0, 500, 50))
    lm = torch.log(torch.tensor(rng.uniform(0.01, 1, 50), dtype=torch.float32))
    knn = torch.log(torch.tensor(rng.uniform(0, 1, 50), dtype=torch.float32))
    gate = AdaptiveGate()
    with torch.no_grad():  # a gate that ignores its input: last layer's weights 0, bias logit(λ)
        last = gate.mlp[-1]
        last.weight.zero_()
        last.bias.fill_(float(np.log(lam / (1 - lam))) if 0 < lam < 1 else (-np.inf if lam == 0 else np.inf))
    lam_t = gate.lambdas(feats)
    np.testing.assert_allclose(lam_t, lam, rtol=1e-7)
    np.testing.assert_allclose(
        mix([lm, knn], weights=[1 - torch.from_numpy(lam_t), torch.from_numpy(lam_t)]).numpy(),
        mix([lm, knn], weights=[1 - lam, lam]).numpy(),
        atol=1e-6,
    )


def _entropy_task(n=1000, seed=0):
    """The kNN term helps only where the LM is unsure (high entropy); elsewhere it is useless or missing."""
    rng = np.random.default_rng(seed)
    ent = rng.uniform(0, 6, n)
    maxlp = -0.3 * ent - rng.uniform(0, 0.5, n)
    pos = rng.integers(0, 1000, n)
    high = ent > 3
    lm = np.where(high, rng.uniform(-6, -4, n), rng.uniform(-0.3, -0.05, n))
    knn = np.where(high, rng.uniform(-1, -0.1, n), rng.uniform(-9, -6, n))
    knn[(~high) & (rng.uniform(size=n) < 0.3)] = -np.inf
    return gate_features(ent, maxlp, pos), lm.astype(np.float32), knn.astype(np.float32), high


def test_trained_gate_learns_where_the_knn_term_helps(tmp_path):
    feats, lm, knn, high = _entropy_task()
    gate = train_gate(feats, lm, knn, steps=150, seed=3)
    lam = gate.lambdas(feats)
    assert lam[high].mean() > 0.8 and lam[~high].mean() < 0.1, (lam[high].mean(), lam[~high].mean())
    # better than the best constant λ on the same tokens
    lm_t, knn_t = torch.from_numpy(lm), torch.from_numpy(knn)
    best_const = min(-mix([lm_t, knn_t], weights=[1 - c, c]).mean().item() for c in np.linspace(0, 1, 21))
    lam_t = torch.from_numpy(lam)
    assert -mix([lm_t, knn_t], weights=[1 - lam_t, lam_t]).mean().item() < best_const - 0.5
    # deterministic, and a save/load round trip gives the same gate
    again = train_gate(feats, lm, knn, steps=150, seed=3)
    assert all(torch.equal(a, b) for a, b in zip(gate.state_dict().values(), again.state_dict().values(), strict=True))
    gate.save(tmp_path / "gate.npz")
    np.testing.assert_array_equal(AdaptiveGate.load(tmp_path / "gate.npz").lambdas(feats), lam)
    with pytest.raises(MemlmError, match="trained on features"):
        AdaptiveGate.load(tmp_path / "gate.npz", feature_names=("lm_entropy", "context_vector"))
    (tmp_path / "bad.npz").write_bytes(b"not a gate")
    with pytest.raises(MemlmError, match="not a memlm adaptive-retrieval gate"):
        AdaptiveGate.load(tmp_path / "bad.npz")


@pytest.mark.parametrize("fraction", [0.0, 0.1, 0.37, 0.5, 1.0])
def test_threshold_for_fraction(fraction):
    feats, lm, knn, _ = _entropy_task(n=1000, seed=1)
    gate = train_gate(feats, lm, knn, steps=20, seed=0)
    thr = threshold_for_fraction(gate, feats, fraction)
    lam, searched = gate_lambdas(gate, feats, thr)
    assert searched.sum() == round(fraction * len(feats))
    assert (lam[~searched] == 0).all() and (lam[searched] >= thr).all()
    # the searched tokens are the ones with the largest λ
    if 0 < fraction < 1:
        assert gate.lambdas(feats)[~searched].max() < thr


# ----------------------------------------------------------------------------------- RetoMaton pointers


def reference_retomaton(queries, targets, doc_index, search_fn, keys, values, doc_hash, offset, k, min_knns, metric,
                        rule="retomaton", provenance=None):  # fmt: skip
    """Token by token, as neulab/retomaton scores a text (``SequenceScorer.score_with_knnlm`` with
    ``KNN_Dstore.get_knn_log_prob``; Alon et al. 2022 Sec. 3), written from their loop:

    * ``cur_knns``: the entries the previous step scored with whose value was the token just seen and that have a
      successor, sorted by score, best first; ``pointers = cur_knns + 1``, at most ``max_knns`` (= k) of them;
    * ``len(cur_knns) < min_knns``: search, and score with the search results *and* the pointers
      (``np.concatenate([knns, pointers])``); otherwise score with the pointers alone;
    * every score recomputed from the stored keys (their default for L2).

    memlm's three changes, on purpose: a successor must be in the same datastore document; an entry both retrieved
    and pointed to enters once; the evaluated token's own entry (``provenance``) is never a survivor (it stays in
    the row, for the memory to drop).
    ``rule="replace"``: memlm's earlier rule, the pointers discarded when searching.
    """
    n = len(targets)
    rows, searched = [], np.zeros(n, bool)
    cur_knns = []  # (score, id) of the previous step's correct entries
    for t in range(n):
        if t == 0 or doc_index[t] != doc_index[t - 1]:
            cur_knns = []  # a new evaluated document
        cur_knns = sorted(cur_knns, key=lambda x: (-x[0], x[1]))
        pointers = [i + 1 for _, i in cur_knns][:k]
        if len(cur_knns) < min_knns:
            searched[t] = True
            found = [int(i) for i in search_fn(queries[t : t + 1])[1][0] if i >= 0]
            entries = found + ([p for p in pointers if p not in found] if rule == "retomaton" else [])
        else:
            entries = pointers
        sc = exact_scores(keys, np.array(entries, np.int64)[None], queries[t : t + 1], metric)[0] if entries else []
        row = sorted(zip(sc.tolist() if len(entries) else [], entries, strict=True), key=lambda x: (-x[0], x[1]))
        rows.append(row)
        own = (provenance["doc_hash"][t], provenance["offset"][t]) if provenance is not None else None
        cur_knns = [(s, i) for s, i in row if values[i] == targets[t] and i + 1 < len(values)
                    and doc_hash[i + 1] == doc_hash[i] and offset[i + 1] == offset[i] + 1
                    and (doc_hash[i], offset[i]) != own]  # fmt: skip
    width = max(1, max(len(r) for r in rows))
    out_s, out_i = np.full((n, width), -np.inf, np.float32), np.full((n, width), -1, np.int64)
    for t, row in enumerate(rows):
        out_s[t, : len(row)] = [s for s, _ in row]
        out_i[t, : len(row)] = [i for _, i in row]
    return out_s, out_i, searched


def _same_rows(got, want):
    """Pointer output == reference, up to the reference's (narrower) padding."""
    (s, i, searched), (rs, ri, rsearched) = got, want
    np.testing.assert_array_equal(searched, rsearched)
    w = ri.shape[1]
    assert w <= i.shape[1] and (i[:, w:] == -1).all()
    np.testing.assert_array_equal(i[:, :w], ri)
    np.testing.assert_allclose(s[:, :w], rs, rtol=1e-6, atol=1e-5)


def _phrase_corpus(n_docs, seed, vocab=30, n_phrases=5, phrase_len=8, doc_phrases=(3, 9)):
    """Documents made of a few fixed phrases in random order: the datastore's continuations repeat."""
    rng = np.random.default_rng(seed)
    phrases = np.random.default_rng(100).integers(0, vocab, size=(n_phrases, phrase_len))
    return [np.concatenate(phrases[rng.integers(0, n_phrases, rng.integers(*doc_phrases))]) for _ in range(n_docs)]


def _contexts(docs, emb, rng, noise=0.3):
    """Entry j of a document: key = f(tokens up to j) (last token + half the one before + noise), value = token j+1."""
    keys, values, doc_hash, offset = [], [], [], []
    for h, toks in enumerate(docs):
        prev2 = np.r_[0, toks[:-2]]
        keys.append(emb[toks[:-1]] + 0.5 * emb[prev2] + noise * rng.normal(size=(len(toks) - 1, emb.shape[1])))
        values.append(toks[1:])
        doc_hash.append(np.full(len(toks) - 1, 1000 + h))
        offset.append(np.arange(1, len(toks)))
    return [np.concatenate(a) for a in (keys, values, doc_hash, offset)]


def _exact_search_fn(keys, k, metric):
    kf = keys.astype(np.float64)

    def fn(q):  # per query row, float64, stable: the same numbers whatever the batch
        out_s, out_i = np.full((len(q), k), -np.inf, np.float32), np.full((len(q), k), -1, np.int64)
        for r, x in enumerate(q.astype(np.float64)):
            s = -((kf - x) ** 2).sum(1) if metric == "l2" else kf @ x
            top = np.argsort(-s, kind="stable")[:k]
            out_s[r, : len(top)], out_i[r, : len(top)] = s[top], top
        return out_s, out_i

    return fn


@pytest.fixture(scope="module")
def pointer_data():
    rng = np.random.default_rng(0)
    emb = rng.normal(size=(30, 16))
    keys, values, doc_hash, offset = _contexts(_phrase_corpus(12, seed=1), emb, rng)
    q, targets, _, _ = _contexts(_phrase_corpus(5, seed=2), emb, rng)
    lengths = [len(d) - 1 for d in _phrase_corpus(5, seed=2)]
    doc_index = np.repeat(np.arange(5), lengths)
    return dict(queries=q.astype(np.float32), targets=targets, doc_index=doc_index, keys=keys.astype(np.float16),
                values=values.astype(np.int32), doc_hash=doc_hash, offset=offset.astype(np.int32))  # fmt: skip


@pytest.mark.parametrize(
    ("k", "min_surv", "lookahead", "metric", "rule"),
    [(8, 1, 32, "l2", "retomaton"), (8, 2, 3, "l2", "retomaton"), (4, 3, 1, "l2", "retomaton"),
     (16, 4, 5, "ip", "retomaton"), (8, 1, 2, "ip", "retomaton"), (8, 3, 4, "l2", "replace"),
     (4, 6, 3, "l2", "retomaton")],
)  # fmt: skip
def test_pointers_equal_the_authors_token_by_token_loop(pointer_data, k, min_surv, lookahead, metric, rule):
    d = pointer_data
    fn = _exact_search_fn(d["keys"], k, metric)
    args = (d["queries"], d["targets"], d["doc_index"], fn, d["keys"], d["values"], d["doc_hash"], d["offset"], k)
    got = pointer_retrieve(*args, min_surv, metric, lookahead=lookahead, rule=rule)
    want = reference_retomaton(*args, min_surv, metric, rule=rule)
    _same_rows(got, want)
    searched = got[2]
    first = np.r_[True, d["doc_index"][1:] != d["doc_index"][:-1]]
    assert searched[first].all()  # a new document always searches
    if min_surv <= k:
        assert searched.mean() < 0.5  # the repeated phrases let chains survive (measured 0.09-0.21 searched)


def test_a_search_keeps_the_surviving_pointers(pointer_data):
    """The authors' rule: where fewer than N pointers survive, the searched row holds the k search results AND the
    survivors' successors (memlm's earlier rule dropped the pointers). With N > k at most k pointers are carried."""
    d = pointer_data
    k, n_min = 4, 3
    fn = _exact_search_fn(d["keys"], k, "l2")
    args = (d["queries"], d["targets"], d["doc_index"], fn, d["keys"], d["values"], d["doc_hash"], d["offset"], k)
    s, i, searched = pointer_retrieve(*args, n_min, "l2")
    rs, ri, _ = pointer_retrieve(*args, n_min, "l2", rule="replace")
    assert i.shape[1] == k + n_min - 1 and ri.shape[1] == k
    merged = searched & ((i >= 0).sum(1) > k)  # searched rows that also carry pointers
    assert merged.sum() > 10
    plain = fn(d["queries"][merged])[1]
    for row, found in zip(i[merged], plain, strict=True):
        assert set(found) < set(row[row >= 0])  # all the search results, plus the pointers
    s, i, searched = pointer_retrieve(*args, k + 2, "l2")
    assert i.shape[1] == 2 * k and ((i >= 0).sum(1) > k).any() and searched.mean() > 0.5


@pytest.mark.parametrize("seed", range(4))
def test_pointers_on_random_edge_cases(seed):
    """Tied scores (duplicate keys), k larger than the datastore (-1 slots), one-token documents, a document index
    that comes back (a new run is a new document), datastore documents cut mid-stream: still the reference."""
    rng = np.random.default_rng(seed)
    nds, n, k = 20, 60, 25
    keys = rng.normal(size=(nds, 4)).astype(np.float16)
    keys[5:10] = keys[0]  # ties
    values = rng.integers(0, 2, nds).astype(np.int32)
    doc_hash = np.repeat([7, 8, 9], [8, 5, 7])
    offset = np.r_[np.arange(8), np.arange(5) + 3, np.arange(7)].astype(np.int32)
    offset[15] += 2  # a gap: 15 does not follow 14
    q = rng.normal(size=(n, 4)).astype(np.float32)
    targets = rng.integers(0, 2, n)
    doc_index = np.r_[np.zeros(20), [1], np.full(15, 2), [3], np.zeros(23)].astype(int)  # doc 0 again: new run
    fn = _exact_search_fn(keys, k, "l2")
    args = (q, targets, doc_index, fn, keys, values, doc_hash, offset, k)
    for min_surv, lookahead in ((1, 4), (3, 1), (6, 7)):
        for rule in ("retomaton", "replace"):
            got = pointer_retrieve(*args, min_surv, "l2", lookahead=lookahead, rule=rule)
            _same_rows(got, reference_retomaton(*args, min_surv, "l2", rule=rule))
            assert got[2][[0, 20, 21, 36, 37]].all() and not got[2].all()


def test_self_matches_are_dropped_before_survivors_are_counted(pointer_data):
    """Evaluating text that is in the datastore with self-matches dropped: the self entry's chain would never break
    (it always predicts the next token), so pointer reuse must not count it. Fails on the earlier code, which
    searched ~2% of the tokens and left rows that held nothing but the self-match."""
    d = pointer_data
    k = 8
    docs = d["doc_hash"]
    own = np.flatnonzero(np.isin(docs, np.unique(docs)[:4]))  # the first four datastore documents, evaluated
    q = d["keys"][own].astype(np.float32)
    targets, doc_index = d["values"][own].astype(np.int64), docs[own]
    prov = {"doc_hash": docs[own], "offset": d["offset"][own]}
    fn = _exact_search_fn(d["keys"], k, "l2")
    args = (q, targets, doc_index, fn, d["keys"], d["values"], d["doc_hash"], d["offset"], k)
    got = pointer_retrieve(*args, 2, "l2", provenance=prov)
    _same_rows(got, reference_retomaton(*args, 2, "l2", provenance=prov))
    s, i, searched = got
    is_self = (
        (i >= 0)
        & (d["doc_hash"][np.maximum(i, 0)] == prov["doc_hash"][:, None])
        & (d["offset"][np.maximum(i, 0)] == prov["offset"][:, None])
    )
    assert not is_self[~searched].any()  # a pointer row never holds the token itself (a searched row may)
    assert searched.mean() > 0.1 and ((i >= 0) & ~is_self).sum(1).min() >= 1  # not the self-chain's ~0 searches
    # without provenance the self entry's chain carries every row after the first: almost no searches
    assert pointer_retrieve(*args, 2, "l2")[2].mean() < 0.1


def test_retrieve_with_pointers_on_a_datastore(tmp_path, pointer_data):
    d = pointer_data
    ds = make_datastore(tmp_path / "ds", d["keys"], d["values"], d["doc_hash"], d["offset"], vocab=30)
    index = ds.build_index("Flat", metric="ip", progress=False)
    got = retrieve_with_pointers(ds, d["queries"], d["targets"], d["doc_index"], k=8, min_survivors=2)
    fn = lambda q: search(index, q, 8)  # noqa: E731
    want = reference_retomaton(d["queries"], d["targets"], d["doc_index"], fn, d["keys"], d["values"],
                               d["doc_hash"], d["offset"], 8, 2, "ip")  # fmt: skip
    _same_rows(got, want)
    assert 0 < got[2].mean() < 0.5


def test_pointer_rows_and_searched_rows_share_one_score_scale(tmp_path, pointer_data):
    """Under a dimension-reducing index (PCA) the index's scores are distances in the reduced space; the pointers'
    are full-dimension distances from the stored keys. Every row is scored exactly, so one τ serves both (fails on
    the earlier code, which kept the index's scores in searched rows)."""
    d = pointer_data
    ds = make_datastore(tmp_path / "ds", d["keys"], d["values"], d["doc_hash"], d["offset"], vocab=30)
    index = ds.build_index("PCA4,Flat", metric="l2", progress=False)
    s, i, searched = retrieve_with_pointers(ds, d["queries"], d["targets"], d["doc_index"], k=8, min_survivors=2,
                                            index=index)  # fmt: skip
    assert searched.any() and (~searched).any()
    want = exact_scores(d["keys"], i, d["queries"], "l2")
    np.testing.assert_allclose(s, want, rtol=1e-6, atol=1e-5)
    index_scores = search(index, d["queries"][searched], 8)[0]
    assert np.abs(index_scores - s[searched][:, :8]).max() > 1.0  # the index's scale is another one
