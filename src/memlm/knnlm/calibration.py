"""Self-calibrating memories: a held-out slice of a memory's own corpus fits its mixture with the LM, stored with it.

A kNN-LM's perplexity depends on the interpolation weight λ and the softmax temperature τ of Eq. 2-3 (Khandelwal et al.
2020 tune λ on validation text; Xu et al. 2023, Sec. 3.4, show how much τ matters), an ∞-gram's on λ_sparse /
λ_dense (Liu et al. 2024, Sec. 5). No fixed default suits every memory (on WikiText-2 here the old defaults λ = 0.25,
τ = 1 are 3.5% worse than no datastore, docs/results/knnlm.md). So ``memlm datastore build`` (and ``memlm ngram
build``) holds out a small deterministic slice of its corpus (:func:`holdout_split`: 2% of the tokens, at least
4,096, at most 8,192, never more than 20%; whole documents first, then, for a corpus of one document or a few long
ones, the tails of the longest documents cut at a paragraph, line, sentence or word boundary), builds the memory from
the rest, then scores the slice with the new memory and fits **one** mixture of the LM and the memory on it
(:func:`calibration_fit`, by the one fitter :func:`memlm.mixing.report.fit_table`)::

    P(w | c) = λ_0(c) P_LM(w | c) + λ_1(c) P_mem(w | c),    λ(c) = softmax(W φ(c) + b)

the LM alone, EM's constant weights or the gate, whichever the part of the slice kept apart prefers
(:func:`memlm.core.mixture.fit_guarded`); no grid over the weights. A datastore's τ is the component's own read
setting, searched on a small grid: the constant mixture (EM, cheap) at each τ of
:data:`memlm.core.tuning.DEFAULT_TEMPERATURES` gives the τ of highest likelihood, and the guarded fit is made at it
and its neighbours (:func:`near_temperatures`), keeping the one whose kept part prefers it; k is the run's.

The fit, with what it was measured with (k, search and score mode, nprobe, index file and factory), is the
calibration: ``manifest.json`` → ``calibration.mixture`` (:meth:`memlm.mixing.dump.DumpMixture.to_dict`, read back by
:func:`stored_mixture`). It carries its own summary as the fixed-weight rule (``rule_weights``: the memory's mean
weight on the slice; an ∞-gram's per sparse / dense state, :func:`memlm.mixing.dump.rule_summary`), which is where the
rule's default weights come from wherever the rule is still used (:func:`knn_parameters`,
:func:`ngram_parameters`: the cache beside, several datastores, ``--temperature`` alone, eval's
comparison rows). A calibration recorded by an older memlm (a grid's λ, τ or λ_sparse, λ_dense beside the fit) is
refused with one MemlmError saying how to recalibrate.

The slice is part of the build's settings: a rerun with another ``--holdout`` (or over a datastore built without
one) is refused, never calibrated on text inside the datastore; such a datastore is calibrated on text the user names
(``memlm datastore calibrate DS --corpus FILE``). ``memlm eval``, ``generate``, the lm-eval adapter and the Python API
mix by the stored fit when no weights are given (:mod:`memlm.knnlm.default_mixture`: one memory's fit as it is,
several memories' fits combined and checked on their calibration slices, whose text is kept under
``calibration.slice``). A slice of fewer than 8 documents (a one-file corpus: its tail) is cut into 512-token blocks
that the fit's kept part and its intervals treat as documents (:func:`memlm.core.mixture.token_blocks`).

The slice is in-domain text the memory has not seen, so its fit is a good default for text like the memory's corpus.
For text from another domain, fit on target-domain text instead: ``memlm eval --dump`` on a valid split, then
``memlm tune``.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import hashlib
import json
import math
import re
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from memlm.core.config import RetrievalConfig
from memlm.errors import MemlmError

if TYPE_CHECKING:
    from memlm.mixing.dump import DumpMixture

__all__ = [
    "HOLDOUT_FRACTION",
    "HOLDOUT_MAX_TOKENS",
    "HOLDOUT_MIN_TOKENS",
    "DEFAULT_LAMBDA",
    "DEFAULT_TEMPERATURE",
    "holdout_split",
    "calibrate",
    "calibrate_ngram",
    "calibrate_index_holdout",
    "calibrate_shared",
    "ngram_calibration",
    "near_temperatures",
    "calibration_mismatch",
    "calibration_summary",
    "mixture_summary",
    "report_mixture",
    "has_stored_mixture",
    "stored_mixture",
    "index_identity",
    "slice_record",
    "knn_parameters",
    "datastore_weights",
    "ngram_parameters",
    "calibration_fit",
]

HOLDOUT_FRACTION = 0.02
HOLDOUT_MIN_TOKENS = 4096
#: the slice never holds more tokens than this: it fits a mixture of two components (and τ), and the held-out
#: log-likelihood difference between the LM and a mixture has a per-token standard deviation
#: of 0.4-1.0 nats (docs/results/mixture/stdlib.json), so 8,192 tokens measure a mean difference to a standard error
#: of 0.004-0.011 nats (0.4-1.1% of perplexity), under the differences calibration chooses between; the LM pass over the
#: slice then costs ~1 minute on 2 cores whatever the corpus's size (2% of a 3.16M-token corpus was 68,038 tokens)
HOLDOUT_MAX_TOKENS = 8192
HOLDOUT_MAX_SHARE = 0.2  # the slice never takes more than this share of the corpus's tokens
MIN_TAIL_TOKENS = 16  # a document is not cut for a shorter tail
HOLDOUT_RULE = "whole documents in sha256(id, text) order, then tails of the longest documents cut at a boundary"
DEFAULT_LAMBDA, DEFAULT_TEMPERATURE = 0.25, 1.0  # the fallback when a datastore has no calibration


def _rank(doc) -> str:
    """The order documents are held out in: by a hash of id and text (deterministic, independent of corpus order)."""
    return hashlib.sha256(f"memlm-holdout-v1\n{doc.id}\n{doc.text}".encode("utf-8", "surrogatepass")).hexdigest()


#: where a tail may start, best first: after a blank line, after a line break, after a sentence's end, after a space
_BOUNDARIES = (
    ("paragraph", re.compile(r"\n[ \t]*\n\s*")),
    ("line", re.compile(r"\n\s*")),
    ("sentence", re.compile(r"[.!?][\"'\u201d\u2019)\]]*\s+")),
    ("word", re.compile(r"\s+")),
)


def _with_text(doc, doc_id: str, text: str, meta: dict[str, Any]):
    """A copy of ``doc`` with another id, text and meta (dataclasses such as :class:`memlm.data.corpora.Document`)."""
    if dataclasses.is_dataclass(doc):
        fields = {f.name for f in dataclasses.fields(doc)}
        return dataclasses.replace(doc, id=doc_id, text=text, **({"meta": meta} if "meta" in fields else {}))
    out = copy.copy(doc)
    out.id, out.text = doc_id, text
    return out


def _cut_tail(text: str, n_tokens: int, goal: int, most: int, must_reach: bool, tokenizer) -> tuple[int, int, str]:
    """``(p, tokens, boundary)``: the tail ``text[p:]`` holds ``tokens`` tokens, in ``[goal, most]`` when it can
    (``must_reach``: at least ``goal``; else at most ``most`` and as close to ``goal`` as a boundary allows), and
    starts at the best boundary (:data:`_BOUNDARIES`) near the position that gives ``goal`` tokens."""

    def count(p: int) -> int:
        return len(tokenizer(text[p:], add_special_tokens=False)["input_ids"])

    cpt = len(text) / max(n_tokens, 1)  # characters per token
    p0 = max(1, len(text) - int(goal * cpt))
    for _ in range(8):  # the character position whose tail holds about ``goal`` tokens
        c = count(p0)
        if goal <= c <= goal + max(4, goal // 100):
            break
        step = int((goal - c) * cpt * (1.05 if c < goal else 0.95)) or (1 if c < goal else -1)
        p0 = min(max(1, p0 - step), len(text) - 1)
    back = int(min(most - goal, goal // 4) * cpt)  # earlier starts give more tokens, up to ``most``
    fwd = 0 if must_reach else int(goal // 4 * cpt)
    lo, hi = max(1, p0 - back), min(len(text) - 1, p0 + fwd)
    for name, pattern in _BOUNDARIES:
        starts = [m.end() for m in pattern.finditer(text, max(0, lo - 8), hi + 1) if lo <= m.end() <= hi]
        for p in sorted(starts, key=lambda s: (abs(s - p0), s)):  # the nearest first, then the earlier
            c = count(p)
            if c <= most and (c >= goal or not must_reach):
                return p, c, name
    c = count(p0)
    while must_reach and c < goal and p0 > 1:  # no boundary fits: cut inside a word, still reaching the goal
        p0 = max(1, p0 - max(1, int((goal - c) * cpt)))
        c = count(p0)
    return p0, c, "none"


def holdout_split(
    documents: Sequence,
    tokenizer,
    fraction: float = HOLDOUT_FRACTION,
    min_tokens: int = HOLDOUT_MIN_TOKENS,
    window: int | None = None,
    stride: int | None = None,
    block_start: str = "skip",
    max_tokens: int = HOLDOUT_MAX_TOKENS,
) -> tuple[list, list, dict[str, Any]]:
    """``(kept, held_out, info)``: documents for the datastore, text for calibration, and what was held out.

    The slice's goal is ``max(fraction * T, min_tokens)`` scored tokens, ``T`` the corpus's tokens, at most
    ``max_tokens`` (:data:`HOLDOUT_MAX_TOKENS`; or ``min_tokens`` when larger) and never more than
    ``HOLDOUT_MAX_SHARE * T`` (so a corpus under ``min_tokens / HOLDOUT_MAX_SHARE`` tokens holds out that share,
    fewer than ``min_tokens``; ``info["short_of_minimum"]`` then says so). The rule (:data:`HOLDOUT_RULE`):

    1. whole documents, in the order of :func:`_rank`, while they fit under the cap and leave one document;
    2. if the slice is still short of its goal (a corpus of one document, or of a few long ones), the tails of the
       longest remaining documents (ties in :func:`_rank` order), at most half of each: a document is cut where a
       paragraph starts (else a line, a sentence, a word) near the point that completes the goal; its head stays in
       the datastore (same id), its tail is held out (id ``ID#tail``).

    "Scored tokens" are counted as the calibration scores them: the documents' tokens with an EOS after each, less
    the first token of the stream (``window``/``stride``/``block_start`` as the build's; non-overlapping blocks skip
    each block's first token). ``kept`` keeps the corpus order. ``fraction = 0`` (or no documents) holds nothing out
    (``info["documents"] == 0``, ``info["reason"]`` says why). The same documents always give the same split, so an
    interrupted build resumes; ``info["ids_sha256"]`` identifies the slice (documents and cut points).
    """
    if not 0.0 <= fraction < 1.0:
        raise MemlmError(f"--holdout must be in [0, 1), got {fraction}")
    docs = list(documents)
    info: dict[str, Any] = {"fraction": fraction, "min_tokens": min_tokens, "rule": HOLDOUT_RULE}
    if max_tokens != HOLDOUT_MAX_TOKENS:
        info["max_tokens"] = max_tokens
    if fraction == 0 or not docs:
        reason = "--holdout 0" if fraction == 0 else "no documents"
        return docs, [], {**info, "documents": 0, "tokens": 0, "reason": reason}
    lengths = [len(ids) for ids in tokenizer([d.text for d in docs], add_special_tokens=False)["input_ids"]]
    total = sum(lengths)
    want, cap = min(max(fraction * total, min_tokens), max(max_tokens, min_tokens)), HOLDOUT_MAX_SHARE * total
    scored = functools.partial(_scored_targets, window=window, stride=stride, block_start=block_start)
    chosen, taken = _whole_documents(docs, lengths, want, cap)  # taken: text tokens held out (no EOS)
    # 2. tails of the longest remaining documents
    pieces = len(chosen)
    cuts: dict[int, dict[str, Any]] = {}
    for i in sorted(set(range(len(docs))) - chosen, key=lambda i: (-lengths[i], _rank(docs[i]))):
        if scored(taken + pieces) >= want or taken >= cap:
            break
        need = max(1, int(math.ceil(want)) - scored(taken + pieces + 1))  # text tokens that complete the goal
        while scored(taken + pieces + 1 + need) < want:
            need += max(1, int(want) - scored(taken + pieces + 1 + need))
        most = min(int(cap - taken), lengths[i] // 2)
        if most < MIN_TAIL_TOKENS:
            continue  # too short a tail to be worth a cut
        goal = min(need, most)
        p, n, boundary = _cut_tail(docs[i].text, lengths[i], goal, most, goal == need, tokenizer)
        if not 0 < n <= most or not docs[i].text[:p].strip():
            continue
        cuts[i] = {"of": docs[i].id, "from_char": p, "tokens": n, "boundary": boundary}
        taken += n
        pieces += 1
    if not pieces:
        reason = "fewer than two documents" if len(docs) < 2 else "every document is over the slice's cap"
        return docs, [], {**info, "documents": 0, "tokens": 0, "reason": reason}
    kept, held, ids_sha256 = _apply_cuts(docs, chosen, cuts)
    tokens = scored(taken + pieces)
    out = {**info, "documents": len(held), "whole_documents": len(chosen), "tails": list(cuts.values()),
           "tokens": tokens, "text_tokens": taken, "corpus_tokens": total, "ids_sha256": ids_sha256}  # fmt: skip
    if tokens < want:
        out["short_of_minimum"] = (
            f"{tokens:,} held-out tokens, under the goal of {int(want):,}: the slice is capped at "
            f"{HOLDOUT_MAX_SHARE:.0%} of this corpus's {total:,} tokens"
        )
    return kept, held, out


def _scored_targets(stream: int, window: int | None, stride: int | None, block_start: str) -> int:
    """The targets scored in a stream of ``stream`` tokens (as :func:`memlm.data.windows.count_targets` counts them):
    every token but the first, or with non-overlapping blocks every token but each block's first (``block_start``
    ``"skip"``) or all of them (``"bos"``)."""
    if window is not None and stride == window:
        return stream if block_start == "bos" else stream - -(-stream // window)
    return max(stream - 1, 0)


def _whole_documents(docs: list, lengths: list[int], want: float, cap: float) -> tuple[set[int], int]:
    """Step 1 of :func:`holdout_split` (unchanged since the first ``--holdout``: the same slice whenever it reaches the
    goal): whole documents in :func:`_rank` order while the slice is short of ``want`` tokens, each under ``cap``
    with the others, leaving one document; ``(their indices, their tokens)``."""
    chosen: set[int] = set()
    taken = 0
    for i in sorted(range(len(docs)), key=lambda i: _rank(docs[i])):
        if taken >= want or len(chosen) == len(docs) - 1:
            break
        if taken + lengths[i] > cap:
            continue  # too long for the slice: try a shorter one
        chosen.add(i)
        taken += lengths[i]
    return chosen, taken


def _apply_cuts(docs: list, chosen: set[int], cuts: dict[int, dict[str, Any]]) -> tuple[list, list, str]:
    """``(kept, held_out, ids_sha256)`` of :func:`holdout_split`: the ``chosen`` documents held out whole, each cut
    document's head kept (same id) and its tail held out (``ID#tail``), the rest kept in corpus order; the hash of the
    held-out ids and the cut points identifies the slice (a slice without tails hashes its ids alone)."""
    kept, held, tails = [], [], []
    for i, d in enumerate(docs):
        if i in chosen:
            held.append(d)
        elif i in cuts:
            p, meta = cuts[i]["from_char"], dict(getattr(d, "meta", None) or {})
            kept.append(_with_text(d, d.id, d.text[:p].rstrip(), {**meta, "holdout_tail_from_char": p}))
            tails.append(_with_text(d, f"{d.id}#tail", d.text[p:], {**meta, "holdout_tail_of": d.id, "from_char": p}))
        else:
            kept.append(d)
    key = "\n".join(sorted(d.id for d in held))
    if cuts:
        key += "".join(f"\n{c['of']}@{c['from_char']}" for c in sorted(cuts.values(), key=lambda c: c["of"]))
    return kept, held + tails, hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()[:16]


SLICE_MAX_CHARACTERS = 400_000  # a calibration keeps its text up to this size (a named corpus may be larger)


def slice_record(held_out: Sequence) -> dict[str, Any]:
    """``{"slice": [{"id", "text"}, ...]}``: the text a calibration scored, kept with it so that a later run over
    several memories can score each memory's slice with all of them (:mod:`memlm.knnlm.default_mixture`'s guard);
    empty when the text is over :data:`SLICE_MAX_CHARACTERS`."""
    docs = [{"id": str(d.id), "text": d.text} for d in held_out]
    return {"slice": docs} if sum(len(d["text"]) for d in docs) <= SLICE_MAX_CHARACTERS else {}


def index_identity(datastore, index_path: str | Path | None = None) -> dict[str, Any] | None:
    """What identifies the index a datastore is searched with: its file (a name inside the datastore's folder, else
    the path), factory, metric and sampled checksum (from the sidecar ``index.faiss.json``); ``None`` if it has none."""
    path = Path(index_path) if index_path is not None else Path(datastore.index_path)
    try:
        meta = json.loads((path.parent / f"{path.name}.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(meta, dict):
        return None
    inside = path.resolve().parent == Path(datastore.path).resolve()
    return {
        "file": path.name if inside else str(path.resolve()),
        "factory": meta.get("factory"),
        "metric": meta.get("metric"),
        "sample_sha256": (meta.get("file") or {}).get("sample_sha256") if isinstance(meta.get("file"), dict) else None,
    }


def near_temperatures(grid, best: float) -> list[float]:
    """The constant mixture's most likely τ and its neighbours in ``grid`` (up to 3 values): where the guarded mixture
    searches τ at calibration (:func:`calibration_fit`). One guarded fit costs seconds per τ on 8k tokens with
    k = 1024 (an L-BFGS gate fit and the kNN features at that τ), so the 14 τ of the whole grid would make the fit the
    slowest part of a build, where calibration should cost little. In docs/results/mixture.md the gate's τ was next
    to the rule's in the fits made on enough text (τ 2-3 where the rule chose 2-3), and far from it only in fits
    under the guard's minimum size (τ 5-10 on 4 valid articles where the rule chose 2), so the neighbours are where a
    fit worth storing looks."""
    grid = sorted(float(t) for t in grid)
    i = min(range(len(grid)), key=lambda j: abs(grid[j] - float(best)))
    return grid[max(0, i - 1) : i + 2]


def calibration_fit(ts, k: int | None = None) -> DumpMixture:
    """The one mixture a calibration stores (module docstring): the guarded fit of the LM and the memories of
    ``ts`` (:func:`memlm.mixing.report.fit_table`), a datastore's τ searched at the τ where EM's constant mixture is
    most likely on ``ts`` and that τ's neighbours in :data:`memlm.core.tuning.DEFAULT_TEMPERATURES`."""
    from memlm.core.tuning import DEFAULT_TEMPERATURES
    from memlm.mixing.report import fit_table

    taus: Sequence[float] = (1.0,)
    if ts.names("knn"):
        tau = fit_table(ts, "constant", DEFAULT_TEMPERATURES, k).temperature
        taus = near_temperatures(DEFAULT_TEMPERATURES, float(tau))
    return fit_table(ts, "guarded", taus, k)


def calibrate(
    model,
    tokenizer,
    datastore,
    held_out: Sequence,
    config: RetrievalConfig | None = None,
    *,
    batch_size: int = 4,
    progress: bool = True,
    text: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Score ``held_out`` with ``datastore`` (one forward pass) and fit the one mixture of the LM and the datastore
    on it (:func:`calibration_fit`).

    The slice is read with the datastore's own windows (``window``, ``stride``); the datastore's index (or exact
    search when it has none) gives ``config.k`` neighbours per token, at ``config.nprobe`` (default
    :class:`~memlm.core.config.RetrievalConfig`: k = 1024, nprobe = 32). Text whose documents are in the datastore
    (same id and text) is refused. Returns the record stored under ``calibration``: the fit (``mixture``:
    :meth:`DumpMixture.to_dict`, read back by :func:`stored_mixture`), the held-out perplexities of the LM and of the
    fit, and what they were measured with (``k``, ``search``, ``scores``, ``nprobe``, ``index``: file, factory,
    metric, checksum; ``text``: the held-out slice or the corpus a user named).
    """
    if not held_out:
        raise MemlmError("nothing to calibrate on: the held-out slice is empty")
    _refuse_inside(datastore, held_out)
    t0 = time.perf_counter()
    config = config or RetrievalConfig()
    ts = _score_slice(model, tokenizer, datastore, held_out, config, batch_size, progress)
    return {**knn_calibration(ts, datastore, config.nprobe, text), "seconds": time.perf_counter() - t0,
            **slice_record(held_out)}  # fmt: skip


def _refuse_inside(datastore, held_out: Sequence) -> None:
    """One MemlmError when documents of ``held_out`` are in ``datastore`` (same id and text)."""
    import numpy as np

    from memlm.data.windows import doc_hash

    inside = np.isin(np.asarray([doc_hash(d.id, d.text) for d in held_out], dtype=np.int64),
                     np.asarray(datastore.doc_hash[:]))  # fmt: skip
    if inside.any():
        raise MemlmError(
            f"{int(inside.sum())} of the {len(held_out)} documents to calibrate on are in datastore "
            f"{datastore.path} (same id and text): calibrate on text outside it"
        )


def _score_slice(model, tokenizer, datastore, held_out: Sequence, config: RetrievalConfig, batch_size: int,
                 progress: bool, ngram=None):  # fmt: skip
    """One forward pass over ``held_out`` in the datastore's own windows, its ``config.k`` neighbours per token (its
    index, or exact search when it has none) and, with ``ngram``, that ∞-gram memory's statistics: a
    :class:`~memlm.knnlm.table.TokenTable` whose ``meta["search"]`` says how it searched."""
    from memlm.knnlm.evaluate import add_memory, add_neighbours, lm_scores

    m = datastore.manifest
    window = int(m["window"])
    stride = int(m.get("stride", window - int(m["min_context"])))
    ts, queries, _ = lm_scores(model, tokenizer, held_out, [datastore.key_spec], window=window, stride=stride,
                               block_start=m.get("block_start", "skip"), batch_size=batch_size,
                               progress=progress)  # fmt: skip
    problem = getattr(datastore, "index_problem", None)  # a sharded datastore's index is checked when opened
    search = "index" if problem is None or problem() is None else "exact"
    k = min(config.k, len(datastore))
    add_neighbours(ts, queries[datastore.key_spec], datastore, k=k, search=search, nprobe=config.nprobe,
                   progress=progress)  # fmt: skip
    if ngram is not None:
        add_memory(ts, ngram, held_out, tokenizer)
    ts.meta.update(search=search, window=window, stride=stride, k=k)
    return ts


def knn_calibration(ts, datastore, nprobe: int = 32, text: dict[str, Any] | None = None) -> dict[str, Any]:
    """The calibration record of ``datastore`` from its slice's scores ``ts`` (:func:`_score_slice`; the ∞-gram's
    columns, if any, are left out): the one fit (:func:`calibration_fit`) and what it was measured with."""
    ts = ts.select(ts.names("knn"))
    k, search = int(ts.meta["k"]), ts.meta["search"]
    return {
        **_fit_record(ts, calibration_fit(ts, k)),
        "k": k,
        "nprobe": int(nprobe),
        "search": search,
        "scores": "index",
        "index": index_identity(datastore) if search == "index" else None,
        "window": int(ts.meta["window"]),
        "stride": int(ts.meta["stride"]),
        "count": len(datastore),
        **({"text": text} if text is not None else {}),
    }


def _fit_record(ts, fit: DumpMixture) -> dict[str, Any]:
    """``tokens``, ``base_ppl`` (the LM) and ``mixture_ppl`` (the fit) on the slice, and the fit itself."""
    from memlm.core.distribution import perplexity

    return {"tokens": len(ts), "base_ppl": perplexity(ts.logprob("lm")),
            "mixture_ppl": perplexity(fit.logprob(ts, "the calibration slice")), "mixture": fit.to_dict()}  # fmt: skip


def calibrate_shared(
    model,
    tokenizer,
    memories: Sequence,
    held_out: Sequence,
    config: RetrievalConfig | None = None,
    *,
    batch_size: int = 4,
    progress: bool = True,
    text: dict[str, Any] | None = None,
) -> tuple[dict[str, Any], dict[str, Any], Any]:
    """``(datastore's record, ∞-gram's record, the slice's scores)``: the calibrations of a datastore and an ∞-gram
    index (``memories = (datastore, ngram)``, ``ngram`` an :class:`~memlm.ngram.memory.NgramMemory`) that both held
    out the same slice ``held_out``, from
    one forward pass over it (:func:`_score_slice`, the datastore's windows) instead of one each. Each record is the
    one :func:`calibrate` / :func:`calibrate_ngram` would store; the scores hold the LM, the neighbours and the
    ∞-gram on the slice, what :func:`memlm.knnlm.default_mixture.choose` scores to check the two fits' combination."""
    datastore, ngram = memories
    if not held_out:
        raise MemlmError("nothing to calibrate on: the held-out slice is empty")
    _refuse_inside(datastore, held_out)
    t0 = time.perf_counter()
    config = config or RetrievalConfig()
    ts = _score_slice(model, tokenizer, datastore, held_out, config, batch_size, progress, ngram=ngram)
    knn = {**knn_calibration(ts, datastore, config.nprobe, text), "seconds": time.perf_counter() - t0}
    t1 = time.perf_counter()
    grams = {**ngram_calibration(ts), "window": int(ts.meta["window"]), "stride": int(ts.meta["stride"]),
             "seconds": time.perf_counter() - t1}  # fmt: skip
    shared = slice_record(held_out)
    return {**knn, **shared}, {**grams, **shared}, ts


def calibration_mismatch(datastore, calibration: dict[str, Any], setting: dict[str, Any]) -> list[str]:
    """How ``setting`` (``k``, ``search``, ``scores``, ``nprobe``, ``index``: the index file searched, or ``None``)
    differs from what ``calibration`` was measured with; empty when the same (or unknown: older records)."""
    out = []
    if "k" in setting and "k" in calibration:
        k = min(int(setting["k"]), len(datastore))
        if k != int(calibration["k"]):
            out.append(f"k={k} (calibrated with k={calibration['k']})")
    for name in ("search", "scores"):
        if setting.get(name) is not None and calibration.get(name) is not None and setting[name] != calibration[name]:
            out.append(f"--{name} {setting[name]} (calibrated with {calibration[name]})")
    if setting.get("search", "index") == "index" and calibration.get("search") == "index" and "index" in calibration:
        was, now = calibration.get("index") or {}, index_identity(datastore, setting.get("index")) or {}
        if was.get("file") != now.get("file") or was.get("factory") != now.get("factory"):
            out.append(f"index {now.get('file')} ({now.get('factory')}) (calibrated on {was.get('file')} "
                       f"({was.get('factory')}))")  # fmt: skip
        elif was.get("sample_sha256") != now.get("sample_sha256"):
            out.append(f"index {now.get('file')} rebuilt since the calibration")
        elif (
            "IVF" in str(now.get("factory"))
            and setting.get("nprobe") is not None
            and int(setting["nprobe"]) != int(calibration.get("nprobe", setting["nprobe"]))
        ):
            out.append(f"nprobe={setting['nprobe']} (calibrated with nprobe={calibration['nprobe']})")
    return out


def knn_parameters(
    datastore,
    lam: float | None = None,
    temperature: float | None = None,
    announce: bool = True,
    setting: dict[str, Any] | None = None,
) -> tuple[float, float, str]:
    """``(λ, τ, origin)``: the values given, else the datastore's calibrated ones, else λ = 0.25, τ = 1.

    A value given explicitly always wins. ``origin`` says where the values came from (printed on stderr when
    ``announce``): the command line, the datastore's calibration (held-out tokens, corpus, file), or the fallback.
    ``setting`` (``k``, ``search``, ``scores``, ``nprobe``, ``index``) describes the run: when calibrated values are
    used with another setting than they were measured with (:func:`calibration_mismatch`), one notice says so.
    """
    datastore = getattr(datastore, "datastore", datastore)  # a DatastoreMemory: its datastore's calibration
    cal = _current_calibration(datastore, counted=True) if datastore is not None else None
    missing = [n for n, v in (("λ", lam), ("τ", temperature)) if v is None]
    notice = None
    if not missing:
        origin = "given"
    elif cal is not None:
        fit = _read_fit(datastore, "knn", cal["mixture"])
        lam = float(fit.rule_weights["knn"]) if lam is None else lam
        temperature = float(fit.temperature) if temperature is None else temperature  # type: ignore[arg-type]
        origin = f"{calibrated_on(cal, fit)}, recorded in {datastore.path}/manifest.json"
        differs = calibration_mismatch(datastore, cal, setting or {})
        if differs:
            notice = (
                f"note: this run uses {', '.join(differs)}: the calibrated mixture may not be the best for it; fit "
                f"for this setting with `memlm datastore calibrate {datastore.path} --corpus FILE` (text outside the "
                "datastore) or `memlm eval --dump` + `memlm tune`, or give --lambda/--temperature"
            )
    else:
        lam = DEFAULT_LAMBDA if lam is None else lam
        temperature = DEFAULT_TEMPERATURE if temperature is None else temperature
        origin = (
            "memlm's fallback defaults (this datastore records no calibration: calibrate it on text outside it with "
            "`memlm datastore calibrate DS --corpus FILE`, or fit on your own valid text with `memlm eval --dump` + "
            "`memlm tune`)"
        )
    if announce and datastore is not None:
        which = f" ({missing[0]} from there)" if len(missing) == 1 else ""
        print(f"kNN-LM parameters: λ={lam:g}, τ={temperature:g}: {origin}{which}", file=sys.stderr, flush=True)
        if notice:
            print(notice, file=sys.stderr, flush=True)
    return float(lam), float(temperature), origin


def calibrated_on(cal: dict[str, Any], fit: DumpMixture) -> str:
    """Where a calibration's rule weights come from, for the line that announces them: the fit, its form, its
    slice and the held-out perplexities of the LM and of the fit."""
    text = cal.get("text") or {}
    what = (f"{cal['tokens']:,} tokens of {text.get('corpus')} (named with memlm datastore calibrate)"
            if text.get("named") else f"{cal['tokens']:,} held-out tokens of its corpus")  # fmt: skip
    knn = f", τ={fit.temperature:g}, k={fit.k}" if fit.temperature is not None else ""
    return (f"the mean weights of the {fit.fit.form} mixture fitted at calibration on {what} (held-out ppl "
            f"{cal['base_ppl']:.3f} -> {cal['mixture_ppl']:.3f}{knn})")  # fmt: skip


#: fields of a calibration recorded by an older memlm: the grid's weights stored beside the fitted mixture
OLD_FIELDS = ("lambda", "temperature", "lambda_sparse", "lambda_dense", "grid")


def ngram_parameters(
    index, lambda_sparse: float | None = None, lambda_dense: float | None = None, announce: bool = True
) -> tuple[float, float, str]:
    """``(λ_sparse, λ_dense, origin)``: the values given, else the summary of the mixture stored with the index's
    calibration (its mean weight where P∞ is sparse and where it is not, :func:`memlm.mixing.dump.rule_summary`), else
    the fallback (:data:`DEFAULT_LAMBDA_SPARSE`, :data:`DEFAULT_LAMBDA_DENSE`)."""
    from memlm.ngram.mixture import DEFAULT_LAMBDA_DENSE, DEFAULT_LAMBDA_SPARSE

    fit = None if lambda_sparse is not None and lambda_dense is not None else stored_mixture(index)
    if fit is None and lambda_sparse is not None and lambda_dense is not None:
        origin = "given"
    elif fit is not None:
        ws, wd = fit.rule_weights["ngram"]
        lambda_sparse = float(ws) if lambda_sparse is None else lambda_sparse
        lambda_dense = float(wd) if lambda_dense is None else lambda_dense
        cal = index.manifest["calibration"]
        origin = f"{calibrated_on(cal, fit)}, recorded in {index.path}/manifest.json"
    else:
        lambda_sparse = DEFAULT_LAMBDA_SPARSE if lambda_sparse is None else lambda_sparse
        lambda_dense = DEFAULT_LAMBDA_DENSE if lambda_dense is None else lambda_dense
        origin = (
            "memlm's fallback defaults (the index records no calibration: fit on your valid text with "
            "`memlm eval --memory DIR --dump` + `memlm tune`)"
        )
    if announce:
        print(f"∞-gram parameters: λ_sparse={lambda_sparse:g}, λ_dense={lambda_dense:g}: {origin}", file=sys.stderr)
    return float(lambda_sparse), float(lambda_dense), origin


def datastore_weights(
    stores: Sequence,
    lam: float | None = None,
    temperature: float | None = None,
    cache_lambda: float = 0.0,
    setting: dict[str, Any] | None = None,
) -> list[tuple[float, float, str]]:
    """Each datastore's ``(λ, τ, origin)`` in the fixed-weight rule of a run (:func:`knn_parameters`: as given, else
    its stored fit's mean weight and τ), beside the cache's ``cache_lambda``. Several datastores whose λ's and the
    cache's sum to 1 or more are one MemlmError (the LM would keep no weight). One datastore whose λ was not given and
    leaves the cache less than its weight: λ lowered to ``1 - cache_lambda`` (its fit was made without the cache),
    said on stderr."""
    weights = [knn_parameters(store, lam, temperature, setting=setting) for store in stores]
    total = sum(w[0] for w in weights) + cache_lambda
    if len(weights) > 1 and total >= 1.0:
        given = ", ".join(f"{w[0]:g}" for w in weights)
        raise MemlmError(f"the datastores' λ's ({given}) and the cache's sum to {total:g}: the LM would keep no "
                         "weight; give a smaller --lambda (each datastore's)")  # fmt: skip
    if len(weights) == 1 and cache_lambda and lam is None and total > 1:
        weights[0] = (1.0 - cache_lambda, *weights[0][1:])
        print(f"λ lowered to {weights[0][0]:g} so that λ + --cache-lambda <= 1", file=sys.stderr)
    return weights


def _current_calibration(owner, counted: bool) -> dict[str, Any] | None:
    """The calibration ``owner``'s manifest records, or None; ``counted`` (a datastore): None too when it was
    recorded for another version of the datastore (another entry count, e.g. before an ``--append``). A record of an
    older memlm (:data:`OLD_FIELDS`, or a fit without its rule summary) is one MemlmError saying to recalibrate."""
    cal = (getattr(owner, "manifest", None) or {}).get("calibration")
    if cal is None:
        return None
    old = [f for f in OLD_FIELDS if f in cal]
    if old or not isinstance((cal.get("mixture") or {}).get("rule_weights"), dict):
        kind = "knn" if hasattr(owner, "key_spec") else "ngram"
        stored = f"the weights {', '.join(old)} beside its mixture" if old else "no fitted mixture with rule weights"
        raise MemlmError(f"{_record_file(owner)}: its calibration was written by an older memlm ({stored}; a "
                         f"calibration now stores one fitted mixture); {_recalibrate_hint(owner, kind)}")  # fmt: skip
    if counted and int(cal.get("count", -1)) != len(owner):
        return None
    return cal


def _record_file(owner) -> Path:
    return Path(owner.path) / ("shards.json" if hasattr(owner, "shards") else "manifest.json")


def _calibrated(memory) -> tuple[Any, str]:
    """``(owner, kind)``: the datastore (plain or sharded) or ∞-gram index whose manifest holds ``memory``'s
    calibration (a :class:`~memlm.retrieval.DatastoreMemory`'s datastore, an :class:`~memlm.ngram.memory.NgramMemory`'s
    index, or the object itself) and its mixture component (``knn`` or ``ngram``)."""
    owner = memory
    for inner in ("datastore", "index"):
        if not hasattr(owner, "manifest"):
            owner = getattr(memory, inner, None)
    if not hasattr(owner, "manifest"):
        raise MemlmError(f"{type(memory).__name__} records no calibration: give a datastore, an ∞-gram index or a "
                         "memory over one (DatastoreMemory, NgramMemory)")  # fmt: skip
    return owner, "knn" if hasattr(owner, "key_spec") else "ngram"  # a datastore's keys; an index has none


def _recalibrate_hint(owner, kind: str) -> str:
    if kind == "ngram":
        return f"recalibrate it: rerun the `memlm ngram build` command that built {owner.path}"
    return (
        f"recalibrate it: rerun the `memlm datastore build` command that built {owner.path} (a build with a "
        f"held-out slice), or `memlm datastore calibrate {owner.path} --corpus FILE` on text outside it"
    )


def _read_fit(owner, kind: str, record: Any) -> DumpMixture:
    """The :class:`~memlm.mixing.dump.DumpMixture` of a calibration's ``mixture`` record (the LM and this one
    memory), or one MemlmError naming the file, what is wrong and how to recalibrate."""
    from memlm.mixing.dump import DumpMixture

    where = _record_file(owner)
    try:
        fit = DumpMixture.from_dict(record, "the record")
        problem = None
        if fit.mixture.components != ("lm", kind):
            problem = f"it mixes {', '.join(fit.mixture.components)}, not the LM and this {kind} memory"
        elif fit.cache_temperature is not None or (kind == "ngram") != (fit.temperature is None):
            problem = f"temperature {fit.temperature!r}, cache temperature {fit.cache_temperature!r}"
        elif kind == "knn" and not (float(fit.temperature) > 0 and math.isfinite(fit.temperature) and int(fit.k) > 0):
            problem = f"temperature {fit.temperature!r} and k {fit.k!r} must be positive"
    except (MemlmError, TypeError, ValueError, AttributeError) as error:
        problem = str(error)
    if problem is not None:
        raise MemlmError(f"{where}: the mixture stored with its calibration cannot be used ({problem}); "
                         f"{_recalibrate_hint(owner, kind)}")  # fmt: skip
    return fit


def stored_mixture(memory, required: bool = False) -> DumpMixture | None:
    """The guarded mixture of the LM and this memory fitted when it was calibrated (components ``lm``,
    ``knn`` for a datastore, ``lm``, ``ngram`` for an ∞-gram index), a
    :class:`~memlm.mixing.dump.DumpMixture`, or None when the memory records no current calibration (a datastore's
    calibration made before an ``--append`` is not current). ``memory``: a datastore (plain or sharded), an ∞-gram
    index, or a memory over one. A record that cannot be read, does not fit this memory or was written by an older
    memlm is one MemlmError naming the file and how to recalibrate; ``required``: no calibration is one too (``memlm
    eval --mixture stored``)."""
    owner, kind = _calibrated(memory)
    cal = _current_calibration(owner, counted=kind == "knn")
    if cal is None and required:
        hint = _recalibrate_hint(owner, kind)
        raise MemlmError(f"{owner.path} records no current calibration (built with --holdout 0 / --no-calibrate, "
                         f"or appended to since): {hint}, or fit one with memlm tune")  # fmt: skip
    return None if cal is None else _read_fit(owner, kind, cal["mixture"])


def has_stored_mixture(memory) -> bool:
    """Whether :func:`stored_mixture` gives a usable fit (a build's rerun recalibrates when it does not)."""
    try:
        return stored_mixture(memory) is not None
    except MemlmError:
        return False


def mixture_summary(fit: DumpMixture) -> dict[str, Any]:
    """What a stored fit (:class:`~memlm.mixing.dump.DumpMixture`) is, for ``info`` and the build's message:
    its form, the tokens and documents it was fitted on (and kept apart), τ and k, the mean weight of each component
    over those tokens and its summary as the fixed-weight rule, the held-out log-likelihood per token of each form
    tried, and its warnings."""
    f = fit.fit
    return {
        "form": f.form,
        "tokens": f.tokens,
        "documents": f.documents,
        "fit_tokens": f.fit_tokens,
        "kept_tokens": f.kept_tokens,
        "temperature": fit.temperature,
        "k": fit.k,
        "mean_weights": dict(zip(fit.mixture.components, f.mean_weights, strict=True)),
        "rule_weights": fit.rule_weights,
        "heldout_loglik": f.heldout_loglik,
        "warnings": list(f.warnings),
    }


def calibration_summary(memory) -> dict[str, Any] | None:
    """The calibration record of a memory's manifest as ``info`` shows it: its ``mixture`` as
    :func:`mixture_summary` (``{"problem": ...}`` when it cannot be read, or was written by an older memlm), None
    without a calibration."""
    owner, kind = _calibrated(memory)
    try:
        cal = _current_calibration(owner, counted=False)
    except MemlmError as error:
        return {**owner.manifest["calibration"], "problem": str(error)}
    if cal is None:
        return None
    out = dict(cal)
    if out.get("slice") is not None:  # the text itself is not shown: its documents and size
        out["slice"] = {"documents": len(cal["slice"]), "characters": sum(len(d["text"]) for d in cal["slice"])}
    try:
        out["mixture"] = mixture_summary(_read_fit(owner, kind, cal["mixture"]))
    except MemlmError as error:
        out["mixture"] = {"problem": str(error)}
    return out


def report_mixture(fit: DumpMixture, fix: str, file=None) -> None:
    """Print on stderr (or ``file``) what the calibration's fit is: the form chosen, the tokens and documents it was
    fitted on, the held-out log-likelihood of each form, the mean weights and the rule weights; then each size warning
    of the fit (:data:`memlm.core.mixture.MIN_FIT_TOKENS`, ``MIN_FIT_DOCUMENTS``) followed by ``fix``."""
    out = file or sys.stderr
    s = mixture_summary(fit)
    tau = f", τ={s['temperature']:g}" if s["temperature"] is not None else ""
    print(f"mixture of {' + '.join(s['mean_weights'])}: {s['form']}{tau}, fitted on {s['tokens']:,} held-out tokens "
          f"of {s['documents']:,} document{'s' if s['documents'] != 1 else ''} ({s['fit_tokens']:,} to fit, "
          f"{s['kept_tokens']:,} kept apart to choose the form; log-likelihood per token on those: "
          + ", ".join(f"{k} {v:.4f}" for k, v in s["heldout_loglik"].items())
          + "); mean weights " + ", ".join(f"{k} {v:.3f}" for k, v in s["mean_weights"].items())
          + "; as the fixed-weight rule " + ", ".join(f"{k} {_weight_text(v)}" for k, v in s["rule_weights"].items()),
          file=out, flush=True)  # fmt: skip
    for w in s["warnings"]:
        print(f"warning: {w} ({fix})", file=out, flush=True)


def _weight_text(w: Any) -> str:
    """A rule weight for a message: ``0.123``, or ``0.300 sparse / 0.100 dense`` for an ∞-gram's pair."""
    return f"{w:.3f}" if isinstance(w, int | float) else f"{w[0]:.3f} sparse / {w[1]:.3f} dense"


OVERLAP_NGRAM = 16  # tokens per span compared by text_overlap
OVERLAP_LIMIT = 0.01  # memlm datastore calibrate refuses text with more of its spans in the datastore


def text_overlap(datastore, documents: Sequence, tokenizer, n: int = OVERLAP_NGRAM) -> tuple[int, int]:
    """``(shared, spans)``: how many of the ``n``-token spans of ``documents`` (tokenized as the datastore's stream,
    EOS after each document) also occur in the datastore's stream of stored next tokens (``values`` in row order, the
    corpus's tokens for a datastore built from contiguous text). Text the datastore holds shares nearly all its spans;
    unrelated text almost none. A pruned or subsampled datastore has gaps, so less is detected there."""
    import numpy as np

    from memlm.data.windows import tokenize_documents
    from memlm.leakage import ngrams_in_stream, token_ngrams

    stream = np.concatenate([c.tokens for c in tokenize_documents(list(documents), tokenizer)] or [np.zeros(0)])
    query = np.unique(token_ngrams([stream.astype(np.int64)], n)[0])
    return int(ngrams_in_stream(datastore.values, query, n).sum()), len(query)


def calibrate_ngram(
    model,
    tokenizer,
    memory,
    held_out: Sequence,
    window: int = 1024,
    stride: int = 512,
    batch_size: int = 4,
    progress: bool = True,
) -> dict[str, Any]:
    """Build-time calibration of an ∞-gram index: score ``held_out`` (a slice :func:`holdout_split` kept out of the
    index, as a datastore build does) with the LM and the ∞-gram ``memory`` in one forward pass, and fit the one
    mixture of the LM and the index on those tokens (:func:`calibration_fit`)::

        P(w | c) = λ_0(c) P_LM(w | c) + λ_1(c) P∞(w | c),    λ(c) = softmax(W φ(c) + b)

    the LM alone, EM's constant weights or the gate over the LM's and the ∞-gram's features, whichever the part of
    the slice kept apart prefers (:func:`memlm.core.mixture.fit_guarded`). Its summary as the fixed-weight rule (the
    index's mean weight where P∞ is sparse and where it is not: Liu et al. 2024, Sec. 5's λ_sparse, λ_dense) is what
    ``--ngram-lambda-*`` default to.

    Returns the record ``memlm ngram build`` stores in the index's ``manifest.json`` → ``calibration`` (the fit under
    ``mixture``, read back by :func:`stored_mixture`)."""
    from memlm.knnlm.evaluate import add_memory, lm_scores

    if not held_out:
        raise MemlmError("nothing to calibrate on: the held-out slice is empty")
    t0 = time.perf_counter()
    ts, _, _ = lm_scores(
        model, tokenizer, held_out, window=window, stride=stride, batch_size=batch_size, progress=progress
    )
    add_memory(ts, memory, held_out, tokenizer)
    return {**ngram_calibration(ts), "window": window, "stride": stride, "seconds": time.perf_counter() - t0,
            **slice_record(held_out)}  # fmt: skip


def calibrate_index_holdout(model, tokenizer, index, held_out: Sequence, holdout: dict[str, Any], window: int = 1024,
                            stride: int = 512, batch_size: int = 4) -> dict[str, Any] | None:  # fmt: skip
    """``memlm ngram build``'s calibration of ``index`` on the slice it held out (:func:`calibrate_ngram`), recorded in
    its manifest and said on stderr; a rerun over the same slice keeps a usable record (None returned) and
    recalibrates a record without a usable fit (an older memlm's, a corrupt one)."""
    from memlm.ngram.memory import NgramMemory

    cal = index.manifest.get("calibration")
    if cal is not None and cal.get("holdout_ids") == holdout.get("ids_sha256") and has_stored_mixture(index):
        print("calibration already recorded", file=sys.stderr)
        return None
    n = holdout["documents"]
    print(f"calibrating the mixture on {holdout['tokens']:,} held-out tokens ({n:,} document{'s' if n != 1 else ''})",
          file=sys.stderr)  # fmt: skip
    cal = calibrate_ngram(model, tokenizer, NgramMemory(index), held_out, window=window, stride=stride,
                          batch_size=batch_size)  # fmt: skip
    cal["holdout_ids"] = holdout.get("ids_sha256")
    index.record_calibration(cal)
    print(f"calibrated: held-out ppl {cal['base_ppl']:.3f} -> {cal['mixture_ppl']:.3f}; recorded in {index.path}",
          file=sys.stderr)  # fmt: skip
    report_mixture(stored_mixture(index), f"the slice is capped by the corpus: fit on your own valid text with "
                   f"`memlm eval --memory {index.path} --dump` + `memlm tune --mixture guarded`")  # fmt: skip
    return cal


def ngram_calibration(ts) -> dict[str, Any]:
    """The ∞-gram part of a calibration record from a slice's scores ``ts`` (its datastore columns, if any, left
    out): the one fit (:func:`calibration_fit`) and the ∞-gram's statistics on the slice (sparse share, median
    effective n)."""
    import numpy as np

    ts = ts.select(ts.names("ngram"))
    cols = ts.columns["ngram"]
    return {**_fit_record(ts, calibration_fit(ts)), "sparse_share": float(np.mean(cols["sparse"])),
            "effective_n_median": float(np.median(cols["n"]))}  # fmt: skip
