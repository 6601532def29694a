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
module compares 64-bit hashes of the n-grams (a hash of each distinct token, chained over the n-gram), whose chance of
a false match is about 2^-64 per pair of distinct n-grams. Both sides are lowercased (``lowercase``), as the paper
did for Pile-train. With several evaluation sets the filter holds all of them (one BFF filter); each document's
overlap with every set alone is recorded too.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from memlm.errors import MemlmError

__all__ = ["RULE", "bff_tokens", "decontaminate", "ngram_hashes", "overlap_fractions"]

RULE = (
    "Liu et al. 2024 (infini-gram), App. B: a reference document is dropped whole when at least `threshold` of its "
    "n-grams (n = 13: every run of 13 consecutive tokens, repeats counted; a document of 5-12 tokens is one n-gram, "
    "one of < 5 tokens has none and is kept) occur in the evaluation documents' n-grams; tokens are Unicode word "
    "segments (UAX #29, as BFF's split_word_bounds), whitespace dropped, text lowercased (BFF's defaults, "
    "Groeneveld 2023)"
)
_MASK = (1 << 64) - 1
_MULT = np.uint64(0x9E3779B97F4A7C15)  # an odd 64-bit multiplier (the golden-ratio constant)


def bff_tokens(text: str) -> list[str]:
    """BFF's tokens of ``text``: its Unicode word-boundary segments (UAX #29 default word boundaries, as the
    ``unicode-segmentation`` crate's ``split_word_bounds``) that are not all whitespace."""
    import regex  # a dependency of transformers (its tokenizers' pre-tokenization patterns)

    return [s for s in regex.split(r"(?w)\b", text) if s and not s.isspace()]


class _Hasher:
    """A stable 64-bit hash per distinct token (BLAKE2b of its UTF-8), cached."""

    def __init__(self) -> None:
        self.cache: dict[str, int] = {}

    def __call__(self, tokens: Sequence[str]) -> np.ndarray:
        cache = self.cache
        for t in set(tokens).difference(cache):
            digest = hashlib.blake2b(t.encode("utf-8", "surrogatepass"), digest_size=8).digest()
            cache[t] = int.from_bytes(digest, "little")
        return np.fromiter(map(cache.__getitem__, tokens), dtype=np.uint64, count=len(tokens))


def ngram_hashes(token_hashes: np.ndarray, n: int = 13, min_n: int = 5) -> np.ndarray:
    """One 64-bit hash per n-gram of a document, as BFF forms them: every window of ``n`` tokens, or, for a document
    of ``min_n <= len < n`` tokens, one n-gram of all of them; none below ``min_n``. The hash chains the token hashes:
    ``h = ((t_1 · M + t_2) · M + ...) · M + t_L`` modulo 2^64 (``M`` odd), plus ``L`` so lengths differ."""
    k = len(token_hashes)
    if k < min(min_n, n):
        return np.empty(0, dtype=np.uint64)
    width = n if k >= n else k
    count = k - width + 1
    h = np.zeros(count, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for j in range(width):
            h = h * _MULT + token_hashes[j : j + count]
        h = h + np.uint64(width)
    return h


def _document_ngrams(text: str, hasher: _Hasher, n: int, min_n: int, lowercase: bool, tokenize) -> tuple:
    tokens = tokenize(text.lower() if lowercase else text)
    return ngram_hashes(hasher(tokens), n, min_n), len(tokens)


def overlap_fractions(
    documents: Sequence,
    eval_sets: Mapping[str, Sequence],
    n: int = 13,
    min_n: int = 5,
    lowercase: bool = True,
    tokenize: Callable[[str], list[str]] = bff_tokens,
    progress: bool = False,
) -> dict[str, Any]:
    """Per document of ``documents`` (objects with ``.text``): its number of n-grams and of BFF tokens, and the share
    of its n-grams found in the n-grams of every evaluation set alone and of all of them (``"all"``); NaN where a
    document has no n-gram. Returns ``{"ngrams", "tokens", "fraction": {name: array, ..., "all": array},
    "eval_ngrams": {name: distinct n-grams}}``."""
    from tqdm.auto import tqdm

    hasher = _Hasher()
    filters: dict[str, np.ndarray] = {}
    for name, docs in eval_sets.items():
        parts = [_document_ngrams(d.text, hasher, n, min_n, lowercase, tokenize)[0] for d in docs]
        filters[name] = np.unique(np.concatenate(parts)) if parts else np.empty(0, dtype=np.uint64)
    union = np.unique(np.concatenate(list(filters.values()))) if filters else np.empty(0, dtype=np.uint64)
    grams, tokens = [], []
    for d in tqdm(documents, desc="decontaminate", unit="doc", disable=not progress, dynamic_ncols=True):
        g, t = _document_ngrams(d.text, hasher, n, min_n, lowercase, tokenize)
        grams.append(g)
        tokens.append(t)
    counts = np.array([len(g) for g in grams], dtype=np.int64)
    flat = np.concatenate(grams) if grams else np.empty(0, dtype=np.uint64)
    ends = np.cumsum(counts)
    fractions = {}
    for name, ref in [*filters.items(), ("all", union)]:
        cum = np.r_[0, np.cumsum(np.isin(flat, ref), dtype=np.int64)]
        contained = cum[ends] - cum[ends - counts]
        with np.errstate(invalid="ignore", divide="ignore"):
            fractions[name] = contained / counts
    return {
        "ngrams": counts,
        "tokens": np.asarray(tokens, dtype=np.int64),
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
) -> tuple[list, dict[str, Any]]:
    """``(kept, record)``: ``documents`` (objects with ``.id``, ``.text``) without those the paper's rule drops against
    the evaluation documents ``eval_sets`` (name -> documents; see the module docstring), in their order, and what was
    dropped. A document is dropped when its overlap with all evaluation sets together (one filter, as BFF) reaches
    ``threshold``; ``record["eval_sets"][name]`` counts the documents that reach it against that set alone.
    ``tokenizer`` (optional, a Hugging Face tokenizer) counts the dropped documents' model tokens. The same inputs
    always give the same record (no timings in it), so a build that records it resumes."""
    if n < 1 or min_n < 1:
        raise MemlmError(f"decontamination needs n >= 1 and min_n >= 1, got n={n}, min_n={min_n}")
    min_n = min(min_n, n)
    if not 0.0 < threshold <= 1.0:
        raise MemlmError(f"the decontamination threshold must be in (0, 1], got {threshold}")
    docs = list(documents)
    res = overlap_fractions(docs, eval_sets, n, min_n, lowercase, tokenize, progress)
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
