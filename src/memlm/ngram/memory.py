"""``NgramMemory``: the ∞-gram next-token distribution (Liu et al. 2024, Sec. 3) from an index folder.

For a context ``c = w_1 .. w_{i-1}`` (the document's tokens before the target, after a document-start marker: the
index's separator) and a target ``w_i``::

    L    = max{ l : cnt(w_{i-l} .. w_{i-1}) > 0 }                   (the longest suffix seen in the corpus; L <= n-1
                                                                     for a fixed-n model, ``max_n``)
    P∞(w_i | c) = cnt(w_{i-L} .. w_{i-1} w_i) / cnt(w_{i-L} .. w_{i-1})
    effective n = L + 1;   sparse  <=>  every occurrence of the suffix is followed by the same token

Counts come from the ``infini-gram`` engine (``find`` over the suffix array, memory-mapped). The token after an
occurrence that ends a document is the EOS token (the separator and the end of the data count as EOS, as the
engine's ``ntd`` does), so the distribution sums to one and a document's end is predicted like any token. ``L = 0``
is the unigram distribution over every position of the index.

:meth:`NgramMemory.score_documents` computes the target statistics for whole documents at once, walking each document
left to right and reusing the previous position's suffix (the paper's trick for consecutive tokens, App. A): the
longest suffix at position ``i + 1`` is at most one longer than at ``i``, and ``cnt(suffix · w_i)`` of position ``i``
is the count of that candidate, so most positions cost two ``find`` calls. :meth:`NgramMemory.search` returns the
whole next-token distribution of a context as a :class:`memlm.core.memory.Retrieved` (scores ``log cnt(suffix · w)``,
values ``w``), which :func:`memlm.core.distribution.knn_distribution` at temperature 1 turns back into P∞.
"""

from __future__ import annotations

import dataclasses
import math
import shutil
import tempfile
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from memlm.core.memory import Retrieved
from memlm.errors import MemlmError
from memlm.ngram.index import INSTALL, NgramIndex

__all__ = ["NgramMemories", "NgramMemory", "NgramScores"]

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
    n: np.ndarray  # int32: effective n = 1 + suffix length (the document-start marker counts as a token)
    sparse: np.ndarray  # bool: one token holds all of P∞'s mass


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

    def _next_token(self, shard: int, rank: int, length: int) -> int:
        """The token after the suffix of ``length`` tokens at suffix-array ``rank`` (separator/end -> EOS)."""
        sa, ptr_size = self._sa[shard]
        ptr = int.from_bytes(bytes(sa[rank * ptr_size : (rank + 1) * ptr_size]), "little")
        pos = ptr // self.width + length
        tok = self._tokens[shard]
        if pos >= len(tok):
            return self.eos
        t = int(tok[pos])
        return self.eos if t == self.sep else t

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
            q = [self.sep, *(self.sep if t == self.eos else int(t) for t in doc.tolist())]  # context of p: q[:p + 1]
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
                out_n.append(length + 1)
                out_sp.append(bool(count) and self._sparse(suffix, segs, count))
                prev_pos, prev_len, prev_cont = p, length, cont
        return NgramScores(
            logprob=np.asarray(out_lp, dtype=np.float32),
            count=np.asarray(out_cnt, dtype=np.int64),
            n=np.asarray(out_n, dtype=np.int32),
            sparse=np.asarray(out_sp, dtype=bool),
        )

    def attach(self, ts, documents: Sequence, tokenizer) -> Any:
        """Attach the ∞-gram statistics of every target of ``ts`` (a :class:`memlm.knnlm.evaluate.TokenScores`
        from ``documents``): ``ngram_logprob``, ``ngram_count``, ``ngram_n``, ``ngram_sparse``. The context of a
        target is its document up to it (the ∞-gram never matches across documents), whatever window the LM read
        it in."""
        from memlm.data.windows import tokenize_documents

        if ts.position is None:
            raise MemlmError("this dump has no target positions; rerun memlm eval with this memlm")
        t0 = time.perf_counter()
        chunks = {c.doc_index: c.tokens for c in tokenize_documents(documents, tokenizer)}
        order = np.lexsort((ts.position, ts.doc_index))
        doc_sorted, pos_sorted = ts.doc_index[order], ts.position[order]
        bounds = np.flatnonzero(np.diff(doc_sorted)) + 1
        starts, ends = np.r_[0, bounds], np.r_[bounds, len(order)]
        docs, positions = [], []
        for a, b in zip(starts, ends, strict=True):
            tokens = chunks[int(doc_sorted[a])]
            pos = pos_sorted[a:b]
            if not np.array_equal(tokens[pos], ts.targets[order[a:b]]):
                raise MemlmError("the dump's targets are not these documents' tokens: score the same corpus")
            docs.append(tokens)
            positions.append(pos)
        scores = self.score_documents(docs, positions)
        n = len(ts)
        ts.ngram_logprob = np.empty(n, np.float32)
        ts.ngram_count = np.empty(n, np.int64)
        ts.ngram_n = np.empty(n, np.int32)
        ts.ngram_sparse = np.empty(n, bool)
        ts.ngram_logprob[order], ts.ngram_count[order] = scores.logprob, scores.count
        ts.ngram_n[order], ts.ngram_sparse[order] = scores.n, scores.sparse
        ts.meta.update(**self.describe(), seconds_ngram=time.perf_counter() - t0)
        return ts

    def search(self, contexts: Sequence[Sequence[int]], k: int, max_support: int = 1000) -> Retrieved:
        """The memory protocol: for each context (token ids, EOS = document start), the ``k`` most frequent next
        tokens of its longest matching suffix: ``scores = log cnt(suffix · w)`` (``-inf`` in empty slots),
        ``values = w`` (``-1``), ``ids`` = the effective n of the row (its provenance). With ``k`` at least the
        number of distinct next tokens, softmax(scores) is P∞ exactly; the engine samples the counts of suffixes
        seen more than ``max_support`` times (``approx``), as its ``infgram_ntd`` does."""
        q_n = len(contexts)
        scores = np.full((q_n, k), -np.inf, dtype=np.float32)
        values = np.full((q_n, k), -1, dtype=np.int64)
        ids = np.full((q_n, k), -1, dtype=np.int64)
        cap = None if self.max_n is None else self.max_n - 1
        for i, ctx in enumerate(contexts):
            ctx = [int(t) for t in ctx]
            if self.eos in ctx:
                ctx = ctx[len(ctx) - ctx[::-1].index(self.eos) :]  # the context starts at the last document start
            q = [self.sep, *ctx]
            if cap is not None:
                q = q[max(0, len(q) - cap) :] if cap else []
            r = self.engine.infgram_ntd(q, max_support=max_support)
            if "error" in r:
                raise MemlmError(f"∞-gram query refused by the engine: {r['error']}")
            dist = sorted(r["result_by_token_id"].items(), key=lambda kv: (-kv[1]["cont_cnt"], kv[0]))[:k]
            for j, (tok, rec) in enumerate(dist):
                scores[i, j] = math.log(rec["cont_cnt"])
                values[i, j] = tok
                ids[i, j] = int(r["suffix_len"]) + 1
        return Retrieved(scores, values, ids)


class NgramMemories:
    """Several ∞-gram indexes scored into one dump (``memlm eval --ngram A --ngram B``; e.g. an in-domain corpus and
    all the text a user has), each later mixed with its own weights (:func:`memlm.ngram.mixture.tune_ngrams`).

    :meth:`attach` fills the dump's ``ngram_*`` arrays with the first memory's statistics, exactly as that memory alone
    would, and the ``ngram_extra_*`` arrays with the others' (one column per memory, in order); ``meta["ngrams"]``
    lists every memory's :meth:`NgramMemory.describe`."""

    def __init__(self, memories: Sequence[NgramMemory]) -> None:
        if len(memories) < 2:
            raise MemlmError("NgramMemories takes two or more ∞-gram memories; use NgramMemory for one")
        self.memories = list(memories)

    def describe(self) -> list[dict]:
        return [m.describe() for m in self.memories]

    def attach(self, ts, documents: Sequence, tokenizer) -> Any:
        first, *rest = self.memories
        first.attach(ts, documents, tokenizer)
        seconds = float(ts.meta["seconds_ngram"])
        cols: dict[str, list[np.ndarray]] = {f: [] for f in ("logprob", "count", "n", "sparse")}
        for memory in rest:
            scratch = dataclasses.replace(ts, meta={})  # attach sets new arrays on the copy; ts keeps the first's
            memory.attach(scratch, documents, tokenizer)
            for f, col in cols.items():
                col.append(getattr(scratch, f"ngram_{f}"))
            seconds += float(scratch.meta["seconds_ngram"])
        for f, col in cols.items():
            setattr(ts, f"ngram_extra_{f}", np.stack(col, axis=1))
        ts.meta.update(ngrams=self.describe(), seconds_ngram=seconds)
        return ts
