"""NPM's phrase index: one encoder vector per token of a reference corpus (Min et al. 2023, §3.1).

``c_1 .. c_N = Encoder(c_1 .. c_N)``: every document is tokenized (no special tokens) and cut into *blocks* of at
most ``max_length - 2`` tokens; a block is encoded unmasked as ``[CLS] block [SEP]`` and the vectors of its own tokens
(not CLS/SEP) are stored. A phrase ``c_{i:j}`` is represented by its start and end token vectors, so a span is valid
only inside one block (:meth:`PhraseIndex.same_block`). Rows are in corpus order: block after block, document after
document, so ``token_ids[i : j + 1]`` is the span's token stream.

The folder is :mod:`memlm.storage.folder`'s format, as a datastore's is (the datastore stores next-token *targets* of
causal-LM windows with a key role, which does not fit token vectors of an encoder, so only the folder is shared)::

    manifest.json   format, encoder + tokenizer fingerprints (memlm.storage.datastore.model_identity), dim, count,
                    block_tokens, corpus fingerprint, file checksums, the [MASK_s]/[MASK_e] choice,
                    manifest_sha256
    docs.json       the documents' ids and 64-bit hashes (index = the ``doc`` value below)
    vectors.bin     float16 [count, dim]  token vectors (last hidden states)
    token_ids.bin   int32   [count]       the token stream
    doc.bin         int32   [count]       document index of each token
    position.bin    int32   [count]       position of the token inside its document
    block.bin       int32   [count]       block (encoder input) of each token; blocks are contiguous row ranges
    index.faiss     FAISS index over the vectors (memlm.storage.index.build_index, metric "ip", exact "Flat" up to
                    memlm.storage.index.FLAT_MAX_N vectors), with index.faiss.json beside it

Building is resumable like a datastore's (:class:`memlm.storage.folder.AppendWriter`): after every batch of blocks the
files are flushed and ``progress.json`` is replaced atomically; a rerun of the same call truncates bytes past the
recorded count and continues. ``manifest.json`` is written last (with the files' full and sampled SHA-256 and its own
checksum), so a folder with a manifest and no ``progress.json`` is complete. Opening checks what a datastore's opening
checks (:meth:`memlm.storage.folder.FolderFormat.open_arrays`; folders built before the sampled and manifest checksums
were recorded open without them). A build holds the folder's writer lock (:mod:`memlm.io.locking`); every metadata
file is schema-checked when read (:mod:`memlm.io.schema`), and the index records the identity (count, dim, vectors'
SHA-256) of the phrase index it was built from (checked on load).
"""

from __future__ import annotations

import hashlib
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from memlm import __version__
from memlm.data.windows import doc_hash
from memlm.errors import MemlmError
from memlm.io import schema
from memlm.io.fileio import atomic_write_json
from memlm.npm.encoder import _cls_sep_pad, encode_sequences, max_block_tokens
from memlm.storage.datastore import model_identity
from memlm.storage.folder import FolderFormat
from memlm.storage.index import FLAT_MAX_N, build_index, flat_ip_index, load_index, search

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "CorpusBlock",
    "PhraseIndex",
    "build_phrase_index",
    "corpus_blocks",
    "open_with_encoder",
    "corpus_fingerprint",
]

FORMAT = "memlm-npm-phrase-index"
FORMAT_VERSION = 1
FILES = {"vectors": "float16", "token_ids": "int32", "doc": "int32", "position": "int32", "block": "int32"}
MASK_CHOICE = "[MASK_s] = [MASK_e] = tokenizer.mask_token_id (paper App. A.2)"

#: the phrase index's folder format (:mod:`memlm.storage.folder`, shared with :mod:`memlm.storage.datastore`)
FOLDER = FolderFormat(
    kind="phrase index",
    title="an NPM phrase index",
    arrays=FILES,
    wide="vectors",
    dim_field=("dim",),
    format_version=FORMAT_VERSION,
    manifest_schema=schema.PHRASE_MANIFEST,
    progress_schema=schema.PHRASE_PROGRESS,
    builder="build_phrase_index (`memlm npm index`)",
    fix="rebuild it with `memlm npm index --overwrite` (or delete the folder)",
    progress_fix="delete the folder or rerun with --overwrite",
    resume="rerun build_phrase_index with the same encoder and corpus to resume it",
    verify_command=None,
    format_name=FORMAT,
    extra_files=("docs.json",),
)


@dataclass(frozen=True)
class CorpusBlock:
    """One encoder input: ``tokens`` of document ``doc`` from position ``start`` on."""

    doc: int
    start: int
    tokens: np.ndarray


def _doc_fields(documents: Sequence) -> list[tuple[str, str]]:
    out = []
    for i, d in enumerate(documents):
        if isinstance(d, str):
            out.append((str(i), d))
        elif hasattr(d, "text"):
            out.append((str(getattr(d, "id", i)), str(d.text)))
        else:
            raise MemlmError(f"document {i} must be a string or have .text (and .id), got {type(d).__name__}")
    return out


def corpus_fingerprint(documents: Sequence) -> str:
    """16 hex digits identifying the corpus: its documents' ids and texts, in order."""
    h = hashlib.sha256(b"memlm-npm-corpus-v1\n")
    for doc_id, text in _doc_fields(documents):
        h.update(f"{doc_hash(doc_id, text)}\n".encode())
    return h.hexdigest()[:16]


def corpus_blocks(documents: Sequence, tokenizer, block_tokens: int) -> list[CorpusBlock]:
    """Tokenize ``documents`` (strings, or objects with ``.text``) without special tokens and cut each into blocks of at
    most ``block_tokens`` tokens (empty documents give no block)."""
    if block_tokens < 1:
        raise MemlmError(f"block_tokens must be >= 1, got {block_tokens}")
    fields = _doc_fields(documents)
    blocks: list[CorpusBlock] = []
    for i, (_, text) in enumerate(fields):
        ids = np.asarray(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=np.int64)
        for s in range(0, len(ids), block_tokens):
            blocks.append(CorpusBlock(i, s, ids[s : s + block_tokens]))
    return blocks


@dataclass
class PhraseIndex:
    """An opened phrase index (memory-mapped arrays, the manifest, the documents and, lazily, the FAISS index)."""

    path: Path
    manifest: dict[str, Any]
    vectors: np.ndarray  # [N, D] float16
    token_ids: np.ndarray  # [N] int32
    doc: np.ndarray  # [N] int32
    position: np.ndarray  # [N] int32
    block: np.ndarray  # [N] int32
    doc_ids: list[str]
    _faiss: Any = field(default=None, repr=False)
    _bm25: Any = field(default=None, repr=False)

    def __len__(self) -> int:
        return int(self.manifest["count"])

    @classmethod
    def from_arrays(
        cls,
        vectors: np.ndarray,
        token_ids: Sequence[int],
        block: Sequence[int] | None = None,
        doc: Sequence[int] | None = None,
        position: Sequence[int] | None = None,
        doc_ids: Sequence[str] | None = None,
    ) -> PhraseIndex:
        """An in-memory phrase index over given vectors (exact inner-product search; no folder, no encoder check).

        ``block`` defaults to ``doc`` (one block per document) and ``doc`` to ``block`` (one document per block); with
        neither, everything is one block of one document.
        """
        vec = np.ascontiguousarray(vectors, dtype=np.float32)
        if vec.ndim != 2:
            raise MemlmError(f"vectors must be [N, D], got shape {vec.shape}")
        n, d = vec.shape
        tok = np.asarray(token_ids, dtype=np.int32)
        if doc is None:
            doc = np.zeros(n, dtype=np.int32) if block is None else block
        doc_a = np.asarray(doc, dtype=np.int32)
        blk = doc_a.copy() if block is None else np.asarray(block, dtype=np.int32)
        if position is None:
            position = np.zeros(n, dtype=np.int32)
            for i in range(1, n):
                position[i] = position[i - 1] + 1 if doc_a[i] == doc_a[i - 1] else 0
        pos = np.asarray(position, dtype=np.int32)
        if any(len(a) != n for a in (tok, doc_a, blk, pos)):
            raise MemlmError("token_ids, block, doc and position must have one entry per vector")
        steps = np.diff(blk)
        if n and (blk[0] != 0 or (steps < 0).any() or (steps > 1).any()):
            raise MemlmError("block ids must be 0, 1, 2, ... in row order (blocks are contiguous row ranges)")
        n_docs = int(doc_a.max()) + 1 if n else 0
        ids = [str(i) for i in range(n_docs)] if doc_ids is None else list(doc_ids)
        manifest = {"format": FORMAT, "format_version": FORMAT_VERSION, "count": n, "dim": d,
                    "n_blocks": int(blk.max()) + 1 if n else 0, "encoder": None}  # fmt: skip
        index = flat_ip_index(vec)
        return cls(Path("."), manifest, vec, tok, doc_a, pos, blk, ids, _faiss=index)

    @property
    def dim(self) -> int:
        return int(self.manifest["dim"])

    @property
    def n_blocks(self) -> int:
        return int(self.manifest["n_blocks"])

    @property
    def index_path(self) -> Path:
        return self.path / "index.faiss"

    @classmethod
    def open(cls, path: str | Path, model=None, tokenizer=None, verify: bool = False) -> PhraseIndex:
        """Open a finished phrase index (checked as :meth:`memlm.storage.folder.FolderFormat.open_arrays` says;
        ``verify``: full checksums); with ``model`` and ``tokenizer`` also :meth:`check_encoder`."""
        path = Path(path)
        manifest = FOLDER.read_manifest(path)
        docs = schema.read_json(path / "docs.json", schema.PHRASE_DOCS, "phrase-index document list", FOLDER.fix)
        if len(docs["ids"]) != manifest["corpus"].get("n_docs", len(docs["ids"])):
            raise MemlmError(f"{path / 'docs.json'} lists {len(docs['ids'])} documents, the manifest says "
                             f"{manifest['corpus'].get('n_docs')}; {FOLDER.fix}")  # fmt: skip
        # plain ndarray views of the checked read-only memory maps: still paged in lazily, but slicing them (one
        # span's token ids, thousands of times per query) skips np.memmap's per-slice subclass overhead
        arrays = {name: np.asarray(a) for name, a in FOLDER.open_arrays(path, manifest, verify).items()}
        out = cls(path, manifest, doc_ids=list(docs["ids"]), **arrays)
        if model is not None or tokenizer is not None:
            if model is None or tokenizer is None:
                raise MemlmError("pass both model and tokenizer to check a phrase index's encoder")
            out.check_encoder(model, tokenizer)
        return out

    def check_encoder(self, model, tokenizer) -> None:
        """Refuse an encoder or tokenizer other than the one the index was built with (vectors would not compare)."""
        ident = model_identity(model, tokenizer)
        mine = self.manifest["encoder"]
        if mine is None:
            return  # an in-memory index (from_arrays) records no encoder
        if ident["tokenizer"]["fingerprint"] != mine["tokenizer"]["fingerprint"]:
            raise MemlmError(
                f"phrase index {self.path} was built with a different tokenizer (vocab "
                f"{mine['tokenizer']['vocab_size']} vs {ident['tokenizer']['vocab_size']}): use its encoder "
                f"({mine['model']['name']}) or rebuild the index"
            )
        if ident["model"]["fingerprint"] != mine["model"]["fingerprint"]:
            raise MemlmError(
                f"phrase index {self.path} was built with encoder {mine['model']['name']} "
                f"({mine['model']['fingerprint']}), not this one ({ident['model']['name']}, "
                f"{ident['model']['fingerprint']}): vectors of different encoders are not comparable; use the index's "
                "encoder or build a new phrase index"
            )

    # ------------------------------------------------------------------------------------------- blocks and spans

    def block_bounds(self) -> np.ndarray:
        """``[n_blocks + 1]`` row offsets: block ``b`` is rows ``bounds[b] : bounds[b + 1]``."""
        return np.searchsorted(np.asarray(self.block), np.arange(self.n_blocks + 1), side="left").astype(np.int64)

    def same_block(self, i: int, j: int) -> bool:
        return 0 <= i <= j < len(self) and int(self.block[i]) == int(self.block[j])

    def span_text(self, tokenizer, i: int, j: int) -> str:
        """The text of rows ``i .. j`` (inclusive)."""
        return tokenizer.decode([int(t) for t in self.token_ids[i : j + 1]]).strip()

    def context(self, tokenizer, i: int, j: int, window: int = 32) -> str:
        """The span's block text around it (``window`` tokens each side), the span in ``[[ ]]``."""
        b = int(self.block[i])
        lo, hi = i, j
        while lo > 0 and i - lo < window and int(self.block[lo - 1]) == b:
            lo -= 1
        while hi + 1 < len(self) and hi - j < window and int(self.block[hi + 1]) == b:
            hi += 1

        def dec(a: int, z: int) -> str:
            return tokenizer.decode([int(t) for t in self.token_ids[a:z]]).strip() if z > a else ""

        return " ".join(x for x in (dec(lo, i), f"[[{dec(i, j + 1)}]]", dec(j + 1, hi + 1)) if x)

    def block_text(self, tokenizer, b: int, bounds: np.ndarray | None = None) -> str:
        bounds = self.block_bounds() if bounds is None else bounds
        return tokenizer.decode([int(t) for t in self.token_ids[bounds[b] : bounds[b + 1]]]).strip()

    # ---------------------------------------------------------------------------------------------------- search

    def faiss_index(self):
        if self._faiss is None:
            self._faiss = load_index(self.index_path)
        return self._faiss

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Top-``k`` rows by inner product ``q . c`` (``[Q, k]`` scores and ids; ``-inf`` / ``-1`` when missing)."""
        return search(self.faiss_index(), np.atleast_2d(np.asarray(queries, dtype=np.float32)), k)

    def search_rows(self, queries: np.ndarray, rows: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Exact top-``k`` by inner product among ``rows`` only (e.g. the BM25 passages, §6.3).

        The rows' vectors are read (and cast to float32) once for all queries; each query is scored on its own
        (``[1, D] @ [D, R]``), so a query's result does not depend on the others passed with it."""
        q = np.atleast_2d(np.asarray(queries, dtype=np.float32))
        rows = np.asarray(rows, dtype=np.int64)
        out_s = np.full((q.shape[0], k), -np.inf, dtype=np.float32)
        out_i = np.full((q.shape[0], k), -1, dtype=np.int64)
        if rows.size == 0:
            return out_s, out_i
        mat = np.asarray(self.vectors[rows], dtype=np.float32).T  # [D, R]
        kk = min(k, rows.size)
        for r in range(q.shape[0]):
            scores = q[r : r + 1] @ mat  # [1, R]
            top = np.argsort(-scores, axis=1, kind="stable")[:, :kk]
            out_s[r, :kk] = np.take_along_axis(scores, top, axis=1)[0]
            out_i[r, :kk] = rows[top[0]]
        return out_s, out_i

    def bm25_blocks(self, tokenizer, query: str, n: int = 3) -> list[int]:
        """The ``n`` blocks (passages) that ``bm25s`` ranks highest for ``query`` (§6.3: top-3 passages)."""
        import bm25s

        if self._bm25 is None:
            bounds = self.block_bounds()
            texts = [self.block_text(tokenizer, b, bounds) for b in range(self.n_blocks)]
            retriever = bm25s.BM25()
            retriever.index(bm25s.tokenize(texts, stopwords="en", show_progress=False), show_progress=False)
            self._bm25 = (retriever, bounds)
        retriever, _ = self._bm25
        q = bm25s.tokenize([query], stopwords="en", show_progress=False)
        if not any(len(x) for x in q.ids):
            return []
        kk = min(n, self.n_blocks)
        docs, scores = retriever.retrieve(q, k=kk, show_progress=False)
        return [int(d) for d, s in zip(docs[0], scores[0], strict=True) if s > 0]

    def block_rows(self, blocks: Sequence[int]) -> np.ndarray:
        bounds = self._bm25[1] if self._bm25 is not None else self.block_bounds()
        parts = [np.arange(bounds[b], bounds[b + 1], dtype=np.int64) for b in blocks]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def build_phrase_index(
    model,
    tokenizer,
    documents: Sequence,
    out: str | Path,
    max_length: int | None = None,
    batch_size: int = 16,
    factory: str | None = None,
    source: dict[str, Any] | None = None,
    progress: bool = False,
    overwrite: bool = False,
) -> PhraseIndex:
    """Encode every token of ``documents`` with ``model`` into a phrase index folder ``out`` (module docstring).

    ``max_length``: encoder input length (default: the encoder's maximum, 512 for BERT/MiniLM); blocks hold
    ``max_length - 2`` corpus tokens. ``factory``: FAISS factory string (default ``"Flat"`` up to
    ``memlm.storage.index.FLAT_MAX_N`` vectors, else :func:`memlm.storage.index.default_factory`); the metric is inner
    product. Rerunning after an interruption resumes; a finished index for the same encoder, corpus and factory is
    returned as is; a folder holding an index for another encoder, corpus, block length or factory is refused
    (:class:`MemlmError` naming the differences) unless ``overwrite=True``, which deletes it first. The folder is locked
    while building.
    """
    out = Path(out)
    if batch_size < 1:
        raise MemlmError(f"batch_size must be >= 1, got {batch_size}")
    with FOLDER.writing(out, "build a phrase index", overwrite=overwrite):
        return _build_phrase_index(model, tokenizer, documents, out, max_length, batch_size, factory, source, progress)


def _build_phrase_index(
    model,
    tokenizer,
    documents: Sequence,
    out: Path,
    max_length: int | None,
    batch_size: int,
    factory: str | None,
    source: dict[str, Any] | None,
    progress: bool,
) -> PhraseIndex:
    block_tokens = max_block_tokens(model, tokenizer, max_length)
    cls, sep, pad = _cls_sep_pad(tokenizer)
    ident = model_identity(model, tokenizer)
    fields = _doc_fields(documents)
    corpus_fp = corpus_fingerprint(documents)
    config = {
        "model_fingerprint": ident["model"]["fingerprint"],
        "tokenizer_fingerprint": ident["tokenizer"]["fingerprint"],
        "corpus_fingerprint": corpus_fp,
        "block_tokens": block_tokens,
        "factory": factory,
    }
    manifest_path, progress_path = out / "manifest.json", FOLDER.progress_path(out)
    if progress_path.exists():
        state = FOLDER.read_progress(out)
        if state["config"] != config:
            diff = [f"{k} {v} -> {config.get(k)}" for k, v in state["config"].items() if config.get(k) != v]
            raise MemlmError(
                f"{out} holds an interrupted phrase-index build with other settings ({'; '.join(diff)}); rerun it "
                "with the same encoder, corpus, max_length and factory to resume, use a new --out, or --overwrite"
            )
    elif manifest_path.exists():
        existing = PhraseIndex.open(out)
        m = existing.manifest
        old = {"encoder": m["encoder"]["model"]["fingerprint"], "tokenizer": m["encoder"]["tokenizer"]["fingerprint"],
               "corpus": m["corpus"]["fingerprint"], "block_tokens": m["block_tokens"],
               "factory": m["index"]["factory"]}  # fmt: skip
        new = {"encoder": config["model_fingerprint"], "tokenizer": config["tokenizer_fingerprint"],
               "corpus": corpus_fp, "block_tokens": block_tokens,
               "factory": factory or ("Flat" if m["count"] <= FLAT_MAX_N else "default")}  # fmt: skip
        diff = [f"{k} {v} -> {new[k]}" for k, v in old.items() if new[k] != v]
        if diff:
            raise MemlmError(
                f"{out} already holds a phrase index built with other settings ({'; '.join(diff)}): rerun with the "
                "same settings to reuse it, use a new --out, or --overwrite to replace it"
            )
        if progress:
            print(f"phrase index {out} already built ({len(existing)} vectors); nothing to do", file=sys.stderr)
        return existing
    else:
        state = {"config": config, "blocks_done": 0, "count": 0, "seconds": 0.0}
        FOLDER.start(out, state)

    atomic_write_json(out / "docs.json", {"ids": [i for i, _ in fields], "hashes": [doc_hash(i, t) for i, t in fields]})
    blocks = corpus_blocks(documents, tokenizer, block_tokens)
    if not blocks:
        progress_path.unlink(missing_ok=True)
        raise MemlmError("the corpus has no tokens to index; give it some text")
    dim = int(model.config.hidden_size)
    t0, seconds0 = time.perf_counter(), float(state["seconds"])
    # truncates what was written after the last recorded batch (a crash between data and progress writes)
    with FOLDER.appender(out, dim, state) as writer:
        for s in range(int(state["blocks_done"]), len(blocks), batch_size):
            chunk = blocks[s : s + batch_size]
            hidden = encode_sequences(model, [[cls, *b.tokens.tolist(), sep] for b in chunk], pad, batch_size)
            for b_index, (b, h) in enumerate(zip(chunk, hidden, strict=True), start=s):
                n = len(b.tokens)
                writer.append(vectors=h[1 : 1 + n], token_ids=b.tokens, doc=np.full(n, b.doc),
                              position=np.arange(b.start, b.start + n), block=np.full(n, b_index))  # fmt: skip
            writer.commit(blocks_done=s + len(chunk), seconds=seconds0 + time.perf_counter() - t0)
    count = int(state["count"])
    files = FOLDER.checksums(out)
    vectors = FOLDER.array(out, "vectors", count, dim)
    chosen = factory or ("Flat" if count <= FLAT_MAX_N else None)
    identity = {"kind": "npm-phrase-index", "count": count, "dim": dim, "sha256": files["vectors"]["sha256"]}
    build_index(vectors, out / "index.faiss", factory=chosen, metric="ip", progress=progress, source=identity)
    del vectors
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "memlm_version": __version__,
        "encoder": ident,
        "mask_tokens": MASK_CHOICE,
        "dim": dim,
        "count": count,
        "block_tokens": block_tokens,
        "n_blocks": len(blocks),
        "corpus": {"fingerprint": corpus_fp, "n_docs": len(fields), **dict(source or {})},
        "files": files,
        "index": {"factory": chosen or "default", "metric": "ip"},
        "build_seconds": float(state["seconds"]),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    FOLDER.publish(out, manifest)
    return PhraseIndex.open(out)


def open_with_encoder(
    path: str | Path, encoder: str | None = None, dtype: str = "float32"
) -> tuple[PhraseIndex, Any, Any]:
    """``(phrase index, encoder, tokenizer)``: the index at ``path`` and ``encoder`` (default: the encoder name its
    manifest records), loaded with :func:`memlm.models.resources.load_encoder` and checked with
    :meth:`PhraseIndex.check_encoder`."""
    from memlm.models.resources import load_encoder

    pi = PhraseIndex.open(path)
    encoder = encoder or (pi.manifest.get("encoder") or {}).get("model", {}).get("name")
    if not encoder:
        raise MemlmError(f"phrase index {path} records no encoder name: pass --encoder")
    model, tok = load_encoder(encoder, dtype=dtype)
    pi.check_encoder(model, tok)
    return pi, model, tok
