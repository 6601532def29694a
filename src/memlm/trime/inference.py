"""TRIME at test time: perplexity with local, long-term and external memories (Zhong et al. 2022, Sec. 4, App. A).

The testing objective is the training objective (Eq. 5) with testing memories and a temperature (App. A, Eq. 6)::

    P(w | c_t) ∝ exp(E_w · f(c_t))  +  Σ_{(c_j, x_j) ∈ M_test, x_j = w} exp(sim(g(c_t), g(c_j)) / τ_mem)
    sim(q, k) = q · k / sqrt(d)

where ``f(c)`` is what the output softmax reads (``E f(c)`` = the logits) and ``g(c)`` the input of the last FFN after
its layer norm (``KeySpec("ffn_in", -1)``). The testing memory ``M_test`` (App. A, Eq. 7) combines:

* ``M_local`` (Sec. 4.1): the earlier positions ``j < t`` of the same segment (``segments=0``);
* ``M_long`` (Sec. 4.2): every position of the ``M`` previous segments of the same document (``segments=M``, tuned on
  the development set: "we simply enumerate the number of segments used in M_long and choose the optimum");
* ``M_ext`` (Sec. 4.3): the top-``k`` entries of a datastore (``memlm datastore build --key ffn_in``) retrieved for
  ``g(c_t)``, in the same softmax with temperature ``τ`` (``temperature``), and, for large external memories, the
  extra interpolation of App. A (Eq. 8-9)::

      P_kNN(w | c)  = Σ_{j ∈ top-k, x_j = w} softmax_j(sim(g(c), g(c_j)) / τ_kNN)                 (Eq. 8)
      P(w | c)      = (1 - λ) P_joint(w | c) + λ P_kNN(w | c)                                       (Eq. 9)

A document is cut into consecutive segments (:func:`memlm.trime.batching.segment_documents`, ``seq_len - 1`` owned
tokens plus the next segment's first token, as in training), each scored fully by one forward pass of at most
``seq_len`` tokens with no context from earlier segments; earlier segments reach a token only through the long-term
memory. With ``context = C > 0`` the windows overlap instead (App. D: "we evaluate on the tokens at the end of the
segment (i.e., an evaluation segment can overlap with others)", following Baevski & Auli 2019): each window scores
the ``seq_len - 1 - C`` targets after the previous window's and reads the ``C`` tokens before them as context
(:func:`evaluation_windows`); the local memory is every earlier position of the window, context included, and the
long-term memory keeps only entries from before the window (none is counted twice).
Segments are processed in document order with a FIFO of the last ``max_segments`` segments' detached
``(g, target)`` pairs.

:func:`score_trime` does the forward passes and the retrieval once and keeps, per target, all a later choice of
``(M, τ_local, τ, λ, τ_kNN)`` needs (:class:`TrimeScores`): the target's vocabulary logit and the log-sum-exp of all
vocabulary logits, the log-sum-exp of the local / long memory terms per segment lag and per local temperature (over all
entries, and over the entries whose value is the target), and the retrieved (score, value) pairs. The per-lag sums are
exact: for any ``M`` the memory term is the log-sum-exp of lags ``0..M``. :func:`trime_perplexity` and
:func:`tune_trime_inference` then work without any new forward pass or search.
"""

from __future__ import annotations

import functools
import itertools
import math
import time
import weakref
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch

from memlm.core.config import RetrievalConfig, replace_fields
from memlm.core.distribution import (
    joint_distribution,
    joint_target_logprob,
    knn_distribution,
    knn_target_logprob,
    memory_lse,
    mix,
    perplexity,
    value_logsumexp,
)
from memlm.core.dumps import TokenDump
from memlm.core.memory import DenseMemory
from memlm.core.tuning import grid_search
from memlm.data.windows import doc_hash
from memlm.errors import MemlmError
from memlm.models.forward import model_device, right_pad
from memlm.models.keys import KeyCapture, KeySpec, num_layers
from memlm.retrieval import DatastoreMemory
from memlm.storage import index as index_lib
from memlm.storage.datastore import Datastore, DatastoreBase
from memlm.storage.searcher import as_searcher
from memlm.storage.sharded import open_datastore
from memlm.trime.batching import Segment, TokenWindow
from memlm.trime.training import G_SPEC, pad_id_of, tokenize_for_trime

__all__ = [
    "TrimeEvalConfig",
    "TrimeScores",
    "EvalWindow",
    "evaluation_windows",
    "score_trime",
    "trime_target_logprobs",
    "trime_perplexity",
    "trime_log_distribution",
    "tune_trime_inference",
    "DEFAULT_SEGMENTS",
    "DEFAULT_TRIME_TEMPERATURES",
    "DEFAULT_TRIME_LAMBDAS",
]

DEFAULT_SEGMENTS = (0, 1, 2, 4, 8)
DEFAULT_TRIME_TEMPERATURES = (
    0.25,
    0.5,
    1.0,
    2.0,
    4.0,
    8.0,
    16.0,
    32.0,
)  # widened: 8, the old top, was chosen
DEFAULT_TRIME_LAMBDAS = (0.0, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6)


@dataclass
class TrimeScores(TokenDump):
    """The per-token dump of a TRIME evaluation; any ``(M, τ_local, τ, λ, τ_kNN)`` is scored from it (module doc).

    ``mem_all[i, a, m]`` = ``logsumexp_j sim(g_i, g_j) / τ_local[a]`` over the memory entries ``j`` of lag ``m``
    (``m = 0``: earlier positions of the own segment; ``m >= 1``: every position of the ``m``-th previous segment of
    the same document), ``-inf`` when there is none; ``mem_hit`` the same over the entries whose value is the target.
    """

    KIND: ClassVar[str] = "a TRIME score dump"
    REQUIRED: ClassVar[dict[str, int]] = {"targets": 1, "doc_index": 1, "segment_index": 1, "target_logit": 1,
                                          "logit_lse": 1, "mem_all": 3, "mem_hit": 3}  # fmt: skip
    OPTIONAL: ClassVar[dict[str, int]] = {"ext_scores": 2, "ext_values": 2}
    PAIRS: ClassVar[tuple[tuple[str, str], ...]] = (("ext_scores", "ext_values"),)
    HINT: ClassVar[str] = "rerun memlm trime-eval --dump {path}"

    targets: np.ndarray  # [N] int64
    doc_index: np.ndarray  # [N] int32, document of each target
    segment_index: np.ndarray  # [N] int32, segment number inside its document
    target_logit: np.ndarray  # [N] float32: E_w · f(c) of the target w
    logit_lse: np.ndarray  # [N] float32: logsumexp_v E_v · f(c)
    mem_all: np.ndarray  # [N, n_local_temperatures, max_segments + 1] float32
    mem_hit: np.ndarray  # [N, n_local_temperatures, max_segments + 1] float32
    ext_scores: np.ndarray | None = None  # [N, k] float32: sim(g(c), key) of the retrieved entries, -inf when empty
    ext_values: np.ndarray | None = None  # [N, k] int32: their values, -1 when empty
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def max_segments(self) -> int:
        """The largest number of previous segments ``M`` this dump can score."""
        return int(self.mem_all.shape[2]) - 1

    @property
    def local_temperatures(self) -> list[float]:
        """The temperatures of the local / long memory term this dump holds."""
        return [float(t) for t in self.meta["local_temperatures"]]

    def check(self, path: str | Path) -> None:
        super().check(path)
        temps = self.meta.get("local_temperatures")
        if (
            self.mem_all.shape != self.mem_hit.shape
            or not isinstance(temps, list)
            or len(temps) != self.mem_all.shape[1]
        ):
            raise MemlmError(
                f"TRIME score dump {path}: its arrays and local temperatures do not match; {self.hint(path)}"
            )


@dataclass(frozen=True)
class EvalWindow(TokenWindow):
    """One evaluation window of a document: ``tokens[a : e2 + 1]``, scoring the targets at document positions
    ``a + 1 + score_from .. e2`` (the ones before are context). Same ``inputs`` / ``targets`` convention as
    :class:`memlm.trime.batching.Segment`."""

    doc_index: int
    index: int  # window number inside the document
    start: int  # a: document offset of the first input token
    tokens: np.ndarray
    score_from: int  # targets[:score_from] are context only

    @property
    def scored_positions(self) -> np.ndarray:
        """Document positions ``p`` of the scored targets (token ``p`` predicted from tokens ``< p``)."""
        return self.start + 1 + np.arange(self.score_from, len(self.targets))


def evaluation_windows(token_docs: Sequence[np.ndarray], span: int, context: int = 0) -> list[EvalWindow]:
    """Windows of at most ``span`` input tokens that score every target of each document exactly once, in order.

    ``context = 0``: consecutive non-overlapping segments, exactly :func:`memlm.trime.batching.segment_documents`
    with ``segment_len = span`` (the training segments). ``context = C`` (``0 <= C < span``): TRIME App. D / Baevski &
    Auli (2019): window ``i`` scores the next ``span - C`` targets after those of window ``i - 1`` and starts ``C``
    tokens before them, so every target but the first ``C`` of a document sees at least ``C`` tokens of its own
    document (window 0 scores its first ``span`` targets with the context they have).
    """
    if span < 1:
        raise MemlmError(f"span must be >= 1, got {span}")
    if isinstance(context, bool) or not isinstance(context, int) or not 0 <= context < span:
        raise MemlmError(
            f"context must be an integer in [0, {span - 1}] (fewer than the {span} input positions of a window), "
            f"got {context!r}"
        )
    out: list[EvalWindow] = []
    for d, doc in enumerate(token_docs):
        arr = np.asarray(doc, dtype=np.int64).reshape(-1)
        last = len(arr) - 1  # the last target position
        done, i = 0, 0  # targets 1..done are scored
        while done < last:
            end = min(done + (span if i == 0 else span - context), last)
            a = 0 if i == 0 else done - context
            out.append(EvalWindow(d, i, a, arr[a : end + 1].copy(), done - a))
            done, i = end, i + 1
    return out


def token_provenance(
    docs: Sequence, token_docs: Sequence[np.ndarray], stream: bool = False
) -> list[tuple[np.ndarray, np.ndarray]]:
    """``(doc_hash, offset)`` of every token of each scored sequence: one pair of arrays per document, or one pair for
    the whole stream (``stream=True``: the documents' tokens joined in order), so that a target at position ``p`` of
    its sequence comes from document ``doc_hash[p]``, token ``offset[p]`` (as :mod:`memlm.data.windows` records it)."""
    per_doc = [
        (np.full(len(t), doc_hash(d.id, d.text), dtype=np.int64), np.arange(len(t), dtype=np.int64))
        for d, t in zip(docs, token_docs, strict=True)
    ]
    if not stream or not per_doc:
        return per_doc
    return [(np.concatenate([h for h, _ in per_doc]), np.concatenate([o for _, o in per_doc]))]


def _forward_segments(
    model: torch.nn.Module, segments: Sequence[Segment | EvalWindow], pad_id: int, key: KeySpec
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``(target_logit [n], logit_lse [n], g [n, D])`` in float32 for each segment (n = its number of targets)."""
    device = model_device(model)
    ids, mask = (t.to(device) for t in right_pad([s.inputs for s in segments], pad_id))
    with KeyCapture(model, key) as cap:
        out = model(input_ids=ids, attention_mask=mask, use_cache=False)
        g = cap.keys
    if g is None or g.shape[:2] != ids.shape:
        raise MemlmError(f"could not capture g(c) ({key.describe()}) for a batch of shape {tuple(ids.shape)}")
    results = []
    for b, s in enumerate(segments):
        n = len(s.inputs)
        logits = out.logits[b, :n].float()
        y = torch.from_numpy(s.targets).to(device)
        results.append((logits.gather(1, y[:, None]).squeeze(1), torch.logsumexp(logits, 1), g[b, :n].float()))
    return results


def _memory_terms(
    g: torch.Tensor,
    y: torch.Tensor,
    past: Sequence[tuple[torch.Tensor, torch.Tensor]],
    max_segments: int,
    temperatures: Sequence[float],
    scale: float,
    first: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``mem_all, mem_hit`` ``[n - first, A, max_segments + 1]`` of one window's rows ``first..n-1`` (the scored
    ones); ``past`` = the entries of earlier windows, latest first.

    Lag ``m`` holds :func:`memlm.core.distribution.memory_lse` of the entries of window ``s - m`` (lag 0: the window's
    own earlier positions, context rows included) at each temperature: the total and the target's unnormalised mass.
    """
    n = g.shape[0]
    q, yq = g[first:], y[first:]
    rows = n - first
    out_all = torch.full((rows, len(temperatures), max_segments + 1), float("-inf"), device=g.device)
    out_hit = out_all.clone()
    earlier = torch.ones(n, n, dtype=torch.bool, device=g.device).tril(-1)[first:]  # [t, j]: j < t
    entries = [(g, y, earlier), *((pg, py, None) for pg, py in past)]
    for m, (keys, values, visible) in enumerate(entries[: max_segments + 1]):
        memory = DenseMemory(keys, values, "ip", scale)  # M_local (lag 0) or M_long (lag m): every entry, k = N
        r = memory.search(q, len(memory), visible)  # an invisible entry is an empty slot
        for a, t in enumerate(temperatures):
            out_all[:, a, m], out_hit[:, a, m] = memory_lse(r.scores, r.values, yq, t)
    return out_all, out_hit


_KEY_SQNORMS: dict[int, np.ndarray] = {}  # id(datastore) -> its keys' squared norms, dropped with the datastore


def _key_sqnorms(datastore: DatastoreBase, chunk: int = 65536) -> np.ndarray:
    """``[N]`` float64 ``||k||^2`` of the datastore's keys (as float32 values), computed once per datastore object
    (8 bytes per entry, kept while the datastore object lives)."""
    out = _KEY_SQNORMS.get(id(datastore))
    if out is None or len(out) != len(datastore.keys):
        keys = datastore.keys
        out = np.empty(len(keys), dtype=np.float64)
        for s in range(0, len(keys), chunk):
            kc = np.asarray(keys[s : s + chunk], dtype=np.float32).astype(np.float64)
            out[s : s + chunk] = np.einsum("nd,nd->n", kc, kc)
        _KEY_SQNORMS[id(datastore)] = out
        weakref.finalize(datastore, _KEY_SQNORMS.pop, id(datastore), None)
    return out


def _dot_from_index(
    datastore: DatastoreBase, index, queries: np.ndarray, sc: np.ndarray, ids: np.ndarray
) -> np.ndarray:
    """``q . k`` of the retrieved entries from the index's own exact distances (``ext_scores="dot-index"``): the
    inner product itself for an ``ip`` index; ``(||q||^2 + ||k||^2 - ||q - k||^2) / 2`` (float64, with the stored keys'
    norms) for an ``l2`` one. Only for indexes whose distances are exact (``Flat``, ``IVF...,Flat``): the result is
    q.k up to float32 rounding (the index's float32 distance), without reading the neighbours' keys again."""
    if index is None or not index_lib.has_exact_distances(index):
        raise MemlmError(
            "ext_scores='dot-index' needs an index with exact distances (Flat or IVF...,Flat); this one compresses "
            "the keys: use ext_scores='dot' (recomputed from the stored keys)"
        )
    valid = ids >= 0
    if index_lib.index_metric(index) == "ip":
        return np.where(valid, sc, -np.inf).astype(np.float32)
    q = np.asarray(queries, dtype=np.float32).astype(np.float64)
    qn = np.einsum("nd,nd->n", q, q)
    kn = _key_sqnorms(datastore)[np.where(valid, ids, 0)]
    dot = 0.5 * (qn[:, None] + kn + sc.astype(np.float64))  # sc = -||q - k||^2
    return np.where(valid, dot, -np.inf).astype(np.float32)


def _retrieve_external(
    memory: DatastoreMemory,
    queries: np.ndarray,
    k: int,
    ext_scores: str,
    scale: float,
    provenance: tuple[np.ndarray, np.ndarray] | None,
) -> tuple[np.ndarray, np.ndarray]:
    """The external memory's ``(scores, values)`` (Sec. 4.3): the datastore's top-k, rescored as ``scale * g . k``
    from the stored keys with ``ext_scores="dot"`` (or from an exact index's distances, ``"dot-index"``);
    self-matches dropped with ``provenance``."""
    sc, ids = memory.search_ids(queries, k)
    if ext_scores in ("dot", "dot-index"):
        if ext_scores == "dot":
            sc = index_lib.exact_scores(memory.datastore.keys, ids, queries, "ip") * np.float32(scale)
        else:
            index = getattr(memory.searcher, "index", None)  # the FAISS index of a one-folder datastore
            sc = _dot_from_index(memory.datastore, index, queries, sc, ids) * np.float32(scale)
        order = np.argsort(-sc, axis=1, kind="stable")
        sc, ids = np.take_along_axis(sc, order, 1), np.take_along_axis(ids, order, 1)
    prov = None if provenance is None else {"doc_hash": provenance[0], "offset": provenance[1]}
    r = memory.retrieved(sc, ids, prov)
    return r.scores, r.values.astype(np.int32)


@dataclass
class _Run:
    """What :func:`score_trime`'s segment loop needs: the settings (key role resolved for the model), the local
    temperatures as floats, the external memory and the tokens' provenance (or None)."""

    config: TrimeEvalConfig
    temps: list[float]
    memory: Any
    provenance: Any


def _trime_windows(documents, tokenizer, seq_len: int, context: int, stream: bool, drop_self_matches: bool):
    """``(token documents, provenance or None, evaluation windows)`` of :func:`score_trime`."""
    docs = list(documents)
    if drop_self_matches and not all(hasattr(d, "id") and hasattr(d, "text") for d in docs):
        raise MemlmError("drop_self_matches needs documents with .id and .text (to match the datastore's doc_hash)")
    token_docs = tokenize_for_trime(docs, tokenizer)
    provenance = token_provenance(docs, token_docs, stream) if drop_self_matches else None
    if stream and token_docs:
        token_docs = [np.concatenate(token_docs)]
    segments = evaluation_windows(token_docs, seq_len - 1, context)
    if not segments:
        raise MemlmError("the evaluation corpus has no targets (every document has fewer than 2 tokens)")
    return token_docs, provenance, segments


def _score_segments(model, segments, batch_size: int, pad_id: int, run: _Run) -> tuple[dict[str, list], float]:
    """The forward passes over ``segments`` (``batch_size`` at a time) with the local / long-term memory terms of
    each target and, with an external memory, its retrieved entries; returns the pieces and the search seconds."""
    parts: dict[str, list] = {k_: [] for k_ in ("y", "doc", "seg", "tl", "lse", "all", "hit", "es", "ev")}
    fifo: deque[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = deque(maxlen=max(run.config.max_segments, 1))
    current_doc = -1
    seconds_search = 0.0
    device = model_device(model)
    for start in range(0, len(segments), batch_size):
        batch = segments[start : start + batch_size]
        outs = _forward_segments(model, batch, pad_id, run.config.key)
        for s, (tl, lse, g) in zip(batch, outs, strict=True):
            if s.doc_index != current_doc:
                fifo.clear()
                current_doc = s.doc_index
            y = torch.from_numpy(s.targets).to(device)
            d = g.shape[1]
            sc = 1.0 / math.sqrt(d) if run.config.scale is None else float(run.config.scale)
            f = s.score_from
            positions = torch.from_numpy(s.scored_positions).to(device)
            # earlier windows' entries whose input position (p - 1) is before this window's first input (a)
            past = [(pg[pp <= s.start], py[pp <= s.start]) for pg, py, pp in reversed(fifo)]
            mem_all, mem_hit = _memory_terms(g, y, past, run.config.max_segments, run.temps, sc, first=f)
            tl, lse, g, y = tl[f:], lse[f:], g[f:], y[f:]
            if run.config.max_segments > 0:
                fifo.append((g, y, positions))
            n = len(y)
            for name, part in (("y", s.targets[f:]), ("doc", np.full(n, s.doc_index, dtype=np.int32)),
                               ("seg", np.full(n, s.index, dtype=np.int32)), ("tl", tl.cpu().numpy()),
                               ("lse", lse.cpu().numpy()), ("all", mem_all.cpu().numpy()),
                               ("hit", mem_hit.cpu().numpy())):  # fmt: skip
                parts[name].append(part)
            if run.memory is not None:
                t1 = time.perf_counter()
                es, ev = _segment_external(run.memory, g, s, run.config.k, run.config.ext_scores, sc, run.provenance)
                parts["es"].append(es)
                parts["ev"].append(ev)
                seconds_search += time.perf_counter() - t1
    return parts, seconds_search


def _segment_external(memory, g: torch.Tensor, s, k: int, ext_scores: str, scale: float, provenance):
    """The external memory's ``(scores, values)`` for one segment's scored positions.

    One search per segment: batching the segments of a forward batch into one FAISS call gained nothing measurable
    (255 queries already fill the threads) and is not result-preserving (the IVF coarse quantizer ranks centroids
    with BLAS, whose rounding depends on the batch: a near-tie at the nprobe-th list flipped for 1 query in 9,889 in
    docs/results/speed)."""
    prov = None
    if provenance is not None:
        doc_hashes, offsets = provenance[s.doc_index]
        prov = (doc_hashes[s.scored_positions], offsets[s.scored_positions])
    return _retrieve_external(memory, g.cpu().numpy(), k, ext_scores, scale, prov)


def _trime_scores(parts: dict[str, list], external: bool, meta: dict[str, Any]) -> TrimeScores:
    """The per-segment pieces of :func:`score_trime` joined into one dump."""

    def cat(name: str, dtype=None) -> np.ndarray:
        a = np.concatenate(parts[name])
        return a if dtype is None else a.astype(dtype)

    return TrimeScores(
        targets=cat("y", np.int64), doc_index=cat("doc"), segment_index=cat("seg"),
        target_logit=cat("tl", np.float32), logit_lse=cat("lse", np.float32), mem_all=cat("all", np.float32),
        mem_hit=cat("hit", np.float32), ext_scores=cat("es") if external else None,
        ext_values=cat("ev") if external else None, meta=meta,
    )  # fmt: skip


def _check_trime_args(model, c: TrimeEvalConfig) -> list[float]:
    """:func:`score_trime`'s settings checked before any work; returns the local temperatures as floats."""
    if c.seq_len < 2:
        raise MemlmError(f"seq_len must be >= 2 (one input and one target), got {c.seq_len}")
    n_pos = getattr(model.config, "n_positions", None) or getattr(model.config, "max_position_embeddings", None)
    if n_pos is not None and c.seq_len > n_pos:
        raise MemlmError(f"seq_len {c.seq_len} is longer than the model's context ({n_pos}); use seq_len <= {n_pos}")
    if isinstance(c.max_segments, bool) or not isinstance(c.max_segments, int) or c.max_segments < 0:
        raise MemlmError(f"max_segments must be an integer >= 0, got {c.max_segments!r}")
    temps = [float(t) for t in c.local_temperatures]
    if not temps or any(t <= 0 for t in temps):
        raise MemlmError(f"local_temperatures must be a non-empty list of values > 0, got {list(c.local_temperatures)}")
    if c.search not in ("index", "exact") or c.ext_scores not in ("dot", "index", "dot-index"):
        raise MemlmError("search must be 'index' or 'exact' and ext_scores 'dot', 'index' or 'dot-index'")
    if c.ext_scores == "dot-index" and c.search != "index":
        raise MemlmError("ext_scores='dot-index' takes q.k from the FAISS index's distances: use search='index'")
    if c.k < 1:
        raise MemlmError(f"k must be >= 1, got {c.k}")
    return temps


def _external_memory(model, tokenizer, datastore, key: KeySpec, search: str, nprobe: int, index) -> Any:
    """TRIME's external memory (Sec. 4.3): the datastore (plain or sharded) on its own searcher, or on ``index`` (a
    FAISS index or searcher already open, checked against it); None without a datastore."""
    if datastore is None:
        return None
    if tokenizer is None:
        raise MemlmError("an external datastore needs the tokenizer to check that it was built for this model")
    datastore.check_compatible(model, tokenizer, key)
    if search != "index":
        index = None
    elif index is None:
        index = datastore.searcher(nprobe=nprobe)
    else:
        index = as_searcher(index)
        if int(index.ntotal) != len(datastore) or int(index.d) != int(datastore.keys.shape[1]):
            raise MemlmError(
                f"the index passed holds {int(index.ntotal):,} x {int(index.d)} keys, the datastore "
                f"{datastore.path} {len(datastore):,} x {int(datastore.keys.shape[1])}: pass its own index"
            )
    return DatastoreMemory(datastore, search, "index", nprobe, searcher=index)


@dataclass(frozen=True)
class TrimeEvalConfig:
    """:func:`score_trime`'s settings (the TRIME variant of :class:`memlm.core.config.RetrievalConfig`): segments of
    ``seq_len`` tokens, ``max_segments`` of long-term memory, the ``local_temperatures`` kept, and for the external
    memory ``k``, ``search``, ``ext_scores``, ``nprobe`` and ``drop_self_matches``; ``scale`` of ``sim`` (None:
    ``1 / sqrt(d)``), the ``key`` role, overlapping ``context`` and ``stream`` (see :func:`score_trime`)."""

    seq_len: int = 512
    max_segments: int = 8
    local_temperatures: Sequence[float] = (1.0,)
    k: int = 1024
    search: str = "index"
    ext_scores: str = "dot"
    nprobe: int = 32
    drop_self_matches: bool = False
    scale: float | None = None
    key: KeySpec = G_SPEC
    context: int = 0
    stream: bool = False

    def with_options(self, **options: Any) -> TrimeEvalConfig:
        """These settings with ``options`` set by name (unknown names refused with the known ones)."""
        return replace_fields(self, "TRIME", **options)


@torch.inference_mode()
def score_trime(
    model: torch.nn.Module,
    tokenizer,
    documents: Sequence,
    seq_len: int | None = None,
    config: TrimeEvalConfig | None = None,
    *,
    datastore: Datastore | None = None,
    batch_size: int = 8,
    meta: dict[str, Any] | None = None,
    index=None,
    **options: Any,
) -> TrimeScores:
    """One forward pass per segment and one retrieval per token: the per-token dump of TRIME's Eq. 6 (App. A).

    For target ``w_t`` at context ``c_t`` of segment ``s`` of a document, with ``g = g(c)`` (``key``,
    ``ffn_in@-1``) and ``sim(q, k) = scale · q · k`` (``scale = 1 / sqrt(d)`` by default, as in training)::

        target_logit = E_{w_t} · f(c_t)            logit_lse = logsumexp_v E_v · f(c_t)
        mem_all[t, a, 0] = logsumexp_{j < t in s} sim(g_t, g_j) / τ_a                  (M_local, Sec. 4.1)
        mem_all[t, a, m] = logsumexp_{j in s - m} sim(g_t, g_j) / τ_a, m = 1..max_segments   (M_long, Sec. 4.2)
        mem_hit = the same over the entries whose value (next token) is w_t
        ext_scores, ext_values = the top-k datastore entries of g(c_t) (M_ext, Sec. 4.3)

    ``documents``: objects with ``.text`` (tokenized with ``tokenizer``, EOS appended) or token-id arrays. Each is cut
    into segments of at most ``seq_len`` input tokens (``seq_len`` <= the model's context), each scored fully with no
    context from earlier segments; every token but a document's first is a target exactly once. ``local_temperatures``
    are the ``τ_local`` values the dump keeps (1.0 = as trained). With ``datastore`` (an ``ffn_in@-1`` datastore of
    this model; its FAISS index unless ``search="exact"``), ``ext_scores="dot"`` recomputes ``sim`` from the stored
    keys (the index only ranks), ``"index"`` keeps the index's own similarity (−L2² or inner product),
    ``"dot-index"`` derives ``q.k`` from the index's exact distances (``Flat`` / ``IVF...,Flat`` only:
    ``(||q||² + ||k||² − L2²) / 2``), equal to ``"dot"`` up to float32 rounding and much cheaper than re-reading the
    keys (:func:`_dot_from_index`).
    ``drop_self_matches`` (needs documents with ``.id``/``.text``) drops retrieved entries that are the scored token.
    The settings come from ``config`` (:class:`TrimeEvalConfig`); ``seq_len`` and ``options`` set its fields by name
    (``max_segments=3, k=8``), the older keyword spelling.
    ``index``: the datastore's FAISS index already loaded (:func:`memlm.storage.index.load_index`; its own ``nprobe``
    applies), to score several corpora without reading the index again; default: read it with ``nprobe``.
    Runs under ``torch.inference_mode``; past segments' keys are kept in a FIFO of ``max_segments``.

    ``context``: 0 (default) scores non-overlapping segments, ``C > 0`` overlapping windows (App. D; the module
    docstring and :func:`evaluation_windows`; ``segment_index`` numbers the windows). ``stream``: join the documents
    (each with its EOS) into one token stream first, as the kNN-LM's evaluation does: with ``context = C`` the targets
    and contexts are those of :func:`memlm.knnlm.evaluate.lm_scores` with ``window = seq_len``, ``min_context = C +
    1``, so TRIME rows and kNN-LM rows share one protocol (``doc_index`` is then 0 for every target).
    """
    if seq_len is not None:
        options["seq_len"] = seq_len
    c = (config or TrimeEvalConfig()).with_options(**options)
    c = c.with_options(key=c.key.normalized(num_layers(model)))
    temps = _check_trime_args(model, c)
    memory = _external_memory(model, tokenizer, datastore, c.key, c.search, c.nprobe, index)
    index = None if memory is None or c.search != "index" else memory.searcher
    token_docs, provenance, segments = _trime_windows(
        documents, tokenizer, c.seq_len, c.context, c.stream, c.drop_self_matches
    )
    pad_id = pad_id_of(tokenizer)

    t0 = time.perf_counter()
    parts, seconds_search = _score_segments(model, segments, batch_size, pad_id, _Run(c, temps, memory, provenance))
    nprobe_used = c.nprobe if getattr(index, "nprobe", None) is None else int(index.nprobe)  # the IVF index's own
    retrieval = None if datastore is None else RetrievalConfig(
        k=c.k, search=c.search, scores="index" if c.ext_scores == "index" else "exact", nprobe=nprobe_used,
        metric=None if c.ext_scores == "index" else "ip", drop_self_matches=c.drop_self_matches, window=c.seq_len,
        min_context=c.context or None,
    ).to_dict()  # fmt: skip
    out = _trime_scores(parts, datastore is not None, {
        **(meta or {}), "method": "trime", "tokens": int(sum(len(p) for p in parts["y"])),
        "documents": len(token_docs), "segments": len(segments), "seq_len": c.seq_len, "context": c.context,
        "stream": bool(c.stream), "max_segments": c.max_segments, "local_temperatures": temps, "scale": c.scale,
        "key": c.key.describe(), "seconds": time.perf_counter() - t0, "retrieval": retrieval,
    })  # fmt: skip
    if datastore is not None:
        out.meta.update(datastore=str(datastore.path), datastore_entries=len(datastore), k=c.k, search=c.search,
                        ext_scores=c.ext_scores, nprobe=nprobe_used, drop_self_matches=c.drop_self_matches,
                        seconds_search=seconds_search)  # fmt: skip
    return out


# ---------------------------------------------------------------------------------------------------------------
# scoring a dump


def _check_params(
    ts: TrimeScores, segments: int | None, local_temperature: float, temperature: float, lam: float
) -> int | None:
    if segments is not None and (isinstance(segments, bool) or not isinstance(segments, int) or segments < 0):
        raise MemlmError(f"segments must be None (no local memory) or an integer >= 0, got {segments!r}")
    if segments is not None and segments > ts.max_segments:
        raise MemlmError(
            f"segments={segments} is more than the {ts.max_segments} previous segments in the dump; "
            f"rescore with max_segments >= {segments}"
        )
    if not any(math.isclose(local_temperature, t) for t in ts.local_temperatures):
        raise MemlmError(
            f"local_temperature {local_temperature} is not in the dump ({ts.local_temperatures}); "
            "rescore with it in local_temperatures"
        )
    if temperature <= 0:
        raise MemlmError(f"temperature must be > 0, got {temperature}")
    if not 0.0 <= lam <= 1.0:
        raise MemlmError(f"lambda must be in [0, 1], got {lam}")
    if lam > 0 and ts.ext_scores is None:
        raise MemlmError("lambda > 0 interpolates with the retrieved entries, but this dump has no external memory")
    return segments


def _local_part(
    ts: TrimeScores, segments: int | None, local_temperature: float
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The local / long memory as one ``(all, hit)`` pair per lag ``0..segments`` (each lag's entries are one memory
    of the joint softmax); none without a local memory (``segments=None``)."""
    if segments is None:
        return []
    a = next(i for i, t in enumerate(ts.local_temperatures) if math.isclose(t, local_temperature))
    all_ = torch.from_numpy(ts.mem_all[:, a, : segments + 1]).double()
    hit = torch.from_numpy(ts.mem_hit[:, a, : segments + 1]).double()
    return [(all_[:, m], hit[:, m]) for m in range(segments + 1)]


def _ext_part(ts: TrimeScores, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    if ts.ext_scores is None:
        ninf = torch.full((len(ts),), float("-inf"), dtype=torch.float64)
        return ninf, ninf
    return memory_lse(
        torch.from_numpy(ts.ext_scores).double(),
        torch.from_numpy(ts.ext_values.astype(np.int64)),
        torch.from_numpy(ts.targets),
        temperature,
    )


def _knn_part(ts: TrimeScores, knn_temperature: float) -> torch.Tensor:
    return knn_target_logprob(
        torch.from_numpy(ts.ext_scores).double(),
        torch.from_numpy(ts.ext_values.astype(np.int64)),
        torch.from_numpy(ts.targets),
        knn_temperature,
    )


def _combine(
    ts: TrimeScores,
    local: list[tuple[torch.Tensor, torch.Tensor]],
    ext: tuple[torch.Tensor, torch.Tensor],
    knn: torch.Tensor | None,
    lam: float,
) -> torch.Tensor:
    tl = torch.from_numpy(ts.target_logit).double()
    lse = torch.from_numpy(ts.logit_lse).double()
    joint = joint_target_logprob(tl, lse, [*local, ext])
    if lam == 0 or knn is None:
        return joint
    return mix([joint, knn.double()], weights=[1.0 - lam, lam])  # Eq. 9, float64


def trime_target_logprobs(
    ts: TrimeScores,
    segments: int | None = 0,
    temperature: float = 1.0,
    lam: float = 0.0,
    knn_temperature: float | None = None,
    local_temperature: float = 1.0,
) -> torch.Tensor:
    """``log P(w_t | c_t)`` of every target in the dump, float64 ``[N]`` (TRIME App. A, Eq. 6-9)::

        log P_joint(w | c) = log[ exp(E_w f) + Σ_{j ∈ M_loc+long, x_j = w} exp(sim_j / τ_local)
                                              + Σ_{j ∈ top-k, x_j = w} exp(sim_j / τ) ]
                           - log[ Σ_v exp(E_v f) + Σ_{j ∈ M_loc+long} exp(sim_j / τ_local)
                                                 + Σ_{j ∈ top-k} exp(sim_j / τ) ]
        P(w | c) = (1 - λ) P_joint(w | c) + λ P_kNN(w | c),  P_kNN = Σ_{j ∈ top-k, x_j = w} softmax_j(sim_j / τ_kNN)

    ``segments``: ``None`` = no local / long memory; ``0`` = the local memory (Sec. 4.1, TrimeLM); ``M`` = local plus
    the ``M`` previous segments of the document (Sec. 4.2, TrimeLM_long). The retrieved entries (Sec. 4.3,
    TrimeLM_ext) enter whenever the dump has them; ``λ = 0`` means no extra interpolation. ``knn_temperature``
    defaults to ``temperature``. Without any memory this is the plain LM's ``log_softmax`` of the target.
    """
    _check_params(ts, segments, local_temperature, temperature, lam)
    knn_t = temperature if knn_temperature is None else knn_temperature
    if knn_t <= 0:
        raise MemlmError(f"knn_temperature must be > 0, got {knn_t}")
    local = _local_part(ts, segments, local_temperature)
    ext = _ext_part(ts, temperature)
    knn = _knn_part(ts, knn_t) if lam > 0 else None
    return _combine(ts, local, ext, knn, lam)


def trime_perplexity(
    ts: TrimeScores,
    segments: int | None = 0,
    temperature: float = 1.0,
    lam: float = 0.0,
    knn_temperature: float | None = None,
    local_temperature: float = 1.0,
) -> dict[str, Any]:
    """Perplexity ``exp(-mean_t log P(w_t | c_t))`` of a dump under TRIME's testing objective (App. A, Eq. 6-9).

    Arguments as :func:`trime_target_logprobs`. Returns ``ppl`` with the parameters, the plain LM's ``base_ppl``
    (``exp(-mean log softmax(E f)_w)``, same segments) and the number of ``tokens``.
    """
    lp = trime_target_logprobs(ts, segments, temperature, lam, knn_temperature, local_temperature)
    return {
        "tokens": len(ts),
        "base_ppl": _base_ppl(ts),
        "ppl": perplexity(lp),
        "segments": segments,
        "local_temperature": local_temperature,
        "temperature": temperature,
        "lambda": lam,
        "knn_temperature": temperature if knn_temperature is None else knn_temperature,
        "external": ts.ext_scores is not None,
    }


def trime_log_distribution(
    logits: torch.Tensor,
    mem_scores: torch.Tensor | None = None,
    mem_values: torch.Tensor | None = None,
    ext_scores: torch.Tensor | None = None,
    ext_values: torch.Tensor | None = None,
    temperature: float = 1.0,
    lam: float = 0.0,
    knn_temperature: float | None = None,
    local_temperature: float = 1.0,
) -> torch.Tensor:
    """The full ``log P(· | c)`` over the vocabulary, ``[..., V]`` (TRIME App. A, Eq. 6 and Eq. 9)::

        P_joint(w | c) = [exp(E_w f) + Σ_{x_j = w} exp(s_j / τ_local) + Σ_{x_j = w} exp(r_j / τ)] / Z
        P(w | c)       = (1 - λ) P_joint(w | c) + λ P_kNN(w | c)       (P_kNN: softmax of r / τ_kNN, Eq. 8)

    ``logits [..., V]`` (``E f(c)``); ``mem_scores/mem_values [..., M]`` the local / long memory's similarities
    ``sim(g(c), g(c_j))`` and values (``-1`` = empty); ``ext_scores/ext_values [..., k]`` the retrieved entries'.
    For inspection and checks (a sum over ``V`` is 1); evaluation uses the per-target :func:`trime_target_logprobs`.
    """
    v = logits.shape[-1]
    logits = logits.double()
    parts = [logits]
    for scores, values, t in ((mem_scores, mem_values, local_temperature), (ext_scores, ext_values, temperature)):
        if scores is None:
            continue
        if values is None or values.shape != scores.shape:
            raise MemlmError("memory scores and values must come together with the same shape")
        if values.numel() and int(values.max()) >= v:
            raise MemlmError(f"memory value {int(values.max())} is out of range for a vocabulary of {v}")
        parts.append(value_logsumexp(scores.double() / t, values, v))  # each value's unnormalised memory mass
    joint = joint_distribution(logits, parts[1:])
    if lam == 0:
        return joint
    if ext_scores is None:
        raise MemlmError("lambda > 0 needs retrieved entries (ext_scores, ext_values)")
    knn = knn_distribution(
        ext_scores.double(), ext_values.long(), v, temperature if knn_temperature is None else knn_temperature
    )
    return mix([joint, knn], weights=[1.0 - lam, lam])


# ---------------------------------------------------------------------------------------------------------------
# tuning


def tune_trime_inference(
    valid: TrimeScores,
    segments: Sequence[int | None] = DEFAULT_SEGMENTS,
    temperatures: Sequence[float] = DEFAULT_TRIME_TEMPERATURES,
    lambdas: Sequence[float] = DEFAULT_TRIME_LAMBDAS,
    knn_temperatures: Sequence[float | None] = (None,),
    local_temperatures: Sequence[float] | None = None,
    test: TrimeScores | None = None,
) -> dict[str, Any]:
    """Grid-search ``M`` (Sec. 4.2, 5.2), ``τ`` (App. A, Eq. 6), ``λ`` and ``τ_kNN`` (Eq. 8-9) on the dev dump.

    Minimises ``exp(-mean log P(w_t | c_t))`` of :func:`trime_target_logprobs` over the grid, with no new forward
    pass or search. ``segments`` values above the dump's ``max_segments`` are skipped; ``local_temperatures``
    defaults to every one in the dump. Without external memory in the dump, ``τ``, ``λ`` and ``τ_kNN`` are fixed
    (1, 0, None). Returns ``{"best": params + ppl, "grid": [...]}`` and, with ``test``, ``"test"``: the
    :func:`trime_perplexity` of the test dump under the best parameters (choose on valid, report on test).
    """
    segs = [s for s in segments if s is None or s <= valid.max_segments]
    if not segs:
        raise MemlmError(f"no segments value in {list(segments)} fits the dump (max_segments={valid.max_segments})")
    lts = valid.local_temperatures if local_temperatures is None else [float(t) for t in local_temperatures]
    if valid.ext_scores is None:
        temperatures, lambdas, knn_temperatures = (1.0,), (0.0,), (None,)
    for s, lt, t, lam in itertools.product(segs, lts, temperatures, lambdas):
        _check_params(valid, s, lt, t, lam)
    if any(x is not None and x <= 0 for x in knn_temperatures):
        raise MemlmError(f"temperatures must be > 0, got {list(knn_temperatures)}")
    local = functools.cache(lambda s, lt: _local_part(valid, s, lt))
    ext = functools.cache(lambda t: _ext_part(valid, t))
    knn = functools.cache(lambda kt: _knn_part(valid, kt))

    def ppl(segments, local_temperature, temperature, knn_temperature, **p) -> float:
        lam, kt = p["lambda"], temperature if knn_temperature is None else knn_temperature
        lp = _combine(valid, local(segments, local_temperature), ext(temperature), knn(kt) if lam > 0 else None, lam)
        return perplexity(lp)

    grid = {"segments": segs, "local_temperature": lts, "temperature": temperatures, "lambda": lambdas,
            "knn_temperature": knn_temperatures}  # fmt: skip
    # τ_kNN is irrelevant without interpolation: keep one grid point
    out = grid_search(ppl, grid, keep=lambda p: p["lambda"] != 0 or p["knn_temperature"] == knn_temperatures[0])
    if test is not None:
        b = out["best"]
        out["test"] = trime_perplexity(test, b["segments"], b["temperature"], b["lambda"], b["knn_temperature"],
                                       b["local_temperature"])  # fmt: skip
    return out


# ---------------------------------------------------------------------------------------------------------------
# command-line glue: score a corpus split, summarise and tune per memory kind (memlm trime-eval, memlm trime-tune)


__all__ += ["trime_memory_results", "tune_trime_memories", "run_trime_eval"]


def _without_external(ts: TrimeScores) -> TrimeScores:
    return replace(ts, ext_scores=None, ext_values=None)


def _base_ppl(ts: TrimeScores) -> float:
    return perplexity(torch.from_numpy(ts.target_logit).double() - torch.from_numpy(ts.logit_lse).double())


def trime_memory_results(
    ts: TrimeScores,
    segments: int | None = None,
    local_temperature: float | None = None,
    temperature: float = 1.0,
    lam: float = 0.0,
    knn_temperature: float | None = None,
) -> dict[str, Any]:
    """Perplexity of a dump with no memory (``base_ppl``), the local memory (``local``: ``M = 0``, Sec. 4.1), the
    long-term memory (``long``: ``M = segments``, default the dump's ``max_segments``, Sec. 4.2; absent when it is 0)
    and, when the dump has retrieved entries, the external memory on top (``external``: ``τ``, ``λ``, ``τ_kNN``,
    Sec. 4.3). Each entry is a :func:`trime_perplexity` result."""
    m = ts.max_segments if segments is None else segments
    lt = ts.local_temperatures[0] if local_temperature is None else local_temperature
    own = _without_external(ts)
    local = trime_perplexity(own, segments=0, local_temperature=lt)
    out: dict[str, Any] = {"tokens": len(ts), "base_ppl": _base_ppl(ts), "local": local}
    if m > 0:
        out["long"] = trime_perplexity(own, segments=m, local_temperature=lt)
    if ts.ext_scores is not None:
        out["external"] = trime_perplexity(ts, m, temperature, lam, knn_temperature, lt)
    return out


def tune_trime_memories(
    valid: TrimeScores,
    test: TrimeScores | None = None,
    segments: Sequence[int] | None = None,
    temperatures: Sequence[float] | None = None,
    lambdas: Sequence[float] | None = None,
    knn_temperatures: Sequence[float | None] | None = None,
    local_temperatures: Sequence[float] | None = None,
) -> dict[str, Any]:
    """:func:`tune_trime_inference` once per memory kind, each chosen on ``valid`` and applied to ``test`` (None
    grids: ``DEFAULT_SEGMENTS``, ``DEFAULT_TRIME_TEMPERATURES``, ``DEFAULT_TRIME_LAMBDAS``, ``τ_kNN = τ``, every
    ``τ_local`` of the dump):

    * ``local`` (TrimeLM): ``M = 0``, only ``τ_local`` tuned, retrieved entries ignored;
    * ``long`` (TrimeLM_long): ``M`` and ``τ_local`` tuned over ``segments``, retrieved entries ignored (absent when
      no ``segments`` value above 0 fits the dump);
    * ``external`` (TrimeLM_ext, only when ``valid`` has retrieved entries): ``M``, ``τ_local``, ``τ``, ``λ`` and
      ``τ_kNN``.

    Returns ``{"valid": {"tokens", "base_ppl"}, "test": {...} (with ``test``), kind: {"best", "grid_points",
    "test"}}``.
    """
    if test is not None and (valid.ext_scores is None) != (test.ext_scores is None):
        raise MemlmError("the valid and test dumps must both have external memory or both not: score them alike")
    segments = DEFAULT_SEGMENTS if segments is None else segments
    temperatures = DEFAULT_TRIME_TEMPERATURES if temperatures is None else temperatures
    lambdas = DEFAULT_TRIME_LAMBDAS if lambdas is None else lambdas
    knn_temperatures = (None,) if knn_temperatures is None else knn_temperatures
    out: dict[str, Any] = {"valid": {"tokens": len(valid), "base_ppl": _base_ppl(valid)}}
    if test is not None:
        out["test"] = {"tokens": len(test), "base_ppl": _base_ppl(test)}
    plans: list[tuple[str, TrimeScores, TrimeScores | None, list[int]]] = [
        ("local", _without_external(valid), None if test is None else _without_external(test), [0])
    ]
    longer = [s for s in segments if s is not None and 0 < s <= valid.max_segments]
    if longer:
        plans.append(("long", plans[0][1], plans[0][2], [0, *longer]))
    if valid.ext_scores is not None:
        plans.append(("external", valid, test, [s for s in segments if s is not None]))
    for name, v, t, segs in plans:
        res = tune_trime_inference(v, segs, temperatures, lambdas, knn_temperatures, local_temperatures, test=t)
        out[name] = {"best": res["best"], "grid_points": len(res["grid"])}
        if t is not None:
            out[name]["test"] = res["test"]
    return out


def run_trime_eval(
    model: str | None,
    corpus: str,
    split: str | None,
    seq_len: int | None = None,
    config: TrimeEvalConfig | None = None,
    *,
    datastore: str | Path | None = None,
    batch_size: int = 8,
    max_tokens: int | None = None,
    dtype: str = "float32",
    dump: str | Path | None = None,
    **options: Any,
) -> tuple[TrimeScores, dict[str, Any]]:
    """Load ``model`` (:func:`memlm.models.resources.load_causal_lm`; None: the model the ``datastore`` was built
    with), score ``corpus`` at ``split`` with :func:`score_trime` (external memory from the ``datastore`` folder, whose
    keys must be ``ffn_in`` of the last layer) and write the dump to ``dump``. Returns the dump and its record: model,
    corpus, split, seq_len, context, stream, :func:`trime_memory_results` (``M = max_segments``, ``τ = 1``,
    ``λ = 0``), the dump's meta and its source. ``config`` / ``seq_len`` / ``options``: :func:`score_trime`'s
    (:class:`TrimeEvalConfig`)."""
    from memlm.data.corpora import load_corpus_source
    from memlm.models.resources import load_causal_lm

    ds = open_datastore(datastore) if datastore else None
    model = model or (ds.model_name if ds is not None else None)
    if not model:
        raise MemlmError("name the model to evaluate (or give a datastore, whose model is then used)")
    lm, tok = load_causal_lm(model, dtype=dtype)
    if ds is not None:
        want = G_SPEC.normalized(num_layers(lm))
        if ds.key_spec != want:
            raise MemlmError(
                f"datastore {ds.path} holds {ds.key_spec.describe()} keys, but TRIME's external memory compares "
                f"g(c) = {want.describe()} (the last FFN's input): build it with --key ffn_in"
            )
    docs, source = load_corpus_source(corpus, split, tok, max_tokens)
    ts = score_trime(
        lm, tok, docs, seq_len, config, datastore=ds, batch_size=batch_size, meta={"model": model, "source": source},
        **options,
    )  # fmt: skip
    if dump:
        ts.save(dump)
    m = ts.meta
    meta = {k: v for k, v in m.items() if k != "source"}
    return ts, {"model": model, "corpus": corpus, "split": split, "seq_len": m["seq_len"], "context": m["context"],
                "stream": m["stream"], **trime_memory_results(ts), "meta": meta, "source": m.get("source")}  # fmt: skip
