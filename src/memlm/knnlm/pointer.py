"""Pointer reuse: RetoMaton's automaton over the datastore (Alon et al. 2022, "Neuro-Symbolic Language Modeling with
Automaton-augmented Retrieval", ICML).

A datastore entry ``i`` stores (key = context representation, value ``v_i`` = the token that followed), and entry
``i + 1`` is what the same corpus said one token later. Let ``S_t`` be the entries step ``t`` scores with. Once the true
token ``x_t`` is seen, the entries of ``S_t`` that predicted it point to their successors::

    C_t     = { i in S_t : v_i = x_t, entry i + 1 follows entry i in the same datastore document }
    P_{t+1} = { i + 1 : i in C_t }      (at most k: the successors of the k best-scored entries of C_t)

("follows": ``doc_hash[i + 1] == doc_hash[i]`` and ``offset[i + 1] == offset[i] + 1``; Alon et al.'s datastore is one
stream, where only the last entry has no successor.) Step ``t + 1`` then scores with::

    S_{t+1} = P_{t+1}                          if |C_t| >= N   (no search)
    S_{t+1} = P_{t+1} ∪ kNN(q_{t+1}, k)        otherwise       (rule "retomaton")
    S_{t+1} = kNN(q_{t+1}, k)                  otherwise       (rule "replace": the pointers are dropped)

``N`` is ``min_survivors`` (the authors' ``--min-knns``); the cap of ``k`` pointers is their ``--max-knns``, which
defaults to ``k``. The "retomaton" rule is the paper's and its code's (``fairseq/knnlm.py`` in neulab/retomaton
concatenates the search results and the pointers), with one difference: an entry that is both retrieved and pointed to
enters once here (a set union, as in the paper's equations); the authors' concatenation scores it twice. The
"replace" rule, memlm's earlier one, discards the pointers whenever it searches. The first token of an evaluated
document always searches (no chain crosses a document boundary). This is the pointer part of RetoMaton, without its
clustering of entries into automaton states.

Scores: every row, searched or not, is scored exactly, ``s(q_t, k_i)`` recomputed from the stored fp16 keys
(:func:`memlm.storage.index.exact_scores`, the index's metric), as the authors' code recomputes L2 distances for the
retrieved and the pointed-to entries alike. One temperature then serves both (an index's own scores are on another
scale: a PQ code's approximate distance, or a distance in an OPQ / PCA index's reduced space).

Self-matches (the evaluated text is in the datastore, ``provenance`` given): the entry that *is* the evaluated token
is never in ``C_t`` (never counted as a survivor, never pointed on). Otherwise its chain never breaks (entry ``i``
predicts ``x_t`` and its successor is the next evaluated token), pointer reuse almost never searches, and the rows
hold nothing once the self-match is dropped. It stays in a searched row, where
:meth:`memlm.retrieval.DatastoreMemory.retrieved` drops it (on a pruned datastore: takes the token's one share out of
its count); no pointer row can hold it.

Vectorised: a chain started at a base row ``t0`` with the set ``S_{t0}`` survives ``m`` steps for exactly the entries
``i`` of ``S_{t0}`` whose stored continuation ``v_i, ..., v_{i+m-1}`` equals ``x_{t0}, ..., x_{t0+m-1}`` within one
datastore document (and that are not self-matches on the way), so one ``[W, L]`` comparison per chain gives its whole
run: the first ``m`` where fewer than ``N`` survive is the next search, whose row also takes the survivors' successors
(rule "retomaton"). All evaluated documents advance together in rounds; each round makes one batched search for every
document that needs one, scores those rows exactly, and looks ``lookahead`` steps ahead for every document (a chain
longer than that continues in the next round without a search). Pointer rows are scored in one call at the end.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from memlm.errors import MemlmError
from memlm.storage import index as index_lib
from memlm.storage.searcher import Searcher, as_searcher

__all__ = ["POINTER_RULES", "pointer_retrieve", "pointer_width", "retrieve_with_pointers", "successor_ok"]

SearchFn = Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]
POINTER_RULES = ("retomaton", "replace")
_GATHER_BUDGET = 1 << 20  # elements of one [docs, width, lookahead] block (a few such arrays live at once)


def successor_ok(ids: np.ndarray, doc_hash: np.ndarray, offset: np.ndarray) -> np.ndarray:
    """Whether entry ``i + 1`` is the successor of entry ``i`` (same document, next offset), elementwise; ``False``
    for ``i = -1`` and for the last entry of the datastore."""
    ids = np.asarray(ids, dtype=np.int64)
    n = len(doc_hash)
    ok = (ids >= 0) & (ids + 1 < n)
    a = np.where(ok, ids, 0)
    b = np.where(ok, ids + 1, 0)
    return ok & (doc_hash[a] == doc_hash[b]) & (offset[b] == offset[a].astype(np.int64) + 1)


def pointer_width(k: int, min_survivors: int, rule: str = "retomaton") -> int:
    """Columns of a pointer-reuse row: ``k`` for "replace"; ``k`` retrieved + at most ``min(N - 1, k)`` carried
    pointers for "retomaton"."""
    if rule not in POINTER_RULES:
        raise MemlmError(f"pointer rule must be one of {', '.join(POINTER_RULES)}, got {rule!r}")
    return k if rule == "replace" else k + min(min_survivors - 1, k)


def _segments(doc_index: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Start and end (exclusive) of each maximal run of equal ``doc_index``: the evaluated documents."""
    n = len(doc_index)
    starts = np.flatnonzero(np.r_[True, doc_index[1:] != doc_index[:-1]]) if n else np.zeros(0, np.int64)
    ends = np.r_[starts[1:], n].astype(np.int64)
    return starts.astype(np.int64), ends


def _is_self(ids: np.ndarray, rows: np.ndarray, doc_hash, offset, provenance) -> np.ndarray:
    """Whether entry ``ids[..., j]`` is the evaluated token of row ``rows[...]`` (broadcast; ``False`` for -1)."""
    if provenance is None:
        return np.zeros(ids.shape, dtype=bool)
    valid = (ids >= 0) & (ids < len(doc_hash))
    safe = np.where(valid, ids, 0)
    return (
        valid
        & (np.asarray(doc_hash)[safe] == np.asarray(provenance["doc_hash"])[rows])
        & (np.asarray(offset)[safe] == np.asarray(provenance["offset"])[rows])
    )


def _sort_rows(ids: np.ndarray, scores: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each row by score descending, ties by id; ``-1`` / ``-inf`` padding last."""
    order = np.lexsort((ids, -scores.astype(np.float64)), axis=1)
    return np.take_along_axis(ids, order, 1), np.take_along_axis(scores, order, 1)


def _check_inputs(q, targets, doc_index, store: tuple, sizes: tuple[int, int, int], provenance) -> None:
    """Shapes of :func:`pointer_retrieve`'s inputs: one query, target and document per token, one datastore."""
    n = len(targets)
    if q.ndim != 2 or len(q) != n or len(doc_index) != n:
        raise MemlmError(
            f"pointer_retrieve needs queries [N, D], targets [N] and doc_index [N], got {q.shape}, "
            f"{targets.shape}, {doc_index.shape}"
        )
    k, min_survivors, lookahead = sizes
    if k < 1 or min_survivors < 1 or lookahead < 1:
        raise MemlmError(f"k, min_survivors and lookahead must be >= 1, got {k}, {min_survivors}, {lookahead}")
    keys, values, doc_hash, offset = store
    if not (len(doc_hash) == len(offset) == len(values) == len(keys)):
        raise MemlmError("keys, values, doc_hash and offset must describe the same datastore entries")
    if provenance is not None and not (len(provenance["doc_hash"]) == len(provenance["offset"]) == n):
        raise MemlmError(f"provenance must give the doc_hash and offset of each of the {n} evaluated tokens")


def _searched_set(search_fn: SearchFn, qs: np.ndarray, k: int, carry: np.ndarray, todo: np.ndarray, rule: str):
    """The ids of a searched row's set: the ``k`` search results and, by the authors' rule, the pointers that
    survived into it (``carry``, then cleared; an entry in both counts once)."""
    s, i = search_fn(qs)
    i = np.asarray(i, dtype=np.int64)
    if np.shape(s) != (len(qs), k) or i.shape != (len(qs), k):
        raise MemlmError(f"search_fn must return scores and ids of shape [{len(qs)}, {k}], got {np.shape(s)}")
    if rule == "retomaton":
        ptr = carry[todo]
        ptr = np.where((ptr[:, :, None] == i[:, None, :]).any(2), -1, ptr)  # in both: once
        i = np.concatenate([i, ptr], axis=1)
        carry[todo] = -1
    return i


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
    rule: str = "retomaton",
    provenance: dict[str, np.ndarray] | None = None,
    progress: bool = False,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """kNN retrieval for ``T`` evaluated tokens with RetoMaton's pointers (see the module docstring).

    ``queries`` ``[T, D]`` and ``targets`` ``[T]`` (the token predicted at each step) in text order, ``doc_index``
    ``[T]`` the evaluated document of each (a new run of equal values starts a document). ``search_fn(q [B, D]) ->
    (scores [B, k], ids [B, k])`` is the normal search (e.g. ``lambda q: memlm.storage.index.search(index, q, k)``;
    ``-1`` ids for missing slots; its scores are not used). ``keys``, ``values``, ``doc_hash``, ``offset``: the
    datastore's arrays (:class:`memlm.storage.datastore.Datastore`). ``min_survivors`` is ``N``, ``metric`` the index's
    (for the exact scores), ``rule`` "retomaton" (the authors') or "replace", ``provenance`` (each token's ``doc_hash``
    and ``offset``, from :func:`memlm.knnlm.evaluate.lm_scores`) keeps self-matches out of the survivors.
    ``lookahead`` is how many steps one round follows a chain (speed only: the result does not depend on it).

    Returns ``(scores [T, W] float32, ids [T, W] int64, searched [T] bool)`` with ``W =``
    :func:`pointer_width`: each row's set ``S_t`` sorted by exact score, descending (ties by id), then ``-inf`` /
    ``-1`` padding.
    """
    width = pointer_width(k, min_survivors, rule)
    q = np.asarray(queries)
    targets = np.asarray(targets, dtype=np.int64).reshape(-1)
    doc_index = np.asarray(doc_index).reshape(-1)
    n = len(targets)
    _check_inputs(q, targets, doc_index, (keys, values, doc_hash, offset), (k, min_survivors, lookahead), provenance)
    out_s = np.full((n, width), -np.inf, dtype=np.float32)
    out_i = np.full((n, width), -1, dtype=np.int64)
    searched = np.zeros(n, dtype=bool)
    if n == 0:
        return out_s, out_i, searched

    starts, ends = _segments(doc_index)
    pos = starts.copy()  # per document: the row whose set is the chain's base
    # pointers that a searched base row merges ("retomaton"): fewer than N survived, so at most min(N - 1, k)
    carry = np.full((len(starts), width - k), -1, dtype=np.int64)
    need_search = np.ones(len(starts), dtype=bool)  # else the base row is already filled (carried pointers)
    active = np.arange(len(starts))
    arrays = (targets, values, doc_hash, offset, provenance)
    with tqdm(total=n, desc="pointer search", unit="tok", disable=not progress, leave=False) as bar:
        while len(active):
            # 1. one batched search for the documents whose base row needs one; the row is S_t, scored exactly
            todo = active[need_search[active]]
            if len(todo):
                rows = pos[todo]
                qs = np.ascontiguousarray(q[rows], dtype=np.float32)
                i = _searched_set(search_fn, qs, k, carry, todo, rule)
                ids, sc = _sort_rows(i, index_lib.exact_scores(keys, i, qs, metric))
                out_i[rows], out_s[rows] = ids[:, :width], sc[:, :width]
                searched[rows] = True
            # 2. follow every document's chain up to `lookahead` steps from its base row
            before = pos[active].copy()
            nxt_pos, nxt_search, keep, carried = _advance(
                active, pos, ends, out_i, arrays, k, carry.shape[1], min_survivors, lookahead
            )
            pos[active], need_search[active] = nxt_pos, nxt_search
            if rule == "retomaton":
                carry[active] = carried
            bar.update(int((np.minimum(nxt_pos, ends[active]) - before).sum()))
            active = active[keep]

        ptr = np.flatnonzero(~searched)
        if len(ptr):
            ids = out_i[ptr]
            out_i[ptr], out_s[ptr] = _sort_rows(ids, index_lib.exact_scores(keys, ids, q[ptr], metric))
        bar.update(n - bar.n)
    return out_s, out_i, searched


def retrieve_with_pointers(
    datastore,
    queries: np.ndarray,
    targets: np.ndarray,
    doc_index: np.ndarray,
    k: int,
    min_survivors: int = 1,
    *,
    index: Searcher | Any = None,
    lookahead: int = 32,
    rule: str = "retomaton",
    provenance: dict[str, np.ndarray] | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`pointer_retrieve` over a datastore (plain or sharded), searching with ``index`` (a searcher or a FAISS
    index already read; default: the datastore's own, :meth:`memlm.storage.datastore.DatastoreBase.searcher`), whose
    metric gives the exact scores."""
    searcher = as_searcher(index) if index is not None else datastore.searcher()
    return pointer_retrieve(
        queries, targets, doc_index, lambda q: searcher.search(q, k), datastore.keys, datastore.values,
        datastore.doc_hash, datastore.offset, k, min_survivors, searcher.metric, lookahead, rule, provenance,
    )  # fmt: skip


def _advance(
    docs: np.ndarray,
    pos: np.ndarray,
    end: np.ndarray,
    out_i: np.ndarray,
    arrays: tuple,
    k: int,
    carry_width: int,
    min_survivors: int,
    lookahead: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Fill the pointer rows that follow each document's base row; return each document's next base row, whether it
    needs a search, whether the document is still active, and the pointers its next searched row merges
    ``[d, carry_width]`` (fewer than ``N`` survived there, so ``carry_width = min(N - 1, k)`` holds them all).
    Blocks of documents bound the ``[d, W, L]`` arrays."""
    targets, values, doc_hash, offset, provenance = arrays
    w = out_i.shape[1]
    nxt_pos = np.empty(len(docs), dtype=np.int64)
    nxt_search = np.empty(len(docs), dtype=bool)
    keep = np.empty(len(docs), dtype=bool)
    carried = np.full((len(docs), carry_width), -1, dtype=np.int64)
    block = max(1, _GATHER_BUDGET // (w * lookahead))
    for b0 in range(0, len(docs), block):
        sl = slice(b0, b0 + block)
        p, e = pos[docs[sl]], end[docs[sl]]
        left = e - p - 1  # rows after the base row in the document
        L = int(min(lookahead, left.max()))
        if L <= 0:
            nxt_pos[sl], nxt_search[sl], keep[sl] = p, False, False
            continue
        base = out_i[p]  # [d, w]: S at the base row, best first where it was searched
        steps = np.arange(L, dtype=np.int64)
        cur = np.where(base[:, :, None] >= 0, base[:, :, None] + steps, -1)  # entry i + m, m < L
        row = np.minimum(p[:, None] + steps, len(targets) - 1)  # row p + m
        safe = np.clip(cur, 0, len(values) - 1)
        own = _is_self(cur, row[:, None, :], doc_hash, offset, provenance)  # i + m is row p + m's own token
        ok = (cur >= 0) & ~own & (values[safe] == targets[row][:, None, :]) & successor_ok(cur, doc_hash, offset)
        count0 = ok[:, :, 0].sum(1)  # |C| at the base row, before the cap of k pointers
        ok[:, :, 0] &= np.cumsum(ok[:, :, 0], axis=1) <= k  # the k best-scored survivors point on
        alive = np.logical_and.accumulate(ok, axis=2)  # alive[:, j, m]: entry j's chain is in C at row p + m
        count = alive.sum(1)  # [d, L]
        count[:, 0] = count0
        in_doc = (steps + 1)[None, :] <= left[:, None]
        cont = (count >= min_survivors) & in_doc  # row p + m + 1 does not search
        stop = np.where(cont.all(1), L + 1, np.argmin(cont, axis=1) + 1)  # first m that searches (or leaves)
        # pointer rows p + m for 1 <= m < stop: successors i + m of the chains alive at row p + m - 1 (not self)
        sel_d, sel_m = np.nonzero((steps + 1)[None, :] < stop[:, None])
        if len(sel_d):
            m = sel_m + 1
            nxt_ids = base[sel_d] + m[:, None]
            own_m = _is_self(np.where(base[sel_d] >= 0, nxt_ids, -1), (p[sel_d] + m)[:, None], doc_hash, offset,
                             provenance)  # fmt: skip
            out_i[p[sel_d] + m] = np.where(alive[sel_d, :, sel_m] & ~own_m, nxt_ids, -1)
        full = stop == L + 1  # every step continued: the last pointer row is the next base, no search
        nxt = np.where(full, p + L, p + stop)
        # the searched row p + stop merges the successors of the chains alive at row p + stop - 1 (at most k)
        part = ~full & (stop <= L)
        if part.any() and carry_width:
            d_idx = np.flatnonzero(part)
            a = alive[d_idx, :, stop[d_idx] - 1]
            ids = np.where(a, base[d_idx] + stop[d_idx][:, None], -1)
            first = np.argsort(~a, axis=1, kind="stable")[:, :carry_width]  # in order (best first at the base)
            got = np.take_along_axis(ids, first, 1)
            carried[b0 + d_idx, : got.shape[1]] = got
        nxt_pos[sl] = nxt
        nxt_search[sl] = ~full
        keep[sl] = np.where(full, nxt < e - 1, nxt < e)
    return nxt_pos, nxt_search, keep, carried
