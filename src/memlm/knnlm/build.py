"""The one build of a usable kNN-LM datastore, for the Python API and ``memlm datastore build`` alike.

A build holds out a slice of the corpus (:func:`memlm.knnlm.calibration.holdout_split`), writes the rest's entries
with one forward pass (:func:`memlm.knnlm.write.write_datastore`, or :func:`memlm.knnlm.write.build_sharded` over
shards), builds the FAISS index over them and calibrates the mixture of the LM and the datastore on the held-out slice
(:func:`memlm.knnlm.calibration.calibrate`), recorded with the datastore: the kNN-LM of Khandelwal et al. (2020, Eq. 3)
with its weight per token

    p(w | c) = λ(c) p_kNN(w | c) + (1 - λ(c)) p_LM(w | c),     λ(c) = softmax(W φ(c) + b)

fitted (guarded: the LM alone, a constant λ or the gate) on text the datastore does not hold, τ chosen with it.
Eval, generation, lm-eval and :func:`memlm.wrap` read them from the folder; a rerun resumes or returns the folder as
it is.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from memlm.core.config import RetrievalConfig
from memlm.data.corpora import corpus_fingerprint
from memlm.data.windows import resolve_stride
from memlm.errors import MemlmError, option
from memlm.io.locking import folder_lock
from memlm.knnlm.calibration import (
    HOLDOUT_FRACTION,
    calibrate,
    has_stored_mixture,
    holdout_split,
    report_mixture,
    stored_mixture,
)
from memlm.leakage import document_record

if TYPE_CHECKING:
    from memlm.models.keys import KeySpec

__all__ = ["build_datastore", "build_index", "calibrate_holdout"]

CALIBRATION_K = 1024  # neighbours per held-out token, as memlm eval


def build_datastore(
    model,
    tokenizer,
    documents: Sequence,
    out: str | Path,
    *,
    key: KeySpec | str = "ffn_in",
    window: int = 1024,
    min_context: int | None = None,
    stride: int | None = None,
    block_start: str = "skip",
    batch_size: int = 4,
    source: dict[str, Any] | None = None,
    append: bool = False,
    overwrite: bool = False,
    holdout: float = HOLDOUT_FRACTION,
    index: bool = True,
    factory: str | None = None,
    metric: str = "l2",
    calibration_k: int = CALIBRATION_K,
    shards: int | None = None,
    ray: str | None = None,
    ray_model: str | None = None,
    dtype: str = "float32",
    device: str = "cpu",
    cpus_per_worker: int = 1,
    progress: bool = True,
):
    """Build (or resume) a usable datastore of ``documents`` in ``out``: what ``memlm datastore build`` does, with its
    defaults (the module docstring). Returns the open datastore (a ShardedDatastore with ``shards`` or ``ray``).

    ``key`` (a :class:`~memlm.models.keys.KeySpec` or its text, e.g. ``"ffn_in@-1"``) selects h_ds; ``window``,
    ``min_context`` (default 512 unless ``stride`` is given), ``stride`` and ``block_start`` the windows
    (:func:`memlm.data.windows.sliding_windows`). ``source`` describes the corpus for the manifest (name, split,
    fingerprint: :func:`memlm.data.corpora.load_corpus_source`; by default the documents' count and fingerprint).
    ``holdout`` is the share of the corpus's tokens kept out of the datastore to calibrate on (0: none, no
    calibration); ``index=False`` builds no index and calibrates nothing (both need it). ``factory`` / ``metric``: the
    FAISS index (default factory chosen from the size). ``shards``: split by documents into that many shards
    (docs/SCALING.md), built as Ray tasks with ``ray`` (``"local"`` or an address), whose workers load ``ray_model``
    (a name or folder) in ``dtype`` on ``device``; ``model`` then calibrates."""
    from memlm.models.keys import KeySpec

    key = KeySpec.parse(key) if isinstance(key, str) else key
    if min_context is None and stride is None:
        min_context = 512  # as the paper
    stride, min_context = resolve_stride(window, min_context, stride)  # refuses a min_context and stride that disagree
    if (shards is not None or ray is not None) and stride == window:
        raise MemlmError(
            f"{option('--stride')} {stride} equal to {option('--window')} gives non-overlapping blocks, which a "
            f"sharded build does not build: give {option('--min-context')} (or a {option('--stride')} below "
            f"{option('--window')}), or build without {option('--shards')}"
        )
    if ray is not None and ray_model is None:
        raise MemlmError("a Ray build loads the model in each worker: name it (ray_model), as a name or folder")
    source = dict(source) if source is not None else {"documents": len(documents), "fingerprint":
                                                       corpus_fingerprint(documents)}  # fmt: skip
    kept, held_out, source["holdout"] = holdout_split(documents, tokenizer, holdout, window=window, stride=stride,
                                                      block_start=block_start)  # fmt: skip
    source["document_hashes"] = document_record(kept)  # what eval's leakage check compares (memlm.leakage)
    if shards is not None or ray is not None:
        from memlm.knnlm.write import build_sharded

        ds = build_sharded(ray_model if ray is not None else model, kept, out, shards or 1, tokenizer=tokenizer,
                           key=key, window=window, min_context=min_context, batch_size=batch_size, source=source,
                           ray=ray, dtype=dtype, device=device, cpus_per_worker=cpus_per_worker,
                           progress=progress)  # fmt: skip
        if index and not (ds.path / "index.faiss.json").exists():
            build_index(ds, factory, metric, ray=ray, progress=progress)
        if index:
            calibrate_holdout(model, tokenizer, ds, held_out, source["holdout"], calibration_k, batch_size)
        return ds
    from memlm.knnlm.write import write_datastore

    with folder_lock(out, "build a datastore"):  # held through the index build and the calibration too
        ds = write_datastore(model, tokenizer, kept, out, key=key, window=window, min_context=min_context,
                             stride=stride, block_start=block_start, batch_size=batch_size, source=source,
                             append=append, overwrite=overwrite, progress=progress)  # fmt: skip
        if index:
            _ensure_index(ds, factory, metric, progress)
            calibrate_holdout(model, tokenizer, ds, held_out, source["holdout"], calibration_k, batch_size)
    return ds


def build_index(ds, factory: str | None, metric: str = "l2", train_size: int | None = None, ray: str | None = None,
                out: str | Path | None = None, progress: bool = True) -> Path:  # fmt: skip
    """Build (or rebuild) the FAISS index of a datastore, plain (``out``: another file than its ``index.faiss``) or
    sharded (one trained quantizer, one index per shard, filled as Ray tasks with ``ray``). Returns the index path
    (a sharded datastore's description file)."""
    if hasattr(ds, "shards"):
        from memlm.storage.sharded_index import build_sharded_index

        if out is not None:
            raise MemlmError(f"{option('--out')} is for a single datastore; a sharded one keeps one index per shard")
        build_sharded_index(ds, factory=factory, metric=metric, train_size=train_size, ray=ray, progress=progress)
        return Path(f"{ds.index_path}.json")
    path = Path(ds.index_path if out is None else out)
    ds.build_index(factory=factory, metric=metric, train_size=train_size, path=path)  # prints its plan
    return path


def _ensure_index(ds, factory: str | None, metric: str, progress: bool) -> None:
    """Build the datastore's index unless a valid one with the same factory and metric is there already."""
    from memlm.storage.index import plan_index, read_index_meta

    problem = ds.index_problem()
    if problem is not None:
        if ds.index_path.exists():
            print(f"rebuilding the index: {problem}", file=sys.stderr)
        build_index(ds, factory, metric, progress=progress)
        return
    meta = read_index_meta(ds.index_path)
    want = plan_index(len(ds), ds.dim, factory, metric).factory
    if (meta["factory"], meta["metric"]) != (want, metric):
        raise MemlmError(
            f"datastore {ds.path} already has an index {meta['factory']} ({meta['metric']}), not {want} ({metric}) as "
            f"asked: rebuild it with `memlm index build {ds.path} --factory '{want}' --metric {metric}`, or rerun "
            "with the index's --factory and --metric"
        )
    print(f"index {ds.index_path} already built ({meta['factory']}, {metric})", file=sys.stderr)


def calibrate_holdout(model, tokenizer, ds, held_out: Sequence, holdout: dict[str, Any], k: int = CALIBRATION_K,
                      batch_size: int = 4) -> dict[str, Any] | None:  # fmt: skip
    """Fit the mixture of the LM and the datastore (and its τ) on the build's held-out slice, and record it
    with the datastore (:func:`memlm.knnlm.calibration.calibrate`); a rerun recalibrates a record without a usable
    fit and keeps one on named text (``memlm datastore calibrate``). Returns the calibration recorded (None when
    nothing was held out)."""
    from memlm.storage.datastore import holdout_key

    if not held_out:
        print(f"no calibration: nothing held out ({holdout.get('reason')}); eval falls back to λ=0.25, τ=1 unless "
              f"you calibrate on text outside the datastore: `memlm datastore calibrate {ds.path} --corpus FILE`",
              file=sys.stderr)  # fmt: skip
        return None
    if not any(holdout_key(s) == holdout.get("ids_sha256") for s in ds.manifest.get("sources", [])):
        raise MemlmError(  # write_datastore compares the slice, so this is a safety net, never a normal path
            f"datastore {ds.path} records no source with this held-out slice: it may hold that text; not calibrating"
        )
    cal = ds.manifest.get("calibration")
    if cal is not None and cal.get("count") == len(ds) and (cal.get("text") or {}).get("named"):
        print(f"calibration on {cal['text'].get('corpus')} (memlm datastore calibrate) kept", file=sys.stderr)
        if not has_stored_mixture(ds):
            print(f"note: it records no usable fitted mixture; rerun `memlm datastore calibrate {ds.path} --corpus "
                  "FILE` to fit one", file=sys.stderr)  # fmt: skip
        return cal
    if (
        cal is not None
        and cal.get("count") == len(ds)
        and cal.get("holdout_ids") == holdout.get("ids_sha256")
        and has_stored_mixture(ds)
    ):
        print("calibration already recorded", file=sys.stderr)
        return cal
    if holdout.get("short_of_minimum"):
        print(f"note: {holdout['short_of_minimum']}", file=sys.stderr)
    n, tails = holdout["documents"], len(holdout.get("tails") or [])
    what = f"{n} document{'s' if n != 1 else ''}" + (f", {tails} of them a document's tail" if tails else "")
    print(f"calibrating the mixture on {holdout['tokens']:,} held-out tokens ({what})", file=sys.stderr)
    text = {"held_out": True, "documents": holdout["documents"], "ids_sha256": holdout.get("ids_sha256")}
    cal = calibrate(model, tokenizer, ds, held_out, RetrievalConfig(k=k), batch_size=batch_size, text=text)
    cal["holdout_ids"] = holdout.get("ids_sha256")
    ds.record_calibration(cal)
    say_calibrated(cal, ds)
    return cal


def say_calibrated(cal: dict[str, Any], ds) -> None:
    """The calibration's lines on stderr: the held-out perplexities of the LM and of the fitted mixture, and the
    fit."""
    print(f"calibrated: held-out ppl {cal['base_ppl']:.3f} -> {cal['mixture_ppl']:.3f} (k={cal['k']}, "
          f"{cal['search']} search); recorded in {ds.path}", file=sys.stderr)  # fmt: skip
    report_mixture(stored_mixture(ds), f"calibrate on more text outside the datastore: `memlm datastore calibrate "
                   f"{ds.path} --corpus FILE`, or tune on your own valid text: `memlm eval --dump` + `memlm tune "
                   "--mixture guarded`")  # fmt: skip
