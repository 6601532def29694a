"""Leakage: a memory (datastore or ∞-gram index) that holds the documents it is evaluated on.

A kNN-LM or an ∞-gram scored on text its memory holds retrieves the very next token and reports a perplexity near 1:
a number that says nothing about the method. ``memlm eval``, ``tune``, ``lm-eval`` and ``generate`` therefore refuse
such a run with one error naming the overlap, unless the user passes ``--allow-overlap`` (then recorded in the result).
What is compared, for every memory and every source it records (``manifest["sources"]``), cheapest first:

1. **named corpus and split** (the manifest only): the evaluated corpus is one of the memory's named corpora and the
   splits meet (the same split, or ``all`` on either side; memlm's splits are document-level, so train never holds a
   test document). The same corpus fingerprint (ids and texts, in order) counts as the same corpus for files too.
2. **document hashes**: a build records the 64-bit hashes of the texts it indexed (:func:`document_record`, sorted,
   in the source record, base64); the evaluated documents' text hashes are looked up in them (ids play no part, so a
   file holding a named corpus's documents is found). Memories built before this record exist are judged by 1 and 3,
   with a note.
3. **near-copies by the 13-gram rule** (Liu et al. 2024, "Infini-gram", App. B, after BFF): an evaluated document is
   a near-copy when at least 80% of its 13-grams occur in the memory. The n-grams are the model's tokens (the memory
   holds token ids, not text), hashed with :mod:`memlm.ngram.decontaminate`'s n-gram hash (``_stream_ngrams``) and
   counted with repeats; a document under 13 tokens has none here (exact copies of it are found by 2). The direction
   is the evaluated document's (its n-grams in the memory), the paper's is the reference document's (its n-grams in
   the evaluation set): a build's ``--decontaminate`` applies the paper's. Looked up cheaply:

   * ∞-gram index: count queries to the engine for up to :data:`NGRAM_SAMPLES` evenly spaced 13-grams per document
     (the share found estimates the share of all of them; a binary search each, no scan);
   * datastore: the 13-grams of the stored next tokens (``values``, the corpus's token stream in row order), one pass
     of 4 bytes per entry; skipped with a note above :data:`SCAN_MAX_ENTRIES` entries (2 still applies).

``memlm tune`` reads dumps: it repeats 1 from the dumps' recorded sources and the memories' manifests, and refuses a
dump whose own check found an overlap that was allowed (:func:`check_dumps`), a ``--test`` dump scored with other
memories or another model than ``--valid``, and a ``--valid`` dump of a test split.
"""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from memlm.errors import MemlmError

__all__ = [
    "NEAR_COPY_N",
    "NEAR_COPY_THRESHOLD",
    "Evaluated",
    "check_leakage",
    "check_dumps",
    "document_record",
    "text_hashes",
]

NEAR_COPY_N = 13  # App. B: n = 13 (BFF's max_ngram_size)
NEAR_COPY_THRESHOLD = 0.8  # App. B: "at least 80% of its n-grams"
NGRAM_SAMPLES = 32  # 13-grams per document queried in an ∞-gram index
SCAN_MAX_ENTRIES = 20_000_000  # a datastore's values are scanned for 13-grams up to this many entries
FIX = (
    "evaluate on text outside the memory (e.g. the test split of a memory built on train), build the memory "
    "without it, or pass --allow-overlap to run anyway (recorded in the result)"
)


def text_hash_each(docs: Sequence) -> np.ndarray:
    """Each document's 64-bit text hash (first 8 bytes of SHA-256 of its stripped text, little-endian), in order."""
    return np.fromiter(
        (
            int.from_bytes(hashlib.sha256(d.text.strip().encode("utf-8", "surrogatepass")).digest()[:8], "little")
            for d in docs
        ),
        dtype=np.uint64,
        count=len(docs),
    )


def text_hashes(docs: Sequence) -> np.ndarray:
    """The sorted distinct text hashes of the documents (:func:`text_hash_each`)."""
    return np.unique(text_hash_each(docs))


def document_record(docs: Sequence) -> dict[str, Any]:
    """What a build records in its source about the documents it indexed: their text hashes (:func:`text_hashes`),
    sorted, as base64 of little-endian uint64 (8 bytes a document)."""
    h = text_hashes(docs)
    return {"rule": "sha256(text.strip())[:8], little-endian uint64, sorted, distinct", "count": int(len(h)),
            "uint64_b64": base64.b64encode(h.astype("<u8").tobytes()).decode("ascii")}  # fmt: skip


def shown_sources(sources: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Sources as ``info`` commands print them: each ``document_hashes`` record as its count and rule, not the
    hashes."""
    out = []
    for s in sources:
        rec = s.get("document_hashes") if isinstance(s, dict) else None
        short = {k: v for k, v in rec.items() if k != "uint64_b64"} if isinstance(rec, dict) else rec
        out.append({**s, "document_hashes": short} if isinstance(rec, dict) else s)
    return out


def _recorded_hashes(source: dict[str, Any]) -> np.ndarray | None:
    rec = source.get("document_hashes")
    if not isinstance(rec, dict) or not isinstance(rec.get("uint64_b64"), str):
        return None
    return np.frombuffer(base64.b64decode(rec["uint64_b64"]), dtype="<u8").astype(np.uint64)


@dataclass
class Evaluated:
    """The documents a command evaluates: ``docs`` (objects with ``.id``, ``.text``), and where they come from
    (``corpus``: a named corpus, a comma-separated list or a path; ``split``; ``fingerprint``), for messages and for
    the comparison with the memory's named sources. ``label`` names them in messages."""

    docs: Sequence
    corpus: str | None = None
    split: str | None = None
    fingerprint: str | None = None
    label: str = ""
    _hashes: np.ndarray | None = field(default=None, repr=False)

    def name(self) -> str:
        return self.label or (f"{self.corpus} ({self.split})" if self.corpus else "the evaluated text")

    def each(self) -> np.ndarray:
        """Each evaluated document's text hash (computed once)."""
        if self._hashes is None:
            self._hashes = text_hash_each(self.docs)
        return self._hashes


# ------------------------------------------------------------------------------------------------ the memories


@dataclass
class _Memory:
    label: str  # "datastore DIR" / "∞-gram index DIR"
    manifest: dict[str, Any]
    values: Any = None  # a datastore's next tokens
    engine: Any = None  # an ∞-gram index's engine (NgramMemory.engine)


def _memories(datastore: Any = None, ngram: Any = None) -> list[_Memory]:
    """The memories of a run: datastores (one or a list; each plain or sharded, or a DatastoreMemory) and ∞-gram
    memories (an NgramMemory, NgramMemories or a list of them)."""
    out = []
    for store in datastore if isinstance(datastore, list | tuple) else [datastore]:
        ds = getattr(store, "datastore", store)
        if ds is not None and getattr(ds, "manifest", None) is not None:
            out.append(_Memory(f"datastore {ds.path}", ds.manifest, values=ds.values))
    memories = getattr(ngram, "memories", ngram if isinstance(ngram, list | tuple) else [ngram] if ngram else [])
    for m in memories:
        out.append(_Memory(f"∞-gram index {m.index.path}", m.index.manifest, engine=m.engine))
    return out


def _names(corpus: str | None) -> list[str]:
    from memlm.data.corpora import CORPORA

    return [c.strip() for c in str(corpus or "").split(",") if c.strip() in CORPORA]


def _splits_meet(a: str | None, b: str | None) -> bool:
    return a == b or "all" in (a, b) or a is None or b is None  # None: all of a named corpus


def source_overlap(evaluated: Evaluated, source: dict[str, Any]) -> list[str]:
    """The reasons (1 of the module docstring) why ``source`` (a memory's recorded source) holds ``evaluated``'s
    corpus: named corpora whose splits meet, or the same fingerprint. Reads no documents."""
    why = []
    if evaluated.fingerprint and evaluated.fingerprint == source.get("fingerprint"):
        why.append(f"the same corpus content (fingerprint {evaluated.fingerprint})")
    shared = [c for c in _names(evaluated.corpus) if c in _names(source.get("corpus"))]
    if shared and _splits_meet(evaluated.split, source.get("split")):
        why.append(f"{', '.join(shared)}: split {evaluated.split} evaluated, split {source.get('split')} in memory")
    return why


def _count_named(evaluated: Evaluated, source: dict[str, Any]) -> int:
    """How many evaluated documents belong to a named corpus split of ``source`` (by id, within that corpus)."""
    from memlm.data.corpora import load_documents

    ids: set[str] = set()
    for c in _names(evaluated.corpus):
        if c in _names(source.get("corpus")):
            ids |= {d.id for d in load_documents(c, source.get("split"))}  # split None or all: every document
    return sum(d.id in ids for d in evaluated.docs)


# ------------------------------------------------------------------------------------------------ near-copies


def token_ngrams(token_lists: Sequence[Sequence[int]], n: int = NEAR_COPY_N) -> tuple[np.ndarray, np.ndarray]:
    """``(hashes, counts)``: every document's ``n``-gram hashes of model token ids (each id one token of the n-gram
    hash of :mod:`memlm.ngram.decontaminate`), grouped by document, and how many each has (none under ``n`` tokens)."""
    from memlm.ngram.decontaminate import _stream_ngrams

    lens = np.fromiter(map(len, token_lists), dtype=np.int64, count=len(token_lists))
    parts = [np.asarray(ts, dtype=np.int64) for ts in token_lists]
    flat = (np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)).astype(np.uint32)
    return _stream_ngrams(flat, np.arange(len(flat), dtype=np.int64), lens, n, n)


def ngrams_in_stream(values: Any, query: np.ndarray, n: int = NEAR_COPY_N) -> np.ndarray:
    """Which of the sorted distinct ``n``-gram hashes ``query`` (:func:`token_ngrams`) occur in the token stream
    ``values`` (a datastore's stored next tokens, in row order), in one pass of chunks; n-grams across a document
    boundary included."""
    from memlm.ngram.decontaminate import _member, _table

    found = np.zeros(len(query), dtype=bool)
    table = _table(query)  # presence bitmaps: most of the stream's n-grams are rejected without a binary search
    total, step = len(values), (1 << 21) - n  # chunks within the hash's cached powers
    for s in range(0, total, step):
        part = np.asarray(values[s : min(total, s + step + n - 1)])
        if len(part) < n:
            break
        h, _ = token_ngrams([part], n)
        found |= _member(query, np.unique(h[_member(h, query, table)]))
    return found


def _near_copies(memory: _Memory, token_lists: list[list[int]]) -> tuple[np.ndarray, str | None]:
    """Per evaluated document, whether the 13-gram rule finds it in ``memory`` (and a note when not checked)."""
    near = np.zeros(len(token_lists), dtype=bool)
    if memory.engine is not None:
        for i, ids in enumerate(token_lists):
            m = len(ids) - NEAR_COPY_N + 1
            if m <= 0:
                continue
            starts = np.unique(np.linspace(0, m - 1, min(m, NGRAM_SAMPLES)).round().astype(np.int64))
            hits = sum(int(memory.engine.count(input_ids=ids[s : s + NEAR_COPY_N])["count"]) > 0 for s in starts)
            near[i] = hits >= NEAR_COPY_THRESHOLD * len(starts)
        return near, None
    if memory.values is None:
        return near, f"{memory.label}: near-copies not looked for (no token stream)"
    if len(memory.values) > SCAN_MAX_ENTRIES:
        return near, (f"{memory.label}: near-copies not looked for ({len(memory.values):,} entries, over the "
                      f"{SCAN_MAX_ENTRIES:,} scanned); exact copies are, by document hashes")  # fmt: skip
    h, counts = token_ngrams(token_lists)
    if not len(h):
        return near, None
    query = np.unique(h)
    found = ngrams_in_stream(memory.values, query)[np.searchsorted(query, h)]
    owner = np.repeat(np.arange(len(token_lists)), counts)
    contained = np.bincount(owner, weights=found, minlength=len(token_lists))
    with np.errstate(invalid="ignore", divide="ignore"):
        near = np.nan_to_num(contained / counts, nan=0.0) >= NEAR_COPY_THRESHOLD
    return near, None


# ------------------------------------------------------------------------------------------------ the check


def find_overlap(evaluated: Evaluated, memories: list[_Memory], tokenizer=None) -> tuple[list[dict], list[str]]:
    """``(overlaps, notes)``: one record per memory that holds evaluated documents (``memory``; ``sources``: the
    named-corpus and fingerprint reasons; ``documents``: how many evaluated documents it holds, by text hash, or for
    a source without hashes by named corpus and split; ``near_copies``: further ones by the 13-gram rule; ``of``: the
    evaluated documents), and notes on what could not be compared."""
    overlaps, notes = [], []
    tokens = None
    for mem in memories:
        sources = [s for s in mem.manifest.get("sources", []) if isinstance(s, dict)]
        reasons, exact, named, unhashed = [], np.zeros(len(evaluated.docs), dtype=bool), 0, 0
        for s in sources:
            why = source_overlap(evaluated, s)
            reasons += why
            recorded = _recorded_hashes(s)
            if recorded is not None:
                hit = np.isin(evaluated.each(), recorded)
                if hit.any():
                    reasons.append(f"{int(hit.sum()):,} by text hash in its source {s.get('corpus')} "
                                   f"(split {s.get('split')})")  # fmt: skip
                exact |= hit
                continue
            unhashed += 1
            if why:
                named = max(named, _count_named(evaluated, s))
        if unhashed:
            notes.append(
                f"{mem.label}: {unhashed} of its {len(sources)} source(s) record no document hashes (built "
                "before memlm recorded them): compared by corpus, split, fingerprint and the 13-gram rule"
            )
        near = np.zeros(len(evaluated.docs), dtype=bool)
        if tokenizer is not None and evaluated.docs:
            if tokens is None:
                ids = tokenizer([d.text for d in evaluated.docs], add_special_tokens=False)["input_ids"]
                tokens = [list(t) for t in ids]
            near, note = _near_copies(mem, tokens)
            if note:
                notes.append(note)
        if reasons or exact.any() or near.any():
            documents = max(int(exact.sum()), named)
            overlaps.append({"memory": mem.label, "sources": reasons, "documents": documents,
                             "near_copies": int((near & ~exact).sum()), "of": len(evaluated.docs)})  # fmt: skip
    return overlaps, notes


def describe_overlap(evaluated: Evaluated, overlaps: list[dict]) -> str:
    """One sentence per memory: which memory holds how many of the evaluated documents, and why."""
    parts = []
    for o in overlaps:
        what = [f"{o['documents']:,} of the {o['of']:,} evaluated documents"] if o["documents"] else []
        if o["near_copies"]:
            noun = "near-copy" if o["near_copies"] == 1 else "near-copies"
            what.append(f"{o['near_copies']:,} {noun} (>= {NEAR_COPY_THRESHOLD:.0%} of their "
                        f"{NEAR_COPY_N}-grams in it)")  # fmt: skip
        why = f" ({'; '.join(o['sources'])})" if o["sources"] else ""
        parts.append(f"{o['memory']} holds {' and '.join(what) or 'the evaluated corpus'}{why}")
    return f"{evaluated.name()} leaks into the memory: " + "; ".join(parts)


def check_leakage(
    evaluated: Evaluated, datastore: Any = None, ngram: Any = None, tokenizer=None, allow_overlap: bool = False
) -> dict[str, Any]:
    """Refuse (one :class:`MemlmError` naming the overlap and the fix) an evaluation whose memories (``datastore``: one
    or a list; ``ngram``) hold the evaluated documents (the module docstring says how that is found), unless
    ``allow_overlap``. Returns the record
    result files keep under ``leakage``: ``allow_overlap``, the ``overlap`` found (empty: none), ``notes``,
    ``memories`` checked. Notes and an allowed overlap are printed on stderr."""
    import sys

    memories = _memories(datastore, ngram)
    overlaps, notes = find_overlap(evaluated, memories, tokenizer) if memories else ([], [])
    if overlaps and not allow_overlap:
        raise MemlmError(f"{describe_overlap(evaluated, overlaps)}: its perplexity would measure recall of stored "
                         f"text; {FIX}")  # fmt: skip
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    if overlaps:
        print(f"warning (--allow-overlap): {describe_overlap(evaluated, overlaps)}", file=sys.stderr)
    return {"allow_overlap": bool(allow_overlap), "overlap": overlaps, "notes": notes,
            "memories": [m.label for m in memories]}  # fmt: skip


# ------------------------------------------------------------------------------------------------ memlm tune's dumps


def dump_memories(meta: dict[str, Any]) -> dict[str, Any]:
    """What a dump was scored with (its ``meta``): the model, the datastore (build id where recorded, path and
    entries) and the ∞-gram indexes (build ids, in order)."""
    described = list((meta.get("components") or {}).values())
    ngrams = [d for d in described if d.get("kind") == "ngram"]
    knn = next((d for d in described if d.get("kind") == "knn"), {})
    out: dict[str, Any] = {"model": meta.get("model")}
    if knn.get("datastore"):
        out["datastore"] = {"build_id": meta.get("datastore_build_id"), "path": knn.get("datastore"),
                            "entries": knn.get("datastore_entries")}  # fmt: skip
    out["ngram"] = [r.get("ngram_build_id") or r.get("ngram") for r in ngrams]
    return out


def _differences(valid: dict[str, Any], test: dict[str, Any]) -> list[str]:
    out = []
    if valid["model"] != test["model"]:
        out.append(f"model {valid['model']} vs {test['model']}")
    a, b = valid.get("datastore"), test.get("datastore")
    if (a is None) != (b is None):
        out.append(f"datastore {a and a['path']} vs {b and b['path']}")
    elif a is not None and b is not None:
        same = a["build_id"] == b["build_id"] if a["build_id"] and b["build_id"] else a["path"] == b["path"]
        if not same or a["entries"] != b["entries"]:
            out.append(f"datastore {a['path']} ({a['entries']} entries, build {a['build_id']}) vs {b['path']} "
                       f"({b['entries']} entries, build {b['build_id']})")  # fmt: skip
    if valid["ngram"] != test["ngram"]:
        out.append(f"∞-gram indexes (build ids) {valid['ngram']} vs {test['ngram']}")
    return out


def _recheck(meta: dict[str, Any]) -> list[dict]:
    """For a dump made before dumps recorded their check: its source against the manifests of the memories it names
    (named corpus, split, fingerprint; no documents are read)."""
    src = meta.get("source") or {}
    ev = Evaluated([], src.get("corpus"), src.get("split"), src.get("fingerprint"))
    described = list((meta.get("components") or {}).values())
    folders = [("datastore" if d.get("kind") == "knn" else "∞-gram index", d.get("datastore") or d.get("ngram"))
               for d in described if d.get("kind") in ("knn", "ngram")]  # fmt: skip
    memories = []
    for kind, folder in folders:
        path = Path(folder) / "manifest.json" if folder else None
        if path is not None and path.is_file():
            try:
                memories.append(_Memory(f"{kind} {folder}", json.loads(path.read_text())))
            except (OSError, ValueError):
                continue
    return find_overlap(ev, memories)[0]


def check_dumps(valid: Any, test: Any = None, names: tuple[str, str] = ("--valid", "--test"),
                allow_overlap: bool = False) -> dict[str, Any]:  # fmt: skip
    """``memlm tune``'s checks of its dumps (objects with ``meta``), before any tuning: ``valid`` is not a test split
    (nor ``all``) of a named corpus; ``test`` was scored with the model and the
    memories of ``valid`` (:func:`dump_memories`); neither holds an overlap of its text with its memories (recorded
    by its ``memlm eval``, else compared from the recorded sources), unless ``allow_overlap``. Returns the record
    for the result's ``leakage``."""
    vsrc = valid.meta.get("source") or {}
    named = bool(_names(vsrc.get("corpus")))
    if named and vsrc.get("split") in ("test", "all"):
        raise MemlmError(
            f"{names[0]} is a dump of {vsrc.get('corpus')}'s {vsrc.get('split')} split: λ and τ tuned "
            f"there are tuned on the test text; tune on a valid dump (memlm eval --split valid --dump)"
        )
    if test is not None:
        diff = _differences(dump_memories(valid.meta), dump_memories(test.meta))
        if diff:
            raise MemlmError(
                f"{names[1]} was scored with other memories or another model than {names[0]} "
                f"({'; '.join(diff)}): parameters tuned for one do not apply to the other; rerun memlm "
                f"eval --dump on the test split with the same --model and --memory options"
            )
    record: dict[str, Any] = {"allow_overlap": bool(allow_overlap)}
    for name, dump in zip(names, (valid, test), strict=True):
        if dump is None:
            continue
        rec = dump.meta.get("leakage")
        overlap = rec.get("overlap", []) if isinstance(rec, dict) else _recheck(dump.meta)
        src = dump.meta.get("source") or {}
        ev = Evaluated(
            [], src.get("corpus"), src.get("split"), label=f"{name} ({src.get('corpus')}, {src.get('split')})"
        )
        if overlap and not allow_overlap:
            raise MemlmError(f"{describe_overlap(ev, overlap)}: {FIX}")
        record[name.lstrip("-")] = {"overlap": overlap, "checked_by": "memlm eval" if isinstance(rec, dict) else
                                    "memlm tune, from the recorded sources (an older dump)"}  # fmt: skip
    return record
