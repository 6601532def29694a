"""Perplexity of an LM with and without memory, and the per-token table it is computed from.

``score_tokens`` makes one forward pass over a corpus (sliding windows, see :mod:`memlm.data.windows`), capturing the
queries of every memory's key, and then lets each memory (a :class:`memlm.mixing.component.Component`) score every
target: the per-token table (:class:`memlm.knnlm.table.TokenTable`) keeps the LM log-probability of each target and
each memory's columns (a datastore's top-k retrieved (score, value) pairs, an ∞-gram's P∞, the cache's entries).
``perplexities`` then computes, for any λ, temperature and k <= the scored k,

    base:    exp(-mean log p_LM(w_t))
    kNN-LM:  exp(-mean log((1-λ) p_LM + λ p_kNN))                 (Khandelwal et al. Eq. 3)
    + cache: exp(-mean log((1-λ-λc) p_LM + λ p_kNN + λc p_cache))  (Table 1)
    oracle:  exp(-mean log max(p_LM, p_kNN))                       (Xu et al. 2023: the best λ ∈ {0, 1} per token)

without searching again, so ``memlm tune`` can fit the mixture on the validation table
(:func:`memlm.mixing.report.fit_table`) and apply it to test.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from memlm.core.bootstrap import DIFFERENCES
from memlm.core.config import RetrievalConfig
from memlm.core.distribution import mix
from memlm.data.windows import batched, count_targets, resolve_stride, sliding_windows, tokenize_documents
from memlm.errors import MemlmError
from memlm.knnlm.adaptive import AdaptiveGate, gate_features, gate_lambdas, threshold_for_fraction
from memlm.knnlm.pointer import pointer_retrieve
from memlm.knnlm.table import TokenTable
from memlm.mixing.component import Batch, Component
from memlm.mixing.datastore import DatastoreComponent
from memlm.mixing.dump import rule_for
from memlm.mixing.report import report
from memlm.models.forward import forward_windows
from memlm.models.keys import KeySpec
from memlm.ngram.step import NgramComponent
from memlm.retrieval import DatastoreMemory
from memlm.storage.datastore import Datastore, DatastoreBase

__all__ = [
    "lm_scores",
    "add_memory",
    "add_neighbours",
    "attach_neighbours",
    "perplexities",
    "eval_result",
    "cache_mixture_ppl",
    "value_counts",
    "CACHE_KEY",
    "CACHE_PPL_KEYS",
]


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
) -> tuple[TokenTable, dict[KeySpec, np.ndarray], dict[str, np.ndarray]]:
    """The forward pass: LM log-probabilities of every target, plus the queries for each key spec.

    ``on_batch`` (optional) is called with each forward batch's queries (spec -> ``[n, D]``, in stream order) as soon
    as they exist: a search started there overlaps the next batch's forward pass (pipelining).

    Windows as :func:`memlm.data.windows.sliding_windows` cuts them: ``stride`` (when given) replaces ``min_context``,
    and ``stride == window`` gives non-overlapping blocks whose first token is skipped (``block_start="skip"``, Hugging
    Face's perplexity guide) or scored after the tokenizer's BOS (or EOS) token (``"bos"``).

    Returns ``(table, queries, provenance)``: the table with the LM's columns and no memory, ``queries[spec]``
    ``[N, D]`` float32, and ``provenance`` holding each target's ``doc_hash`` and ``offset`` (to drop self-matches).
    Memories are scored later (:func:`score_tokens`, :func:`add_neighbours`), so one forward pass serves any number.
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
    windows_meta = {"window": window, "min_context": min_context, "stride": stride,
                    **({"block_start": block_start} if stride == window else {})}  # fmt: skip
    table = _lm_table(cat, {**(meta or {}), **windows_meta, "seconds_forward": time.perf_counter() - t0})
    provenance = {"doc_hash": cat["hash"], "offset": cat["off"]}
    return table, {s: np.concatenate(q) for s, q in queries.items()}, provenance


def _lm_table(cat: dict[str, np.ndarray], meta: dict[str, Any]) -> TokenTable:
    """:func:`lm_scores`' table from its concatenated columns (``targets``, ``lm``, ``doc``, ``off``, ``ent``,
    ``max``): the LM's columns, no memory."""
    return TokenTable(
        targets=cat["targets"].astype(np.int64),
        doc_index=cat["doc"].astype(np.int32),
        lm_logprob=cat["lm"].astype(np.float32),
        position=cat["off"].astype(np.int32),
        lm_entropy=cat["ent"].astype(np.float32),
        lm_max_logprob=cat["max"].astype(np.float32),
        meta={**meta, "tokens": int(len(cat["targets"]))},
    )


def add_neighbours(
    table: TokenTable,
    queries: np.ndarray,
    datastore: Datastore,
    config: RetrievalConfig | None = None,
    *,
    provenance: dict[str, np.ndarray] | None = None,
    progress: bool = True,
    **options: Any,
) -> TokenTable:
    """Retrieve the k nearest datastore entries of every query and add them to ``table`` as its next datastore
    (``knn``, then ``knn2``, ...).

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
    r = memory.search(queries, c.k, provenance)
    columns = {"scores": r.scores, "values": r.values.astype(np.int32)}
    if r.log_counts is not None:
        columns["log_counts"] = r.log_counts
    table.add(DatastoreComponent(memory, c.k), columns, drop_self_matches=provenance is not None,
              seconds=time.perf_counter() - t1)  # fmt: skip
    return table


def add_memory(
    table: TokenTable, memory: Any, documents: Sequence, tokenizer, queries: dict[Any, np.ndarray] | None = None
) -> str:
    """Score every target of ``table`` (from ``documents``) with one more memory (a component, or an ∞-gram memory)
    and add its columns; its name is returned. ``queries``: the forward pass's queries by key spec, for a memory
    that reads a hidden state."""
    component = memory if isinstance(memory, Component) else NgramComponent(memory)
    t0 = time.perf_counter()
    chunks = {c.doc_index: c.tokens for c in tokenize_documents(documents, tokenizer)}
    batch = Batch(queries=queries or {}, targets=table.targets, doc_index=table.doc_index, position=table.position,
                  documents=chunks)  # fmt: skip
    return table.add(component, component.score(batch), seconds=time.perf_counter() - t0)


CACHE_KEY = KeySpec("final", -1)  # Grave et al.'s cache reads the hidden state the softmax reads


def _search_every_query(table, queries, memory, config, provenance, progress) -> tuple:
    """No efficiency option: one search per token."""
    return (*memory.search_ids(queries, config.k), {})


def _pointer_reuse(table, queries, memory, config, provenance, progress) -> tuple:
    """RetoMaton (Alon et al. 2022): search only where fewer than ``pointer_min`` pointers survive
    (:func:`memlm.knnlm.pointer.pointer_retrieve`); the ``searched`` column records where it searched."""
    ds, k = memory.datastore, config.k
    sc, ids, searched = pointer_retrieve(
        queries, table.targets, table.doc_index, lambda x: memory.search_ids(x, k, progress=False), ds.keys,
        ds.values, ds.doc_hash, ds.offset, k, config.pointer_min, memory.metric, rule=config.pointer_rule,
        provenance=provenance, progress=progress,
    )  # fmt: skip
    return sc, ids, {"searched": searched}


def _adaptive_gate(table, queries, memory, config, provenance, progress) -> tuple:
    """He et al. (2021): the gate gives each token its λ (the ``lambda`` column); tokens under its threshold are not
    searched (``searched``)."""
    gate = AdaptiveGate.load(config.adaptive)
    features = gate_features(table.lm_entropy, table.lm_max_logprob, table.position)
    fraction = config.adaptive_fraction
    threshold = 0.0 if fraction is None else threshold_for_fraction(gate, features, fraction)
    lam, searched = gate_lambdas(gate, features, threshold)
    sc = np.full((len(queries), config.k), -np.inf, dtype=np.float32)
    ids = np.full((len(queries), config.k), -1, dtype=np.int64)
    if searched.any():
        sc[searched], ids[searched] = memory.search_ids(queries[searched], config.k)
    return sc, ids, {"lambda": lam, "searched": searched}


#: ``RetrievalConfig.efficiency`` -> how the neighbours of a forward pass's queries are found: ``(scores, ids, further
#: columns)`` (pipelining searches during the forward pass: its results arrive as ``found``)
EFFICIENCY_STRATEGIES: dict[str, Callable[..., tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]]] = {
    "none": _search_every_query,
    "pipeline": _search_every_query,
    "pointer": _pointer_reuse,
    "adaptive": _adaptive_gate,
}


def attach_neighbours(
    table: TokenTable,
    queries: np.ndarray,
    memory: Any,
    config: RetrievalConfig | int,
    provenance: dict[str, np.ndarray] | None = None,
    found: tuple[np.ndarray, np.ndarray] | None = None,
    progress: bool = True,
    **options: Any,
) -> str:
    """Retrieve for the queries of one forward pass (:func:`lm_scores`) with the efficiency strategy ``config``
    chooses (:data:`EFFICIENCY_STRATEGIES`), and add the datastore's columns to ``table``; its name is returned.

    ``config``: a :class:`RetrievalConfig` (or ``k``, with its other fields as ``options``: ``pointer_min=16``...).
    ``found``: scores and ids already searched (pipelined). ``provenance`` drops self-matches (before pointer
    survivors are counted). ``memory``: a :class:`DatastoreMemory` (every strategy) or any memory (one plain search).
    Keeping this apart from the forward pass lets one forward pass serve several memories and options (e.g.
    benchmarks/speed/bench_efficient.py).
    """
    if not isinstance(config, RetrievalConfig):
        config = RetrievalConfig.with_options(k=int(config), **options)
    component = memory if isinstance(memory, DatastoreComponent) else DatastoreComponent(memory, config.k)
    memory, k = component.memory, component.k
    if not isinstance(memory, DatastoreMemory):  # any memory: one plain search, its own description
        return table.add(component, component.score(Batch(queries={memory.key_spec: queries})))
    if found is not None:
        sc, ids, more = (*found, {})
    else:
        sc, ids, more = EFFICIENCY_STRATEGIES[config.efficiency](table, queries, memory, config.replace(k=k),
                                                                 provenance, progress)  # fmt: skip
    r = memory.retrieved(sc, ids, provenance)
    columns = {"scores": r.scores, "values": r.values.astype(np.int32), **more}
    if r.log_counts is not None:
        columns["log_counts"] = r.log_counts
    record = {"drop_self_matches": provenance is not None, **({"scores": "exact"} if config.pointer_min else {})}
    return table.add(component, columns, **record)  # pointer reuse scores every row from the stored keys


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
    ts: TokenTable,
    lam: float = 0.25,
    temperature: float = 1.0,
    k: int | None = None,
    cache_lambda: float = 0.0,
    cache_temperature: float = 1.0,
    target_counts: np.ndarray | None = None,
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
    resamples. With ``target_counts`` (c(w_t) of every target among the datastore's values),
    ``frequency_buckets`` breaks the kNN-LM's change down by that frequency (:mod:`memlm.core.frequency`).
    """
    lm = torch.from_numpy(ts.lm_logprob)
    rows: dict[str, Any] = {"base_ppl": lm}  # each row: a Mixture over the table, or its per-token log p
    stats: dict[str, Any] = {}
    has_knn = "knn" in ts.columns
    gate = ts.columns["knn"].get("lambda") if has_knn else None  # He et al.'s per-token λ (adaptive retrieval)
    knn = ts.logprob("knn", temperature=temperature, k=k) if has_knn else None
    if has_knn:
        lam_t = None if gate is None else torch.from_numpy(gate).double()
        rows["knn_ppl"] = rule_for(ts, {"knn": lam}) if lam_t is None else mix([lm, knn], weights=[1.0 - lam_t, lam_t])
        rows.update(knn_only_ppl=knn, oracle_ppl=torch.maximum(lm, knn))
        stats.update(target_in_neighbours=float(torch.isfinite(knn).float().mean()),
                     knn_beats_lm=float((knn > lm).float().mean()),  # tokens where the oracle picks the memory
                     **{"lambda": lam if gate is None else "adaptive", "temperature": temperature},
                     k=k or ts.columns["knn"]["scores"].shape[1])  # fmt: skip
        if "searched" in ts.columns["knn"]:
            stats["searched_fraction"] = float(ts.columns["knn"]["searched"].mean())
    taus: Any = temperature
    if datastores and has_knn and gate is None:
        taus = _several_datastores(ts, lam, temperature, datastores, (rows, stats))
    if cache_lambda:
        key = CACHE_PPL_KEYS[has_knn]
        rows[key] = _with_cache(ts, lm, knn, gate, lam, (cache_lambda, cache_temperature))
        stats.update(cache_lambda=cache_lambda, cache_temperature=cache_temperature)
    several = [(ref, key) for key in rows if key == "multi_knn_ppl" or (key[:3] == "knn" and key[3:4].isdigit())
               for ref in ("base_ppl", "knn_ppl")]  # fmt: skip
    res = report(ts, rows, (*DIFFERENCES, *several), target_counts, "the datastore's values", temperature=taus, k=k,
                 cache_temperature=cache_temperature)  # fmt: skip
    head = {key: v for key, v in res.items() if key == "tokens" or key in rows}
    return {**head, **stats, **{key: v for key, v in res.items() if key not in head}}


def _with_cache(ts: TokenTable, lm: torch.Tensor, knn: torch.Tensor | None, gate: np.ndarray | None, lam: float,
                cache: tuple[float, float]) -> Any:  # fmt: skip
    """:func:`perplexities`' row with the cache at ``cache = (λc, τc)``: the rule's Mixture, or for an adaptive
    table the gate's per-token λ_t, capped so that λ_t + λc <= 1."""
    if "cache" not in ts.columns:
        raise MemlmError("this table has no cache entries; rerun memlm eval with --memory cache")
    if gate is None:
        return rule_for(ts, {**({"knn": lam} if knn is not None else {}), "cache": cache[0]})
    p_cache = ts.logprob("cache", temperature=cache[1])
    lam_t = torch.from_numpy(gate).double().clamp(max=1.0 - cache[0])
    return mix([lm.double(), knn.double(), p_cache.double()], weights=[1.0 - lam_t - cache[0], lam_t, cache[0]])


def _several_datastores(ts: TokenTable, lam: float, temperature: float, datastores, into: tuple) -> list[float]:
    """:func:`perplexities`' rows of a table of several datastores: each further one alone beside the LM
    (``knn2_ppl``, ...) and all together (``multi_knn_ppl``), each at its ``(λ, τ)`` (the first's is
    ``(lam, temperature)``), by the rule, added to ``into = (rows, stats)``; the τ of each datastore is returned."""
    rows, stats = into
    names = list(ts.names("knn"))
    if len(datastores) != len(names) - 1:
        raise MemlmError(f"{len(datastores)} (λ, τ) given for the {len(names) - 1} further datastores of this table: "
                         "give one per datastore after the first")  # fmt: skip
    taus = [temperature] + [t for _, t in datastores]
    weights = dict(zip(names, [lam] + [w for w, _ in datastores], strict=True))
    rows.update({f"{c}_ppl": rule_for(ts, {c: weights[c]}) for c in names[1:]}, multi_knn_ppl=rule_for(ts, weights))
    stats.update(temperatures=taus, lambdas=[weights[c] for c in names])
    return taus


def eval_result(
    ts: TokenTable,
    weights: Sequence[tuple[float, float, str]],
    cache: tuple[float, float] = (0.0, 1.0),
    datastore: DatastoreBase | None = None,
    temperature: float | None = None,
    about: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """``memlm eval``'s result of a scored table: :func:`perplexities` with each datastore at its ``(λ, τ, origin)``
    of ``weights`` (the first's the kNN-LM's rows, the others' ``knn2_ppl``, ``multi_knn_ppl``; no datastore: τ =
    ``temperature`` or 1), the cache at ``cache = (λc, τc)`` (λc = 0: none), the frequency buckets counted among
    ``datastore``'s values; then ``about`` (model, memories, corpus, split), where the weights came from
    (``parameters_from``; each datastore's with several), the seconds spent, the first datastore's description and
    ``retrieval``: the search settings and the weights used."""
    has_knn = datastore is not None and bool(weights)
    lam, tau, origin = weights[0] if has_knn else (0.0, temperature or 1.0, None)
    res = perplexities(ts, lam=lam, temperature=tau, cache_lambda=cache[0], cache_temperature=cache[1],
                       target_counts=value_counts(datastore, ts.targets) if has_knn else None,
                       datastores=[(w[0], w[1]) for w in weights[1:]])  # fmt: skip
    described = [ts.meta["components"][name] for name in ts.names("knn")]
    each = [{**d, "lambda": w[0], "temperature": w[1], "parameters_from": w[2]}
            for d, w in zip(described, weights, strict=True)] if len(weights) > 1 else []  # fmt: skip
    first = described[0] if described else {}
    res.update(
        **(about or {}),
        **({"parameters_from": origin} if origin else {}),
        **({"datastores": each} if each else {}),
        **{k: v for k, v in ts.meta.items() if k.startswith("seconds")},
        **{k: v for k, v in first.items() if k in ("datastore", "key", "search", "scores")},
        retrieval={  # the values this result used (score_tokens records the search)
            **ts.meta["retrieval"],
            **({"lam": res.get("lambda", lam), "temperature": tau} if has_knn else {}),
            "cache_lambda": res.get("cache_lambda", cache[0]),
            "cache_temperature": cache[1],
        },
    )
    return res


def value_counts(datastore: DatastoreBase, targets: np.ndarray) -> np.ndarray:
    """c(w_t) of every target among a datastore's stored next-token values (one bincount over them)."""
    counts = np.bincount(np.asarray(datastore.values, dtype=np.int64), minlength=int(np.max(targets, initial=0)) + 1)
    return counts[np.asarray(targets, dtype=np.int64)]
