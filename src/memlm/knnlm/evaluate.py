"""Perplexity of an LM with and without memory, per-token score dumps, and λ / temperature tuning on them.

``score_tokens`` makes one forward pass over a corpus (sliding windows, see :mod:`memlm.data.windows`) and one search
per token, and keeps what every later question needs: the LM log-probability of each target and the top-k retrieved
(score, value) pairs of each memory. ``perplexities`` then computes, for any λ, temperature and k <= the dumped k,

    base:    exp(-mean log p_LM(w_t))
    kNN-LM:  exp(-mean log((1-λ) p_LM + λ p_kNN))                 (Khandelwal et al. Eq. 3)
    + cache: exp(-mean log((1-λ-λc) p_LM + λ p_kNN + λc p_cache))  (Table 1)
    oracle:  exp(-mean log max(p_LM, p_kNN))                       (Xu et al. 2023: the best λ ∈ {0, 1} per token)

without searching again, so ``tune`` can grid-search on the validation dump and apply the result to test.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch
from tqdm.auto import tqdm

from memlm.core.bootstrap import DIFFERENCES, evidence
from memlm.core.config import DEFAULT_MIN_CONTEXT, DEFAULT_WINDOW, RetrievalConfig
from memlm.core.distribution import mix, perplexity
from memlm.core.dumps import TokenDump
from memlm.core.frequency import bucket_table
from memlm.core.memory import Memory
from memlm.core.tuning import DEFAULT_LAMBDAS, DEFAULT_TEMPERATURES, grid_search
from memlm.data.windows import batched, count_targets, resolve_stride, sliding_windows, tokenize_documents
from memlm.errors import MemlmError
from memlm.knnlm.adaptive import AdaptiveGate, gate_features, gate_lambdas, threshold_for_fraction
from memlm.knnlm.cache import continuous_cache
from memlm.knnlm.pointer import pointer_retrieve
from memlm.mixing.dump import rule_rows
from memlm.mixing.inputs import component_name, memory_logprob
from memlm.models.forward import forward_windows
from memlm.models.keys import KeySpec, num_layers
from memlm.retrieval import DatastoreMemory, as_memory, describe_memory
from memlm.storage.datastore import Datastore, DatastoreBase

__all__ = [
    "TokenScores",
    "lm_scores",
    "add_neighbours",
    "add_cache",
    "attach_neighbours",
    "score_tokens",
    "perplexities",
    "cache_mixture_ppl",
    "value_counts",
    "CACHE_PPL_KEYS",
    "tune",
]


@dataclass
class TokenScores(TokenDump):
    """Everything needed to score a corpus under any λ / temperature / k: the kNN-LM's per-token dump."""

    KIND: ClassVar[str] = "a kNN-LM score dump"
    REQUIRED: ClassVar[dict[str, int]] = {"targets": 1, "lm_logprob": 1, "doc_index": 1}
    OPTIONAL: ClassVar[dict[str, int]] = {"knn_scores": 2, "knn_values": 2, "cache_scores": 2, "cache_values": 2,
                                          "knn_log_counts": 2, "lm_entropy": 1, "lm_max_logprob": 1, "position": 1,
                                          "knn_lambda": 1, "searched": 1, "ngram_logprob": 1, "ngram_count": 1,
                                          "ngram_n": 1, "ngram_sparse": 1, "ngram_extra_logprob": 2,
                                          "ngram_extra_count": 2, "ngram_extra_n": 2,
                                          "ngram_extra_sparse": 2, "knn_extra_scores": 3, "knn_extra_values": 3,
                                          "knn_extra_log_counts": 3}  # fmt: skip
    PAIRS: ClassVar[tuple[tuple[str, str], ...]] = (("knn_scores", "knn_values"), ("cache_scores", "cache_values"),
                                                    ("knn_extra_scores", "knn_extra_values"))  # fmt: skip
    HINT: ClassVar[str] = "rerun memlm eval --dump {path}"

    targets: np.ndarray  # [N] int64
    lm_logprob: np.ndarray  # [N] float32
    doc_index: np.ndarray  # [N] int32
    knn_scores: np.ndarray | None = None  # [N, k] float32, sorted best first, -inf in empty slots
    knn_values: np.ndarray | None = None  # [N, k] int32, -1 in empty slots
    knn_log_counts: np.ndarray | None = None  # [N, k] float32: log of merged entries (a pruned datastore), else None
    cache_scores: np.ndarray | None = None
    cache_values: np.ndarray | None = None
    lm_entropy: np.ndarray | None = None  # [N] float32: H(p_LM) at each target's context (adaptive retrieval)
    lm_max_logprob: np.ndarray | None = None  # [N] float32: max_w log p_LM(w)
    position: np.ndarray | None = None  # [N] int32: the target's offset in its document
    knn_lambda: np.ndarray | None = None  # [N] float32: per-token λ of an adaptive gate (0 where not searched)
    searched: np.ndarray | None = None  # [N] bool: where the datastore was searched (adaptive, pointer reuse)
    # the ∞-gram (memlm.ngram): log P∞(target), cnt(suffix), effective n, sparse flag
    ngram_logprob: np.ndarray | None = None  # [N] float32, -inf where P∞(target) = 0
    ngram_count: np.ndarray | None = None  # [N] int64
    ngram_n: np.ndarray | None = None  # [N] int32
    ngram_sparse: np.ndarray | None = None  # [N] bool
    # further ∞-gram references (memlm eval --ngram A --ngram B ...): the same four, one column per reference after
    # the first (memlm.ngram.memory.NgramMemories)
    ngram_extra_logprob: np.ndarray | None = None  # [N, R-1] float32
    ngram_extra_count: np.ndarray | None = None  # [N, R-1] int64
    ngram_extra_n: np.ndarray | None = None  # [N, R-1] int32
    ngram_extra_sparse: np.ndarray | None = None  # [N, R-1] bool
    # further datastores (memlm eval --datastore A --datastore B ...): their k best (score, value) and merged counts,
    # one slice per datastore after the first (mixture components knn2, knn3, ...)
    knn_extra_scores: np.ndarray | None = None  # [N, D-1, k] float32
    knn_extra_values: np.ndarray | None = None  # [N, D-1, k] int32
    knn_extra_log_counts: np.ndarray | None = None  # [N, D-1, k] float32 (0 for a datastore without merged counts)
    meta: dict[str, Any] = field(default_factory=dict)

    def lm_only(self) -> TokenScores:
        """A copy with the LM scores and no memories: attach another datastore to the same forward pass."""
        lm_fields = ("lm_entropy", "lm_max_logprob", "position")
        return TokenScores(self.targets, self.lm_logprob, self.doc_index, meta=dict(self.meta),
                           **{f: getattr(self, f) for f in lm_fields})  # fmt: skip


def lm_scores(
    model,
    tokenizer,
    documents: Sequence,
    key_specs: Sequence[KeySpec] = (),
    window: int = 1024,
    min_context: int = 512,
    batch_size: int = 4,
    progress: bool = True,
    meta: dict[str, Any] | None = None,
    stride: int | None = None,
    block_start: str = "skip",
    on_batch: Callable[[dict[KeySpec, np.ndarray]], None] | None = None,
) -> tuple[TokenScores, dict[KeySpec, np.ndarray], dict[str, np.ndarray]]:
    """The forward pass: LM log-probabilities of every target, plus the queries for each key spec.

    ``on_batch`` (optional) is called with each forward batch's queries (spec -> ``[n, D]``, in stream order) as soon
    as they exist: a search started there overlaps the next batch's forward pass (pipelining).

    Windows as :func:`memlm.data.windows.sliding_windows` cuts them: ``stride`` (when given) replaces ``min_context``,
    and ``stride == window`` gives non-overlapping blocks whose first token is skipped (``block_start="skip"``, Hugging
    Face's perplexity guide) or scored after the tokenizer's BOS (or EOS) token (``"bos"``).

    Returns ``(scores, queries, provenance)``; ``queries[spec]`` is ``[N, D]`` float32 and ``provenance`` holds each
    target's ``doc_hash`` and ``offset`` (to drop self-matches). Memories are attached later by :func:`add_neighbours`
    and :func:`add_cache`, so one forward pass serves any number of datastores.
    """
    stride, min_context = resolve_stride(window, None if stride is not None else min_context, stride)
    n_total = count_targets(documents, tokenizer, window, stride, block_start)
    if n_total == 0:
        raise MemlmError("the evaluation corpus has no tokens; give it some text")
    specs = list(dict.fromkeys(key_specs))
    parts: dict[str, list[np.ndarray]] = {"targets": [], "lm": [], "doc": [], "off": [], "hash": [], "ent": [],
                                          "max": []}  # fmt: skip
    queries: dict[KeySpec, list[np.ndarray]] = {s: [] for s in specs}
    bos_id = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    tokens = tokenize_documents(documents, tokenizer)
    windows = sliding_windows(tokens, window, stride=stride, block_start=block_start, bos_id=bos_id)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    t0 = time.perf_counter()
    with tqdm(total=n_total, unit="tok", desc="forward", disable=not progress, dynamic_ncols=True) as bar:
        for outputs in forward_windows(model, batched(windows, batch_size), specs, True, pad_id=pad_id):
            if on_batch is not None:
                on_batch({s: np.concatenate([o.keys[s] for o in outputs]) for s in specs})
            for o in outputs:
                rows = slice(o.window.score_from, len(o.window.input_ids))
                parts["targets"].append(o.targets)
                parts["lm"].append(o.lm_logprob)
                parts["ent"].append(o.lm_entropy)
                parts["max"].append(o.lm_max_logprob)
                parts["doc"].append(o.window.doc_index[rows])
                parts["off"].append(o.window.offset[rows])
                parts["hash"].append(o.window.doc_hash[rows])
                for s in specs:
                    queries[s].append(o.keys[s])
                bar.update(len(o.targets))
    cat = {name: np.concatenate(v) for name, v in parts.items()}
    ts = TokenScores(
        targets=cat["targets"].astype(np.int64),
        lm_logprob=cat["lm"].astype(np.float32),
        doc_index=cat["doc"].astype(np.int32),
        lm_entropy=cat["ent"].astype(np.float32),
        lm_max_logprob=cat["max"].astype(np.float32),
        position=cat["off"].astype(np.int32),
        meta={
            **(meta or {}),
            "tokens": int(len(cat["targets"])),
            "window": window,
            "min_context": min_context,
            "stride": stride,
            **({"block_start": block_start} if stride == window else {}),
            "seconds_forward": time.perf_counter() - t0,
        },
    )
    provenance = {"doc_hash": cat["hash"], "offset": cat["off"]}
    return ts, {s: np.concatenate(q) for s, q in queries.items()}, provenance


def add_neighbours(
    ts: TokenScores,
    queries: np.ndarray,
    datastore: Datastore,
    config: RetrievalConfig | None = None,
    *,
    provenance: dict[str, np.ndarray] | None = None,
    progress: bool = True,
    **options: Any,
) -> TokenScores:
    """Retrieve the k nearest datastore entries of every query and store their (score, value) in ``ts``.

    ``index_path`` picks another index of the same datastore than its default ``index.faiss`` (e.g. an IP or a PQ
    index built for an ablation). ``metric`` (``l2``/``ip``) sets the similarity of exact search and exact scores
    (default: the index's). These and ``k``, ``search``, ``scores``, ``nprobe`` come from ``config``
    (:class:`RetrievalConfig`) or ``options`` by name.
    With ``provenance`` (from :func:`lm_scores`), neighbours that are the evaluated token itself (same document hash
    and offset) are dropped: use it when the evaluated text is also in the datastore.
    """
    c = RetrievalConfig.with_options(config, **options)
    t1 = time.perf_counter()
    memory = DatastoreMemory(datastore, c.search, c.scores, c.nprobe, index_path=c.index, metric=c.metric,
                             progress=progress)  # fmt: skip
    k = c.k
    r = memory.search(queries, k, provenance)
    ts.knn_scores, ts.knn_values = r.scores, r.values.astype(np.int32)
    ts.knn_log_counts = r.log_counts
    ts.meta.update(
        **memory.describe(), k=k, drop_self_matches=provenance is not None, seconds_search=time.perf_counter() - t1
    )
    return ts


def add_cache(
    ts: TokenScores, queries: np.ndarray, k: int = 256, max_len: int = 2048, metric: str = "ip"
) -> TokenScores:
    """Attach the continuous cache's (score, value) pairs (Grave et al. 2017c) to ``ts``."""
    t2 = time.perf_counter()
    cs, cv = continuous_cache(queries, ts.targets, ts.doc_index, k, max_len, metric)
    ts.cache_scores, ts.cache_values = cs, cv.astype(np.int32)
    ts.meta.update(cache_k=k, cache_max_len=max_len, cache_metric=metric, seconds_cache=time.perf_counter() - t2)
    return ts


CACHE_KEY = KeySpec("final", -1)  # Grave et al.'s cache reads the hidden state the softmax reads


def _search_every_query(ts, queries, memory, config, provenance, progress) -> tuple[np.ndarray, np.ndarray]:
    """No efficiency option: one search per token."""
    return memory.search_ids(queries, config.k)


def _pointer_reuse(ts, queries, memory, config, provenance, progress) -> tuple[np.ndarray, np.ndarray]:
    """RetoMaton (Alon et al. 2022): search only where fewer than ``pointer_min`` pointers survive
    (:func:`memlm.knnlm.pointer.pointer_retrieve`); ``ts.searched`` records where it searched."""
    ds, k = memory.datastore, config.k
    sc, ids, ts.searched = pointer_retrieve(
        queries, ts.targets, ts.doc_index, lambda x: memory.search_ids(x, k, progress=False), ds.keys, ds.values,
        ds.doc_hash, ds.offset, k, config.pointer_min, memory.metric, rule=config.pointer_rule, provenance=provenance,
        progress=progress,
    )  # fmt: skip
    return sc, ids


def _adaptive_gate(ts, queries, memory, config, provenance, progress) -> tuple[np.ndarray, np.ndarray]:
    """He et al. (2021): the gate gives each token its λ (``ts.knn_lambda``); tokens under its threshold are not
    searched (``ts.searched``)."""
    gate = AdaptiveGate.load(config.adaptive)
    features = gate_features(ts.lm_entropy, ts.lm_max_logprob, ts.position)
    fraction = config.adaptive_fraction
    threshold = 0.0 if fraction is None else threshold_for_fraction(gate, features, fraction)
    ts.knn_lambda, ts.searched = gate_lambdas(gate, features, threshold)
    sc = np.full((len(queries), config.k), -np.inf, dtype=np.float32)
    ids = np.full((len(queries), config.k), -1, dtype=np.int64)
    if ts.searched.any():
        sc[ts.searched], ids[ts.searched] = memory.search_ids(queries[ts.searched], config.k)
    return sc, ids


#: ``RetrievalConfig.efficiency`` -> how the neighbours of a forward pass's queries are found (pipelining searches
#: during the forward pass: its results arrive as ``found``)
EFFICIENCY_STRATEGIES: dict[str, Callable[..., tuple[np.ndarray, np.ndarray]]] = {
    "none": _search_every_query,
    "pipeline": _search_every_query,
    "pointer": _pointer_reuse,
    "adaptive": _adaptive_gate,
}


def attach_neighbours(
    ts: TokenScores,
    queries: np.ndarray,
    memory: Any,
    config: RetrievalConfig | int,
    provenance: dict[str, np.ndarray] | None = None,
    found: tuple[np.ndarray, np.ndarray] | None = None,
    progress: bool = True,
    **options: Any,
) -> TokenScores:
    """Retrieve for the queries of one forward pass (:func:`lm_scores`) with the efficiency strategy ``config``
    chooses (:data:`EFFICIENCY_STRATEGIES`), into ``ts``.

    ``config``: a :class:`RetrievalConfig` (or ``k``, with its other fields as ``options``: ``pointer_min=16``...).
    ``found``: scores and ids already searched (pipelined). ``provenance`` drops self-matches (before pointer
    survivors are counted). ``memory``: a :class:`DatastoreMemory` (every strategy) or any memory (one plain search).
    Keeping this apart from the forward pass lets one forward pass serve several memories and options (e.g.
    benchmarks/speed/bench_efficient.py).
    """
    if not isinstance(config, RetrievalConfig):
        config = RetrievalConfig.with_options(k=int(config), **options)
    k = config.k
    if not isinstance(memory, DatastoreMemory):  # any memory: one plain search, its own description
        scores, values, log_counts = memory.search(queries, k).tensors()
        ts.knn_scores, ts.knn_values = scores.float().numpy(), values.numpy().astype(np.int32)
        ts.knn_log_counts = None if log_counts is None else log_counts.float().numpy()
        ts.meta.update(**describe_memory(memory), k=k, drop_self_matches=False)
        return ts
    if found is not None:
        sc, ids = found
    else:
        sc, ids = EFFICIENCY_STRATEGIES[config.efficiency](ts, queries, memory, config, provenance, progress)
    r = memory.retrieved(sc, ids, provenance)
    ts.knn_scores, ts.knn_values, ts.knn_log_counts = r.scores, r.values.astype(np.int32), r.log_counts
    ts.meta.update(**memory.describe(), k=k, drop_self_matches=provenance is not None)
    if config.pointer_min:
        ts.meta["scores"] = "exact"  # pointer reuse scores every row from the stored keys
    return ts


def _plain_search_only(memory: Any, config: RetrievalConfig) -> None:
    """A memory other than a datastore is searched as it is: refuse the options that need a datastore's index, keys
    or provenance."""
    asked = [name for name, on in (("search", config.search != "index"), ("scores", config.scores != "index"),
                                   ("index", config.index is not None), ("drop_self_matches", config.drop_self_matches),
                                   ("adaptive", config.adaptive is not None), ("pointer_min", bool(config.pointer_min)),
                                   ("pipeline", config.pipeline)) if on]  # fmt: skip
    if asked:
        raise MemlmError(
            f"{', '.join(asked)} need a datastore (its index, keys and entry provenance); "
            f"{type(memory).__name__} is searched as it is: leave them at their defaults"
        )


def _scoring_memory(datastore: Any, config: RetrievalConfig, progress: bool) -> tuple[Any, RetrievalConfig]:
    """The memory ``score_tokens`` searches and the config it records (the index file searched filled in)."""
    if isinstance(datastore, DatastoreBase | DatastoreMemory):  # a memory over a datastore: every option applies
        memory = datastore
        if isinstance(datastore, DatastoreBase):
            memory = DatastoreMemory(datastore, config.search, config.scores, config.nprobe, index_path=config.index,
                                     progress=progress)  # fmt: skip
        return memory, config.replace(index=str(memory.index_path) if memory.search_mode == "index" else None)
    memory = as_memory(datastore)  # any other memory: searched as it is
    _plain_search_only(memory, config)
    return memory, config


def _forward_and_search(
    model, tokenizer, documents, dense: list, config: RetrievalConfig, specs, batch_size: int, progress: bool, meta
) -> tuple[TokenScores, dict[KeySpec, np.ndarray]]:
    """:func:`lm_scores` and, for each dense memory, :func:`attach_neighbours` (pipelined: each forward batch's
    queries are searched in a background thread while the model computes the next). The first memory's neighbours
    go into ``knn_*``, the others' into ``knn_extra_*`` (:func:`_stack_extra`)."""
    pending: list[list[Future]] = [[] for _ in dense]
    pipelined = config.pipeline and bool(dense)
    window = config.window
    min_context = config.min_context if config.min_context is not None else DEFAULT_MIN_CONTEXT
    with ThreadPoolExecutor(max_workers=1) if pipelined else contextlib.nullcontext() as pool:
        on_batch = None
        if pipelined:

            def on_batch(q: dict[KeySpec, np.ndarray]) -> None:
                for futures, memory in zip(pending, dense, strict=True):
                    futures.append(pool.submit(memory.search_ids, q[memory.key_spec], config.k))

        ts, queries, provenance = lm_scores(model, tokenizer, documents, specs, window, min_context, batch_size,
                                            progress, meta, config.stride, config.block_start, on_batch)  # fmt: skip
        t1 = time.perf_counter()
        prov = provenance if config.drop_self_matches else None
        extra, lm_meta = [], set(ts.meta)
        for r, (memory, futures) in enumerate(zip(dense, pending, strict=True)):
            found = None
            if futures:
                parts = [f.result() for f in futures]
                found = (np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]))
            into = ts if r == 0 else ts.lm_only()
            attach_neighbours(into, queries[memory.key_spec], memory, config, prov, found, progress)
            if r > 0:
                extra.append(into)
        if dense:
            ts.meta["seconds_search"] = time.perf_counter() - t1  # after the forward pass (pipelined: the rest)
        if extra:
            _stack_extra(ts, extra, lm_meta)
    return ts, queries


def _stack_extra(ts: TokenScores, extra: list[TokenScores], lm_meta: set[str]) -> None:
    """The neighbours of the datastores after the first (each attached to its own copy of ``ts``) as ``knn_extra_*``
    ``[N, D-1, k]``, described in ``meta["datastores"]`` (the first's description included, in order; the meta
    keys not in ``lm_meta``, what the forward pass wrote, are each datastore's)."""
    ts.knn_extra_scores = np.stack([e.knn_scores for e in extra], axis=1)
    ts.knn_extra_values = np.stack([e.knn_values for e in extra], axis=1)
    if any(e.knn_log_counts is not None for e in extra):  # log 1 = 0 for a datastore without merged entries
        ts.knn_extra_log_counts = np.stack([np.zeros_like(e.knn_scores) if e.knn_log_counts is None else
                                            e.knn_log_counts for e in extra], axis=1).astype(np.float32)  # fmt: skip
    ts.meta["datastores"] = [{k: v for k, v in d.meta.items() if k not in lm_meta} for d in [ts, *extra]]


def _split_memories(memories: Sequence, datastore: Any, ngram: Any) -> tuple[list, Any]:
    """``memories`` (with ``datastore`` and ``ngram`` folded in front) as the dense memories, in order, and the
    ∞-gram memory (an NgramMemory, or NgramMemories for several), or None."""
    from memlm.ngram.memory import NgramMemories, NgramMemory

    dense, ngrams = [], []
    for m in [*([datastore] if datastore is not None else []), *([ngram] if ngram is not None else []), *memories]:
        if isinstance(m, NgramMemories):
            ngrams.extend(m.memories)
        elif isinstance(m, NgramMemory):
            ngrams.append(m)
        else:
            dense.append(m)
    ngram_memory = None if not ngrams else ngrams[0] if len(ngrams) == 1 else NgramMemories(ngrams)
    return dense, ngram_memory


def score_tokens(
    model,
    tokenizer,
    documents: Sequence,
    datastore: DatastoreBase | Memory | None = None,
    config: RetrievalConfig | None = None,
    *,
    batch_size: int = 4,
    progress: bool = True,
    meta: dict[str, Any] | None = None,
    ngram: Any | None = None,
    memories: Sequence[Any] = (),
    **options: Any,
) -> TokenScores:
    """One forward pass over ``documents`` and one retrieval per token; see the module docstring.

    ``config`` (:class:`memlm.core.config.RetrievalConfig`) holds every retrieval and windowing setting: ``k``,
    ``search`` / ``scores`` / ``nprobe`` / ``index`` (another index of the datastore, e.g. a compressed ``OPQ``/``PCA``
    one), ``drop_self_matches``, the windows (``window`` 1024 and ``min_context`` 512 when not set; ``stride`` replaces
    ``min_context``; ``stride = window`` gives non-overlapping blocks, ``block_start`` skip or bos, as in
    :func:`lm_scores`), the continuous cache (``cache``, ``cache_k``, ``cache_max_len``, ``cache_metric``) and the
    efficiency options. ``options`` set its fields by name on top of ``config`` (``k=16, window=64``; ``index_path``
    is ``index``), the older keyword spelling. The config is recorded in ``meta["retrieval"]``.

    With a ``datastore`` (plain or sharded), its key role is used for the queries and the model must be the one that
    built it. ``datastore`` may also be any memory with a ``key_spec`` (:func:`memlm.retrieval.as_memory`): it is
    searched once per token as it is (the options below that need an index, keys or provenance are refused).
    ``drop_self_matches`` removes neighbours that are the very token being scored (same document, same offset), for
    when the evaluated text is also in the datastore. A pruned datastore's merged counts enter the scores.
    ``ngram`` (a :class:`memlm.ngram.memory.NgramMemory`) adds the ∞-gram's per-target statistics
    (:func:`memlm.ngram.mixture.add_ngram`), alone or beside the datastore's neighbours.

    ``memories``: every memory as one list, in order (``datastore`` and ``ngram``, when given, are folded in
    front): datastores (plain, sharded, or any memory with a ``key_spec``) and ∞-gram memories (``NgramMemory``,
    ``NgramMemories``). The first datastore's neighbours go into ``knn_*``, each further one's into ``knn_extra_*``
    (mixture components knn2, knn3, ...: :mod:`memlm.mixing.inputs`); the ∞-gram memories into ``ngram_*``
    and ``ngram_extra_*``. ``adaptive`` and ``pointer_min`` decide per token for one datastore: one only with them.

    Efficiency options (:mod:`memlm.knnlm`; :data:`EFFICIENCY_STRATEGIES`, chosen by ``config.efficiency``):

    * ``adaptive``: a trained gate file (:class:`memlm.knnlm.adaptive.AdaptiveGate`, He et al. 2021) gives each
      token its λ; tokens below the gate's threshold (set so that ``adaptive_fraction`` of the tokens are searched,
      or the gate's λ > 0 when no fraction is given) are not searched and get λ = 0;
    * ``pointer_min``: RetoMaton's pointer reuse (Alon et al. 2022): a token whose predecessor's neighbours leave at
      least this many pointers is not searched (:func:`memlm.knnlm.pointer.pointer_retrieve`); where it searches,
      ``pointer_rule="retomaton"`` (the authors') scores with the search results and the surviving pointers,
      ``"replace"`` with the search results alone. Every row is then scored exactly from the stored keys (one scale
      for searched and pointer rows), and self-matches are dropped before survivors are counted;
    * ``pipeline``: each forward batch's queries are searched in a background thread while the model computes the
      next batch (FAISS releases the GIL). Not combinable with the two above, which need every query first.
    """
    config = RetrievalConfig.with_options(config, **options)
    min_context = config.min_context if config.min_context is not None else DEFAULT_MIN_CONTEXT
    min_context = None if config.stride is not None else min_context
    config = config.replace(window=config.window or DEFAULT_WINDOW, min_context=min_context)
    specs: list[KeySpec] = []
    sources, ngram = _split_memories(memories, datastore, ngram)
    if len(sources) > 1 and (config.adaptive is not None or config.pointer_min or config.index is not None):
        raise MemlmError("adaptive retrieval and pointer reuse decide per token for one datastore, and another "
                         "index is one datastore's: give one datastore with them, or leave them out to search "
                         "several")  # fmt: skip
    dense, first_config = [], config
    for r, source in enumerate(sources):
        memory, used = _scoring_memory(source, config, progress)
        first_config = used if r == 0 else first_config
        check = getattr(memory, "check_compatible", None)
        if check is not None:
            check(model, tokenizer)
        dense.append(memory)
        specs.append(memory.key_spec)
    config = first_config
    if config.cache:
        specs.append(CACHE_KEY.normalized(num_layers(model)))
    ts, queries = _forward_and_search(model, tokenizer, documents, dense, config, specs, batch_size, progress, meta)
    ts.meta["retrieval"] = config.to_dict()
    if config.cache:
        add_cache(ts, queries[specs[-1]], config.cache_k, config.cache_max_len, config.cache_metric)
    if ngram is not None:
        ngram.attach(ts, documents, tokenizer)  # the memory adds its own per-target statistics
    return ts


#: The key of the perplexity with the cache, by whether a kNN term is in the mixture (``LM + cache`` / ``LM + kNN +
#: cache``); older result files used ``cache_ppl`` for either (:func:`cache_mixture_ppl` reads both).
CACHE_PPL_KEYS = {False: "lm_cache_ppl", True: "knn_cache_ppl"}


def cache_mixture_ppl(result: dict[str, Any]) -> float | None:
    """The perplexity with the cache of a :func:`perplexities` result, old (``cache_ppl``) or new; None without one."""
    for key in (*CACHE_PPL_KEYS.values(), "cache_ppl"):
        if key in result:
            return result[key]
    return None


def perplexities(
    ts: TokenScores,
    lam: float = 0.25,
    temperature: float = 1.0,
    k: int | None = None,
    cache_lambda: float = 0.0,
    cache_temperature: float = 1.0,
    target_counts: np.ndarray | None = None,
    counted_in: str = "the datastore's values",
    datastores: Sequence[tuple[float, float]] = (),
) -> dict[str, Any]:
    """Base, memory-interpolated and oracle perplexity of a dump under the given parameters, with their evidence.

    ``knn_only_ppl`` (the memory alone, λ = 1) is infinite when some target is never among its retrieved neighbours
    (``p_kNN = 0``); JSON files (``memlm eval --json``) write it as ``null``. A dump with a per-token ``knn_lambda``
    (adaptive retrieval, :mod:`memlm.knnlm.adaptive`) interpolates with it instead of ``lam`` (``lambda`` is then
    reported as ``"adaptive"``) and reports ``searched_fraction``, the share of tokens whose datastore was searched.

    With ``cache_lambda`` > 0 the continuous cache joins the mixture (Khandelwal et al. 2020, Table 1)::

        p = (1 - λ_t - λc) p_LM + λ_t p_kNN + λc p_cache,   λ_t = min(λ(x_t), 1 - λc)

    with ``λ_t = λ`` for a fixed λ, the gate's per-token ``λ(x_t)`` for an adaptive dump (capped at ``1 - λc``, as
    ``memlm eval`` lowers a calibrated λ), and no kNN term for a dump without a datastore. Its perplexity is
    ``knn_cache_ppl`` (LM + kNN + cache) or ``lm_cache_ppl`` (LM + cache, no datastore); files written before
    older result files called either ``cache_ppl``.

    Each fixed-weight row is the rule's :class:`~memlm.core.mixture.Mixture` (``mixtures``: row -> ``to_dict()``).
    ``datastores``: each further datastore's ``(λ, τ)`` (``knn2_ppl``, ``multi_knn_ppl``: :func:`_several_datastores`).

    Evidence (:mod:`memlm.core.bootstrap`): ``intervals`` gives each perplexity's 95% bootstrap interval over the
    dump's documents, ``differences`` the paired interval of each relative change (``knn_ppl vs base_ppl``:
    ``knn_ppl / base_ppl - 1``; the cache rows against base and against the kNN-LM), ``bootstrap`` the documents and
    resamples. With ``target_counts`` (c(w_t) of every target in the memory's corpus, ``counted_in`` naming it),
    ``frequency_buckets`` breaks the kNN-LM's change down by that frequency (:mod:`memlm.core.frequency`).
    """
    lm = torch.from_numpy(ts.lm_logprob)
    out: dict[str, Any] = {"tokens": len(ts), "base_ppl": perplexity(lm)}
    rows: dict[str, torch.Tensor] = {"base_ppl": lm}  # each perplexity's per-token log p, for the intervals
    mixtures: dict[str, Any] = {}  # each fixed-weight row's rule (Mixture.to_dict), recorded in the result
    has_knn, adaptive = ts.knn_scores is not None, ts.knn_lambda is not None

    def rule_row(key: str, weights: dict[str, float]) -> torch.Tensor:
        logprobs, mixture = rule_rows(ts, {key: weights}, temperature, k, cache_temperature)
        mixtures.update(mixture)
        return logprobs[key]

    if has_knn:
        knn = memory_logprob(ts.knn_scores, ts.knn_values, ts.targets, temperature, k, ts.knn_log_counts)
        lam_t = torch.from_numpy(ts.knn_lambda).double() if adaptive else None  # He et al.'s per-token λ
        mixed = mix([lm, knn], weights=[1.0 - lam_t, lam_t]) if adaptive else rule_row("knn_ppl", {"knn": lam})
        out.update(
            knn_ppl=perplexity(mixed),
            knn_only_ppl=perplexity(knn),
            oracle_ppl=perplexity(torch.maximum(lm, knn)),
            target_in_neighbours=float(torch.isfinite(knn).float().mean()),
            knn_beats_lm=float((knn > lm).float().mean()),  # tokens where the oracle picks the memory
            **{"lambda": lam if not adaptive else "adaptive", "temperature": temperature},
            k=k or ts.knn_scores.shape[1],
        )
        rows.update(knn_ppl=mixed, knn_only_ppl=knn, oracle_ppl=torch.maximum(lm, knn))
        if ts.searched is not None:
            out["searched_fraction"] = float(ts.searched.mean())
    if datastores and has_knn and not adaptive:
        _several_datastores(ts, (lam, temperature), k, datastores, (out, rows, mixtures))
    if cache_lambda:
        key = CACHE_PPL_KEYS[has_knn]
        rows[key] = _with_cache(ts, (lm, knn if has_knn else None), lam, (cache_lambda, cache_temperature),
                                lambda w: rule_row(key, w))  # fmt: skip
        out.update(**{key: perplexity(rows[key])}, cache_lambda=cache_lambda, cache_temperature=cache_temperature)
    if mixtures:
        out["mixtures"] = mixtures
    several = [(ref, key) for key in rows if key == "multi_knn_ppl" or (key[:3] == "knn" and key[3:4].isdigit())
               for ref in ("base_ppl", "knn_ppl")]  # fmt: skip
    out.update(evidence(rows, ts.doc_index, pairs=(*DIFFERENCES, *several)))
    if target_counts is not None and "knn_ppl" in rows:
        out["frequency_buckets"] = {"knn_ppl": bucket_table(ts, rows["knn_ppl"], target_counts, counted_in)}
    return out


def _with_cache(ts: TokenScores, lm_knn: tuple, lam: float, cache: tuple[float, float], rule_row) -> torch.Tensor:
    """:func:`perplexities`' row with the cache at ``cache = (λc, τc)``: the rule through ``rule_row(weights)``, or
    for an adaptive dump the gate's per-token λ_t, capped so that λ_t + λc <= 1."""
    if ts.cache_scores is None:
        raise MemlmError("this dump has no cache entries; rerun memlm eval with --cache")
    lm, knn = lm_knn
    if knn is None or ts.knn_lambda is None:
        return rule_row({**({"knn": lam} if knn is not None else {}), "cache": cache[0]})
    p_cache = memory_logprob(ts.cache_scores, ts.cache_values, ts.targets, cache[1])
    lam_t = torch.from_numpy(ts.knn_lambda).double().clamp(max=1.0 - cache[0])
    return mix([lm.double(), knn.double(), p_cache.double()], weights=[1.0 - lam_t - cache[0], lam_t, cache[0]])


def _several_datastores(ts: TokenScores, first: tuple[float, float], k: int | None, datastores, into: tuple) -> None:
    """:func:`perplexities`' rows of a dump of several datastores: each further one alone beside the LM
    (``knn2_ppl``, ...) and all together (``multi_knn_ppl``), each at its ``(λ, τ)`` (the first's is ``first``),
    by the rule, added to ``into = (out, rows, mixtures)``."""
    out, rows, mixtures = into
    extra = ts.knn_extra_scores.shape[1] if ts.knn_extra_scores is not None else 0
    if len(datastores) != extra:
        raise MemlmError(f"{len(datastores)} (λ, τ) given for the {extra} further datastores of this dump: give one "
                         "per datastore after the first")  # fmt: skip
    names = [component_name("knn", r) for r in range(extra + 1)]
    taus = [first[1]] + [t for _, t in datastores]
    weights = dict(zip(names, [first[0]] + [w for w, _ in datastores], strict=True))
    found, rules = rule_rows(ts, {**{f"{c}_ppl": {c: weights[c]} for c in names[1:]}, "multi_knn_ppl": weights},
                             taus, k)  # fmt: skip
    rows.update(found)
    mixtures.update(rules)
    out.update({key: perplexity(v) for key, v in found.items()}, temperatures=taus,
               lambdas=[weights[c] for c in names])  # fmt: skip


def value_counts(datastore: DatastoreBase, targets: np.ndarray) -> np.ndarray:
    """c(w_t) of every target among a datastore's stored next-token values (one bincount over them)."""
    counts = np.bincount(np.asarray(datastore.values, dtype=np.int64), minlength=int(np.max(targets, initial=0)) + 1)
    return counts[np.asarray(targets, dtype=np.int64)]


def tune(
    ts: TokenScores,
    lambdas: Sequence[float] = DEFAULT_LAMBDAS,
    temperatures: Sequence[float] = DEFAULT_TEMPERATURES,
    k: int | None = None,
    cache_lambdas: Sequence[float] = (0.0,),
    cache_temperatures: Sequence[float] = (1.0,),
) -> dict[str, Any]:
    """Grid-search λ, temperature (and the cache's λc, τc) for the lowest interpolated perplexity on a dump.

    Returns the best parameters and every grid point (``grid``: list of dicts), without any new search.
    """
    if ts.knn_scores is None and ts.cache_scores is None:
        raise MemlmError("nothing to tune: the dump has neither datastore neighbours nor cache entries")
    lm = torch.from_numpy(ts.lm_logprob)
    has_knn = ts.knn_scores is not None
    if not has_knn:
        lambdas, temperatures = (0.0,), (1.0,)
    if not (any(cache_lambdas) and ts.cache_scores is not None):
        cache_lambdas, cache_temperatures = (0.0,), (1.0,)

    @functools.cache
    def knn(t: float) -> torch.Tensor:
        return memory_logprob(ts.knn_scores, ts.knn_values, ts.targets, t, k, ts.knn_log_counts)

    @functools.cache
    def cache(t: float) -> torch.Tensor:
        return memory_logprob(ts.cache_scores, ts.cache_values, ts.targets, t)

    def ppl(lam: float, temperature: float, cache_lambda: float, cache_temperature: float) -> float:
        comps, weights = [lm], [max(0.0, 1.0 - lam - cache_lambda)]
        if has_knn:
            comps.append(knn(temperature))
            weights.append(lam)
        if cache_lambda:
            comps.append(cache(cache_temperature))
            weights.append(cache_lambda)
        return perplexity(mix(comps, weights=weights))

    grid = {"lambda": lambdas, "temperature": temperatures, "cache_lambda": cache_lambdas,
            "cache_temperature": cache_temperatures}  # fmt: skip
    return grid_search(
        lambda **p: ppl(p["lambda"], p["temperature"], p["cache_lambda"], p["cache_temperature"]),
        grid,
        keep=lambda p: p["lambda"] + p["cache_lambda"] <= 1.0 + 1e-9,
    )
