"""Build-time calibration of an ∞-gram index: λ_sparse, λ_dense and the learned mixture, on a held-out slice.

``memlm ngram build`` holds out a slice of its corpus (:func:`memlm.knnlm.calibration.holdout_split`, as a datastore
build does), indexes the rest, then scores the slice once with the LM and the new index and fits on those tokens:

* Liu et al. (2024, Sec. 5)'s two weights, λ_sparse where P∞(· | c) is sparse and λ_dense elsewhere, by grid search
  (:func:`memlm.ngram.mixture.tune_ngram`): the fixed-weight rule that ``--ngram-lambda-sparse`` /
  ``--ngram-lambda-dense`` and an index's default still give;
* the guarded mixture of the LM and the index (issue 35, :func:`memlm.knnlm.dump_mixture.fit_dump`)::

      P(w | c) = λ_0(c) P_LM(w | c) + λ_1(c) P∞(w | c),    λ(c) = softmax(W φ(c) + b)

  the LM alone, EM's constant weights or the gate over the LM's and the ∞-gram's features, whichever the part of the
  slice kept apart prefers (:func:`memlm.core.mixture.fit_guarded`).

Both are recorded in the index's ``manifest.json`` → ``calibration`` (the fit under ``mixture``, read back by
:func:`memlm.knnlm.calibration.stored_mixture`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from memlm.errors import MemlmError

__all__ = ["calibrate_ngram"]


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
    """Score ``held_out`` with the LM and the ∞-gram ``memory`` (one forward pass), tune λ_sparse, λ_dense and fit the
    mixture on those tokens (module docstring). Returns the record stored under the index's ``calibration``."""
    from memlm.core.mixture import token_blocks
    from memlm.knnlm.calibration import slice_record
    from memlm.knnlm.dump_mixture import fit_dump
    from memlm.knnlm.evaluate import lm_scores
    from memlm.ngram.mixture import add_ngram, ngram_report, tune_ngram

    if not held_out:
        raise MemlmError("nothing to calibrate on: the held-out slice is empty")
    t0 = time.perf_counter()
    ts, _, _ = lm_scores(
        model, tokenizer, held_out, window=window, stride=stride, batch_size=batch_size, progress=progress
    )
    add_ngram(ts, held_out, tokenizer, memory)
    best = tune_ngram(ts)["best"]
    ts.doc_index = token_blocks(ts.doc_index)  # a slice of one file: blocks the fit treats as documents
    rep = ngram_report(ts, best["lambda_sparse"], best["lambda_dense"])
    return {
        "lambda_sparse": best["lambda_sparse"],
        "lambda_dense": best["lambda_dense"],
        "tokens": len(ts),
        "base_ppl": rep["base_ppl"],
        "ngram_ppl": rep["ngram_ppl"],
        "sparse_share": rep["sparse_share"],
        "effective_n_median": rep["effective_n"]["median"],
        "mixture": fit_dump(ts, (1.0,)).to_dict(),  # no kNN term: no temperature to search
        "window": window,
        "stride": stride,
        "seconds": time.perf_counter() - t0,
        **slice_record(held_out),
    }
