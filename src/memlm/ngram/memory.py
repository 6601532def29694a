"""``NgramMemory``: the ∞-gram next-token distribution (Liu et al. 2024, Sec. 3) from an index folder.

For a context ``c = w_1 .. w_{i-1}`` (the document's tokens before the target, after a document-start marker: the
index's separator) and a target ``w_i``::

    L    = max{ l : cnt(w_{i-l} .. w_{i-1}) > 0 }                   (the longest suffix seen in the corpus; L <= n-1
                                                                     for a fixed-n model, ``max_n``)
    P∞(w_i | c) = cnt(w_{i-L} .. w_{i-1} w_i) / cnt(w_{i-L} .. w_{i-1})
    effective n = L + 1;   sparse  <=>  every occurrence of the suffix is followed by the same token

The effective n counts words only (the paper's ``w_1 .. w_{i-1}``): the document-start separator, when the suffix
reaches it, is not a word, so a suffix of the whole context ``START w_1 .. w_{i-1}`` gives ``n = i`` (the same n as
the paper's definition without a marker, since it cannot exceed ``i``).

Counts come from the ``infini-gram`` engine (``find`` over the suffix array, memory-mapped). The token after an
occurrence that ends a document is the EOS token (the separator and the end of the data count as EOS, as the
engine's ``ntd`` does), so the distribution sums to one and a document's end is predicted like any token. ``L = 0``
is the unigram distribution over every position of the index.

End of text inside a document: a literal EOS token in a document's text (e.g. ``<|endoftext|>`` typed in it, which
the tokenizer turns into the EOS id) is one of the document's tokens on both sides, as infini-gram's authors do
(their ``indexing.py`` writes ``tokenizer.encode(text)`` after the separator and nothing else, and the engine
searches a query's ids as given): the index stores it as a token (:mod:`memlm.ngram.index`), and the query of a
document is ``[separator, *its tokens]`` with the EOS kept (:func:`document_query`). The separator occurs only at the
start of a query and only at document starts in the index, so no matched suffix spans two documents. As the *next*
token, a literal EOS and a document's end both count as EOS (the engine's ``ntd`` maps the separator to EOS).

:meth:`NgramMemory.score_documents` computes the target statistics for whole documents at once, walking each document
left to right and reusing the previous position's suffix (the paper's trick for consecutive tokens, App. A): the
longest suffix at position ``i + 1`` is at most one longer than at ``i``, and ``cnt(suffix · w_i)`` of position ``i``
is the count of that candidate, so most positions cost two ``find`` calls. :meth:`NgramMemory.search` returns the
whole next-token distribution of a context as a :class:`memlm.core.memory.Retrieved` (scores ``log cnt(suffix · w)``,
values ``w``), which :func:`memlm.core.distribution.knn_distribution` at temperature 1 turns back into P∞.
"""

from __future__ import annotations

import math
import shutil
import tempfile
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from memlm.core.memory import Retrieved
from memlm.errors import MemlmError
from memlm.ngram.index import INSTALL, NgramIndex

__all__ = ["NextTokens", "NgramMemories", "NgramMemory", "NgramScores", "context_document", "document_query"]


def document_query(tokens: Sequence[int], separator: int) -> list[int]:
    """The ∞-gram query of a document's tokens: the document-start separator, then the tokens as they are (a literal
    EOS inside the document stays a token: the module docstring's end-of-text rule, the index's too)."""
    return [separator, *(int(t) for t in tokens)]


def context_document(context: Sequence[int], eos: int) -> list[int]:
    """The document of an LM context (a generation row, an lm_eval request): the tokens after its leading run of EOS
    (left padding, or the prefix token of an empty context: they mark where the document starts); an EOS after the
    first other token is the document's own token (the end-of-text rule of the module docstring)."""
    ctx = [int(t) for t in context]
    start = 0
    while start < len(ctx) and ctx[start] == eos:
        start += 1
    return ctx[start:]


def effective_n(suffix_len: int, query_len: int) -> int:
    """The paper's effective n of a longest suffix of ``suffix_len`` tokens of a query of ``query_len`` tokens that
    starts with the document-start separator: 1 + its words, the separator (reached when the suffix is the whole
    query) not counted."""
    return suffix_len + 1 - int(suffix_len == query_len and query_len > 0)


# infini-gram's engine (cpp_engine.h, ``Engine::Engine``) sorts a folder's files into token / suffix-array / offset /
# metadata files by whether the file's *whole path* contains one of these words, in this order.
_ENGINE_FILE_WORDS = ("tokenized", "table", "offset", "metadata", "metaoff", "unigram")


def engine_folder(path: Path) -> tuple[str, str | None]:
    """The folder name to hand to the infini-gram engine for the index at ``path``, and a temporary folder to remove
    when the engine is gone (None when ``path`` is used as it is).

    The engine classifies ``path/table.0`` as a suffix array because the string contains "table", so an index under
    a folder named e.g. ``test_writes_table_0`` (pytest) or ``~/offsets`` makes every file a suffix array and the
    engine crashes with a segmentation fault. Such an index is opened through a symlink with a neutral name in a
    fresh temporary folder."""
    if not any(w in str(path.resolve()) for w in _ENGINE_FILE_WORDS):
        return str(path), None
    tmp = tempfile.mkdtemp(prefix="memlm-ngram-")
    link = Path(tmp) / "index"
    if any(w in str(link) for w in _ENGINE_FILE_WORDS):
        shutil.rmtree(tmp, ignore_errors=True)
        raise MemlmError(
            f"cannot open the ∞-gram index {path}: the infini-gram engine misreads folders whose path contains any "
            f"of {', '.join(_ENGINE_FILE_WORDS)}, and so does the temporary folder {tmp}; move the index or set "
            "TMPDIR to a folder without those words"
        )
    link.symlink_to(path.resolve(), target_is_directory=True)
    return str(link), tmp


@dataclass
class NgramScores:
    """Per-target ∞-gram statistics (all arrays ``[N]``)."""

    logprob: np.ndarray  # float32: log P∞(target | context), -inf where the target never follows the suffix
    count: np.ndarray  # int64: cnt(suffix), the denominator
    n: np.ndarray  # int32: effective n = 1 + the suffix's words (the document-start marker is not one)
    sparse: np.ndarray  # bool: one token holds all of P∞'s mass


@dataclass
class NextTokens:
    """What follows each context's longest matching suffix (:meth:`NgramMemory.next_tokens`), all rows ``[Q]``."""

    retrieved: Retrieved  # scores log cnt(suffix · w), exact; values w; ids the effective n (row-wide)
    count: np.ndarray  # int64: cnt(suffix), the denominator of P∞
    sparse: np.ndarray  # bool: one token follows every occurrence (exact, from the suffix array's segment ends)
    missing: np.ndarray  # float64: share of cnt(suffix) held by next tokens not in the row (0: the row is exact)
    sampled: np.ndarray  # bool: the engine sampled the counts (cnt(suffix) > max_support) and memlm recounted them

    def approximate(self) -> dict[str, Any] | None:
        """None when every row's P∞ is exact over the vocabulary, else what is approximate and why."""
        rows = np.flatnonzero(self.missing > 0)
        if not len(rows):
            return None
        return {
            "rows": len(rows),
            "of": len(self.missing),
            "max_missing_mass": float(self.missing.max()),
            "reason": "next tokens rarer than the k kept per row, or left uncounted once a suffix seen more than "
            "max_support times has more distinct next tokens than the exact recount takes (max_support finds): their "
            "P∞ mass is unassigned (each kept token's P∞ is exact, the sparse flag too)",
        }


class NgramMemory:
    """An ∞-gram index as a memory (see the module docstring); ``max_n`` caps the effective n (a fixed-n n-gram
    with the ∞-gram's back-off, no discounting)."""

    def __init__(self, index: NgramIndex | str | Path, max_n: int | None = None, load_to_ram: bool = False) -> None:
        try:
            from infini_gram.engine import InfiniGramEngine
        except ImportError:
            raise MemlmError(INSTALL) from None
        self.index = index if isinstance(index, NgramIndex) else NgramIndex.open(index)
        if max_n is not None and max_n < 1:
            raise MemlmError(f"--ngram-max-n must be >= 1, got {max_n}")
        self.max_n = max_n
        self.max_support = 1000  # the engine samples next-token counts past this many occurrences (next_tokens)
        ix = self.index
        vocab = ix.manifest["tokenizer"]["vocab_size"]
        folder, tmp = engine_folder(ix.path)
        if tmp is not None:
            weakref.finalize(self, shutil.rmtree, tmp, True)
        self.engine = InfiniGramEngine(
            folder,
            eos_token_id=ix.eos_id,
            vocab_size=min(vocab, ix.separator),
            token_dtype=ix.token_dtype,
            load_to_ram=load_to_ram,
        )
        self.sep, self.eos = ix.separator, ix.eos_id
        self.width = np.dtype(ix.dtype).itemsize
        self._tokens = []
        self._sa = []
        for s in range(ix.num_shards):
            tok = np.memmap(ix.path / f"tokenized.{s}", dtype=ix.dtype, mode="r")
            sa = np.memmap(ix.path / f"table.{s}", dtype=np.uint8, mode="r")
            self._tokens.append(tok)
            self._sa.append((sa, len(sa) // len(tok)))
        self.total = int(sum(len(t) for t in self._tokens))  # cnt(empty suffix): every position, separators too

    def describe(self) -> dict:
        """What a result file records about the memory."""
        m = self.index.manifest
        return {
            "ngram": str(self.index.path),
            "ngram_tokens": int(m["tokens"]),
            "ngram_max_n": self.max_n,
            "ngram_build_id": m.get("build_id"),
            "ngram_integrity": self.index.integrity,  # what opening checked: full or sampled checksums
        }

    # ------------------------------------------------------------------------------------------------ counting

    def token_counts(self, ids: np.ndarray) -> np.ndarray:
        """c(w) of every id in ``ids`` among the index's tokens, as P∞ counts a 1-gram (EOS: the documents' ends),
        for the frequency buckets of :mod:`memlm.core.frequency`; one engine count per distinct id."""
        ids = np.asarray(ids, dtype=np.int64)
        distinct, inverse = np.unique(ids, return_inverse=True)
        counts = np.array([self._cont_count([], int(t)) for t in distinct], dtype=np.int64)
        return counts[inverse].reshape(ids.shape)

    def _find(self, ids: list[int]) -> tuple[int, list]:
        r = self.engine.find(ids)
        if "error" in r:
            raise MemlmError(f"∞-gram query refused by the engine: {r['error']}")
        return int(r["cnt"]), r["segment_by_shard"]

    def _after(self, shard: int, rank: int, length: int) -> int | None:
        """The token id stored after the suffix of ``length`` tokens at suffix-array ``rank`` (None at the shard's
        end)."""
        sa, ptr_size = self._sa[shard]
        ptr = int.from_bytes(bytes(sa[rank * ptr_size : (rank + 1) * ptr_size]), "little")
        pos = ptr // self.width + length
        tok = self._tokens[shard]
        return None if pos >= len(tok) else int(tok[pos])

    def _next_token(self, shard: int, rank: int, length: int) -> int:
        """The token after the suffix of ``length`` tokens at suffix-array ``rank`` (separator/end -> EOS)."""
        t = self._after(shard, rank, length)
        return self.eos if t is None or t == self.sep else t

    def _eos_count(self, suffix: list[int]) -> int:
        """Occurrences of ``suffix`` followed by EOS: by the EOS id itself, by a separator, or by the end of a shard."""
        n = self._find([*suffix, self.eos])[0] + self._find([*suffix, self.sep])[0]
        if suffix:
            k = len(suffix)
            for tok in self._tokens:
                if len(tok) >= k and np.array_equal(np.asarray(tok[-k:], dtype=np.int64), suffix):
                    n += 1
        return n

    def _cont_count(self, suffix: list[int], target: int) -> int:
        if target == self.eos:
            return self._eos_count(suffix)
        if target == self.sep:
            return 0
        return self._find([*suffix, target])[0]

    def _sparse(self, suffix: list[int], segments: list, count: int) -> bool:
        """One token follows every occurrence: the first and last entries of each shard's segment of the suffix
        array (sorted by what follows the suffix) agree, and across shards too."""
        firsts = set()
        for s, (lo, hi) in enumerate(segments):
            if hi <= lo:
                continue
            a, b = self._next_token(s, lo, len(suffix)), self._next_token(s, hi - 1, len(suffix))
            if a != b:
                return False
            firsts.add(a)
        if len(firsts) != 1:
            return False
        (tok,) = firsts
        if tok == self.eos:  # EOS has three spellings (id, separator, end): sorted apart, so count them
            return self._eos_count(suffix) == count
        return True

    # ------------------------------------------------------------------------------------------------ scoring

    def _longest_suffix(self, q: list[int], end: int, length: int) -> tuple[int, int, list]:
        """``(L, cnt, segments)`` of the longest suffix of ``q[:end]`` of at most ``length`` tokens that occurs in the
        index. Counts can only fall as a suffix grows, so the lengths that occur are ``0 .. L``: a few steps down
        first (at the next position of a walk the longest suffix rarely shrinks by more), then a binary search, so a
        context seen cold costs ``O(log length)`` finds instead of one per token of its document."""
        for _ in range(4):
            count, segs = self._find(q[end - length : end])
            if count > 0 or length == 0:
                return length, count, segs
            length -= 1
        lo, hi, best = 0, length + 1, None  # cnt(lo) > 0 (the empty suffix), cnt(hi) == 0
        while hi - lo > 1:
            mid = (lo + hi) // 2
            count, segs = self._find(q[end - mid : end])
            if count > 0:
                lo, best = mid, (count, segs)
            else:
                hi = mid
        if best is None:
            best = self._find([])
        return lo, best[0], best[1]

    def score_documents(self, documents: Sequence[np.ndarray], positions: Sequence[np.ndarray]) -> NgramScores:
        """Statistics of every target ``documents[j][p]`` for ``p`` in ``positions[j]`` (increasing), the context
        being the document-start marker and ``documents[j][:p]``; results in the order given."""
        out_lp, out_cnt, out_n, out_sp = [], [], [], []
        cap = None if self.max_n is None else self.max_n - 1
        for doc, pos in zip(documents, positions, strict=True):
            doc = np.asarray(doc, dtype=np.int64)
            pos = np.asarray(pos, dtype=np.int64)
            if len(pos) and (pos.min() < 0 or pos.max() >= len(doc) or np.any(np.diff(pos) <= 0)):
                raise MemlmError("positions must be increasing offsets inside their document")
            q = document_query(doc.tolist(), self.sep)  # context of p: q[:p + 1]
            prev_pos, prev_len, prev_cont = -1, 0, None
            for p in pos.tolist():
                end = p + 1
                length = end if prev_pos < 0 else min(end, prev_len + p - prev_pos)
                if cap is not None:
                    length = min(length, cap)
                if p == prev_pos + 1 and length == prev_len + 1 and prev_cont == 0:
                    length -= 1  # cnt(previous suffix · previous target) = 0: that candidate is known to fail
                length, count, segs = self._longest_suffix(q, end, length)
                suffix = q[end - length : end]
                target = int(doc[p])
                cont = self._cont_count(suffix, target) if count else 0
                out_lp.append(math.log(cont / count) if cont > 0 else -math.inf)
                out_cnt.append(count)
                out_n.append(effective_n(length, end))
                out_sp.append(bool(count) and self._sparse(suffix, segs, count))
                prev_pos, prev_len, prev_cont = p, length, cont
        return NgramScores(
            logprob=np.asarray(out_lp, dtype=np.float32),
            count=np.asarray(out_cnt, dtype=np.int64),
            n=np.asarray(out_n, dtype=np.int32),
            sparse=np.asarray(out_sp, dtype=bool),
        )

    def _recount(self, suffix: list[int], segments: list, seeds: Sequence[int], budget: int) -> tuple[dict, bool]:
        """``({w: cnt(suffix · w)}, complete)``, exact, for the next tokens of ``suffix`` (EOS: literal, separator and
        shard ends together): the suffix array's segment of ``suffix`` is sorted by what follows it, so each next
        token holds one run of it; the walk reads the token at a run's start, finds ``suffix · w`` (its run) and jumps
        past it, one ``find`` per distinct next token, the ``seeds`` (the engine's sampled tokens, most frequent
        first) looked up first. Past ``budget`` finds beyond the seeds the walk stops (``complete`` False)."""
        runs: dict[int, list] = {}

        def look(t: int) -> None:
            runs[t] = self._find([*suffix, t])[1]

        for t in (*seeds, self.eos, self.sep):
            if t not in runs:
                look(t)
        limit, complete = len(runs) + budget, True
        for s, (lo, hi) in enumerate(segments):
            rank = lo
            while rank < hi and complete:
                t = self._after(s, rank, len(suffix))
                if t is None:  # the shard's end: counted by _eos_count
                    rank += 1
                    continue
                if t not in runs:
                    if len(runs) >= limit:
                        complete = False
                        break
                    look(t)
                rank = max(rank + 1, runs[t][s][1])
        counts = {t: sum(b - a for a, b in segs) for t, segs in runs.items() if t not in (self.eos, self.sep)}
        counts = {t: c for t, c in counts.items() if c}
        eos = self._eos_count(suffix)
        if eos:
            counts[self.eos] = eos
        return counts, complete

    def next_tokens(self, contexts: Sequence[Sequence[int]], k: int, max_support: int | None = None) -> NextTokens:
        """For each context (LM token ids: :func:`context_document` takes its document), the ``k`` most frequent next
        tokens of its longest matching suffix with their exact counts ``cnt(suffix · w)``, ``cnt(suffix)``, the exact
        sparse flag and the share of ``cnt(suffix)`` left out (tokens past ``k``; see :meth:`_recount`).

        The engine's ``infgram_ntd`` finds the suffix and its next-token counts; past ``max_support`` occurrences it
        samples them (every ``2^j``-th rank of the suffix array: a token with fewer occurrences than that can be
        missed, the others' counts are estimates). Those rows are recounted exactly (:meth:`_recount`, at most
        ``max_support`` finds past the sampled tokens) and their sparse flag read from the segment's ends.
        ``max_support``: default ``self.max_support`` (1,000, the engine's default)."""
        max_support = self.max_support if max_support is None else int(max_support)
        q_n = len(contexts)
        scores = np.full((q_n, k), -np.inf, dtype=np.float32)
        values = np.full((q_n, k), -1, dtype=np.int64)
        ids = np.full((q_n, k), -1, dtype=np.int64)
        count = np.zeros(q_n, dtype=np.int64)
        sparse = np.zeros(q_n, dtype=bool)
        missing = np.zeros(q_n, dtype=np.float64)
        sampled = np.zeros(q_n, dtype=bool)
        cap = None if self.max_n is None else self.max_n - 1
        for i, ctx in enumerate(contexts):
            full = document_query(context_document(ctx, self.eos), self.sep)
            q = full if cap is None else (full[max(0, len(full) - cap) :] if cap else [])
            r = self.engine.infgram_ntd(q, max_support=max_support)
            if "error" in r:
                raise MemlmError(f"∞-gram query refused by the engine: {r['error']}")
            length, total = int(r["suffix_len"]), int(r["prompt_cnt"])
            counts = {int(t): int(rec["cont_cnt"]) for t, rec in r["result_by_token_id"].items()}
            one = len(counts) == 1
            if r.get("approx"):
                suffix = q[len(q) - length :]
                total, segs = self._find(suffix)
                seeds = sorted(counts, key=lambda t: (-counts[t], t))
                counts, _ = self._recount(suffix, segs, seeds, max_support)
                one, sampled[i] = self._sparse(suffix, segs, total), True
            dist = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:k]
            for j, (tok, c) in enumerate(dist):
                scores[i, j] = math.log(c)
                values[i, j] = tok
                ids[i, j] = effective_n(length, len(full))
            count[i], sparse[i] = total, one
            missing[i] = 1.0 - sum(c for _, c in dist) / total if total else 0.0
        return NextTokens(Retrieved(scores, values, ids), count, sparse, np.maximum(missing, 0.0), sampled)

    def search(self, contexts: Sequence[Sequence[int]], k: int, max_support: int | None = None) -> Retrieved:
        """The memory protocol: for each context (token ids; :func:`context_document`), the ``k`` most frequent next
        tokens of its longest matching suffix: ``scores = log cnt(suffix · w)`` (exact, :meth:`next_tokens`;
        ``-inf`` in empty slots), ``values = w`` (``-1``), ``ids`` = the effective n of the row (its provenance).
        softmax(scores) is P∞ wherever the row holds every next token (:attr:`NextTokens.missing` 0)."""
        return self.next_tokens(contexts, k, max_support).retrieved


class NgramMemories:
    """Several ∞-gram indexes (e.g. an in-domain corpus and all the text a user has), each a memory of its own in the
    per-token table (components ngram, ngram2, ...), later mixed with its own weights
    (:func:`memlm.mixing.report.fit_table`)."""

    def __init__(self, memories: Sequence[NgramMemory]) -> None:
        if len(memories) < 2:
            raise MemlmError("NgramMemories takes two or more ∞-gram memories; use NgramMemory for one")
        self.memories = list(memories)

    def describe(self) -> list[dict]:
        return [m.describe() for m in self.memories]
