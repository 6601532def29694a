"""Ray for memlm: connect to a cluster, build shards as tasks, add shard indexes as tasks, search shards with actors.

Ray is optional (``pip install memlm[ray]``); everything here imports it lazily. ``address="local"`` starts a local
cluster on this machine (``ray.init(num_cpus=os.cpu_count())``); any other address joins an existing cluster
(``ray.init(address=...)``; ``"auto"`` finds the one started by ``ray start`` on this node). Every node must have
memlm (and the model, for builds) installed; a local cluster inherits this process's environment (``PYTHONPATH``).

* **Build**: one task per unfinished shard (:func:`build_shards_on_ray`), ``num_cpus=cpus_per_worker`` (torch uses
  that many threads) and ``num_gpus=gpus_per_worker``. A worker process keeps the model it loaded and reuses it for the
  next shard it gets ("a model per worker"). A task whose worker dies is retried by Ray (``max_retries``); the retry
  resumes the shard from its ``progress.json``, and a rerun of the command after a crash of the driver redoes only
  unfinished shards.
* **Search**: one actor per shard (:class:`memlm.storage.sharded_index.ShardedSearcher` with ``ray=``) holding
  that shard's FAISS index memory-mapped; the queries go to the object store once per batch, each actor returns its
  top-k with global ids, the driver merges.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from memlm.errors import MemlmError

__all__ = ["connect", "build_shards_on_ray", "add_shard_indexes_on_ray", "ShardActorPool"]

_MODELS: dict[tuple[str, str, str], Any] = {}  # per worker process: (name, dtype, device) -> (model, tokenizer)


def _ray():
    try:
        import ray
    except ImportError:
        raise MemlmError("Ray is not installed: pip install 'memlm[ray]' (or ray), or omit --ray") from None
    return ray


def connect(address: str):
    """Initialise Ray once per process: ``"local"`` starts a local cluster, anything else is ``ray.init(address)``."""
    ray = _ray()
    if ray.is_initialized():
        return ray
    env = {"env_vars": {k: os.environ[k] for k in ("PYTHONPATH", "MEMLM_HOME", "HF_HUB_OFFLINE") if k in os.environ}}
    try:
        if address == "local":
            ray.init(  # address="local": always a new cluster, never one that `ray start` left running
                address="local",
                num_cpus=os.cpu_count(),
                include_dashboard=False,
                runtime_env=env,
                logging_level="WARNING",
            )
        else:
            ray.init(address=address, runtime_env=env, logging_level="WARNING")
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise MemlmError(
            f"cannot connect to the Ray cluster at {address!r} ({e}); start one with `ray start --head` or use "
            "--ray local"
        ) from None
    return ray


def _worker_model(name: str, dtype: str, device: str):
    key = (name, dtype, device)
    if key not in _MODELS:
        from memlm.models.resources import load_causal_lm

        model, tok = load_causal_lm(name, dtype=dtype)
        _MODELS[key] = (model.to(device), tok)
    return _MODELS[key]


def _build_shard_task(
    build_shard: Callable, plan_cls: type, name: str, dtype: str, device: str, threads: int, docs: Sequence, out: str,
    plan: dict, kw: dict,
) -> int:  # fmt: skip
    import torch

    torch.set_num_threads(max(1, threads))
    model, tok = _worker_model(name, dtype, device)
    p = plan_cls(**plan)
    # ``docs`` holds documents [read_doc, doc_hi): shift the plan to that slice, then back for the provenance
    return len(build_shard(model, tok, _Shifted(docs, p.read_doc), out, p, progress=False, **kw))


class _Shifted(Sequence):
    """``docs`` (the slice starting at document ``start``) indexed by global document number."""

    def __init__(self, docs: Sequence, start: int) -> None:
        self.docs, self.start = docs, start

    def __len__(self) -> int:
        return self.start + len(self.docs)

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            a, b, _ = i.indices(len(self))
            return self.docs[max(a - self.start, 0) : max(b - self.start, 0)]
        return self.docs[i - self.start]


def build_shards_on_ray(
    address: str,
    build_shard: Callable,
    plan_cls: type,
    model_name: str,
    dtype: str,
    device: str,
    documents: Sequence,
    out: Path,
    plans: Sequence,
    key,
    window: int,
    min_context: int,
    batch_size: int,
    source: dict[str, Any],
    cpus_per_worker: int = 1,
    gpus_per_worker: float = 0.0,
    max_retries: int = 3,
) -> list[int]:
    """Build the shards of ``plans`` as Ray tasks (each gets only the documents it reads); returns their counts.

    ``build_shard`` / ``plan_cls`` are :func:`memlm.knnlm.write.build_shard` and its ``ShardPlan``, passed in by the
    caller (Ray pickles them by reference): this module runs work, it does not import what it runs."""
    ray = connect(address)
    if device.startswith("cuda") and not gpus_per_worker:
        gpus_per_worker = 1.0
    task = ray.remote(_build_shard_task).options(
        num_cpus=cpus_per_worker, num_gpus=gpus_per_worker, max_retries=max_retries
    )
    from memlm.data.corpora import Document

    def portable(docs: Sequence) -> list:  # only .id and .text are read: plain Documents unpickle on every node
        return [Document(str(d.id), d.text) for d in docs]

    kw = {"key": key, "window": window, "min_context": min_context, "batch_size": batch_size, "source": source}
    refs = [
        task.remote(
            build_shard,
            plan_cls,
            model_name,
            dtype,
            device,
            cpus_per_worker,
            portable(documents[p.read_doc : p.doc_hi]),
            str(out),
            p.as_dict(),
            kw,
        )
        for p in plans
    ]
    try:
        return ray.get(refs)
    except Exception as e:  # a task's MemlmError arrives wrapped in a RayTaskError
        cause = getattr(e, "cause", None)
        if isinstance(cause, MemlmError):
            raise MemlmError(str(cause)) from None
        raise MemlmError(f"a shard build failed on Ray ({type(e).__name__}: {e}); rerun the command to resume") from e


def _add_index_task(
    add_shard_index: Callable, trained: str, keys_path: str, n: int, d: int, out: str, meta: dict, threads: int
) -> int:
    from memlm.storage.index import set_threads

    set_threads(threads)
    return add_shard_index(trained, keys_path, n, d, out, meta)


def add_shard_indexes_on_ray(
    address: str, jobs: Sequence[tuple], add_shard_index: Callable, threads: int = 1
) -> list[int]:
    """Run ``add_shard_index`` (:func:`memlm.storage.sharded_index.add_shard_index`) for each job tuple as a Ray
    task."""
    ray = connect(address)
    task = ray.remote(_add_index_task).options(num_cpus=threads, max_retries=3)
    return ray.get([task.remote(add_shard_index, *job, threads) for job in jobs])


class _ShardActor:
    """Holds one shard's index (memory-mapped) and answers top-k queries with global ids; ``ops`` are
    :mod:`memlm.storage.sharded_index`'s ``(load_index_mmap, search_with_offset, set_nprobe)``."""

    def __init__(self, path: str, nprobe: int, offset: int, threads: int, ops: tuple) -> None:
        from memlm.storage.index import set_threads

        set_threads(threads)
        self.load, self.search_fn, self.set_nprobe_fn = ops
        self.index = self.load(path, nprobe)
        self.offset = offset

    def search(self, queries, k: int):
        return self.search_fn(self.index, queries, k, self.offset)

    def set_nprobe(self, nprobe: int) -> None:
        self.set_nprobe_fn(self.index, nprobe)


class ShardActorPool:
    """One Ray actor per shard index; :meth:`search` fans out and returns each shard's (scores, global ids)."""

    def __init__(
        self, address: str, paths: Sequence[str], offsets: Sequence[int], nprobe: int, ops: tuple, cpus: float = 1
    ):
        ray = connect(address)
        self.ray = ray
        threads = max(1, int(cpus))
        # every actor must fit at once (search waits on all of them): with more shards than CPUs each asks for a share
        cluster = float(ray.cluster_resources().get("CPU", 0) or 0)
        if cluster > 0 and len(paths) * cpus > cluster:
            cpus = cluster / len(paths)
        cls = ray.remote(_ShardActor).options(num_cpus=cpus, scheduling_strategy="SPREAD")
        self.actors = [cls.remote(p, nprobe, int(o), threads, ops) for p, o in zip(paths, offsets, strict=True)]

    def search(self, queries, k: int) -> list:
        ref = self.ray.put(queries)
        return self.ray.get([a.search.remote(ref, k) for a in self.actors])

    def set_nprobe(self, nprobe: int) -> None:
        self.ray.get([a.set_nprobe.remote(nprobe) for a in self.actors])

    def close(self) -> None:
        for a in self.actors:
            try:
                self.ray.kill(a)
            except Exception:  # the cluster may already be shut down
                pass
        self.actors = []
