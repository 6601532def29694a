"""Scoring a corpus with every memory at once: one forward pass, then each memory's columns in the per-token table.

:func:`score_tokens` takes the memories as one list (:func:`memlm.knnlm.memories.open_memories`: components, a
memory spec string, folders, open datastores, ∞-gram memories), captures in one forward pass the query of every
memory's key (:func:`memlm.knnlm.evaluate.lm_scores`), and lets each component score every target
(:meth:`memlm.mixing.component.Component.score`) into a :class:`memlm.knnlm.table.TokenTable`; a datastore's
scoring keeps its efficiency strategies (:data:`memlm.knnlm.evaluate.EFFICIENCY_STRATEGIES`). Perplexities and tuning
on the table are :mod:`memlm.knnlm.evaluate`'s.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from memlm.core.config import DEFAULT_MIN_CONTEXT, DEFAULT_WINDOW, RetrievalConfig
from memlm.data.windows import tokenize_documents
from memlm.errors import MemlmError
from memlm.knnlm.cache import CacheComponent
from memlm.knnlm.evaluate import attach_neighbours, lm_scores
from memlm.knnlm.memories import open_memories
from memlm.knnlm.table import TokenTable
from memlm.mixing.component import Batch, Component
from memlm.mixing.datastore import DatastoreComponent
from memlm.models.keys import KeySpec, num_layers
from memlm.retrieval import DatastoreMemory, as_memory
from memlm.storage.datastore import DatastoreBase

__all__ = ["score_tokens"]


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


def _components(memories: Any, config: RetrievalConfig, progress: bool) -> tuple[list[Component], RetrievalConfig]:
    """Every memory as a component, in order (:func:`memlm.knnlm.memories.open_memories`), an open datastore (plain
    or sharded) searched with ``config``'s settings; and the config recorded (the index file searched filled in)."""
    from memlm.ngram.memory import NgramMemories

    if memories is None:
        return [], config
    items = [memories] if isinstance(memories, str) or not isinstance(memories, Sequence) else list(memories)
    out: list[Component] = []
    for item in items:
        if isinstance(item, NgramMemories):
            out.extend(open_memories(list(item.memories)))
        elif isinstance(item, DatastoreBase | DatastoreMemory):  # a memory over a datastore: every option applies
            memory = item
            if isinstance(item, DatastoreBase):
                memory = DatastoreMemory(item, config.search, config.scores, config.nprobe, index_path=config.index,
                                         progress=progress)  # fmt: skip
            if not out or not any(isinstance(c, DatastoreComponent) for c in out):
                config = config.replace(index=str(memory.index_path) if memory.search_mode == "index" else None)
            out.append(DatastoreComponent(memory, config.k))
        elif not isinstance(item, Component | str) and hasattr(item, "key_spec") and hasattr(item, "search"):
            _plain_search_only(as_memory(item), config)  # any other memory: searched as it is
            out.append(DatastoreComponent(as_memory(item), config.k))
        else:
            out.extend(open_memories([item]))
    return out, config


def _forward(model, tokenizer, documents, components: list[Component], config: RetrievalConfig, batch_size: int,
             progress: bool, meta) -> tuple[TokenTable, Batch, list[Any]]:  # fmt: skip
    """:func:`lm_scores` with every component's queries, and (``config.pipeline``) each datastore's searches started
    per forward batch in a background thread while the model computes the next (FAISS releases the GIL)."""
    layers = num_layers(model)
    specs = [c.key_spec.normalized(layers) if isinstance(c, CacheComponent) else c.key_spec for c in components]
    dense = [c for c in components if isinstance(c, DatastoreComponent) and isinstance(c.memory, DatastoreMemory)]
    pending: dict[int, list[Future]] = {id(c): [] for c in dense}
    pipelined = config.pipeline and bool(dense)
    min_context = config.min_context if config.min_context is not None else DEFAULT_MIN_CONTEXT
    with ThreadPoolExecutor(max_workers=1) if pipelined else contextlib.nullcontext() as pool:
        on_batch = None
        if pipelined:

            def on_batch(q: dict[KeySpec, np.ndarray]) -> None:
                for c in dense:
                    pending[id(c)].append(pool.submit(c.memory.search_ids, q[c.key_spec], c.k))

        table, queries, provenance = lm_scores(model, tokenizer, documents, [s for s in specs if s is not None],
                                               config.window, min_context, batch_size, progress, meta, config.stride,
                                               config.block_start, on_batch)  # fmt: skip
        found = []
        for c in components:
            parts = [f.result() for f in pending.get(id(c), [])]
            found.append((np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])) if parts
                         else None)  # fmt: skip
    chunks = {c.doc_index: c.tokens for c in tokenize_documents(documents, tokenizer)}
    queries = {**queries, **{c.key_spec: queries[s] for c, s in zip(components, specs, strict=True) if s is not None}}
    batch = Batch(queries=queries, targets=table.targets, doc_index=table.doc_index, position=table.position,
                  documents=chunks, provenance=provenance if config.drop_self_matches else None)  # fmt: skip
    return table, batch, found


def score_tokens(
    model,
    tokenizer,
    documents: Sequence,
    memories: Any = (),
    config: RetrievalConfig | None = None,
    *,
    batch_size: int = 4,
    progress: bool = True,
    meta: dict[str, Any] | None = None,
    **options: Any,
) -> TokenTable:
    """One forward pass over ``documents`` (the queries of every memory's key captured), then every memory scores
    every target into the per-token table (:class:`memlm.knnlm.table.TokenTable`); see the module docstring.

    ``memories``: one list of memories, in order (:func:`memlm.knnlm.memories.open_memories`: components, a memory
    spec string such as ``knn:ds/wiki;ngram:idx/wt2;cache``, folders, open datastores (plain or sharded), any memory
    with a ``key_spec``, ∞-gram memories). Each becomes a component named by :func:`memlm.mixing.component.
    component_names` (knn, knn2, ngram, cache, ...). An open datastore is searched with ``config``'s settings; a
    component keeps its own (a spec's ``k``). The model must be the one that built each datastore.

    ``config`` (:class:`memlm.core.config.RetrievalConfig`) holds every retrieval and windowing setting: ``k``,
    ``search`` / ``scores`` / ``nprobe`` / ``index`` (another index of the datastore, e.g. a compressed ``OPQ``/``PCA``
    one), ``drop_self_matches``, the windows (``window`` 1024 and ``min_context`` 512 when not set; ``stride`` replaces
    ``min_context``; ``stride = window`` gives non-overlapping blocks, ``block_start`` skip or bos, as in
    :func:`lm_scores`) and the efficiency options. ``options`` set its fields by name on top of ``config``
    (``k=16, window=64``; ``index_path`` is ``index``). The config is recorded in ``meta["retrieval"]``.
    ``drop_self_matches`` removes neighbours that are the very token being scored (same document, same offset), for
    when the evaluated text is also in the datastore. A pruned datastore's merged counts enter the scores.

    Efficiency options of a datastore's scoring (:mod:`memlm.knnlm`; :data:`EFFICIENCY_STRATEGIES`, chosen by
    ``config.efficiency``); ``adaptive`` and ``pointer_min`` decide per token for one datastore: one only with them.

    * ``adaptive``: a trained gate file (:class:`memlm.knnlm.adaptive.AdaptiveGate`, He et al. 2021) gives each
      token its λ; tokens below the gate's threshold (set so that ``adaptive_fraction`` of the tokens are searched,
      or the gate's λ > 0 when no fraction is given) are not searched and get λ = 0 (columns ``lambda``,
      ``searched``);
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
    components, config = _components(memories, config, progress)
    datastores = [c for c in components if isinstance(c, DatastoreComponent)]
    if len(datastores) > 1 and (config.adaptive is not None or config.pointer_min or config.index is not None):
        raise MemlmError("adaptive retrieval and pointer reuse decide per token for one datastore, and another "
                         "index is one datastore's: give one datastore with them, or leave them out to search "
                         "several")  # fmt: skip
    for c in components:
        c.check_compatible(model, tokenizer)
    table, batch, found = _forward(model, tokenizer, documents, components, config, batch_size, progress, meta)
    table.meta["retrieval"] = config.to_dict()
    t1 = time.perf_counter()
    for c, searched in zip(components, found, strict=True):
        t0 = time.perf_counter()
        if isinstance(c, DatastoreComponent):
            name = attach_neighbours(table, batch.query(c.key_spec), c, config, batch.provenance, searched, progress)
        else:
            name = table.add(c, c.score(batch))
        table.meta["components"][name]["seconds"] = time.perf_counter() - t0
    table.meta["seconds_search"] = (
        time.perf_counter() - t1
    )  # every memory, after the forward pass (pipelined: the rest)
    return table
