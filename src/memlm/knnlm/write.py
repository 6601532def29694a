"""Writing a datastore's entries with one forward pass over a corpus (Khandelwal et al. 2020, Sec. 2: a key h_ds of each
target's context, its value the target token), in one process (:func:`write_datastore`) or split by documents into
shards (:func:`build_sharded`: each shard a :func:`write_datastore` over its :class:`ShardDocuments`, one after the
other or as Ray tasks). The folder formats and the reading side are :mod:`memlm.storage.datastore` and
:mod:`memlm.storage.sharded`; the usable build (held-out slice, index, calibration) is
:func:`memlm.knnlm.build.build_datastore`."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from memlm import __version__
from memlm.data.windows import (
    TokenChunk,
    Window,
    batched,
    count_targets,
    resolve_stride,
    sliding_windows,
    tokenize_documents,
)
from memlm.errors import MemlmError, option
from memlm.io import schema
from memlm.io.fileio import atomic_write_json
from memlm.models.compute import describe_compute_path
from memlm.models.forward import forward_windows
from memlm.models.keys import KeySpec, key_dim, num_layers
from memlm.storage.datastore import (
    _PROGRESS_FIX,
    FOLDER,
    FORMAT_VERSION,
    Datastore,
    _diff,
    _manifest_settings,
    _publish,
    _same_corpus,
    _settings,
    _source_diff,
    model_identity,
)
from memlm.storage.index import meta_path
from memlm.storage.sharded import FORMAT, SHARDS_FILE, ShardedDatastore, ShardPlan, plan_shards, shard_name
from memlm.storage.sharded import FORMAT_VERSION as SHARDED_FORMAT_VERSION

__all__ = ["ShardDocuments", "build_shard", "build_sharded", "write_datastore"]


def write_datastore(
    model,
    tokenizer,
    documents: Sequence,
    out: str | Path,
    key: KeySpec | None = None,
    window: int = 1024,
    min_context: int = 512,
    batch_size: int = 4,
    source: dict[str, Any] | None = None,
    append: bool = False,
    progress: bool = True,
    overwrite: bool = False,
    stride: int | None = None,
    block_start: str = "skip",
) -> Datastore:
    """Write (or resume, or ``append`` to) a datastore's entries in ``out`` from ``documents`` with one forward pass: no
    index, no calibration (:func:`memlm.knnlm.build.build_datastore` adds both).

    ``key`` selects h_ds (default: ``ffn_in`` of the last layer, Khandelwal's best key). ``source`` describes the
    corpus for the manifest (name, split, fingerprint).
    Rerunning the same call after an interruption resumes; a finished datastore built with the same settings and
    source is returned as is. Other settings (key, window, min_context, model, tokenizer, dtype, corpus) are refused
    with the differences named, unless ``append=True`` (adds ``documents`` as a new source; model, key and windows
    must match) or ``overwrite=True`` (the folder's datastore, index and any unfinished build are deleted first).
    The folder is locked for the whole build (:func:`memlm.io.locking.folder_lock`).
    ``stride`` (default ``window - min_context``) equal to ``window`` gives non-overlapping blocks whose first token is
    skipped or scored from BOS (``block_start``, see :func:`memlm.data.windows.sliding_windows`).
    """
    if append and overwrite:
        raise MemlmError(
            f"give {option('--append')} (add to the datastore) or {option('--overwrite')} (replace it), not both"
        )
    key = (key or KeySpec()).normalized(num_layers(model))
    stride, min_context = resolve_stride(window, None if stride is not None else min_context, stride)
    block = block_start if stride == window else None  # only blocks have a first token to skip or score
    with FOLDER.writing(Path(out), "build a datastore", overwrite=overwrite) as out:
        return _build_locked(model, tokenizer, documents, out, key, window, min_context, batch_size, source, append,
                             progress, stride, block)  # fmt: skip


def _build_locked(
    model,
    tokenizer,
    documents: Sequence,
    out: Path,
    key: KeySpec,
    window: int,
    min_context: int,
    batch_size: int,
    source: dict[str, Any] | None,
    append: bool,
    progress: bool,
    stride: int,
    block_start: str | None,
) -> Datastore:
    manifest_path, progress_path = out / "manifest.json", FOLDER.progress_path(out)
    ident = model_identity(model, tokenizer)
    source = dict(source or {})
    dtype = str(next(iter(model.parameters())).dtype).replace("torch.", "")
    config = {
        "key": {"role": key.role, "layer": key.layer},
        "window": window,
        "min_context": min_context,
        **({"block_start": block_start} if block_start else {}),
        "batch_size": batch_size,
        "source": source,
        "model_fingerprint": ident["model"]["fingerprint"],
        "tokenizer_fingerprint": ident["tokenizer"]["fingerprint"],
        "dtype": dtype,
    }
    how = f"rerun with the same settings, use a new {option('--out')}, or {option('--overwrite')} to replace it"

    if progress_path.exists():
        state = FOLDER.read_progress(out)
        if state["config"] != config:
            diff = _diff(_settings(state["config"]), _settings(config)) or ["the recorded settings differ"]
            raise MemlmError(
                f"{out} holds an interrupted build with other settings ({'; '.join(diff)}): rerun it with its "
                f"settings to resume, use a new {option('--out')}, or {option('--overwrite')} to discard it"
            )
        base = state["base"]
        if base["manifest"] is not None:
            schema.check(base["manifest"], schema.DATASTORE_MANIFEST, progress_path, "datastore build progress file",
                         _PROGRESS_FIX)  # fmt: skip
    elif manifest_path.exists():
        existing = Datastore.open(out)
        old = _manifest_settings(existing.manifest)
        new = _settings(config)
        diff = _diff(old, new)
        if not append:
            diff += _source_diff(existing.manifest["sources"], source)
            if diff:
                if all(d.startswith("held-out slice") for d in diff):  # same text, another slice held out of it
                    fix = (f"{how} (the entries hold the text this slice would calibrate on); to calibrate it as it "
                           f"is, name text outside it: `memlm datastore calibrate {out} --corpus FILE`")  # fmt: skip
                else:
                    fix = f"{how}, or {option('--append')} to add this corpus to it"
                raise MemlmError(
                    f"{out} already holds a datastore built with other settings ({'; '.join(diff)}): {fix}"
                )
            print(f"datastore {out} already built ({len(existing)} entries); nothing to do", file=sys.stderr)
            return existing
        if diff:
            raise MemlmError(
                f"cannot append to {out}: it was built with other settings ({'; '.join(diff)}); append with the "
                f"datastore's own model, key, window and min-context, or use a new {option('--out')}"
            )
        existing.check_compatible(model, tokenizer, key)
        if any(_same_corpus(s, source) for s in existing.manifest["sources"]):
            print(f"datastore {out} already holds this corpus ({len(existing)} entries); nothing to append",
                  file=sys.stderr)  # fmt: skip
            return existing
        base = {"count": len(existing), "manifest": existing.manifest}
        for stale in (existing.index_path, meta_path(existing.index_path)):
            stale.unlink(missing_ok=True)  # the index no longer covers every entry
        state = {"config": config, "base": base, "windows_done": 0, "count": base["count"], "seconds": 0.0}
        FOLDER.start(out, state)
    else:
        if append:
            flag = option("--append")
            raise MemlmError(f"{flag} needs an existing datastore in {out}; build it first without {flag}")
        base = {"count": 0, "manifest": None}
        state = {"config": config, "base": base, "windows_done": 0, "count": 0, "seconds": 0.0}
        FOLDER.start(out, state)

    dim = key_dim(model, key)
    # a shard (ShardDocuments) brings its own windows: those of the one-process build for its
    # targets
    custom = hasattr(documents, "memlm_windows")
    n_total = (
        documents.memlm_count_targets(tokenizer)
        if custom
        else count_targets(documents, tokenizer, window, stride, block_start or "skip")
    )
    if n_total == 0:
        if base["count"] == 0:
            progress_path.unlink(missing_ok=True)
        raise MemlmError(f"corpus {source.get('corpus', '')} has no tokens to store; give it some text")

    count = _write_entries(model, tokenizer, documents, out, key, dim, window, stride, block_start, batch_size, state,
                           base, n_total, progress)  # fmt: skip
    prev = base["manifest"]
    sources = (prev["sources"] if prev else []) + [{**source, "targets": count - base["count"]}]
    manifest = {
        "format_version": FORMAT_VERSION,
        "memlm_version": __version__,
        **ident,
        "key": {"role": key.role, "layer": key.layer, "dim": dim, "describe": key.describe()},
        "count": count,
        "window": window,
        "min_context": min_context,
        "stride": stride,
        **({"block_start": block_start} if block_start else {}),
        "sources": sources,
        "build": {"dtype": config["dtype"], "batch_size": batch_size, "compute_path": describe_compute_path(model)},
        "build_seconds": (prev["build_seconds"] if prev and "build_seconds" in prev else 0.0) + float(state["seconds"]),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    _publish(manifest, out)
    return Datastore.open(out)


def _write_entries(
    model,
    tokenizer,
    documents: Sequence,
    out: Path,
    key: KeySpec,
    dim: int,
    window: int,
    stride: int,
    block_start: str | None,
    batch_size: int,
    state: dict[str, Any],
    base: dict[str, Any],
    n_total: int,
    progress: bool,
) -> int:
    """The streaming part of a build: append every remaining window's entries, recording progress per batch."""
    bos_id = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    if hasattr(documents, "memlm_windows"):  # a shard of a sharded build (ShardDocuments)
        windows = documents.memlm_windows(tokenizer, window, window - stride)
    else:
        windows = sliding_windows(
            tokenize_documents(documents, tokenizer),
            window,
            stride=stride,
            block_start=block_start or "skip",
            bos_id=bos_id,
        )
    skip = int(state["windows_done"])
    bar = tqdm(
        total=n_total,
        initial=int(state["count"]) - base["count"],
        unit="tok",
        desc=f"datastore {out.name}",
        disable=not progress,
        dynamic_ncols=True,
    )
    t0 = time.perf_counter()
    seconds0 = float(state["seconds"])
    remaining = (w for w in windows if w.index >= skip)
    # truncates what was written after the last recorded batch (a crash between data and progress writes)
    with FOLDER.appender(out, dim, state) as writer, bar:
        for outputs in forward_windows(model, batched(remaining, batch_size), [key], with_logprobs=False):
            for o in outputs:
                rows = slice(o.window.score_from, len(o.window.input_ids))
                bar.update(writer.append(keys=o.keys[key], values=o.targets, doc_hash=o.window.doc_hash[rows],
                                         offset=o.window.offset[rows]))  # fmt: skip
            writer.commit(windows_done=outputs[-1].window.index + 1, seconds=seconds0 + time.perf_counter() - t0)
    return writer.count


class ShardDocuments(Sequence):
    """The documents one shard reads, with the windows a one-process build would score for its targets.

    A ``Sequence`` of the documents ``[read_doc, doc_hi)``; :func:`write_datastore` asks it for
    ``memlm_windows`` / ``memlm_count_targets`` instead of windowing the documents from scratch.
    """

    def __init__(self, documents: Sequence, plan: ShardPlan, window: int, min_context: int) -> None:
        self.docs = documents[plan.read_doc : plan.doc_hi]
        self.plan, self.window, self.min_context = plan, window, min_context

    def __len__(self) -> int:
        return len(self.docs)

    def __getitem__(self, i):  # type: ignore[override]
        return self.docs[i]

    def memlm_count_targets(self, tokenizer) -> int:
        return self.plan.count

    def _chunks(self, tokenizer) -> Iterator[TokenChunk]:
        for j, chunk in enumerate(tokenize_documents(self.docs, tokenizer)):
            tokens = chunk.tokens[self.plan.read_skip :] if j == 0 else chunk.tokens
            yield TokenChunk(tokens, chunk.doc_index + self.plan.read_doc, chunk.doc_hash)

    def memlm_windows(self, tokenizer, window: int, min_context: int) -> Iterator[Window]:
        """Global windows ``first_window, first_window + 1, ...`` cut down to this shard's targets (renumbered 0..)."""
        if (window, min_context) != (self.window, self.min_context):
            raise MemlmError("a shard's windows were planned with another window / min_context; plan it again")
        p = self.plan
        stride = window - min_context
        n = 0
        for w in sliding_windows(self._chunks(tokenizer), window, min_context):
            g = p.first_window + w.index
            start = g * stride  # global stream position of input_ids[0]
            lo = max(start + (1 if g == 0 else min_context), p.target_lo) - start
            hi = min(start + len(w.input_ids), p.target_hi) - start
            if hi <= lo:
                continue
            offset = w.offset[:hi].copy()
            offset[w.doc_index[:hi] == p.read_doc] += p.read_skip  # read_doc's tokens were read from read_skip on
            yield Window(n, w.input_ids[:hi], lo, w.doc_index[:hi], offset, w.doc_hash[:hi])
            n += 1


def _config(
    n_shards: int, key: KeySpec | None, window: int, min_context: int, batch_size: int, source: dict[str, Any]
) -> dict[str, Any]:
    key = key or KeySpec()
    return {
        "shards": n_shards,
        "key": {"role": key.role, "layer": key.layer},
        "window": window,
        "min_context": min_context,
        "batch_size": batch_size,
        "source": source,
    }


def build_shard(
    model,
    tokenizer,
    documents: Sequence,
    out: str | Path,
    plan: ShardPlan,
    key: KeySpec | None,
    window: int,
    min_context: int,
    batch_size: int,
    source: dict[str, Any],
    progress: bool = True,
) -> Datastore:
    """Build (or resume) one shard into ``out / shard_name(plan.index)`` with :func:`write_datastore`."""
    shard_source = {**source, "shard": plan.as_dict()}
    return write_datastore(
        model,
        tokenizer,
        ShardDocuments(documents, plan, window, min_context),
        Path(out) / shard_name(plan.index),
        key=key,
        window=window,
        min_context=min_context,
        batch_size=batch_size,
        source=shard_source,
        progress=progress,
    )


def build_sharded(
    model,
    documents: Sequence,
    out: str | Path,
    n_shards: int,
    tokenizer=None,
    key: KeySpec | None = None,
    window: int = 1024,
    min_context: int = 512,
    batch_size: int = 4,
    source: dict[str, Any] | None = None,
    ray: str | None = None,
    dtype: str = "float32",
    device: str = "cpu",
    cpus_per_worker: int = 1,
    gpus_per_worker: float = 0.0,
    progress: bool = True,
) -> ShardedDatastore:
    """Build (or resume) a sharded datastore of ``documents`` in ``out`` with ``n_shards`` shards.

    ``model`` is a loaded causal LM (with ``tokenizer``; in-process builds only) or a model name / folder that each
    worker loads with :func:`memlm.models.resources.load_causal_lm` in ``dtype`` on ``device`` (``cuda`` for GPU
    workers; with ``ray`` each task also asks Ray for ``gpus_per_worker`` GPUs and ``cpus_per_worker`` CPUs, and uses
    that many torch threads). ``ray``: ``None`` builds the shards one after the other in this process; ``"local"``
    starts a local Ray cluster; any other string is a Ray address (``ray.init(address=...)``, e.g. ``"auto"``).
    Rerunning the same call resumes: finished shards are skipped, unfinished ones resume from their own progress.
    """
    out = Path(out)
    source = dict(source or {})
    if tokenizer is None:
        if not isinstance(model, str):
            raise MemlmError("build_sharded needs the tokenizer with a loaded model (or pass a model name instead)")
        from memlm.models.resources import load_causal_lm

        _, tokenizer = load_causal_lm(model, dtype=dtype)
    if ray is not None and not isinstance(model, str):
        raise MemlmError("a Ray build loads the model in each worker: pass its name or folder, not a loaded model")
    config = _config(n_shards, key, window, min_context, batch_size, source)
    out.mkdir(parents=True, exist_ok=True)
    shards_path = out / SHARDS_FILE
    if shards_path.exists():
        state = json.loads(shards_path.read_text())
        if state.get("config") != config:
            raise MemlmError(
                f"{out} holds a sharded datastore built with other settings ({state.get('config')}): rerun with those "
                "settings to resume it, or use a new --out"
            )
        plans = [ShardPlan(**p) for p in state["plan"]]
    else:
        if (out / "manifest.json").exists() or any(out.iterdir()):
            raise MemlmError(f"{out} is not empty and holds no sharded datastore; use a new or empty --out folder")
        lengths = [len(c.tokens) for c in tokenize_documents(documents, tokenizer)]
        plans = plan_shards(lengths, n_shards, window, min_context)
        state = {
            "format": FORMAT,
            "format_version": SHARDED_FORMAT_VERSION,
            "memlm_version": __version__,
            "config": config,
            "plan": [p.as_dict() for p in plans],
            "order": "shard 0's entries, then shard 1's, ...: the one-process build's order (memlm.storage.sharded)",
            "complete": False,
        }
        atomic_write_json(shards_path, state)

    todo = [p for p in plans if not FOLDER.is_complete(out / shard_name(p.index))]
    t0 = time.perf_counter()
    if todo:
        if progress:
            print(f"building {len(todo)} of {len(plans)} shards in {out}", file=sys.stderr, flush=True)
        if ray is None:
            if isinstance(model, str):
                from memlm.models.resources import load_causal_lm

                model, tokenizer = load_causal_lm(model, dtype=dtype)
            if device != "cpu":
                model.to(device)
            for p in todo:
                build_shard(model, tokenizer, documents, out, p, key, window, min_context, batch_size, source, progress)
        else:
            from memlm.storage.ray_backend import build_shards_on_ray

            build_shards_on_ray(
                ray, build_shard, ShardPlan, model, dtype, device, documents, out, todo, key, window, min_context,
                batch_size, source, cpus_per_worker, gpus_per_worker,
            )  # fmt: skip
    counts = [len(Datastore.open(out / shard_name(p.index))) for p in plans]
    if counts != [p.count for p in plans]:
        raise MemlmError(
            f"shard sizes {counts} differ from the plan {[p.count for p in plans]}; rebuild into a new --out"
        )
    if not state.get("complete"):
        state.update(
            complete=True,
            count=int(sum(counts)),
            offsets=[int(x) for x in np.concatenate([[0], np.cumsum(counts)])[:-1]],
            build_seconds_last_run=time.perf_counter() - t0,
        )
        atomic_write_json(shards_path, state)
    return ShardedDatastore.open(out)
