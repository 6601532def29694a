"""Self-calibrating datastores: a held-out slice of the datastore's own corpus picks its default λ and τ.

A kNN-LM's perplexity depends on the interpolation weight λ and the softmax temperature τ of Eq. 2-3 (Khandelwal et al.
2020 tune λ on validation text; Xu et al. 2023, Sec. 3.4, show how much τ matters). No fixed default suits every
datastore (issue 16 reports, on 92k tokens of speeches, -1.5% perplexity with the old defaults λ = 0.25, τ = 1 and -6.5%
tuned; on WikiText-2 here the old defaults are 3.5% worse than no datastore, docs/BENCHMARKS.md). So ``memlm datastore
build`` holds out a small deterministic slice of its documents (:func:`holdout_split`: 2% of the tokens, at least 4,096
tokens, never more than 20%), builds the datastore from the rest, then scores the slice with the new datastore and grid-
searches λ and τ on it (:func:`calibrate`); the result is recorded with the datastore (``manifest.json`` →
``calibration``). ``memlm eval``, ``generate``, the lm-eval adapter and the Python API take those values when none are
given (:func:`knn_parameters`) and say which they used and where they came from.

The slice is in-domain text the datastore has not seen, so its λ/τ are a good default for text like the datastore's
corpus. For text from another domain (domain adaptation, or a datastore much larger than the slice's context), tune on
target-domain text instead: ``memlm eval --dump`` on a valid split, then ``memlm tune``.
"""

from __future__ import annotations

import hashlib
import sys
import time
from collections.abc import Sequence
from typing import Any

from memlm.errors import MemlmError

__all__ = [
    "HOLDOUT_FRACTION",
    "HOLDOUT_MIN_TOKENS",
    "DEFAULT_LAMBDA",
    "DEFAULT_TEMPERATURE",
    "holdout_split",
    "calibrate",
    "knn_parameters",
]

HOLDOUT_FRACTION = 0.02
HOLDOUT_MIN_TOKENS = 4096
HOLDOUT_MAX_SHARE = 0.2  # the slice never takes more than this share of the corpus's tokens
DEFAULT_LAMBDA, DEFAULT_TEMPERATURE = 0.25, 1.0  # the fallback when a datastore has no calibration


def _rank(doc) -> str:
    """The order documents are held out in: by a hash of id and text (deterministic, independent of corpus order)."""
    return hashlib.sha256(f"memlm-holdout-v1\n{doc.id}\n{doc.text}".encode("utf-8", "surrogatepass")).hexdigest()


def holdout_split(
    documents: Sequence,
    tokenizer,
    fraction: float = HOLDOUT_FRACTION,
    min_tokens: int = HOLDOUT_MIN_TOKENS,
) -> tuple[list, list, dict[str, Any]]:
    """``(kept, held_out, info)``: documents for the datastore, documents for calibration, and what was held out.

    Documents are taken in the order of :func:`_rank` until the slice holds ``max(fraction * total, min_tokens)``
    tokens, without passing ``HOLDOUT_MAX_SHARE`` of the corpus and leaving at least one document; ``kept`` keeps the
    corpus order. ``fraction = 0`` or fewer than two documents hold nothing out (``info["documents"] == 0`` and
    ``info["reason"]`` says why). The same documents always give the same split, so an interrupted build resumes.
    """
    if not 0.0 <= fraction < 1.0:
        raise MemlmError(f"--holdout must be in [0, 1), got {fraction}")
    docs = list(documents)
    info: dict[str, Any] = {"fraction": fraction, "min_tokens": min_tokens, "selection": "sha256(id, text) order"}
    if fraction == 0 or len(docs) < 2:
        reason = "--holdout 0" if fraction == 0 else "fewer than two documents"
        return docs, [], {**info, "documents": 0, "tokens": 0, "reason": reason}
    lengths = [len(ids) for ids in tokenizer([d.text for d in docs], add_special_tokens=False)["input_ids"]]
    total = sum(lengths)
    want, cap = max(fraction * total, min_tokens), HOLDOUT_MAX_SHARE * total
    chosen: set[int] = set()
    taken = 0
    for i in sorted(range(len(docs)), key=lambda i: _rank(docs[i])):
        if taken >= want or len(chosen) == len(docs) - 1:
            break
        if taken + lengths[i] > cap:
            continue  # too long for the slice: try a shorter one
        chosen.add(i)
        taken += lengths[i]
    if not chosen:
        return docs, [], {**info, "documents": 0, "tokens": 0, "reason": "every document is over the slice's cap"}
    kept = [d for i, d in enumerate(docs) if i not in chosen]
    held = [d for i, d in enumerate(docs) if i in chosen]
    ids = hashlib.sha256("\n".join(sorted(d.id for d in held)).encode()).hexdigest()[:16]
    return kept, held, {**info, "documents": len(held), "tokens": taken, "corpus_tokens": total, "ids_sha256": ids}


def calibrate(
    model,
    tokenizer,
    datastore,
    held_out: Sequence,
    k: int = 1024,
    nprobe: int = 32,
    batch_size: int = 4,
    progress: bool = True,
) -> dict[str, Any]:
    """Score ``held_out`` with ``datastore`` and grid-search λ and τ on it (:func:`memlm.knnlm.evaluate.tune`).

    The slice is read with the datastore's own windows (``window``, ``stride``); the datastore's index (or exact
    search when it has none) gives ``k`` neighbours per token. Returns the record stored under ``calibration``.
    """
    from memlm.knnlm.evaluate import add_neighbours, lm_scores, perplexities, tune

    if not held_out:
        raise MemlmError("nothing to calibrate on: the held-out slice is empty")
    m = datastore.manifest
    t0 = time.perf_counter()
    window = int(m["window"])
    stride = int(m.get("stride", window - int(m["min_context"])))
    block_start = m.get("block_start", "skip")
    ts, queries, _ = lm_scores(model, tokenizer, held_out, [datastore.key_spec], window=window, stride=stride,
                               block_start=block_start, batch_size=batch_size, progress=progress)  # fmt: skip
    problem = getattr(datastore, "index_problem", None)  # a sharded datastore's index is checked when opened
    search = "index" if problem is None or problem() is None else "exact"
    k = min(k, len(datastore))
    add_neighbours(ts, queries[datastore.key_spec], datastore, k=k, search=search, nprobe=nprobe, progress=progress)
    best = tune(ts)["best"]
    res = perplexities(ts, lam=best["lambda"], temperature=best["temperature"])
    return {
        "lambda": float(best["lambda"]),
        "temperature": float(best["temperature"]),
        "k": int(k),
        "nprobe": int(nprobe),
        "search": search,
        "tokens": len(ts),
        "base_ppl": float(res["base_ppl"]),
        "knn_ppl": float(res["knn_ppl"]),
        "window": window,
        "stride": stride,
        "seconds": time.perf_counter() - t0,
        "count": len(datastore),
    }


def knn_parameters(
    datastore, lam: float | None = None, temperature: float | None = None, announce: bool = True
) -> tuple[float, float, str]:
    """``(λ, τ, origin)``: the values given, else the datastore's calibrated ones, else λ = 0.25, τ = 1.

    A value given explicitly always wins. ``origin`` says where the values came from (printed on stderr when
    ``announce``): the command line, the datastore's calibration (held-out tokens, corpus, file), or the fallback.
    """
    cal = (getattr(datastore, "manifest", None) or {}).get("calibration") if datastore is not None else None
    if cal is not None and int(cal.get("count", -1)) != len(datastore):
        cal = None  # recorded for another version of the datastore (e.g. before an --append)
    missing = [n for n, v in (("λ", lam), ("τ", temperature)) if v is None]
    if not missing:
        origin = "given"
    elif cal is not None:
        lam = float(cal["lambda"]) if lam is None else lam
        temperature = float(cal["temperature"]) if temperature is None else temperature
        origin = (
            f"calibrated on {cal['tokens']:,} held-out tokens of the datastore's corpus "
            f"(valid ppl {cal['base_ppl']:.3f} -> {cal['knn_ppl']:.3f}, k={cal['k']}), recorded in "
            f"{datastore.path}/manifest.json"
        )
    else:
        lam = DEFAULT_LAMBDA if lam is None else lam
        temperature = DEFAULT_TEMPERATURE if temperature is None else temperature
        origin = (
            "memlm's fallback defaults (this datastore records no calibration: rebuild it with this memlm, or tune "
            "on your own valid text with `memlm eval --dump` + `memlm tune`)"
        )
    if announce and datastore is not None:
        which = f" ({missing[0]} from there)" if len(missing) == 1 else ""
        print(f"kNN-LM parameters: λ={lam:g}, τ={temperature:g}: {origin}{which}", file=sys.stderr, flush=True)
    return float(lam), float(temperature), origin
