"""Token streams and sliding windows: each target scored once, with at least ``min_context`` tokens of context.

A corpus becomes one stream of tokens: each document's tokens followed by the EOS token (so the end of a document is
itself predicted, and context flows across documents as in the kNN-LM paper's concatenated Wikipedia). The stream is
cut into windows of ``window`` tokens that advance by ``stride = window - min_context``; in every window but the first
only the last ``stride`` positions are scored, so each scored target sees at least ``min_context`` prior tokens
(Khandelwal et al. 2020, Sec. 3: 1536 for Wikitext-103, 512 elsewhere). The first window scores all its positions.
``min_context`` is at least 1: a target must be predicted from a position of its own window that has not seen it.

Non-overlapping blocks (``stride = window``: the protocol of Hugging Face's perplexity guide and of knn-transformers'
``run_clm.py``) have no context to carry over, so the first token of each block is handled as ``block_start`` says:

* ``"skip"`` (the guide's and run_clm's labels): blocks of ``window`` stream tokens; the first token of every block
  is not scored, so each block scores ``window - 1`` targets and ``ceil(n / window)`` tokens of the stream are skipped;
* ``"bos"``: blocks of ``window - 1`` stream tokens after a BOS token (``bos_id``, e.g. the tokenizer's BOS or EOS);
  every token of the stream, the first included, is scored, the first of each block from the BOS alone.

Nothing here holds the whole corpus: documents are tokenized as they are read and a small buffer is kept. Every target
carries where it came from (document index, offset in that document and a 64-bit hash of the document) so that a
datastore entry can be matched back to its text, e.g. to drop exact self-matches.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from memlm.errors import MemlmError

__all__ = [
    "TokenChunk",
    "Window",
    "tokenize_documents",
    "count_targets",
    "sliding_windows",
    "batched",
    "doc_hash",
    "limit_documents",
    "resolve_stride",
    "BLOCK_STARTS",
    "truncate_document",
]

BLOCK_STARTS = ("skip", "bos")


@dataclass
class TokenChunk:
    """The tokens of one document (EOS included) with per-token provenance."""

    tokens: np.ndarray  # [n] int64
    doc_index: int
    doc_hash: int


@dataclass
class Window:
    """``input_ids[j]`` for ``j >= score_from`` are targets, each predicted from the hidden state at ``j - 1``."""

    index: int  # window number in the stream
    input_ids: np.ndarray  # [L] int64
    score_from: int  # >= 1
    doc_index: np.ndarray  # [L] int32, for each input position
    offset: np.ndarray  # [L] int32, position of the token inside its document
    doc_hash: np.ndarray  # [L] int64

    @property
    def n_targets(self) -> int:
        return len(self.input_ids) - self.score_from

    @property
    def targets(self) -> np.ndarray:
        return self.input_ids[self.score_from :]


def doc_hash(doc_id: str, text: str) -> int:
    """A stable signed 64-bit hash of a document (its id and text)."""
    digest = hashlib.sha256(f"{doc_id}\x00{text}".encode()).digest()
    return int.from_bytes(digest[:8], "little", signed=True)


def tokenize_documents(
    docs: Sequence, tokenizer, eos_id: int | None = None, batch_size: int = 256
) -> Iterator[TokenChunk]:
    """Tokenize documents (objects with ``.id`` and ``.text``) lazily, appending ``eos_id`` after each one.

    Special tokens are not added (SmolLM2's converted tokenizer would otherwise prepend BOS to each document).
    """
    eos = tokenizer.eos_token_id if eos_id is None else eos_id
    if eos is None:
        raise MemlmError("the tokenizer has no EOS token; pass eos_id= (the id that separates documents)")
    for start in range(0, len(docs), batch_size):
        batch = docs[start : start + batch_size]
        encoded = tokenizer([d.text for d in batch], add_special_tokens=False)["input_ids"]
        for i, (doc, ids) in enumerate(zip(batch, encoded, strict=True)):
            tokens = np.asarray([*ids, eos], dtype=np.int64)
            yield TokenChunk(tokens, start + i, doc_hash(doc.id, doc.text))


def count_targets(
    docs: Sequence, tokenizer, window: int | None = None, stride: int | None = None, block_start: str = "skip"
) -> int:
    """Number of scored targets in the stream of ``docs``: all tokens but the very first with overlapping windows,
    all but the first of each block with ``stride == window`` and ``block_start="skip"``, all with ``"bos"``."""
    total = sum(len(c.tokens) for c in tokenize_documents(docs, tokenizer))
    if window is not None and stride == window:
        return total if block_start == "bos" else total - -(-total // window)
    return max(total - 1, 0)


def resolve_stride(window: int, min_context: int | None, stride: int | None = None) -> tuple[int, int]:
    """``(stride, min_context)`` from either one; ``stride == window`` (min_context 0) means non-overlapping blocks.

    Give ``min_context`` in ``[1, window)`` for overlapping windows, or ``stride`` in ``[1, window]``; when both are
    given they must agree (``stride == window - min_context``).
    """
    if window < 2:
        raise MemlmError(f"window must be at least 2 tokens, got {window}")
    if stride is not None:
        if not 1 <= stride <= window:
            raise MemlmError(f"stride must be in [1, window], got {stride} with window {window}")
        if min_context is not None and min_context != window - stride:
            raise MemlmError(
                f"min_context {min_context} and stride {stride} disagree (stride = window - min_context = "
                f"{window - min_context}); give one of them"
            )
        return stride, window - stride
    if min_context is not None and min_context >= window:
        raise MemlmError(
            f"min_context {min_context} must be smaller than the window ({window}): each window scores "
            "window - min_context new tokens; lower --min-context or raise --window"
        )
    if min_context is None or not 1 <= min_context < window:
        raise MemlmError(
            f"min_context must be in [1, window), got {min_context} with window {window}: every scored target needs "
            "at least one token of context from its own window (with 0 the first target of each later window would be "
            "predicted from a position that has already seen it); for non-overlapping blocks set stride = window"
        )
    return window - min_context, min_context


def sliding_windows(
    chunks: Iterable[TokenChunk],
    window: int,
    min_context: int | None = None,
    *,
    stride: int | None = None,
    block_start: str = "skip",
    bos_id: int | None = None,
) -> Iterator[Window]:
    """Cut the concatenated stream of ``chunks`` into windows (see the module docstring). Streaming.

    ``stride`` (instead of ``min_context``) equal to ``window`` gives non-overlapping blocks, whose first token is
    skipped or scored after ``bos_id`` as ``block_start`` says.
    """
    stride, min_context = resolve_stride(window, min_context, stride)
    blocks = stride == window
    if blocks and block_start not in BLOCK_STARTS:
        raise MemlmError(f"block_start must be one of {', '.join(BLOCK_STARTS)}, got {block_start!r}")
    bos = blocks and block_start == "bos"
    if bos and bos_id is None:
        raise MemlmError("block_start='bos' needs bos_id (the token each block starts from, e.g. BOS or EOS)")
    span = window - 1 if bos else window  # stream tokens per window
    step = span if blocks else stride
    it = iter(chunks)
    tok: list[np.ndarray] = []
    meta: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    buffered = 0  # tokens in the buffer
    exhausted = False
    index = 0
    while True:
        while not exhausted and buffered < span:
            chunk = next(it, None)
            if chunk is None:
                exhausted = True
                break
            n = len(chunk.tokens)
            tok.append(chunk.tokens)
            meta.append(
                (
                    np.full(n, chunk.doc_index, dtype=np.int32),
                    np.arange(n, dtype=np.int32),
                    np.full(n, chunk.doc_hash, dtype=np.int64),
                )
            )
            buffered += n
        if not tok:
            return
        ids = np.concatenate(tok)
        docs_i, offs, hashes = (np.concatenate([m[j] for m in meta]) for j in range(3))
        length = min(span, len(ids))
        score_from = 1 if index == 0 or blocks else min_context
        w_ids, w_doc, w_off, w_hash = ids[:length], docs_i[:length], offs[:length], hashes[:length]
        if bos:  # the BOS position has no provenance: doc -1, offset -1, hash 0
            w_ids = np.concatenate([[bos_id], w_ids]).astype(np.int64)
            w_doc, w_off = (
                np.concatenate([[-1], w_doc]).astype(np.int32),
                np.concatenate([[-1], w_off]).astype(np.int32),
            )
            w_hash = np.concatenate([[0], w_hash]).astype(np.int64)
        if len(w_ids) > score_from:
            yield Window(index, w_ids, score_from, w_doc, w_off, w_hash)
        if exhausted and len(ids) <= span:
            return
        # advance by `step`
        tok, meta = [ids[step:]], [(docs_i[step:], offs[step:], hashes[step:])]
        buffered = len(ids) - step
        index += 1


def batched(windows: Iterable[Window], batch_size: int) -> Iterator[list[Window]]:
    """Group windows into lists of ``batch_size`` (the last one may be shorter)."""
    batch: list[Window] = []
    for w in windows:
        batch.append(w)
        if len(batch) == batch_size:
            yield batch
            batch = []
    if batch:
        yield batch


def limit_documents(docs: Sequence, tokenizer, max_tokens: int | None) -> list:
    """The leading documents of ``docs`` whose tokens (EOS included) add up to at most ``max_tokens`` (at least one)."""
    if max_tokens is None:
        return list(docs)
    if max_tokens < 1:
        raise MemlmError(f"max_tokens must be >= 1, got {max_tokens}")
    kept, total = [], 0
    for chunk in tokenize_documents(docs, tokenizer):
        if total + len(chunk.tokens) > max_tokens:
            if not kept:  # one document longer than the budget: its leading part, not all of it
                kept.append(truncate_document(docs[chunk.doc_index], tokenizer, max_tokens))
            break
        kept.append(docs[chunk.doc_index])
        total += len(chunk.tokens)
    return kept


def truncate_document(doc, tokenizer, max_tokens: int, extra_tokens: int = 1):
    """``doc`` (an object with ``.text``, or a string) cut to its longest leading text whose tokens plus
    ``extra_tokens`` (the EOS) number at most ``max_tokens`` (at least one character, so that a window has a target).
    The id is kept; ``meta['truncated_to_tokens']`` records the cut."""
    import copy
    import dataclasses

    def n_tokens(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"]) + extra_tokens

    text = doc if isinstance(doc, str) else doc.text
    # invariant: the answer is in [lo, hi]; n_tokens grows (nearly) with the prefix length
    lo, hi = 1, min(len(text), 64 * max_tokens)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if n_tokens(text[:mid]) <= max_tokens:
            lo = mid
        else:
            hi = mid - 1
    if isinstance(doc, str):
        return text[:lo]
    meta = {**(getattr(doc, "meta", None) or {}), "truncated_to_tokens": max_tokens}
    if dataclasses.is_dataclass(doc):
        fields = {f.name for f in dataclasses.fields(doc)}
        return dataclasses.replace(doc, text=text[:lo], **({"meta": meta} if "meta" in fields else {}))
    out = copy.copy(doc)
    out.text = text[:lo]
    return out
