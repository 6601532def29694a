"""Datasets of memlm's offline lm-eval tasks, built from memlm's named corpora (no download).

Each function returns a ``datasets.DatasetDict`` with ``train``, ``validation`` and ``test`` splits (the corpus's
``train``, ``valid`` and ``test`` splits, see :mod:`memlm.data.corpora`).
"""

from __future__ import annotations

from typing import Any

import datasets
from lm_eval.tasks.wikitext.preprocess_wikitext import process_results, wikitext_detokenizer

from memlm.data.corpora import load_documents

__all__ = ["wikitext2", "imdb", "bbc_topic", "wikitext_detokenizer", "process_results", "BBC_TOPICS"]

_SPLITS = {"train": "train", "validation": "valid", "test": "test"}
BBC_TOPICS = ("business", "entertainment", "politics", "sport", "tech")


def _dataset(rows_of) -> datasets.DatasetDict:
    return datasets.DatasetDict({name: datasets.Dataset.from_list(rows_of(split)) for name, split in _SPLITS.items()})


def wikitext2(**kwargs: Any) -> datasets.DatasetDict:
    """WikiText-2 raw, one row per article: ``page`` (the raw article, heading included) and ``title``.

    The same rows as lm_eval's ``EleutherAI/wikitext_document_level`` (``wikitext-2-raw-v1``): 629/60/62 articles.
    """
    return _dataset(lambda s: [{"page": d.text, "title": d.meta["title"]} for d in load_documents("wikitext2", s)])


def imdb(**kwargs: Any) -> datasets.DatasetDict:
    """Movie reviews (IMDB + Rotten Tomatoes, memlm's hashed split): ``text``, ``label`` (0 negative, 1 positive)."""
    labels = {"negative": 0, "positive": 1}
    return _dataset(
        lambda s: [
            {"text": d.text, "label": labels[d.meta["label"]], "source": d.meta["source"]}
            for d in load_documents("imdb", s)
        ]
    )


def bbc_topic(**kwargs: Any) -> datasets.DatasetDict:
    """BBC News articles (memlm's hashed split): ``text``, ``label`` (index into ``BBC_TOPICS``)."""
    topic = {"business": 0, "entertainment": 1, "politics": 2, "sport": 3, "sports": 3, "tech": 4}
    return _dataset(lambda s: [{"text": d.text, "label": topic[d.meta["topic"]]} for d in load_documents("bbc", s)])
