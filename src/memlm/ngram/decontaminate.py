"""Decontamination of an ∞-gram reference corpus against evaluation text (Liu et al. 2024, "Infini-gram", App. B).

The paper's rule (Appendix B, "Decontamination of Reference Data"): before Pile-train and RedPajama serve as reference
data, the Big Friendly Filter (BFF; Groeneveld 2023, github.com/allenai/bff) filters out "documents with too much
n-gram overlap with Pile's evaluation sets": "we always remove whole documents, instead of by paragraphs. Following
the default settings, we consider n-grams where n = 13, and discard the document if at least 80% of its n-grams are
present in the evaluation set. For Pile's training set, we lowercase all documents to capture more potential
contaminations." (0.6% of Pile-train's documents and 0.08% of RedPajama's were removed, their Table 4.)

BFF's defaults, from its ``src/main.rs`` (``process_file`` with ``--whole-document``), which this module follows:

* tokens are the Unicode word-boundary segments of the text (UAX #29, the ``unicode-segmentation`` crate's
  ``split_word_bounds``) that are not all whitespace: words, numbers such as ``3.14``, and each punctuation mark;
* a document's n-grams are every run of ``n = 13`` consecutive tokens (``max_ngram_size``), counted with repeats;
  a document of fewer than 13 but at least ``min_n = 5`` tokens (``min_ngram_size``) is one n-gram, all its tokens;
  a document of fewer than 5 tokens has none and is always kept;
* the evaluation set's n-grams, made the same way, are the filter; a document is dropped when
  ``contained / total >= threshold`` (0.8), ``contained`` being how many of its n-grams are in the filter.

Two deliberate differences from the tool: BFF's code compares with ``>`` where the paper says "at least" (here
``>=``, the paper's words; the two differ only at exactly 80%), and BFF's Bloom filter has false positives where this
module compares 64-bit hashes of the n-grams (a polynomial hash modulo 2^64 of the n-gram's code points, each
token's end marked), whose chance of a false match is about 2^-64 per pair of distinct n-grams of natural text (a
power-of-two modulus can be defeated by strings built for it, e.g. Thue-Morse sequences thousands of characters long).
Both sides are lowercased (``lowercase``), as the paper did for Pile-train. With several evaluation sets the filter
holds all of them (one BFF filter); each document's overlap with every set alone is recorded too.

Speed: the tokens come from the ``regex`` module's UAX #29 ``\b`` (:func:`bff_tokens`), except for texts whose every
character is of the Word_Break classes ALetter, Numeric, ExtendNumLet, MidLetter, MidNum, MidNumLet, Single_Quote,
WSegSpace, CR, LF, Newline or Other (all but 74 of the 45,517 offline train documents): those are split in numpy by
the same rules (:func:`_word_breaks`), in chunks of documents, and every n-gram is hashed at once from prefix sums.
The documents' n-grams are looked up in the evaluation set's through two presence bitmaps (of two ranges of hash
bits), then a binary search; forked worker processes (one per usable CPU, Linux) share the chunks.
"""

from __future__ import annotations

import functools
import gc
import hashlib
import multiprocessing
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from memlm.errors import MemlmError

__all__ = [
    "EVAL_SPLITS",
    "RULE",
    "bff_tokens",
    "decontaminate",
    "decontaminate_reference",
    "decontamination_sets",
    "load_evaluation_sets",
    "overlap_fractions",
]

EVAL_SPLITS = ("valid", "test")  # the paper filtered against Pile's validation and test sets; memlm tunes on valid

RULE = (
    "Liu et al. 2024 (infini-gram), App. B: a reference document is dropped whole when at least `threshold` of its "
    "n-grams (n = 13: every run of 13 consecutive tokens, repeats counted; a document of 5-12 tokens is one n-gram, "
    "one of < 5 tokens has none and is kept) occur in the evaluation documents' n-grams; tokens are Unicode word "
    "segments (UAX #29, as BFF's split_word_bounds), whitespace dropped, text lowercased (BFF's defaults, "
    "Groeneveld 2023)"
)


def bff_tokens(text: str) -> list[str]:
    """BFF's tokens of ``text``: its Unicode word-boundary segments (UAX #29 default word boundaries, as the
    ``unicode-segmentation`` crate's ``split_word_bounds``) that are not all whitespace."""
    import regex  # a dependency of transformers (its tokenizers' pre-tokenization patterns)

    return list(filter(str.strip, regex.split(r"(?w)\b", text)))  # str.strip: "" for "" and all-whitespace


# Word_Break classes the fast path implements (UAX #29's rules among them, in numpy); a text with any character of the
# other classes (Extend, Format, ZWJ, Katakana, Hebrew_Letter, Regional_Indicator: the rules WB4, WB3c, WB7a-c, WB13,
# WB15-16) is split by ``bff_tokens`` (the regex module) instead.
# the whitespace classes last (_OS: Other and whitespace): a character is whitespace iff its class is >= _WS
_OT, _AL, _NU, _EX, _ML, _MN, _MNL, _CX, _WS, _CR, _LF, _NL, _OS = range(13)
_CLASSES = {
    "ALetter": _AL,
    "Numeric": _NU,
    "ExtendNumLet": _EX,
    "MidLetter": _ML,
    "MidNum": _MN,
    "MidNumLet": _MNL,
    "Single_Quote": _MNL,  # MidNumLetQ: as MidNumLet outside the Hebrew-letter rules
    "WSegSpace": _WS,
    "CR": _CR,
    "LF": _LF,
    "Newline": _NL,
    "Extend": _CX,
    "Format": _CX,
    "ZWJ": _CX,
    "Katakana": _CX,
    "Hebrew_Letter": _CX,
    "Regional_Indicator": _CX,
}
_BASE = 0x9E3779B97F4A7C15  # P: the polynomial base, odd, hence invertible modulo 2^64
_BASE_INV = pow(_BASE, -1, 1 << 64)
_CHUNK_CHARS = 1 << 18  # characters of documents per chunk of work (its arrays stay in the CPU's caches)


@functools.cache
def _classes() -> np.ndarray:
    """Per code point: its Word_Break class as the fast path names it (read from the regex module's Unicode tables,
    the ones its ``\\b`` uses), Other split by whether Python counts it as whitespace (``str.isspace``)."""
    import regex

    chars = np.arange(0x110000, dtype=np.uint32).tobytes().decode("utf-32-le", "surrogatepass")
    cls = np.full(0x110000, _OT, dtype=np.uint8)
    for name, code in _CLASSES.items():
        for m in regex.finditer(rf"\p{{Word_Break={name}}}+", chars):
            cls[m.start() : m.end()] = code
    space = np.fromiter(map(str.isspace, chars), dtype=bool, count=len(chars))
    # whitespace in a class whose rules join it to other characters (U+202F, ExtendNumLet) goes the slow way, so that
    # every fast-path segment is all whitespace or has none
    cls[space & ~np.isin(cls, [_WS, _CR, _LF, _NL, _OT])] = _CX
    cls[space & (cls == _OT)] = _OS
    cls[~space & (cls >= _WS)] = _CX  # (none in Unicode 15-16) so that the classes >= _WS are exactly the whitespace
    return cls


def _code_points(text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype=np.uint32)


def _word_breaks(c: np.ndarray) -> np.ndarray:
    """``brk[i]``: a word boundary before position ``i`` (``len(c) + 1`` of them) of a text whose Word_Break classes
    ``c`` are all of the fast path's: UAX #29's rules WB1-3d and WB5-13b without WB4 (no Extend, Format, ZWJ),
    WB7a-c (no Hebrew letter) and WB13 (no Katakana); every rule is a no-break (×) except WB3a-b and WB999."""
    n = len(c)
    brk = np.ones(n + 1, dtype=bool)
    if n < 2:
        return brk
    al, nu = c == _AL, c == _NU
    word = al | nu | (c == _EX)  # WB5, WB8-10, WB13a-b: ALetter, Numeric, ExtendNumLet never break among themselves
    mid_l = (c == _ML) | (c == _MNL)
    mid_n = (c == _MN) | (c == _MNL)
    a, b = slice(0, n - 1), slice(1, n)
    keep = word[a] & word[b]
    keep |= (c[a] == _CR) & (c[b] == _LF)  # WB3
    keep |= (c[a] == _WS) & (c[b] == _WS)  # WB3d
    if n >= 3:
        lml = al[:-2] & mid_l[1:-1] & al[2:]  # ALetter (MidLetter | MidNumLetQ) ALetter at i-1, i, i+1
        nmn = nu[:-2] & mid_n[1:-1] & nu[2:]  # Numeric (MidNum | MidNumLetQ) Numeric
        keep[:-1] |= lml | nmn  # WB6, WB12: no break before the middle one
        keep[1:] |= lml | nmn  # WB7, WB11: none after it
    brk[1:n] = ~keep
    return brk


def _powers(length: int) -> tuple[np.ndarray, np.ndarray]:
    """``P^k`` and ``P^-k`` modulo 2^64 for ``k < length`` (cached up to ``_POWERS_CACHED``, grown on demand; a longer
    request, a single document of millions of characters, is computed and not kept)."""
    global _POWERS
    if len(_POWERS[0]) < length:
        size = max(length, min(2 * len(_POWERS[0]), _POWERS_CACHED), 1 << 16)
        pw = np.full(size, _BASE, dtype=np.uint64)
        inv = np.full(size, _BASE_INV, dtype=np.uint64)
        pw[0] = inv[0] = 1
        with np.errstate(over="ignore"):
            np.cumprod(pw, out=pw)
            np.cumprod(inv, out=inv)
        if size > _POWERS_CACHED:
            return pw[:length], inv[:length]
        _POWERS = (pw, inv)
    return _POWERS[0][:length], _POWERS[1][:length]


_POWERS_CACHED = 1 << 22  # 64 MB for both
_POWERS: tuple[np.ndarray, np.ndarray] = (np.ones(0, dtype=np.uint64), np.ones(0, dtype=np.uint64))


def _ngram_counts(doc_tokens: np.ndarray, n: int, min_n: int) -> np.ndarray:
    """How many n-grams documents of ``doc_tokens`` tokens have: ``T - n + 1`` windows for ``T >= n``, one n-gram of all
    tokens for ``min(min_n, n) <= T < n``, none below (BFF's ``max_ngram_size`` and ``min_ngram_size``)."""
    return np.where(doc_tokens >= n, doc_tokens - n + 1, (doc_tokens >= min(min_n, n)).astype(np.int64))


def _stream_ngrams(
    cps: np.ndarray, starts: np.ndarray, doc_tokens: np.ndarray, n: int, min_n: int
) -> tuple[np.ndarray, np.ndarray]:
    """``(hashes, counts)``: the n-gram hashes of documents given as one stream of their tokens' code points ``cps``
    (tokens back to back, starting at ``starts``; ``doc_tokens`` tokens per document, in order), grouped by
    document, and how many each document has (:func:`_ngram_counts`: windows of ``n`` tokens, one n-gram of
    all tokens for ``min(min_n, n) <= T < n``, none below). An n-gram's hash is the polynomial hash modulo 2^64 of its
    tokens' code points, each token's last one marked: ``h = Σ_k x_k P^(k-s) + width`` over its stream positions
    ``s <= k < e``, ``x_k = 2·cp_k + 1 (+1 at a token's end)``, computed for all n-grams at once from the prefix sums
    ``S_e - S_s`` (``S_i = Σ_{k<i} x_k P^k``) times ``P^-s``."""
    doc_tokens = np.asarray(doc_tokens, dtype=np.int64)
    counts = _ngram_counts(doc_tokens, n, min_n)
    if not counts.any():
        return np.empty(0, dtype=np.uint64), counts
    ends = np.empty(len(starts), dtype=np.int64)
    ends[:-1], ends[-1] = starts[1:], len(cps)
    x = cps.astype(np.uint64) * np.uint64(2) + np.uint64(1)
    x[ends - 1] += np.uint64(1)
    pw, inv = _powers(len(x) + 1)
    with np.errstate(over="ignore"):
        prefix = np.empty(len(x) + 1, dtype=np.uint64)
        prefix[0] = 0
        np.cumsum(x * pw[: len(x)], out=prefix[1:])

        def hashes(s: np.ndarray, e: np.ndarray, width) -> np.ndarray:
            return (prefix[e] - prefix[s]) * inv[s] + np.asarray(width, dtype=np.uint64)

        total = int(counts.sum())
        first = np.cumsum(doc_tokens) - doc_tokens  # each document's first token
        long_ = np.flatnonzero(doc_tokens >= n)
        h = np.empty(total, dtype=np.uint64)
        slot = np.cumsum(counts) - counts  # each document's first n-gram in h
        short = np.flatnonzero((counts == 1) & (doc_tokens < n))
        h[slot[short]] = hashes(starts[first[short]], ends[first[short] + doc_tokens[short] - 1], doc_tokens[short])
        if len(long_):
            # every window of n tokens, across documents too, then those inside one (token i of document d starts
            # one iff first_d <= i <= first_d + T_d - n)
            inside = np.zeros(len(starts) + 1, dtype=np.int8)
            inside[first[long_]] = 1
            inside[first[long_] + doc_tokens[long_] - n + 1] -= 1
            keep = np.cumsum(inside[: len(starts) - n + 1], dtype=np.int8).view(bool)
            windows = hashes(starts[: len(starts) - n + 1], ends[n - 1 :], n)[keep]
            if len(short):
                rest = np.ones(total, dtype=bool)
                rest[slot[short]] = False
                h[rest] = windows
            else:
                h = windows
    return h, counts


def _text_ngrams(texts: Sequence[str], n: int, min_n: int, lowercase: bool, tokenize: Callable) -> tuple:
    """``(hashes, counts, tokens)`` of ``texts``: every text's n-gram hashes (grouped by text, in order), how many
    each has and its number of tokens. With ``tokenize`` = :func:`bff_tokens`, texts made only of the fast path's
    Word_Break classes are split in numpy (:func:`_word_breaks`: the same tokens), the others by ``tokenize``."""
    texts = [t.lower() for t in texts] if lowercase else list(texts)
    if tokenize is not bff_tokens or not texts:
        h, counts, tokens = _tokens_ngrams([tokenize(t) for t in texts], n, min_n)
        return h, counts, tokens
    cls = _classes()
    lengths = np.fromiter(map(len, texts), dtype=np.int64, count=len(texts))
    text_start = np.cumsum(lengths + 1) - (lengths + 1)
    cps = _code_points("\n".join([*texts, ""]))  # after each text an LF: a boundary on both sides (WB3a-b)
    c = cls[cps]
    # a segment is all whitespace or has none (no fast-path rule joins a space to a non-space): the tokens are the
    # segments that start with a non-whitespace character, and their characters are the text's non-whitespace ones
    solid = c < _WS
    token_start = _word_breaks(c)[:-1] & solid
    tokens = np.add.reduceat(token_start, text_start, dtype=np.int64)
    kept = np.flatnonzero(solid)  # (integer indexing: faster here than a boolean mask, used twice)
    h, counts = _stream_ngrams(cps[kept], np.flatnonzero(token_start[kept]), tokens, n, min_n)
    slow = _distinct(np.searchsorted(text_start, np.flatnonzero(c == _CX), "right") - 1)
    if not len(slow):
        return h, counts, tokens
    # texts with characters of other classes: split by the regex module, their n-grams put in place of the fast ones
    hs, cs, ts = _tokens_ngrams([bff_tokens(texts[i]) for i in slow], n, min_n)
    at = (np.cumsum(counts) - counts)[slow]
    ends = at + counts[slow]
    starts_s = np.cumsum(cs) - cs
    pieces, prev = [], 0
    for a, b, k, e in zip(at.tolist(), starts_s.tolist(), cs.tolist(), ends.tolist(), strict=True):
        pieces += [h[prev:a], hs[b : b + k]]
        prev = e
    counts[slow], tokens[slow] = cs, ts
    return np.concatenate([*pieces, h[prev:]]), counts, tokens


def _tokens_ngrams(token_lists: Sequence[Sequence[str]], n: int, min_n: int) -> tuple:
    """:func:`_stream_ngrams` of documents given as lists of tokens: ``(hashes, counts, tokens)``."""
    tokens = np.fromiter(map(len, token_lists), dtype=np.int64, count=len(token_lists))
    flat = [t for ts in token_lists for t in ts]
    lens = np.fromiter(map(len, flat), dtype=np.int64, count=len(flat))
    h, counts = _stream_ngrams(_code_points("".join(flat)), np.cumsum(lens) - lens, tokens, n, min_n)
    return h, counts, tokens


_JOB: dict[str, Any] = {}  # the work of the running overlap_fractions, set before its workers fork (inherited)


def _chunk_ngrams(i: int) -> np.ndarray:
    """The n-gram hashes of chunk ``i`` of ``_JOB["chunks"]``."""
    return _text_ngrams(_JOB["chunks"][i], *_JOB["args"])[0]


def _chunk_overlap(i: int) -> tuple:
    """``(counts, tokens, contained)`` of chunk ``i`` of ``_JOB["chunks"]``: n-grams and tokens per document, and per
    evaluation set of ``_JOB["filters"]`` and their union ``"all"``, how many of each document's n-grams it holds
    (looked up in the union first)."""
    texts = _JOB["chunks"][i]
    h, counts, tokens = _text_ngrams(texts, *_JOB["args"])
    hit = np.flatnonzero(_member(h, _JOB["union"], _JOB["table"]))
    owner = np.searchsorted(np.cumsum(counts), hit, "right")  # the document of each n-gram found
    contained = {"all": np.bincount(owner, minlength=len(texts))}
    for name, ref in _JOB["filters"].items():
        contained[name] = np.bincount(owner[_member(h[hit], ref)], minlength=len(texts))
    return counts, tokens, contained


def _batch(indices: Sequence[int]) -> list:
    """``_JOB["job"]`` of chunks ``indices``, in one task (a pool's task costs the parent ~2 ms of CPU)."""
    return [_JOB["job"](i) for i in indices]


def _run(job: Callable[[int], Any], chunks: list, workers: int, bar=None) -> list:
    """``job`` of every chunk index, in order: in ``workers`` forked processes (they inherit ``_JOB``), 8 batches of
    chunks per worker, or here."""
    _JOB.update(chunks=chunks, job=job)
    out = []
    if workers > 1 and len(chunks) > 1 and sys.platform.startswith("linux"):  # fork: safe, and cheap, on Linux
        batches = [b.tolist() for b in np.array_split(np.arange(len(chunks)), min(len(chunks), 8 * workers))]
        gc.freeze()  # the collector leaves the inherited objects alone: no copy-on-write of the parent's memory
        try:
            with multiprocessing.get_context("fork").Pool(min(workers, len(chunks))) as pool:
                for batch, parts in zip(batches, pool.imap(_batch, batches), strict=True):
                    out += parts
                    if bar is not None:
                        bar.update(sum(len(chunks[i]) for i in batch))
        finally:
            gc.unfreeze()
    else:
        for i in range(len(chunks)):
            out.append(job(i))
            if bar is not None:
                bar.update(len(chunks[i]))
    return out


def _table(ref: np.ndarray) -> np.ndarray:
    """Two presence bitmaps of the sorted hashes ``ref`` for :func:`_member` (rows): one bit per value of their top
    ``b`` bits, one per value of their bits ``_MID .. _MID + b``, ``b`` about log2(32 · len(ref)) (4 MB each for the
    offline test splits' 0.9M n-grams: in the CPU's cache). A hash is looked up in ``ref`` only where both are set."""
    bits = int(np.clip(np.ceil(np.log2(max(len(ref), 1) * 32)), 16, 36))
    table = np.zeros((2, 1 << (bits - 3)), dtype=np.uint8)
    for row, key in enumerate(_bitmap_keys(ref, bits)):
        for b in range(8):  # a byte's bits one at a time: fancy-index assignment does not accumulate repeats
            table[row, key[(key & np.uint64(7)) == b] >> np.uint64(3)] |= np.uint8(1 << b)
    return table


_MID = 20  # the second bitmap's lowest hash bit


def _bitmap_keys(values: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    return values >> np.uint64(64 - bits), (values >> np.uint64(_MID)) & np.uint64((1 << bits) - 1)


def _member(values: np.ndarray, ref: np.ndarray, table: np.ndarray | None = None) -> np.ndarray:
    """``values`` in the sorted array ``ref`` (binary search; first the bitmaps of :func:`_table`, if given)."""
    if not len(ref):
        return np.zeros(len(values), dtype=bool)
    if table is None:
        at = np.searchsorted(ref, values)
        at[at == len(ref)] = 0
        return ref[at] == values
    bits = table.shape[1].bit_length() - 1 + 3

    def bit(row: int, key: np.ndarray) -> np.ndarray:
        return ((table[row, key >> np.uint64(3)] >> (key & np.uint64(7)).astype(np.uint8)) & np.uint8(1)).view(bool)

    found = bit(0, _bitmap_keys(values, bits)[0])
    idx = np.flatnonzero(found)
    found[idx] = bit(1, _bitmap_keys(values[idx], bits)[1])
    idx = idx[found[idx]]
    found[idx] = _member(values[idx], ref)
    return found


def _distinct(values: np.ndarray) -> np.ndarray:
    """The sorted distinct ``values`` (as ``np.unique``, whose hash table in numpy 2.4 is 40x slower than this sort)."""
    values = np.sort(values)
    return values[np.r_[True, values[1:] != values[:-1]]] if len(values) else values


def _chunks(texts: Sequence[str], chars: int) -> list[list[str]]:
    out, cur, size = [], [], 0
    for t in texts:
        cur.append(t)
        size += len(t)
        if size >= chars:
            out.append(cur)
            cur, size = [], 0
    return [*out, cur] if cur else out


def overlap_fractions(
    documents: Sequence,
    eval_sets: Mapping[str, Sequence],
    n: int = 13,
    min_n: int = 5,
    lowercase: bool = True,
    tokenize: Callable[[str], list[str]] = bff_tokens,
    progress: bool = False,
    workers: int | None = None,
) -> dict[str, Any]:
    """Per document of ``documents`` (objects with ``.text``): its number of n-grams and of BFF tokens, and the share
    of its n-grams found in the n-grams of every evaluation set alone and of all of them (``"all"``); NaN where a
    document has no n-gram. Returns ``{"ngrams", "tokens", "fraction": {name: array, ..., "all": array},
    "eval_ngrams": {name: distinct n-grams}}``. ``workers`` processes (default: the usable CPUs; forked, on Linux;
    elsewhere one) share the documents in chunks: the result does not depend on how many."""
    from tqdm.auto import tqdm

    if workers is None:
        workers = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    _classes()  # built (and regex imported) before the workers fork
    _JOB.clear()
    _JOB["args"] = (n, min_n, lowercase, tokenize)
    bar = tqdm(total=len(documents), desc="decontaminate", unit="doc", disable=not progress, dynamic_ncols=True)
    try:
        chunks = {name: _chunks([d.text for d in docs], _CHUNK_CHARS) for name, docs in eval_sets.items()}
        parts = iter(_run(_chunk_ngrams, [c for cs in chunks.values() for c in cs], workers))
        filters = {
            name: _distinct(np.concatenate([next(parts) for _ in cs])) if cs else np.empty(0, dtype=np.uint64)
            for name, cs in chunks.items()
        }
        union = _distinct(np.concatenate(list(filters.values()))) if filters else np.empty(0, dtype=np.uint64)
        _JOB.update(filters=filters, union=union, table=_table(union))
        parts = _run(_chunk_overlap, _chunks([d.text for d in documents], _CHUNK_CHARS), workers, bar)
    finally:
        _JOB.clear()
        bar.close()
    cat = np.concatenate
    counts = cat([p[0] for p in parts]) if parts else np.empty(0, dtype=np.int64)
    fractions = {}
    for name in [*filters, "all"]:
        contained = cat([p[2][name] for p in parts]) if parts else np.empty(0, dtype=np.int64)
        with np.errstate(invalid="ignore", divide="ignore"):
            fractions[name] = contained / counts
    return {
        "ngrams": counts,
        "tokens": cat([p[1] for p in parts]) if parts else np.empty(0, dtype=np.int64),
        "fraction": fractions,
        "eval_ngrams": {k: int(len(v)) for k, v in filters.items()},
    }


def decontaminate(
    documents: Sequence,
    eval_sets: Mapping[str, Sequence],
    tokenizer=None,
    n: int = 13,
    threshold: float = 0.8,
    min_n: int = 5,
    lowercase: bool = True,
    tokenize: Callable[[str], list[str]] = bff_tokens,
    progress: bool = False,
    workers: int | None = None,
) -> tuple[list, dict[str, Any]]:
    """``(kept, record)``: ``documents`` (objects with ``.id``, ``.text``) without those the paper's rule drops against
    the evaluation documents ``eval_sets`` (name -> documents; see the module docstring), in their order, and what was
    dropped. A document is dropped when its overlap with all evaluation sets together (one filter, as BFF) reaches
    ``threshold``; ``record["eval_sets"][name]`` counts the documents that reach it against that set alone.
    ``tokenizer`` (optional, a Hugging Face tokenizer) counts the dropped documents' model tokens. The same inputs
    always give the same record (no timings in it), so a build that records it resumes. ``workers``: as in
    :func:`overlap_fractions`."""
    if n < 1 or min_n < 1:
        raise MemlmError(f"decontamination needs n >= 1 and min_n >= 1, got n={n}, min_n={min_n}")
    min_n = min(min_n, n)
    if not 0.0 < threshold <= 1.0:
        raise MemlmError(f"the decontamination threshold must be in (0, 1], got {threshold}")
    docs = list(documents)
    res = overlap_fractions(docs, eval_sets, n, min_n, lowercase, tokenize, progress, workers)
    frac = res["fraction"]
    drop = np.nan_to_num(frac["all"], nan=0.0) >= threshold
    dropped = [d for d, x in zip(docs, drop, strict=True) if x]
    kept = [d for d, x in zip(docs, drop, strict=True) if not x]

    def model_tokens(ds: Sequence) -> int | None:
        if tokenizer is None or not ds:
            return None if tokenizer is None else 0
        return int(sum(len(ids) for ids in tokenizer([d.text for d in ds], add_special_tokens=False)["input_ids"]))

    sets = {}
    for name, docs_e in eval_sets.items():
        mask = np.nan_to_num(frac[name], nan=0.0) >= threshold
        hit = [d for d, x in zip(docs, mask, strict=True) if x]
        sets[name] = {
            "documents": len(docs_e),
            "ngrams": res["eval_ngrams"][name],
            "dropped_documents": len(hit),
            "dropped_tokens": model_tokens(hit),
            "dropped_words": int(res["tokens"][mask].sum()),
        }
    ids = [str(d.id) for d in dropped]
    record = {
        "rule": RULE,
        "n": n,
        "min_n": min_n,
        "threshold": threshold,
        "lowercase": lowercase,
        "checked_documents": len(docs),
        "eval_sets": sets,
        "dropped_documents": len(dropped),
        "dropped_tokens": model_tokens(dropped),
        "dropped_words": int(res["tokens"][drop].sum()),
        "dropped": [
            {"id": str(d.id), "overlap": round(float(frac["all"][i]), 6)}
            for i, d in zip(np.flatnonzero(drop).tolist(), dropped, strict=True)
        ][:200],
        "dropped_ids_sha256": hashlib.sha256("\n".join(ids).encode("utf-8", "surrogatepass")).hexdigest(),
    }
    return kept, record


# ---------------------------------------------------------------------------------------------------- the build's sets


def decontamination_sets(corpus: str, split: str, spec: str | None) -> list[str]:
    """The evaluation sets an ∞-gram build decontaminates against (the paper filtered its reference data against
    Pile's validation *and* test sets): the ``valid`` and ``test`` splits of every named corpus in ``corpus`` (a
    comma-separated ``--corpus``) when the build reads train splits (none with ``split`` = ``all``, whose index holds
    them), and the sets ``spec`` names: comma-separated ``CORPUS:SPLIT``, ``CORPUS`` (its valid and test splits) or
    paths of files or folders. ``spec`` = ``none``: no decontamination at all. In order, each once."""
    from memlm.data.corpora import CORPORA

    if spec is not None and spec.strip().lower() == "none":
        return []
    names = []
    if split == "train":
        named = [c for c in (x.strip() for x in corpus.split(",")) if c in CORPORA]
        names += [f"{c}:{s}" for c in named for s in EVAL_SPLITS]
    if spec is not None:
        given = [x.strip() for x in spec.split(",") if x.strip()]
        if not given:
            raise MemlmError(
                "--decontaminate needs CORPUS:SPLIT names, CORPUS names or paths (e.g. wikitext2:test,imdb), or none"
            )
        for x in given:
            names += [f"{x}:{s}" for s in EVAL_SPLITS] if x in CORPORA else [x]
    return list(dict.fromkeys(names))


def load_evaluation_sets(names: Sequence[str]) -> dict[str, list]:
    """The documents of each evaluation set of :func:`decontamination_sets` (a named corpus's split, or a file or
    folder read whole), by name."""
    from pathlib import Path

    from memlm.data.corpora import CORPORA, load_documents

    out = {}
    for name in names:
        corpus, _, split = name.rpartition(":")
        out[name] = load_documents(corpus, split) if corpus in CORPORA else load_documents(Path(name), None)
    return out


def decontaminate_reference(
    documents: Sequence,
    names: Sequence[str],
    tokenizer=None,
    n: int = 13,
    threshold: float = 0.8,
    progress: bool = False,
) -> tuple[list, dict[str, Any] | None]:
    """``(kept, record)``: the reference ``documents`` of an ∞-gram index without those the paper's rule
    (:func:`decontaminate`) finds in the evaluation sets ``names`` (:func:`load_evaluation_sets`), and the record a
    manifest keeps (each set's fingerprint added); ``(documents, None)`` when ``names`` is empty. What ``memlm ngram
    build`` and ``memlm demo`` both run before indexing."""
    if not names:
        return list(documents), None
    from memlm.data.corpora import corpus_fingerprint

    eval_sets = load_evaluation_sets(names)
    kept, record = decontaminate(documents, eval_sets, tokenizer, n=n, threshold=threshold, progress=progress)
    for name, docs in eval_sets.items():
        record["eval_sets"][name]["fingerprint"] = corpus_fingerprint(docs)
    return kept, record
