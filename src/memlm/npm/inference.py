"""NPM inference (Min et al. 2023, §3.1, App. A.1, A.3, A.4; BM25 restriction §6.3).

Open-set prediction (App. A.1). With ``q_start`` / ``q_end`` the encoder outputs at ``[MASK_s]`` / ``[MASK_e]`` and
``sim(h1, h2) = h1 . h2 / sqrt(h)`` (``h`` the token-vector size):

1. ``c_{s_1} .. c_{s_k} = argTopk_c sim(q_start, E(c))`` and ``c_{e_1} .. c_{e_k} = argTopk_c sim(q_end, E(c))``
   (FAISS, inner product);
2. candidate phrases ``C~* = U_i U_{j=1..l_max} c*_{s_i : s_i+j-1}  u  U_i U_{j=1..l_max} c*_{e_i-j+1 : e_i}``:
   every span of 1 .. ``l_max`` tokens *starting* at a retrieved start, and every one *ending* at a retrieved end,
   kept inside one block (an encoder input); ``C~*`` is a set, so a span reached both ways counts once;
3. prediction ``argmax_v sum_{c* in C~*} I[v = c*] expsim(q, E(c*))`` with ``q = [q_start; q_end]`` and
   ``E(c*_{i:j}) = [E(c_i); E(c_j)]`` in ``R^{2h}``. Read with the paper's ``sim`` (scaled by the token size ``h``,
   the reading under which App. A.4 calls its two formulas equivalent), ``expsim(q, E(c*_{i:j})) =
   exp(sim(q_start, E(c_i)) + sim(q_end, E(c_j)))``. The similarities of a span's start and end are recomputed from
   the stored vectors, also where only one side was retrieved. This is ``combine="a1"`` (the default). §3.1 writes
   the exact (non-approximated) rule with a *sum* ``exp(sim(q_start, c_i)) + exp(sim(q_end, c_j))``; that reading is
   ``combine="sum"``.

Scores are summed per distinct phrase string (the decoded span text); :class:`PhrasePrediction` carries the summed
score, its share of all candidates' mass (``prob``) and the spans (with document id and context) behind it.

NPM SINGLE (App. A.3): the top-``k`` tokens of one ``[MASK]`` vector; ``exp(sim(q, E(c)))`` summed per token string.

Closed-set tasks (App. A.4, following Shi et al. 2022's fuzzy verbalizers): each label has several verbalizer strings;
a candidate (a span for NPM, a token for NPM SINGLE) supports label ``y`` when its *token ids* are exactly the token
ids of a verbalizer of ``y`` (``I[c in f(y)]``; :func:`verbalizer_sequences`). A verbalizer ``w`` stands for the
token-id sequences of ``w``, ``w.lower()`` and ``w`` capitalised, each tokenized alone and after a space (no special
tokens): for a cased BPE tokenizer that is ``music`` / ``Ġmusic`` / ``Music`` / ``ĠMusic``, for the uncased WordPiece
of MiniLM/BERT all of them are the one id of ``music``. A span with extra tokens (``music .``, ``, film``) or a
word piece (``##film`` of "microfilm") does not match; a word-initial piece followed by ``##`` pieces in the corpus
does (the rule looks at the span's tokens only, like the paper's token-level ``c in f(y)``).
``score(y) = sum over supporting candidates of exp(sim(q_start, E(c_i)) / tau + sim(q_end, E(c_j)) / tau)`` (NPM) or
``exp(sim(q, E(c)) / tau)`` (NPM SINGLE), ``tau = 5``; label probabilities are the normalised scores (uniform, with
``matched=False``, when no candidate matches any verbalizer).

BM25 restriction (§6.3): the search space is reduced to the top 3 passages (blocks of the phrase index) that ``bm25s``
ranks for the query text (its ``[MASK]`` removed) and the start/end search is exact inside them.
"""

from __future__ import annotations

import math
import re
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from memlm.core.distribution import knn_distribution, value_logsumexp
from memlm.core.memory import Retrieved
from memlm.errors import MemlmError
from memlm.npm.encoder import encode_query
from memlm.npm.phrase_index import PhraseIndex
from memlm.storage.index import blas_threshold

__all__ = [
    "COMBINES",
    "SpanHit",
    "PhrasePrediction",
    "LabelScores",
    "normalize_text",
    "verbalizer_sequences",
    "retrieve",
    "retrieve_batch",
    "PhraseMemory",
    "candidate_spans",
    "span_log_scores",
    "cached_decoder",
    "group_phrases",
    "predict_phrases",
    "predict_tokens",
    "closed_set",
    "restrict_rows",
    "npm_predict",
    "npm_single_predict",
    "npm_classify",
]

COMBINES = ("a1", "sum")


@dataclass(frozen=True)
class SpanHit:
    """One corpus span ``rows start .. end`` (inclusive) behind a prediction, with its score and context."""

    start: int
    end: int
    doc_id: str
    position: int  # position of the span's first token in its document
    score: float  # exp-score of this span (before summing per phrase)
    context: str | None = None


@dataclass(frozen=True)
class PhrasePrediction:
    """A distinct phrase string, its summed score and its share of all candidates' score mass."""

    phrase: str
    score: float
    prob: float
    log_score: float
    spans: tuple[SpanHit, ...]

    def summary(self) -> dict[str, Any]:
        """JSON record: phrase, scores, number of occurrences and the best-scoring span."""
        h = self.spans[0]
        top = {"doc_id": h.doc_id, "position": h.position, "score": h.score, "context": h.context}
        return {"phrase": self.phrase, "score": self.score, "prob": self.prob, "log_score": self.log_score,
                "occurrences": len(self.spans), "top_span": top}  # fmt: skip


@dataclass(frozen=True)
class LabelScores:
    """Closed-set result: label -> probability (normalised scores) and -> log score (``-inf``: no support)."""

    probs: dict[str, float]
    log_scores: dict[str, float]
    matched: bool

    @property
    def label(self) -> str:
        return max(self.probs, key=lambda y: (self.probs[y], self.log_scores[y]))

    def summary(self) -> dict[str, Any]:
        """JSON record: the label, probabilities, whether any candidate matched, log scores (``None`` for ``-inf``)."""
        logs = {y: v if math.isfinite(v) else None for y, v in self.log_scores.items()}
        return {"label": self.label, "probs": self.probs, "matched": self.matched, "log_scores": logs}


def normalize_text(text: str) -> str:
    """Fuzzy-verbalizer matching key: lower case, punctuation to spaces, whitespace collapsed."""
    return " ".join(re.sub(r"[^\w\s]|_", " ", text.lower()).split())


def verbalizer_sequences(tokenizer, verbalizers: Mapping[str, Sequence[str] | str]) -> dict[tuple[int, ...], str]:
    """App. A.4's fuzzy verbalizer ``f`` as token ids: ``{token-id sequence: label}``.

    Each verbalizer ``w`` of a label contributes the tokenizations (no special tokens) of ``w``, ``w.lower()`` and
    ``w`` with its first letter upper-cased, each alone and after a space (module docstring). Raises when a
    verbalizer has no tokens or one sequence is given for two labels.
    """
    if not verbalizers:
        raise MemlmError("give at least one label with its verbalizer strings")
    out: dict[tuple[int, ...], str] = {}
    for label, words in verbalizers.items():
        for w in [words] if isinstance(words, str) else list(words):
            w = " ".join(str(w).split())
            if not w:
                raise MemlmError(f"label {label!r} has an empty verbalizer: give words")
            forms = {w, w.lower(), w[:1].upper() + w[1:]}
            texts = sorted(forms | {" " + f for f in forms})
            for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]:
                key = tuple(int(t) for t in ids)
                if not key:
                    raise MemlmError(f"verbalizer {w!r} of label {label!r} has no tokens")
                if out.get(key, label) != label:
                    raise MemlmError(f"verbalizer {w!r} is given for both {out[key]!r} and {label!r}")
                out[key] = label
    return out


def _vec(q: np.ndarray, dim: int, name: str) -> np.ndarray:
    v = np.asarray(q, dtype=np.float32).reshape(-1)
    if v.shape[0] != dim:
        raise MemlmError(f"{name} has size {v.shape[0]}, the phrase index holds {dim}-dim vectors: same encoder?")
    return v


def _check_k_lmax(k: int, l_max: int | None = None) -> None:
    if not isinstance(k, int | np.integer) or k < 1:
        raise MemlmError(f"k must be an integer >= 1, got {k!r}")
    if l_max is not None and (not isinstance(l_max, int | np.integer) or l_max < 1):
        raise MemlmError(f"l_max must be an integer >= 1, got {l_max!r}")


def retrieve(pi: PhraseIndex, q: np.ndarray, k: int, rows: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Top-``k`` rows for one query vector: ``(sims, ids)`` with ``sim = q . c / sqrt(h)``; only valid hits.

    ``rows``: restrict to these rows with exact search (BM25 passages); ``None``: the FAISS index.
    """
    return retrieve_batch(pi, [q], k, rows)[0]


def retrieve_batch(
    pi: PhraseIndex, queries: Sequence[np.ndarray], k: int, rows: np.ndarray | None = None
) -> list[tuple[np.ndarray, np.ndarray]]:
    """:func:`retrieve` for several query vectors (NPM's ``q_start`` and ``q_end``) with one search call: one FAISS
    search of ``[Q, h]``, or one read of the ``rows``' vectors. Each query's result is the one :func:`retrieve` gives
    it alone: FAISS computes the distances of fewer than ``faiss.cvar.distance_compute_blas_threshold`` (20) queries
    one query at a time (from that many on it uses BLAS, whose rounding depends on the batch, so larger batches are
    searched in chunks below it), and :meth:`PhraseIndex.search_rows` scores queries one by one."""
    _check_k_lmax(k)
    if not len(queries):
        return []
    r = PhraseMemory(pi, rows).search(np.stack([_vec(v, pi.dim, "query") for v in queries]), k)
    keep = r.ids >= 0
    return [(r.scores[i][keep[i]], r.ids[i][keep[i]]) for i in range(len(r))]


class PhraseMemory:
    """NPM's phrase index as a :class:`memlm.core.memory.Memory`: every token of the reference corpus is an entry
    (its encoder vector the key, its token id the value); ``search`` returns ``sim = q . c / sqrt(h)`` (App. A.1),
    best first. ``rows`` restricts the search to those rows with exact scores (BM25 passages), else the FAISS index.
    Queries are searched in chunks below FAISS's BLAS threshold (``faiss.cvar.distance_compute_blas_threshold``, 20):
    below it FAISS scores one query at a time, so each query's result is its one-query result whatever the batch."""

    def __init__(self, pi: PhraseIndex, rows: np.ndarray | None = None) -> None:
        self.pi, self.rows = pi, rows

    def search(self, queries: np.ndarray, k: int) -> Retrieved:
        q = np.atleast_2d(np.asarray(queries, dtype=np.float32))
        if self.rows is None:
            step = max(1, blas_threshold() - 1)
            found = [self.pi.search(q[s : s + step], k) for s in range(0, len(q), step)]
            scores, ids = np.concatenate([f[0] for f in found]), np.concatenate([f[1] for f in found])
        else:
            scores, ids = self.pi.search_rows(q, self.rows, k)
        valid = ids >= 0
        values = np.where(valid, np.asarray(self.pi.token_ids)[np.where(valid, ids, 0)], -1)
        return Retrieved(np.where(valid, scores / math.sqrt(self.pi.dim), -np.inf), values, np.where(valid, ids, -1))


def candidate_spans(pi: PhraseIndex, starts: Sequence[int], ends: Sequence[int], l_max: int) -> np.ndarray:
    """App. A.1's candidate set ``C~*``: ``[S, 2]`` distinct ``(i, j)`` rows (inclusive), sorted, each inside one block:
    spans of 1 .. ``l_max`` tokens starting at a retrieved start or ending at a retrieved end.

    Vectorised: every ``(start, start + o)`` and ``(end - o, end)`` for ``o < l_max`` inside the index and the
    start's (end's) block (blocks are contiguous row ranges, so this is the run up to the block boundary), then the
    distinct pairs in ``(i, j)`` order."""
    _check_k_lmax(1, l_max)
    n = len(pi)
    block = np.asarray(pi.block)
    off = np.arange(min(int(l_max), max(n, 1)), dtype=np.int64)
    parts = []
    for anchors, sign in ((starts, 1), (ends, -1)):
        a = np.unique(np.asarray(anchors, dtype=np.int64).reshape(-1))
        if a.size and (a[0] < 0 or a[-1] >= n):
            raise MemlmError(f"span anchors must be rows of the phrase index (0 .. {n - 1}), got {a[0]} .. {a[-1]}")
        other = a[:, None] + sign * off[None, :]  # [A, L]: the span's other end
        inside = (other >= 0) & (other < n)
        inside &= block[np.clip(other, 0, max(n - 1, 0))] == block[a][:, None]
        anchor = np.broadcast_to(a[:, None], other.shape)[inside]
        other = other[inside]
        i, j = (anchor, other) if sign > 0 else (other, anchor)
        parts.append(i * n + j)
    codes = np.unique(np.concatenate(parts))
    return np.stack([codes // max(n, 1), codes % max(n, 1)], axis=1).astype(np.int64).reshape(-1, 2)


def span_log_scores(
    pi: PhraseIndex,
    spans: np.ndarray,
    q_start: np.ndarray,
    q_end: np.ndarray,
    combine: str = "a1",
    tau: float = 1.0,
) -> np.ndarray:
    """``[S]`` log of each span's score from the stored vectors: ``(sim_s + sim_e) / tau`` for ``"a1"`` (A.1, A.4),
    ``log(exp(sim_s / tau) + exp(sim_e / tau))`` for ``"sum"`` (§3.1)."""
    if combine not in COMBINES:
        raise MemlmError(f"combine must be one of {COMBINES}, got {combine!r}")
    if tau <= 0:
        raise MemlmError(f"tau must be positive, got {tau}")
    spans = np.asarray(spans, dtype=np.int64).reshape(-1, 2)
    if spans.size == 0:
        return np.zeros(0, dtype=np.float64)
    scale = 1.0 / math.sqrt(pi.dim)
    qs, qe = _vec(q_start, pi.dim, "q_start"), _vec(q_end, pi.dim, "q_end")
    sim_s = (np.asarray(pi.vectors[spans[:, 0]], dtype=np.float32) @ qs).astype(np.float64) * scale / tau
    sim_e = (np.asarray(pi.vectors[spans[:, 1]], dtype=np.float32) @ qe).astype(np.float64) * scale / tau
    return sim_s + sim_e if combine == "a1" else np.logaddexp(sim_s, sim_e)


class _CachedDecode:
    """A tokenizer stand-in for :func:`group_phrases` and :meth:`PhraseIndex.context`: ``decode(ids)`` is memoised by
    token-id tuple (decoding is a pure function of the ids), everything else is the tokenizer's own. Grouping decodes
    every distinct candidate span (about 15k per NPM query at ``k = 1024``); on the 300k-token wiki index about half
    of a query's spans were decoded for an earlier query. Two generations of at most ``max_entries`` strings each (a
    hit in the old one moves to the new one; when the new one is full it becomes the old one), so the strings that
    keep coming back stay without a per-lookup LRU."""

    def __init__(self, tokenizer, max_entries: int = 1 << 18) -> None:
        self._tokenizer = tokenizer
        self._texts: dict[tuple[int, ...], str] = {}
        self._old: dict[tuple[int, ...], str] = {}
        self._max = int(max_entries)

    def decode(self, ids, *args, **kwargs) -> str:
        if args or kwargs:
            return self._tokenizer.decode(ids, *args, **kwargs)
        key = tuple(ids) if type(ids) is list else tuple(int(t) for t in ids)  # group_phrases passes lists of ints
        text = self._texts.get(key)
        if text is None:
            text = self._old.get(key)
            if text is None:
                text = self._tokenizer.decode(list(key))
            if len(self._texts) >= self._max:
                self._old, self._texts = self._texts, {}
            self._texts[key] = text
        return text

    def __getattr__(self, name: str):
        return getattr(self._tokenizer, name)


_DECODERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def cached_decoder(tokenizer):
    """A stand-in for ``tokenizer`` whose ``decode`` is memoised (:class:`_CachedDecode`; the same one for every call
    with this tokenizer object, so all queries share its cache), for :func:`group_phrases`."""
    if isinstance(tokenizer, _CachedDecode):
        return tokenizer
    try:
        dec = _DECODERS.get(tokenizer)
        if dec is None:
            dec = _DECODERS[tokenizer] = _CachedDecode(tokenizer)
        return dec
    except TypeError:  # not weak-referenceable: no cache across calls
        return _CachedDecode(tokenizer)


def group_phrases(
    pi: PhraseIndex,
    tokenizer,
    spans: np.ndarray,
    log_scores: np.ndarray,
    top: int | None,
    contexts: bool,
    context_window: int,
) -> list[PhrasePrediction]:
    """Ranked phrases from scored spans: a span's value is its phrase (the decoded text of its tokens), and M sums each
    phrase's mass (:func:`memlm.core.distribution.value_logsumexp`) and its share of all candidates' mass
    (:func:`memlm.core.distribution.knn_distribution`). Vectorised: distinct token sequences by one
    ``np.unique``, one decode per distinct sequence, one per-value logsumexp."""
    spans = np.asarray(spans, dtype=np.int64).reshape(-1, 2)
    if not len(spans):
        return []
    log_scores = np.asarray(log_scores, dtype=np.float64)
    tid = np.asarray(pi.token_ids)
    length = spans[:, 1] - spans[:, 0] + 1
    cols = np.arange(int(length.max()))
    tokens = np.where(cols < length[:, None], tid[np.minimum(spans[:, :1] + cols, len(tid) - 1)], -1)  # [S, L]
    seqs, inv = np.unique(tokens, axis=0, return_inverse=True)
    phrase_of: dict[str, int] = {}
    seq_phrase = np.array([phrase_of.setdefault(tokenizer.decode(row[row >= 0].tolist()).strip(), len(phrase_of))
                           for row in seqs], dtype=np.int64)  # fmt: skip
    phrases = list(phrase_of)
    phrase_id = seq_phrase[inv.reshape(-1)]
    lv, pv = torch.from_numpy(log_scores)[None], torch.from_numpy(phrase_id)[None]
    mass = value_logsumexp(lv, pv, len(phrases))[0].numpy()  # log sum of each phrase's span scores
    logp = knn_distribution(lv, pv, len(phrases))[0].numpy()  # its share of all candidates' mass (Eq. 2, τ = 1)
    by_phrase = np.argsort(phrase_id, kind="stable")  # rows of each phrase, ascending
    bounds = np.searchsorted(phrase_id[by_phrase], np.arange(len(phrases) + 1))
    order = sorted(range(len(phrases)), key=lambda n: (-mass[n], phrases[n]))
    out = []
    for n in order[:top] if top is not None else order:
        rows = by_phrase[bounds[n] : bounds[n + 1]]
        hits = []
        for r in rows[np.argsort(-log_scores[rows], kind="stable")].tolist():
            i, j = (int(x) for x in spans[r])
            ctx = pi.context(tokenizer, i, j, context_window) if contexts else None
            doc = int(pi.doc[i])
            hits.append(SpanHit(i, j, pi.doc_ids[doc], int(pi.position[i]), math.exp(log_scores[r]), ctx))
        ls = float(mass[n])
        out.append(PhrasePrediction(phrases[n], math.exp(ls), math.exp(float(logp[n])), ls, tuple(hits)))
    return out


def predict_phrases(
    pi: PhraseIndex,
    tokenizer,
    q_start: np.ndarray,
    q_end: np.ndarray,
    k: int = 4096,
    l_max: int = 10,
    combine: str = "a1",
    rows: np.ndarray | None = None,
    top: int | None = 10,
    contexts: bool = True,
    context_window: int = 32,
) -> list[PhrasePrediction]:
    """NPM open-set prediction from query vectors (App. A.1; module docstring): ranked phrases, scores summed per
    distinct phrase string. ``rows`` restricts the search (BM25); ``top=None`` returns every phrase."""
    _check_k_lmax(k, l_max)
    spans = _npm_spans(pi, q_start, q_end, k, l_max, rows)
    logs = span_log_scores(pi, spans, q_start, q_end, combine)
    return group_phrases(pi, cached_decoder(tokenizer), spans, logs, top, contexts, context_window)


def _npm_spans(
    pi: PhraseIndex, q_start: np.ndarray, q_end: np.ndarray, k: int, l_max: int, rows: np.ndarray | None
) -> np.ndarray:
    """``C~*`` of a query (App. A.1): one search for both ``q_start`` and ``q_end``, the spans around the hits, kept
    inside the allowed ``rows`` (BM25 passages) when given."""
    (_, starts), (_, ends) = retrieve_batch(pi, [q_start, q_end], k, rows)
    spans = candidate_spans(pi, starts, ends, l_max)
    if rows is not None and len(spans):  # stay inside the allowed passages
        allowed = np.zeros(len(pi), dtype=bool)
        allowed[np.asarray(rows, dtype=np.int64)] = True
        spans = spans[allowed[spans[:, 0]] & allowed[spans[:, 1]]]
    return spans


def predict_tokens(
    pi: PhraseIndex,
    tokenizer,
    q: np.ndarray,
    k: int = 4096,
    rows: np.ndarray | None = None,
    top: int | None = 10,
    contexts: bool = True,
    context_window: int = 32,
) -> list[PhrasePrediction]:
    """NPM SINGLE (App. A.3): ``sum_{i <= k} I[c^i = v] exp(sim(q, E(c^i)))`` per token string ``v``, ranked."""
    sims, ids = retrieve(pi, q, k, rows)
    spans = np.stack([ids, ids], axis=1) if len(ids) else np.zeros((0, 2), dtype=np.int64)
    return group_phrases(pi, cached_decoder(tokenizer), spans, sims.astype(np.float64), top, contexts, context_window)


def closed_set(
    pi: PhraseIndex,
    tokenizer,
    verbalizers: Mapping[str, Sequence[str] | str],
    q_start: np.ndarray,
    q_end: np.ndarray | None = None,
    k: int = 4096,
    l_max: int = 10,
    tau: float = 5.0,
    rows: np.ndarray | None = None,
) -> LabelScores:
    """Closed-set scores (App. A.4) from query vectors: NPM with ``q_end``, NPM SINGLE with ``q_end=None``.

    ``verbalizers``: label -> its verbalizer strings (a fuzzy verbalizer, e.g. ``{"positive": ["great", "good"]}``); a
    candidate supports a label when its token ids equal one of :func:`verbalizer_sequences`.
    """
    keys = verbalizer_sequences(tokenizer, verbalizers)
    _check_k_lmax(k, l_max)
    if q_end is None:
        sims, ids = retrieve(pi, q_start, k, rows)
        spans = np.stack([ids, ids], axis=1) if len(ids) else np.zeros((0, 2), dtype=np.int64)
        logs = sims.astype(np.float64) / tau
    else:
        spans = _npm_spans(pi, q_start, q_end, k, l_max, rows)
        logs = span_log_scores(pi, spans, q_start, q_end, "a1", tau)
    labels = list(verbalizers)
    values = _verbalizer_hits(pi, spans, keys, labels)  # I[c in f(y)]: the label whose verbalizer has its token ids
    lv, v = torch.from_numpy(np.asarray(logs, dtype=np.float64))[None], torch.from_numpy(values)[None]
    mass = value_logsumexp(lv, v, len(labels))[0]
    log_scores = {y: float(mass[n]) for n, y in enumerate(labels)}
    if not torch.isfinite(mass).any():
        return LabelScores({y: 1.0 / len(log_scores) for y in log_scores}, log_scores, False)
    probs = knn_distribution(lv, v, len(labels))[0].exp()
    return LabelScores({y: float(probs[n]) for n, y in enumerate(labels)}, log_scores, True)


def _verbalizer_hits(
    pi: PhraseIndex, spans: np.ndarray, keys: Mapping[tuple[int, ...], str], labels: Sequence[str]
) -> np.ndarray:
    """``[S]`` label number of each span whose token ids are exactly a verbalizer sequence of ``keys``, ``-1`` for
    the others (vectorised over spans: one comparison of the span tokens per verbalizer sequence)."""
    spans = np.asarray(spans, dtype=np.int64).reshape(-1, 2)
    out = np.full(len(spans), -1, dtype=np.int64)
    if not len(spans) or not keys:
        return out
    tid = np.asarray(pi.token_ids)
    length = spans[:, 1] - spans[:, 0] + 1
    number = {y: a for a, y in enumerate(labels)}
    for key, label in keys.items():
        sel = np.flatnonzero(length == len(key))
        for t, token in enumerate(key):
            if not len(sel):
                break
            sel = sel[tid[spans[sel, 0] + t] == token]
        out[sel] = number[label]
    return out


def restrict_rows(pi: PhraseIndex, tokenizer, query: str, passages: int | None) -> np.ndarray | None:
    """Rows of the top-``passages`` BM25 blocks for ``query`` (its mask token removed); ``None`` when not asked."""
    if passages is None:
        return None
    if passages < 1:
        raise MemlmError(f"bm25 passages must be >= 1, got {passages}")
    text = query.replace(tokenizer.mask_token, " ")
    return pi.block_rows(pi.bm25_blocks(tokenizer, text, passages))


def npm_predict(
    model, tokenizer, pi: PhraseIndex, query: str, k: int = 4096, l_max: int = 10, bm25_passages: int | None = None,
    combine: str = "a1", top: int | None = 10,
) -> list[PhrasePrediction]:  # fmt: skip
    """NPM: fill the query's single ``[MASK]`` with ranked corpus phrases (``bm25_passages=3``: §6.3's BM25 top 3)."""
    pi.check_encoder(model, tokenizer)
    q_s, q_e = encode_query(model, tokenizer, query)
    rows = restrict_rows(pi, tokenizer, query, bm25_passages)
    return predict_phrases(pi, tokenizer, q_s, q_e, k, l_max, combine, rows, top)


def npm_single_predict(
    model, tokenizer, pi: PhraseIndex, query: str, k: int = 4096, bm25_passages: int | None = None,
    top: int | None = 10,
) -> list[PhrasePrediction]:  # fmt: skip
    """NPM SINGLE: fill the query's ``[MASK]`` with one token (ranked token strings of the corpus)."""
    pi.check_encoder(model, tokenizer)
    q, _ = encode_query(model, tokenizer, query, single=True)
    rows = restrict_rows(pi, tokenizer, query, bm25_passages)
    return predict_tokens(pi, tokenizer, q, k, rows, top)


def npm_classify(
    model, tokenizer, pi: PhraseIndex, query: str, verbalizers: Mapping[str, Sequence[str] | str],
    single: bool = False, k: int = 4096, l_max: int = 10, tau: float = 5.0, bm25_passages: int | None = None,
) -> LabelScores:  # fmt: skip
    """Closed-set classification of a query with one ``[MASK]`` (App. A.4), NPM or NPM SINGLE (``single=True``)."""
    pi.check_encoder(model, tokenizer)
    q_s, q_e = encode_query(model, tokenizer, query, single=single)
    rows = restrict_rows(pi, tokenizer, query, bm25_passages)
    return closed_set(pi, tokenizer, verbalizers, q_s, None if single else q_e, k, l_max, tau, rows)
