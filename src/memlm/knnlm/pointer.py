"""Pointer reuse: RetoMaton's automaton over the datastore (Alon et al. 2022, "Neuro-Symbolic Language Modeling with
Automaton-augmented Retrieval", ICML).

A datastore entry ``i`` stores (key = context representation, value ``v_i`` = the token that followed), and entry
``i + 1`` is what the same corpus said one token later. After a kNN-LM step has retrieved the entries ``S_t`` and the
true token ``x_t`` (the target of step ``t``) is seen, the entries of ``S_t`` that predicted it correctly point to their
successors, which are good candidates for step ``t + 1`` without searching again::

    P_{t+1} = { i + 1 : i in S_t, v_i = x_t, entry i + 1 follows entry i in the same datastore document }

("follows": ``doc_hash[i + 1] == doc_hash[i]`` and ``offset[i + 1] == offset[i] + 1``). If ``|P_{t+1}| >=
min_survivors`` the search for step ``t + 1`` is skipped and ``S_{t+1} = P_{t+1}``, their scores ``s(q_{t+1}, k_i)``
recomputed exactly from the stored fp16 keys (:func:`memlm.index.exact_scores`, the index's metric); otherwise step
``t + 1`` searches as usual (``S_{t+1}`` = the top-k). The first token of an evaluated document always searches (no
chain crosses a document boundary). The kNN distribution over ``S_t`` is then the usual one
(:mod:`memlm.core.distribution`); the saving is the fraction of searches skipped (Alon et al. report ~80% with little
or no perplexity loss; this is the pointer part of RetoMaton, without its clustering of entries into automaton states).

Vectorised: a chain started at ``t0`` from the set ``S_{t0}`` survives ``m`` steps for exactly the entries ``i`` of
``S_{t0}`` whose stored continuation ``v_i, ..., v_{i+m-1}`` equals ``x_{t0}, ..., x_{t0+m-1}`` within one datastore
document, and the pointer set of step ``t0 + m`` is ``{i + m}`` over them. So one ``[k, L]`` comparison per chain
gives its whole run: the first ``m`` where fewer than ``min_survivors`` remain is the next search. All evaluated
documents advance together in rounds; each round makes one batched search for every document that needs one and
looks ``lookahead`` steps ahead for every document (a chain longer than that continues in the next round without a
search). The rows of pointer steps are filled for all tokens at once, and their exact scores computed in one call.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from memlm import index as index_lib
from memlm.errors import MemlmError

__all__ = ["pointer_retrieve", "retrieve_with_pointers", "successor_ok"]

SearchFn = Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]
_GATHER_BUDGET = 1 << 20  # elements of one [docs, k, lookahead] block (a few such int64 arrays live at once)


def successor_ok(ids: np.ndarray, doc_hash: np.ndarray, offset: np.ndarray) -> np.ndarray:
    """Whether entry ``i + 1`` is the successor of entry ``i`` (same document, next offset), elementwise; ``False``
    for ``i = -1`` and for the last entry of the datastore."""
    ids = np.asarray(ids, dtype=np.int64)
    n = len(doc_hash)
    ok = (ids >= 0) & (ids + 1 < n)
    a = np.where(ok, ids, 0)
    b = np.where(ok, ids + 1, 0)
    return ok & (doc_hash[a] == doc_hash[b]) & (offset[b] == offset[a].astype(np.int64) + 1)


def _segments(doc_index: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Start and end (exclusive) of each maximal run of equal ``doc_index``: the evaluated documents."""
    n = len(doc_index)
    starts = np.flatnonzero(np.r_[True, doc_index[1:] != doc_index[:-1]]) if n else np.zeros(0, np.int64)
    ends = np.r_[starts[1:], n].astype(np.int64)
    return starts.astype(np.int64), ends


def pointer_retrieve(
    queries: np.ndarray,
    targets: np.ndarray,
    doc_index: np.ndarray,
    search_fn: SearchFn,
    keys: np.ndarray,
    values: np.ndarray,
    doc_hash: np.ndarray,
    offset: np.ndarray,
    k: int,
    min_survivors: int = 1,
    metric: str = "l2",
    lookahead: int = 32,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """kNN retrieval for ``N`` evaluated tokens with RetoMaton's pointers (see the module docstring).

    ``queries`` ``[N, D]`` and ``targets`` ``[N]`` (the token predicted at each step) in text order, ``doc_index``
    ``[N]`` the evaluated document of each (a new run of equal values starts a document). ``search_fn(q [B, D]) ->
    (scores [B, k], ids [B, k])`` is the normal search (e.g. ``lambda q: memlm.index.search(index, q, k)``: larger
    score = closer, ``-1`` ids for missing slots). ``keys``, ``values``, ``doc_hash``, ``offset``: the datastore's
    arrays (:class:`memlm.datastore.Datastore`). ``metric`` is the index's (for the pointers' exact scores);
    ``lookahead`` how many steps one round follows a chain (speed only: the result does not depend on it).

    Returns ``(scores [N, k] float32, ids [N, k] int64, searched [N] bool)``. A searched row is ``search_fn``'s result
    as given; a pointer row holds the surviving pointers (at most ``k``) sorted by exact score, descending (ties by
    id), then ``-inf`` / ``-1`` padding. ``min_survivors > k`` gives plain search at every token. Self-matches (the
    evaluated text being in the datastore) are not dropped here.
    """
    q = np.asarray(queries)
    targets = np.asarray(targets, dtype=np.int64).reshape(-1)
    doc_index = np.asarray(doc_index).reshape(-1)
    n = len(targets)
    if q.ndim != 2 or len(q) != n or len(doc_index) != n:
        raise MemlmError(
            f"pointer_retrieve needs queries [N, D], targets [N] and doc_index [N], got {q.shape}, "
            f"{targets.shape}, {doc_index.shape}"
        )
    if k < 1 or min_survivors < 1 or lookahead < 1:
        raise MemlmError(f"k, min_survivors and lookahead must be >= 1, got {k}, {min_survivors}, {lookahead}")
    nds = len(values)
    if not (len(doc_hash) == len(offset) == nds == len(keys)):
        raise MemlmError("keys, values, doc_hash and offset must describe the same datastore entries")
    out_s = np.full((n, k), -np.inf, dtype=np.float32)
    out_i = np.full((n, k), -1, dtype=np.int64)
    searched = np.zeros(n, dtype=bool)
    if n == 0:
        return out_s, out_i, searched

    starts, ends = _segments(doc_index)
    pos = starts.copy()  # per document: the row whose set is the chain's base
    end = ends.copy()
    need_search = np.ones(len(starts), dtype=bool)  # else the base row is already filled (carried pointers)
    active = np.arange(len(starts))
    while len(active):
        # 1. one batched search for the documents whose base row needs one
        todo = active[need_search[active]]
        if len(todo):
            rows = pos[todo]
            s, i = search_fn(np.ascontiguousarray(q[rows], dtype=np.float32))
            s, i = np.asarray(s), np.asarray(i)
            if s.shape != (len(rows), k) or i.shape != (len(rows), k):
                raise MemlmError(f"search_fn must return scores and ids of shape [{len(rows)}, {k}], got {s.shape}")
            out_s[rows], out_i[rows] = s, i
            searched[rows] = True
        # 2. follow every document's chain up to `lookahead` steps from its base row
        nxt_pos, nxt_search, keep = _advance(
            active, pos, end, out_i, targets, values, doc_hash, offset, min_survivors, lookahead
        )
        pos[active], need_search[active] = nxt_pos, nxt_search
        active = active[keep]

    ptr = np.flatnonzero(~searched)
    if len(ptr):
        ids = out_i[ptr]
        sc = index_lib.exact_scores(keys, ids, q[ptr], metric)
        order = np.lexsort((ids, -sc.astype(np.float64)), axis=1)  # score descending, then id; padding (-inf) last
        out_i[ptr] = np.take_along_axis(ids, order, 1)
        out_s[ptr] = np.take_along_axis(sc, order, 1)
    return out_s, out_i, searched


def retrieve_with_pointers(
    datastore,
    queries: np.ndarray,
    targets: np.ndarray,
    doc_index: np.ndarray,
    k: int,
    min_survivors: int = 1,
    index=None,
    index_path=None,
    nprobe: int = 32,
    lookahead: int = 32,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`pointer_retrieve` over a :class:`memlm.datastore.Datastore`, searching its index (default
    ``index.faiss``, or ``index`` / ``index_path``) with the index's metric for the pointers' exact scores."""
    from memlm.sharded_index import index_metric_of, open_index, search_index

    if index is None:
        index = open_index(datastore, index_path, nprobe=nprobe)
    return pointer_retrieve(
        queries, targets, doc_index, lambda q: search_index(index, q, k), datastore.keys, datastore.values,
        datastore.doc_hash, datastore.offset, k, min_survivors, index_metric_of(index), lookahead,
    )  # fmt: skip


def _advance(
    docs: np.ndarray,
    pos: np.ndarray,
    end: np.ndarray,
    out_i: np.ndarray,
    targets: np.ndarray,
    values: np.ndarray,
    doc_hash: np.ndarray,
    offset: np.ndarray,
    min_survivors: int,
    lookahead: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Fill the pointer rows that follow each document's base row; return each document's next base row, whether it
    needs a search, and whether the document is still active. Blocks of documents bound the ``[D, k, L]`` arrays."""
    k = out_i.shape[1]
    nxt_pos = np.empty(len(docs), dtype=np.int64)
    nxt_search = np.empty(len(docs), dtype=bool)
    keep = np.empty(len(docs), dtype=bool)
    block = max(1, _GATHER_BUDGET // (k * lookahead))
    for b0 in range(0, len(docs), block):
        sl = slice(b0, b0 + block)
        p, e = pos[docs[sl]], end[docs[sl]]
        left = e - p - 1  # rows after the base row in the document
        L = int(min(lookahead, left.max()))
        if L <= 0:
            nxt_pos[sl], nxt_search[sl], keep[sl] = p, False, False
            continue
        base = out_i[p]  # [d, k]
        steps = np.arange(L, dtype=np.int64)
        cur = np.where(base[:, :, None] >= 0, base[:, :, None] + steps, -1)  # entry i + j, j < L
        tgt = targets[np.minimum(p[:, None] + steps, len(targets) - 1)]  # x_{p + j}
        safe = np.clip(cur, 0, len(values) - 1)
        ok = (cur >= 0) & (values[safe] == tgt[:, None, :]) & successor_ok(cur, doc_hash, offset)
        alive = np.logical_and.accumulate(ok, axis=2)  # alive[..., m-1]: survives to row p + m
        count = alive.sum(1)  # [d, L]
        in_doc = (steps + 1)[None, :] <= left[:, None]
        cont = (count >= min_survivors) & in_doc
        stop = np.where(cont.all(1), L + 1, np.argmin(cont, axis=1) + 1)  # first m that does not continue
        # pointer rows p + m for m < stop: the survivors' successors i + m
        sel_d, sel_m = np.nonzero((steps + 1)[None, :] < stop[:, None])
        if len(sel_d):
            ids = np.where(alive[sel_d, :, sel_m], base[sel_d] + (sel_m + 1)[:, None], -1)
            out_i[p[sel_d] + sel_m + 1] = ids
        full = stop == L + 1  # every step continued: the last pointer row is the next base, no search
        nxt = np.where(full, p + L, p + stop)
        nxt_pos[sl] = nxt
        nxt_search[sl] = ~full
        keep[sl] = np.where(full, nxt < e - 1, nxt < e)
    return nxt_pos, nxt_search, keep
