"""Training-batch construction for TRIME (Zhong et al. 2022, "Training Language Models with Memory Augmentation").

TRIME trains with *in-batch memories*: the memory of a token is made of the other tokens in the same training batch
(Sec. 3), so how segments are grouped into batches decides which memory the model learns to use (Sec. 4):

* ``TrimeLM`` (local memory, Sec. 4.1): any batching (random segments).
* ``TrimeLM_long`` (long-term memory, Sec. 4.2): each batch holds ``m`` consecutive segments of one document, so a
  token's memory includes the tokens of the *earlier* segments of its document (:func:`pack_consecutive`; a batch of
  ``B`` segments thus holds about ``B / m`` documents).
* ``TrimeLM_ext`` (external memory, Sec. 4.3, Algorithm 1 / App. B): segments with large lexical overlap, measured by
  BM25, are packed into the same batch, as a cheap proxy for the nearest neighbours that an external datastore returns
  at test time (:func:`bm25_neighbors` and :func:`chain_order`; ``m = 1``). Random batches are the "w/o BM25
  batching" ablation (App. H). :class:`memlm.trime.training.TrimeBatches` cuts these orders into batches.

Everything works on token arrays (one ``np.ndarray`` of ids per document, e.g. a
:class:`memlm.data.windows.TokenChunk`'s ``tokens``), is deterministic given ``seed`` and uses every segment exactly
once per call (one epoch). A batch is a list of indices into the segment list.

Segment convention (:func:`segment_documents`): a document of ``n`` tokens is cut at ``0, L, 2L, ...`` into segments
that *own* ``L`` tokens each (the last one fewer); these owned tokens cover the document exactly once, in order. Each
segment's ``tokens`` also carries the first token of the next segment, when there is one ("+1 for targets"), so
``inputs = tokens[:-1]`` and ``targets = tokens[1:]`` give next-token pairs in which every document token but the first
is a target exactly once, and the segment ``x_1..x_L`` of the paper is ``tokens[:L]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from memlm.errors import MemlmError

__all__ = [
    "TokenWindow",
    "Segment",
    "segment_documents",
    "pack_consecutive",
    "bm25_neighbors",
    "chain_order",
    "batch_purity",
]


class TokenWindow:
    """Next-token view of a run of ``tokens``: position ``i`` of :attr:`inputs` predicts :attr:`targets` ``[i]``."""

    tokens: np.ndarray

    @property
    def inputs(self) -> np.ndarray:
        """Input positions that have a next-token target: ``tokens[:-1]``."""
        return self.tokens[:-1]

    @property
    def targets(self) -> np.ndarray:
        """Next-token targets of :attr:`inputs`: ``tokens[1:]``."""
        return self.tokens[1:]


@dataclass(frozen=True)
class Segment(TokenWindow):
    """One segment of a tokenized document (see the module docstring for the ``+1`` convention)."""

    doc_index: int  # index of the document in the ``token_docs`` given to :func:`segment_documents`
    index: int  # position of the segment inside its document: 0, 1, 2, ...
    start: int  # offset of the segment's first token inside its document (= index * segment_len)
    length: int  # number of document tokens the segment owns (segment_len, or fewer for the last one)
    tokens: np.ndarray  # [length] or [length + 1] int64: the owned tokens, plus the next segment's first token

    @property
    def owned(self) -> np.ndarray:
        """The ``length`` document tokens this segment covers (disjoint across segments)."""
        return self.tokens[: self.length]


def segment_documents(token_docs: Sequence[np.ndarray], segment_len: int) -> list[Segment]:
    """Cut each tokenized document into consecutive segments owning ``segment_len`` tokens (Sec. 4, ``L``).

    Segments are listed document by document, in order; empty documents give no segment. Each segment's ``tokens``
    holds its owned tokens plus the next segment's first token when there is one (module docstring).
    """
    if segment_len < 1:
        raise MemlmError(f"segment_len must be >= 1, got {segment_len}")
    segments: list[Segment] = []
    for d, doc in enumerate(token_docs):
        arr = np.asarray(doc, dtype=np.int64).reshape(-1)
        n = len(arr)
        for i, s in enumerate(range(0, n, segment_len)):
            length = min(segment_len, n - s)
            segments.append(Segment(d, i, s, length, arr[s : min(s + segment_len + 1, n)].copy()))
    return segments


def pack_consecutive(
    segments: Sequence[Segment], batch_size: int, m: int, seed: int = 0, max_open: int = 8
) -> list[list[int]]:
    """Consecutive-segment batching for ``TrimeLM_long`` (Sec. 4.2): batches of groups of ``m`` consecutive segments.

    Each document's segments are split into runs of ``m`` consecutive segments (``[0, m)``, ``[m, 2m)``, ...; the last
    run may be shorter). The runs are shuffled with ``seed`` and placed first-fit into batches of at most
    ``batch_size`` segments; a run is never split, and keeps its order inside the batch, so each segment's earlier
    segments of the same document are in its batch. Up to ``max_open`` partly filled
    batches are kept open (the oldest is closed when one more is needed), so batches are full except when runs do not
    tile ``batch_size``; with ``batch_size % m == 0`` and whole runs only, every batch but the last is full.
    """
    if m < 1 or m > batch_size:
        raise MemlmError(f"m must be in [1, batch_size={batch_size}], got {m}")
    if max_open < 1:
        raise MemlmError(f"max_open must be >= 1, got {max_open}")
    by_doc: dict[int, list[int]] = {}
    for i, s in enumerate(segments):
        by_doc.setdefault(s.doc_index, []).append(i)
    runs: list[list[int]] = []
    for doc in sorted(by_doc):
        idx = sorted(by_doc[doc], key=lambda i: segments[i].start)
        runs.extend(idx[j : j + m] for j in range(0, len(idx), m))
    order = np.random.default_rng(seed).permutation(len(runs))

    closed: list[list[int]] = []
    open_: list[list[int]] = []
    for r in order:
        run = runs[int(r)]
        target = next((b for b in open_ if len(b) + len(run) <= batch_size), None)
        if target is None:
            if len(open_) >= max_open:
                closed.append(open_.pop(0))
            target = []
            open_.append(target)
        target.extend(run)
        if len(target) == batch_size:
            open_.remove(target)
            closed.append(target)
    return closed + open_


def _bm25_corpus(segments: Sequence[Segment], texts: Sequence[str] | None) -> tuple[list[list[int]], dict[str, int]]:
    """Term-id lists (one per segment) and vocabulary: words of ``texts`` (bm25s tokenizer, English stopwords
    removed), or the segments' owned token ids when ``texts`` is None."""
    import bm25s

    if texts is not None:
        if len(texts) != len(segments):
            raise MemlmError(f"got {len(texts)} texts for {len(segments)} segments")
        tok = bm25s.tokenize(list(texts), stopwords="en", show_progress=False, return_ids=True)
        return [list(map(int, ids)) for ids in tok.ids], dict(tok.vocab)
    owned = [s.owned for s in segments]
    flat = np.concatenate(owned) if owned else np.zeros(0, dtype=np.int64)
    vocab_ids, inverse = np.unique(flat, return_inverse=True)
    bounds = np.cumsum([0] + [len(o) for o in owned])
    ids = [inverse[bounds[i] : bounds[i + 1]].tolist() for i in range(len(owned))]
    return ids, {str(int(t)): i for i, t in enumerate(vocab_ids)}


def _queries(ids: list[list[int]], vocab_size: int, max_terms: int | None) -> list[list[int]]:
    """Per segment: its distinct terms with document frequency > 1, the ``max_terms`` best by ``tf * idf``."""
    uniq = [np.unique(np.asarray(q, dtype=np.int64), return_counts=True) for q in ids]
    df = np.zeros(vocab_size + 1, dtype=np.int64)
    for terms, _ in uniq:
        df[terms] += 1
    idf = np.log(1.0 + (len(ids) - df + 0.5) / (df + 0.5))
    out: list[list[int]] = []
    for terms, tf in uniq:
        keep = df[terms] > 1
        terms, tf = terms[keep], tf[keep]
        if max_terms is not None and len(terms) > max_terms:
            best = np.lexsort((terms, -(tf * idf[terms])))[:max_terms]
            terms = np.sort(terms[best])
        out.append(terms.tolist())
    return out


def bm25_neighbors(
    segments: Sequence[Segment],
    k: int = 20,
    texts: Sequence[str] | None = None,
    k1: float = 1.5,
    b: float = 0.75,
    n_threads: int = 0,
    max_query_terms: int | None = 128,
) -> np.ndarray:
    """``SimSeg(I, c, k)`` of Algorithm 1 for every segment at once: ``[n, k]`` int64 indices of each segment's ``k``
    most BM25-similar other segments, best first, ``-1`` where fewer than ``k`` have a positive score.

    The index ``I`` holds each segment as a bag of terms (the words of ``texts[i]``, or its owned token ids), scored
    with Lucene BM25 (``k1``, ``b``). The query for a segment is its set of distinct terms that occur in some other
    segment; when ``max_query_terms`` is set, only that many are kept, those with the highest ``tf * idf`` in the
    segment (as Lucene's MoreLikeThis does). This bounds the query cost for long segments (the paper's ``L`` is up to
    3072 tokens); ``None`` queries with all terms. The segment itself and zero-score segments (no shared query term)
    are left out; ties are broken by the lower index.
    """
    import bm25s

    n = len(segments)
    if n == 0:
        return np.zeros((0, k), dtype=np.int64)
    if max_query_terms is not None and max_query_terms < 1:
        raise MemlmError(f"max_query_terms must be >= 1 or None, got {max_query_terms}")
    ids, vocab = _bm25_corpus(segments, texts)
    retriever = bm25s.BM25(k1=k1, b=b)
    retriever.index(bm25s.tokenization.Tokenized(ids=ids, vocab=vocab), show_progress=False)
    queries = _queries(ids, len(vocab), max_query_terms)
    asked = [i for i, q in enumerate(queries) if q]  # an empty query (no shared term) has no neighbour
    out = np.full((n, k), -1, dtype=np.int64)
    if not asked:
        return out
    kk = min(k + 1, n)
    docs, scores = retriever.retrieve(
        [queries[i] for i in asked], k=kk, show_progress=False, n_threads=n_threads, sorted=True
    )
    docs = np.asarray(docs, dtype=np.int64).reshape(len(asked), kk)
    scores = np.asarray(scores, dtype=np.float64).reshape(len(asked), kk)
    for r, i in enumerate(asked):
        keep = (docs[r] != i) & (scores[r] > 0)
        d, s = docs[r][keep], scores[r][keep]
        d = d[np.lexsort((d, -s))][:k]
        out[i, : len(d)] = d
    return out


def chain_order(neighbors: np.ndarray, seed: int = 0) -> list[int]:
    """The list ``l`` of Algorithm 1: start from a random segment, then repeatedly move to the most similar unused
    segment among the current one's ``neighbors`` row, or to a random unused segment when all of them are used.

    Random picks walk a seeded permutation of the segments (the first one still unused), so the whole order is a
    deterministic function of ``neighbors`` and ``seed``; every segment appears exactly once.
    """
    n = len(neighbors)
    used = np.zeros(n, dtype=bool)
    perm = np.random.default_rng(seed).permutation(n).tolist()
    rows = neighbors.tolist()
    order: list[int] = []
    p = 0
    c: int | None = None
    while len(order) < n:
        if c is None:
            while used[perm[p]]:
                p += 1
            c = perm[p]
        order.append(c)
        used[c] = True
        nxt: int | None = None
        for j in rows[c]:
            if j >= 0 and not used[j]:
                nxt = j
                break
        c = nxt
    return order


def batch_purity(batches: Sequence[Sequence[int]], labels: Sequence[int] | np.ndarray) -> float:
    """Mean over batches of the share of the batch's most common label (``labels[i]`` for segment ``i``): 1.0 when
    every batch is one topic. A diagnostic for BM25 batching."""
    lab = np.asarray(labels)
    shares = [np.unique(lab[list(b)], return_counts=True)[1].max() / len(b) for b in batches if len(b)]
    return float(np.mean(shares)) if shares else 1.0
