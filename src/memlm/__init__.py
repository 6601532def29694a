"""memlm: memory-augmented (nonparametric) language models on any Hugging Face model.

The public API, importable from here (each name is loaded on first use, so ``import memlm`` stays light)::

    import memlm

    model, tok = memlm.load_causal_lm("smollm2-135m")                 # any HF id or folder
    docs = memlm.limit_documents(memlm.load_documents("wiki", "train"), tok, 200_000)
    ds = memlm.build_datastore(model, tok, docs, "ds/wiki")            # as `memlm datastore build`: usable as it is
    knn_lm = memlm.wrap(model, ds)                                     # forward / generate: the mixture's distribution

See README.md ("Python") for scoring, tuning, generation, the ∞-gram and lm-eval.
"""

from __future__ import annotations

import importlib
from typing import Any

from memlm.errors import MemlmError

__version__ = "0.1.0"

# name -> module that defines it
_API = {
    "load_causal_lm": "memlm.models.resources",
    "load_documents": "memlm.data.corpora",
    "limit_documents": "memlm.data.windows",
    "KeySpec": "memlm.models.keys",
    "Datastore": "memlm.storage.datastore",
    "build_datastore": "memlm.knnlm.build",
    "open_datastore": "memlm.storage.sharded",
    "build_index": "memlm.storage.index",
    "DatastoreMemory": "memlm.retrieval",
    "Retrieved": "memlm.core.memory",
    "open_searcher": "memlm.storage.searcher",
    "holdout_split": "memlm.knnlm.calibration",
    "calibrate": "memlm.knnlm.calibration",
    "knn_parameters": "memlm.knnlm.calibration",
    "score_tokens": "memlm.knnlm.scoring",
    "perplexities": "memlm.knnlm.evaluate",
    "generate_text": "memlm.knnlm.generate",
    "MixtureLogitsProcessor": "memlm.knnlm.generate",
    "open_memories": "memlm.knnlm.memories",
    "fixed_mixture": "memlm.mixing.weights",
    "Component": "memlm.mixing.component",
    "Step": "memlm.mixing.component",
    "TokenTable": "memlm.knnlm.table",
    "report": "memlm.mixing.report",
    "fit_table": "memlm.mixing.report",
    "Mixture": "memlm.core.mixture",
    "wrap": "memlm.knnlm.wrap",
    "KNNLM": "memlm.knnlm.wrap",
    "build_ngram_index": "memlm.ngram.index",
    "NgramMemory": "memlm.ngram.memory",
}

__all__ = ["MemlmError", "__version__", *_API]


def __getattr__(name: str) -> Any:
    if name in _API:
        value = getattr(importlib.import_module(_API[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'memlm' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
