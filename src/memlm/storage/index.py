"""Build, save, load and search the FAISS index over a datastore's keys.

A datastore's keys are an ``[N, D]`` float16 array (usually an ``np.memmap``); the index stores them under
ids ``0 .. N-1``, so an id returned by :func:`search` is a row of the datastore's values. This module never
imports the datastore: it takes the keys array itself and only ever converts ``chunk_size`` rows to float32 at
a time (plus the training sample), so building scales to datastores much larger than RAM.

Scores follow memlm's convention everywhere: **larger is closer**.

* ``metric="l2"``: score = ``-||q - k||^2`` (negative *squared* L2 distance; approximate for PQ/SQ indexes).
* ``metric="ip"``: score = ``q . k``.

An index is trusted only as far as it can be checked. Its sidecar ``<index>.json`` records the index file's size
and a sampled SHA-256 (and the full SHA-256), the factory, metric, ``n`` and ``d``, and the identity of the datastore
or phrase index it was built from (``source``: kind, count, dim, the SHA-256 of the keys and the build id).
:func:`load_index` refuses an index whose file does not match its sidecar (replaced, truncated, or a stale sidecar),
whose FAISS header disagrees with it (count, dimension, metric), or that was built from another datastore than the one
in its folder (see :func:`expected_source`); a missing sidecar is refused rather than guessed.

Where fewer than ``k`` neighbours exist (``k`` larger than the index, or an IVF probe that reaches too few
keys) the missing slots hold ``id = -1`` and ``score = -inf``; a softmax over such a row gives them
weight 0.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import faiss
import numpy as np
import torch
from tqdm.auto import tqdm

from memlm.errors import MemlmError
from memlm.io import schema
from memlm.io.fileio import (
    atomic_write_json,
    disk_full_error,
    is_disk_full,
    sample_sha256,
    sha256_file,
    unique_tmp,
)
from memlm.io.locking import folder_lock

__all__ = [
    "METRICS",
    "IndexPlan",
    "build_index",
    "default_factory",
    "exact_scores",
    "exact_search",
    "expected_source",
    "FLAT_BATCH_QUERIES",
    "flat_vectors",
    "index_metric",
    "load_index",
    "meta_path",
    "plan_index",
    "read_index_meta",
    "search",
    "validate_factory",
]

METRICS = ("l2", "ip")
"""Supported metrics: ``"l2"`` (squared Euclidean) and ``"ip"`` (inner product)."""

FLAT_MAX_N = 200_000
"""Up to this many keys :func:`default_factory` picks exact ``Flat`` search."""

IVF_FLAT_MAX_BYTES = 4 * 1024**3
"""Above ``FLAT_MAX_N`` keys, :func:`default_factory` keeps uncompressed ``IVF...,Flat`` codes up to this."""

DEFAULT_MIN_TRAIN = 100_000
"""Default training sample: ``min(n, max(40 * nlist, DEFAULT_MIN_TRAIN))`` keys (for indexes that train)."""

_FAISS_METRIC = {"l2": faiss.METRIC_L2, "ip": faiss.METRIC_INNER_PRODUCT}
_FACTORY_HELP = "e.g. 'Flat', 'HNSW32', 'IVF4096,Flat' or 'IVF4096,PQ64' (PQ m must divide the key dimension)"
# Per-block budget for the float32 temporaries of exact_scores / exact_search.
_EXACT_BLOCK_BYTES = 64 * 1024**2

_FLAT_CHUNK = 262_144  # keys per step when search() scores a flat index itself (exact_search's chunk_size)
FLAT_BATCH_QUERIES = 20
"""From this many queries :func:`search` scores a flat index by one matmul (batch-dependent rounding, as BLAS)."""

_RESCORE_BLOCK_BYTES = 8 * 1024**2
"""float32 neighbour rows per block of :func:`exact_scores`: small enough for the allocator to reuse the buffers
(a 64 MiB block was a fresh memory map, page-faulted anew for every block of queries)."""


# --------------------------------------------------------------------------------------------- factories


def _check_metric(metric: str) -> None:
    if metric not in METRICS:
        raise MemlmError(f"unknown metric {metric!r}; use one of {', '.join(METRICS)}")


def default_factory(n: int, d: int) -> str:
    """A sensible FAISS factory string for ``n`` keys of dimension ``d``.

    * ``n <= 200k``: ``"Flat"`` (exact search).
    * larger, if ``n * d * 4`` bytes fit in 4 GiB: ``"IVF{nlist},Flat"``;
    * otherwise ``"IVF{nlist},PQ{m}"`` (Khandelwal et al. used ``IVF4096,PQ64`` with ``nprobe=32``).

    ``nlist`` is ``4 * sqrt(n)`` rounded to the nearest power of two (at most 65536); ``m`` (bytes per key)
    is the largest divisor of ``d`` that is at most ``min(64, d / 2)`` (64 for d = 576, 768, 1024, ...),
    or ``"IVF{nlist},SQ8"`` when that divisor is below 8 (e.g. a prime ``d``).
    """
    if n <= FLAT_MAX_N:
        return "Flat"
    nlist = min(65536, 2 ** round(math.log2(4 * math.sqrt(n))))
    if n * d * 4 <= IVF_FLAT_MAX_BYTES:
        return f"IVF{nlist},Flat"
    m = next(m for m in range(min(64, max(1, d // 2)), 0, -1) if d % m == 0)
    if m < 8 and d > 16:  # awkward (e.g. prime) dimension: 8-bit scalar quantization instead
        return f"IVF{nlist},SQ8"
    return f"IVF{nlist},PQ{m}"


def _faiss_reason(err: BaseException) -> str:
    """The human part of a FAISS C++ exception message, on one line."""
    msg = " ".join(str(err).split())
    m = re.search(r" at \S+:\d+: (.*)$", msg)
    if m:
        msg = m.group(1)
    msg = re.sub(r"^Error: '.*?' failed: ", "", msg)
    return msg.rstrip(".")


def _make_index(factory: str, d: int, metric: str) -> faiss.Index:
    """``faiss.index_factory`` with errors rephrased as :class:`MemlmError`."""
    _check_metric(metric)
    if not isinstance(factory, str) or not factory.strip():
        raise MemlmError(f"empty FAISS index factory string; use {_FACTORY_HELP}")
    if d <= 0:
        raise MemlmError(f"key dimension must be positive, got {d}; check the datastore's keys")
    try:
        index = faiss.index_factory(int(d), factory, _FAISS_METRIC[metric])
    except RuntimeError as err:
        prefix = re.match(r"\s*(PCA|OPQ)", factory)
        reduced = "; after a PCA/OPQ prefix, m must divide the reduced dimension" if prefix else ""
        raise MemlmError(
            f"invalid FAISS index factory {factory!r} for {d}-dim keys ({_faiss_reason(err)}); use {_FACTORY_HELP}"
            f"{reduced}"
        ) from None
    for vt in _transforms(index):
        if isinstance(vt, faiss.PCAMatrix) and vt.d_out > vt.d_in:  # FAISS only finds out when training
            raise MemlmError(
                f"invalid FAISS index factory {factory!r} for {d}-dim keys (PCA{vt.d_out} cannot output more "
                f"dimensions than its {vt.d_in} inputs); use PCA{vt.d_in} or fewer"
            )
    return index


def _transforms(index: faiss.Index) -> list[Any]:
    """The vector transforms (PCA, OPQ, random rotation, ...) of an ``IndexPreTransform``, in order."""
    root = faiss.downcast_index(index)
    if not isinstance(root, faiss.IndexPreTransform):
        return []
    return [faiss.downcast_VectorTransform(root.chain.at(i)) for i in range(root.chain.size())]


_FACTORY_PROBE_DIM = 20160  # 2^6 3^2 5 7: divisible by every usual PQ/OPQ/PCA size, so only real syntax errors fail


def validate_factory(factory: str, d: int | None, metric: str = "l2") -> None:
    """Raise :class:`MemlmError` if ``factory`` is not a FAISS factory string usable on ``d``-dim keys (``None``: the
    dimension is not known yet, check the syntax only).

    Validation builds the (empty, untrained) index with ``faiss.index_factory``, which is cheap.
    """
    if d is not None:
        _make_index(factory, d, metric)
        return
    try:
        _make_index(factory, _FACTORY_PROBE_DIM, metric)
    except MemlmError as e:  # the probe dimension is not the caller's: leave it out of the message
        raise MemlmError(str(e).replace(f" for {_FACTORY_PROBE_DIM}-dim keys", "")) from None


def _sub_indexes(index: faiss.Index) -> list[Any]:
    """``index`` and the indexes nested in it (pre-transform target, IVF quantizer, HNSW storage, refine)."""
    out: list[Any] = []
    stack = [faiss.downcast_index(index)]
    while stack:
        idx = stack.pop()
        out.append(idx)
        if isinstance(idx, faiss.IndexPreTransform):
            stack.append(faiss.downcast_index(idx.index))
        elif isinstance(idx, faiss.IndexIVF):
            stack.append(faiss.downcast_index(idx.quantizer))
        elif isinstance(idx, faiss.IndexHNSW):
            stack.append(faiss.downcast_index(idx.storage))
        elif isinstance(idx, faiss.IndexRefine):
            stack.extend([faiss.downcast_index(idx.base_index), faiss.downcast_index(idx.refine_index)])
    return out


def _nlist(index: faiss.Index) -> int | None:
    ivf = faiss.try_extract_index_ivf(index)
    return None if ivf is None else int(ivf.nlist)


def _min_train(index: faiss.Index) -> int:
    """The fewest training vectors FAISS accepts for ``index`` (k-means needs >= one point per centroid)."""
    need = 1
    for vt in _transforms(index):
        if isinstance(vt, faiss.OPQMatrix):
            need = max(need, 256)  # OPQ trains an 8-bit PQ internally
        elif isinstance(vt, faiss.PCAMatrix):
            need = max(need, int(vt.d_out))  # a PCA of n points has at most n components
    for idx in _sub_indexes(index):
        if isinstance(idx, faiss.IndexIVF):
            need = max(need, int(idx.nlist))
        pq = getattr(idx, "pq", None)
        if isinstance(pq, faiss.ProductQuantizer):
            need = max(need, int(pq.ksub))
    return need


def _index_bytes(index: faiss.Index, n: int) -> tuple[int, int]:
    """Estimated ``(resident, serialized)`` bytes of ``index`` once it holds ``n`` vectors."""
    idx = faiss.downcast_index(index)
    if isinstance(idx, faiss.IndexPreTransform):
        extra = 0
        for i in range(idx.chain.size()):
            vt = faiss.downcast_VectorTransform(idx.chain.at(i))
            extra += 4 * (int(vt.d_in) * int(vt.d_out) + int(vt.d_out))
        mem, disk = _index_bytes(idx.index, n)
        return mem + extra, disk + extra
    if isinstance(idx, faiss.IndexIVF):
        nlist = int(idx.nlist)
        qmem, qdisk = _index_bytes(idx.quantizer, nlist)
        codes = n * (int(idx.code_size) + 8)  # codes + int64 ids in the inverted lists
        mem, disk = codes + qmem, codes + qdisk
        if isinstance(idx, faiss.IndexIVFPQ) and idx.by_residual and idx.metric_type == faiss.METRIC_L2:
            # precomputed tables (built on load when they fit FAISS's 2 GiB default limit)
            table = nlist * int(idx.pq.M) * int(idx.pq.ksub) * 4
            if table <= 2 * 1024**3:
                mem += table
        return mem, disk
    if isinstance(idx, faiss.IndexHNSW):
        smem, sdisk = _index_bytes(idx.storage, n)
        m = int(idx.hnsw.nb_neighbors(1))
        # int32 links: 2M at level 0 plus ~M/(M-1) on upper levels; int64 offsets and int32 levels per node
        links = int(n * (2 * m + m / max(1, m - 1)) * 4) + n * 12
        return smem + links, sdisk + links
    if isinstance(idx, faiss.IndexRefine):
        bmem, bdisk = _index_bytes(idx.base_index, n)
        rmem, rdisk = _index_bytes(idx.refine_index, n)
        return bmem + rmem, bdisk + rdisk
    if isinstance(idx, faiss.IndexFlatCodes):
        size = n * int(idx.code_size)
        return size, size
    size = n * int(idx.d) * 4  # unknown index type: assume uncompressed
    return size, size


# ------------------------------------------------------------------------------------------------- plan


def _fmt_bytes(b: int) -> str:
    size = float(b)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"


@dataclass(frozen=True)
class IndexPlan:
    """What :func:`build_index` will build, with size estimates.

    ``memory_bytes``: the index resident in RAM once loaded for search. ``disk_bytes``: the saved file.
    ``train_size``: keys sampled for training (0 for indexes that need none); building needs
    ``train_bytes = train_size * d * 4`` more RAM on top of the index while training.
    """

    factory: str
    metric: str
    n: int
    d: int
    train_size: int
    memory_bytes: int
    disk_bytes: int

    @property
    def train_bytes(self) -> int:
        """Extra RAM for the float32 training sample."""
        return self.train_size * self.d * 4

    def __str__(self) -> str:
        train = (
            f"training on {self.train_size:,} sampled keys needs ~{_fmt_bytes(self.train_bytes)} more"
            if self.train_size
            else "no training"
        )
        return (
            f"index {self.factory} ({self.metric}) over {self.n:,} x {self.d} keys: "
            f"~{_fmt_bytes(self.memory_bytes)} in RAM, ~{_fmt_bytes(self.disk_bytes)} on disk; {train}"
        )


def _suggest_nlist(n: int) -> int:
    """Largest power of two with at least 39 training points per centroid (FAISS's recommendation)."""
    return max(1, 2 ** int(math.floor(math.log2(max(1, n // 39)))))


def plan_index(
    n: int, d: int, factory: str | None = None, metric: str = "l2", train_size: int | None = None
) -> IndexPlan:
    """Validate an index spec for ``n`` keys of dimension ``d`` and estimate its memory and disk size.

    ``factory=None`` uses :func:`default_factory`. ``train_size=None`` samples
    ``min(n, max(40 * nlist, 100_000))`` keys for indexes that need training (IVF, PQ, OPQ, SQ, ...).
    Raises :class:`MemlmError` if the spec is invalid or ``n`` / ``train_size`` is too small to train it.
    """
    if n <= 0:
        raise MemlmError(f"cannot build an index over {n} keys; build the datastore first (it is empty)")
    factory = default_factory(n, d) if factory is None else factory
    index = _make_index(factory, d, metric)
    nlist = _nlist(index)
    if index.is_trained:
        size = 0
    else:
        need = _min_train(index)
        if n < need:
            fix = f"a smaller nlist such as 'IVF{_suggest_nlist(n)},...' or 'Flat'" if nlist else "'Flat'"
            raise MemlmError(
                f"index {factory!r} needs at least {need:,} keys to train but the datastore has only {n:,}; use {fix}"
            )
        if train_size is None:
            size = min(n, max(40 * (nlist or 0), DEFAULT_MIN_TRAIN))
        else:
            size = min(n, int(train_size))
            if size < need:
                raise MemlmError(
                    f"train_size {train_size:,} is too small for index {factory!r}, which needs at least "
                    f"{need:,} training keys; pass a train size >= {need:,} (or omit it for the default)"
                )
    mem, disk = _index_bytes(index, n)
    return IndexPlan(factory=factory, metric=metric, n=n, d=d, train_size=size, memory_bytes=mem, disk_bytes=disk)


# ------------------------------------------------------------------------------------------------ build


def _check_keys(keys: np.ndarray) -> tuple[int, int]:
    shape = getattr(keys, "shape", None)
    if shape is None or len(shape) != 2:
        raise MemlmError(f"keys must be a 2-D [N, D] array, got shape {shape}; pass the datastore's keys memmap")
    n, d = int(shape[0]), int(shape[1])
    if n == 0 or d == 0:
        raise MemlmError(f"keys array is empty (shape {tuple(shape)}); build the datastore before the index")
    return n, d


def _as_f32(block: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(block, dtype=np.float32)


def meta_path(index_path: str | os.PathLike[str]) -> Path:
    """The sidecar JSON written next to an index: ``<index_path>.json``."""
    p = Path(index_path)
    return p.with_name(p.name + ".json")


_PHRASE_FORMAT = "memlm-npm-phrase-index"
_REBUILD = "rebuild it with `memlm index build DIR` (or `memlm npm index` for a phrase index)"


def _source_of_manifest(manifest_path: Path) -> dict[str, Any] | None:
    """The identity an index built over the folder's keys must record (``None``: not a memlm data folder)."""
    try:
        raw = json.loads(manifest_path.read_bytes())
    except (OSError, ValueError):
        raw = None
    if isinstance(raw, dict) and raw.get("format") == _PHRASE_FORMAT:
        m = schema.check(raw, schema.PHRASE_MANIFEST, manifest_path, "phrase-index manifest",
                         "rebuild the phrase index with `memlm npm index`")  # fmt: skip
        return {
            "kind": "npm-phrase-index",
            "count": m["count"],
            "dim": m["dim"],
            "sha256": m["files"]["vectors"]["sha256"],
        }
    fix = "rebuild the datastore with `memlm datastore build --overwrite`"
    return datastore_source(schema.read_json(manifest_path, schema.DATASTORE_MANIFEST, "datastore manifest", fix))


def datastore_source(m: dict[str, Any]) -> dict[str, Any]:
    """The identity an index over a datastore's keys records (``source``), from the datastore's manifest ``m``."""
    src = {"kind": "datastore", "count": m["count"], "dim": m["key"]["dim"], "sha256": m["files"]["keys"]["sha256"]}
    return src | ({"build_id": m["build_id"]} if "build_id" in m else {})


def expected_source(index_path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The identity of the datastore or phrase index in ``index_path``'s folder (from its ``manifest.json``).

    ``None`` when the folder holds no manifest (an index over arbitrary keys). An index in a data folder must have been
    built from that folder's keys: :func:`load_index` compares this with the sidecar's ``source``.
    """
    manifest = Path(index_path).parent / "manifest.json"
    if not manifest.exists():
        return None
    return _source_of_manifest(manifest)


def _auto_source(keys: np.ndarray, out_path: Path) -> dict[str, Any] | None:
    """``source`` for keys memory-mapped from the ``keys.bin``/``vectors.bin`` of ``out_path``'s own folder."""
    filename = getattr(keys, "filename", None)
    folder = out_path.parent
    if filename is None or not (folder / "manifest.json").exists():
        return None
    if Path(filename).resolve() not in {(folder / n).resolve() for n in ("keys.bin", "vectors.bin")}:
        return None
    src = expected_source(out_path)
    if src is not None and (src["count"], src["dim"]) != tuple(keys.shape):
        return None
    return src


def _source_diff(recorded: dict[str, Any] | None, expected: dict[str, Any]) -> list[str]:
    if recorded is None:
        return ["it records no datastore identity (built by an older memlm or over other keys)"]
    out = []
    for k in ("kind", "count", "dim", "sha256", "build_id"):
        if k in recorded and k in expected and recorded[k] != expected[k]:
            a, b = recorded[k], expected[k]
            if k in ("sha256", "build_id"):
                a, b = str(a)[:12], str(b)[:12]
            out.append(f"{'keys sha256' if k == 'sha256' else k} {a} (index) vs {b} (folder)")
    return out


def build_index(
    keys: np.ndarray,
    out_path: str | os.PathLike[str],
    factory: str | None = None,
    metric: str = "l2",
    train_size: int | None = None,
    chunk_size: int = 65536,
    seed: int = 0,
    progress: bool = True,
    source: dict[str, Any] | None = None,
) -> faiss.Index:
    """Train and fill a FAISS index over ``keys`` ([N, D], float16 or float32), save it, and return it.

    * Training uses ``train_size`` keys sampled without replacement with ``seed`` (indices sorted, so a
      memmap is read front to back); see :func:`plan_index` for defaults and size checks.
    * Keys are added in order (id ``i`` = row ``i``), ``chunk_size`` rows at a time: at most one chunk of
      keys is ever converted to float32.
    * The index is written to a uniquely named temporary file and then renamed over ``out_path``, so a crash never
      leaves a half-written index; a sidecar ``<out_path>.json`` records factory, metric, n, d, train_size, seed, the
      FAISS version, the build time, the file's size and checksums and ``source``: the identity of the datastore the
      keys come from (see :func:`read_index_meta`). ``source=None`` takes it from the folder's manifest when ``keys``
      is that folder's ``keys.bin`` memmap (``Datastore.keys``).
    * The folder of ``out_path`` is locked for the build (:func:`memlm.io.locking.folder_lock`).
    * PQ indexes skip FAISS's polysemous training (on by default for ``PQ{m}``; it only serves polysemous
      Hamming-filtered search, which memlm never enables, and it dominates training time).
    * With ``progress=True`` the plan (:class:`IndexPlan`) is printed to stderr and a progress bar is shown.
    """
    n, d = _check_keys(keys)
    if chunk_size <= 0:
        raise MemlmError(f"chunk_size must be positive, got {chunk_size}; use e.g. 65536")
    plan = plan_index(n, d, factory, metric, train_size)
    out_path = Path(out_path)
    if source is None:
        source = _auto_source(keys, out_path)
    with folder_lock(out_path.parent, "build an index"):
        return _build_index_locked(keys, out_path, plan, chunk_size, seed, progress, source)


def train_on_sample(index: faiss.Index, keys, plan: IndexPlan, seed: int, chunk_size: int) -> None:
    """Train ``index`` on ``plan.train_size`` keys drawn without replacement with ``seed`` (sorted row ids, read
    ``chunk_size`` at a time; all keys when there are no more): the same sample for one datastore and for the
    concatenated keys of a sharded one."""
    n, d = int(keys.shape[0]), int(keys.shape[1])
    rng = np.random.default_rng(seed)
    sample = np.sort(rng.choice(n, size=plan.train_size, replace=False)) if plan.train_size < n else None
    train = np.empty((plan.train_size, d), dtype=np.float32)
    for s in range(0, plan.train_size, chunk_size):
        e = min(s + chunk_size, plan.train_size)
        train[s:e] = keys[s:e] if sample is None else keys[sample[s:e]]
    try:
        index.train(train)
    except RuntimeError as err:
        raise MemlmError(
            f"training index {plan.factory!r} failed ({_faiss_reason(err)}); "
            "use a smaller nlist, a larger train size, or 'Flat'"
        ) from None


def trained_index(keys, plan: IndexPlan, seed: int, chunk_size: int, progress: bool, sample: str = "") -> faiss.Index:
    """The empty index of ``plan``, trained (:func:`train_on_sample`, the k-means seeded with ``seed``; no polysemous
    PQ training, 10x slower for a search mode memlm never uses). ``sample`` describes the keys in the progress line."""
    index = _make_index(plan.factory, plan.d, plan.metric)
    ivf = faiss.try_extract_index_ivf(index)
    if ivf is not None:
        ivf.cp.seed = seed
    for sub in _sub_indexes(index):
        if getattr(sub, "do_polysemous_training", False):
            sub.do_polysemous_training = False
    if plan.train_size:
        if progress:
            print(f"training {plan.factory} on {plan.train_size:,} keys{sample} ...", file=sys.stderr, flush=True)
        train_on_sample(index, keys, plan, seed, chunk_size)
    return index


def _build_index_locked(
    keys: np.ndarray,
    out_path: Path,
    plan: IndexPlan,
    chunk_size: int,
    seed: int,
    progress: bool,
    source: dict[str, Any] | None,
) -> faiss.Index:
    t0 = time.perf_counter()
    n = plan.n
    for stale in [out_path.with_name(out_path.name + ".tmp"), *out_path.parent.glob(f".{out_path.name}.*.tmp")]:
        stale.unlink(missing_ok=True)  # left by a killed build (we hold the folder's lock: no one else writes here)
    if progress:
        print(plan, file=sys.stderr, flush=True)
    index = trained_index(keys, plan, seed, chunk_size, progress)
    with tqdm(total=n, unit="key", unit_scale=True, desc="adding keys", disable=not progress) as bar:
        for s in range(0, n, chunk_size):
            e = min(s + chunk_size, n)
            try:
                index.add(_as_f32(keys[s:e]))
            except RuntimeError as err:
                raise MemlmError(
                    f"cannot add keys to index {plan.factory!r} ({_faiss_reason(err)}); "
                    f"use a factory without IDMap, {_FACTORY_HELP}"
                ) from None
            bar.update(e - s)

    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = unique_tmp(out_path)
    try:
        faiss.write_index(index, str(tmp))
        # the sidecar (with the new file's checksums) goes first: a crash between the two renames leaves a sidecar
        # that does not match the old index file, which load_index refuses, never a stale sidecar that matches
        meta = asdict(plan) | {
            "seed": seed,
            "chunk_size": chunk_size,
            "faiss_version": faiss.__version__,
            "build_seconds": round(time.perf_counter() - t0, 3),
            "file": {"bytes": tmp.stat().st_size, "sample_sha256": sample_sha256(tmp), "sha256": sha256_file(tmp)},
            "source": source,
        }
        atomic_write_json(meta_path(out_path), meta)
        os.replace(tmp, out_path)
    except RuntimeError as err:
        reason = _faiss_reason(err)
        if "No space left" in reason or "quota" in reason.lower():
            raise disk_full_error(out_path, resume=False) from None
        raise MemlmError(
            f"cannot write index to {out_path} ({reason}); check the folder is writable and has "
            f"~{_fmt_bytes(plan.disk_bytes)} free"
        ) from None
    except OSError as err:
        if is_disk_full(err):
            raise disk_full_error(out_path, resume=False) from None
        raise MemlmError(f"cannot write index to {out_path} ({err.strerror or err}); check the folder") from None
    finally:
        tmp.unlink(missing_ok=True)
    return index


# ------------------------------------------------------------------------------------------------- load


def read_index_meta(index_path: str | os.PathLike[str], verify: bool = False) -> dict[str, Any] | None:
    """The sidecar JSON of an index written by :func:`build_index`, checked against the index file.

    ``None`` when there is no index file at ``index_path``. Otherwise the sidecar must exist, pass the schema check
    and match the file's size and sampled SHA-256 (``verify=True``: the full SHA-256 too); anything else is a
    :class:`MemlmError`: an index whose metric or origin cannot be known is not used.
    """
    path = Path(index_path)
    if not path.is_file():
        return None
    side = meta_path(path)
    if not side.exists():
        raise MemlmError(f"index {path} has no {side.name} (its metric and datastore are unknown); {_REBUILD}")
    meta = schema.read_json(side, schema.INDEX_META, "index sidecar", _REBUILD)
    file = meta.get("file")
    if file is not None:
        size = path.stat().st_size
        if size != file["bytes"] or sample_sha256(path) != file["sample_sha256"]:
            what = f"{size} bytes, its sidecar says {file['bytes']}" if size != file["bytes"] else "its content differs"
            raise MemlmError(
                f"index file {path} does not match {side.name} ({what}: the index was replaced, is corrupt or "
                f"truncated, or the sidecar is stale); {_REBUILD}"
            )
        if verify:
            if "sha256" not in file:
                raise MemlmError(f"{side} records no full checksum to verify; {_REBUILD}")
            if sha256_file(path) != file["sha256"]:
                raise MemlmError(f"checksum mismatch in index file {path}: the file is corrupt; {_REBUILD}")
    return meta


def index_metric(index: faiss.Index) -> str:
    """``"l2"`` or ``"ip"`` for a FAISS index (:class:`MemlmError` for other FAISS metrics)."""
    mt = faiss.downcast_index(index).metric_type
    for name, code in _FAISS_METRIC.items():
        if mt == code:
            return name
    raise MemlmError(f"index uses FAISS metric type {mt}, which memlm does not support; rebuild with l2 or ip")


def load_index(
    path: str | os.PathLike[str],
    nprobe: int = 32,
    hnsw_ef_search: int | None = None,
    expect: dict[str, Any] | None = None,
    verify: bool = False,
    expect_from: str | os.PathLike[str] | None = None,
) -> faiss.Index:
    """Read an index saved by :func:`build_index`, check it, and set its search-time knobs.

    ``nprobe`` (capped at ``nlist``) applies to IVF indexes, ``hnsw_ef_search`` to HNSW ones; both are
    ignored for index types that lack them. A missing or corrupt file raises :class:`MemlmError`, and so does an
    index that does not match its sidecar (:func:`read_index_meta`; ``verify=True`` adds the full SHA-256), whose
    count, dimension or metric disagree with the sidecar, or whose recorded ``source`` is not ``expect`` (default:
    :func:`expected_source`, the datastore or phrase index in the index's folder, if any). ``expect_from`` names the
    folder ``expect`` describes in the messages (default: the index's folder).
    """
    if hnsw_ef_search is not None and hnsw_ef_search < 1:
        raise MemlmError(f"hnsw_ef_search must be >= 1, got {hnsw_ef_search}; try 128")
    path = _index_file(path, nprobe)
    meta = read_index_meta(path, verify=verify)
    assert meta is not None
    if expect is None:
        expect = expected_source(path)
    where = path.parent if expect_from is None else Path(expect_from)
    if expect is not None:
        diff = _source_diff(meta.get("source"), expect)
        if diff:
            raise MemlmError(
                f"index {path} was not built from the {expect['kind']} in {where} ({'; '.join(diff)}); {_REBUILD}"
            )
    try:
        index = faiss.read_index(str(path))
    except (RuntimeError, MemoryError) as err:
        raise MemlmError(
            f"index file {path} is corrupt or truncated ({_faiss_reason(err)}); rebuild with `memlm index build DIR`"
        ) from None
    got = (int(index.ntotal), int(index.d), index_metric(index))
    want = (meta["n"], meta["d"], meta["metric"])
    if got != want:
        raise MemlmError(
            f"index {path} holds {got[0]} x {got[1]} {got[2]} vectors but {meta_path(path).name} says "
            f"{want[0]} x {want[1]} {want[2]} (a stale or foreign sidecar); {_REBUILD}"
        )
    if expect is not None and (got[0], got[1]) != (expect["count"], expect["dim"]):
        raise MemlmError(
            f"index {path} holds {got[0]} x {got[1]} vectors, the {expect['kind']} in {where} has "
            f"{expect['count']} x {expect['dim']}; {_REBUILD}"
        )
    set_nprobe(index, nprobe)
    if hnsw_ef_search is not None:
        for idx in _sub_indexes(index):
            if isinstance(idx, faiss.IndexHNSW):
                idx.hnsw.efSearch = int(hnsw_ef_search)
    return index


def _index_file(path: str | os.PathLike[str], nprobe: int) -> Path:
    """``path`` checked to be an index file, with a valid ``nprobe`` to search it with."""
    if nprobe < 1:
        raise MemlmError(f"nprobe must be >= 1, got {nprobe}; the usual value is 32")
    if not Path(path).is_file():
        raise MemlmError(f"no index at {path}; build it with `memlm index build DIR`")
    return Path(path)


def set_nprobe(index: faiss.Index, nprobe: int) -> None:
    ivf = faiss.try_extract_index_ivf(index)
    if ivf is not None:
        ivf.nprobe = min(int(nprobe), int(ivf.nlist))


def _sidecar_factory(path: Path) -> str:
    """The factory string in an index's (or shard index's) sidecar, "IVF" when it cannot be read (both mappings are
    then tried)."""
    try:
        meta = json.loads(meta_path(path).read_text())
        return str(meta.get("factory", "IVF")) if isinstance(meta, dict) else "IVF"
    except (OSError, ValueError):
        return "IVF"


def set_threads(n: int) -> None:
    """The number of OpenMP threads FAISS searches and builds with (at least 1)."""
    faiss.omp_set_num_threads(max(1, int(n)))


def blas_threshold() -> int:
    """Below this many queries :func:`search` scores one query at a time, so a query's result does not depend on the
    batch it came in: FAISS's ``distance_compute_blas_threshold`` (20 in older FAISS; FAISS 1.15.1 reports 128,000),
    capped at ``FLAT_BATCH_QUERIES`` (20), from which a flat index is scored by a batched matmul
    (:func:`flat_vectors`)."""
    return min(int(faiss.cvar.distance_compute_blas_threshold), FLAT_BATCH_QUERIES)


def flat_ip_index(vectors: np.ndarray) -> faiss.Index:
    """An exact inner-product index over ``vectors [N, D]`` (float32), in memory."""
    index = faiss.IndexFlatIP(int(vectors.shape[1]))
    index.add(np.ascontiguousarray(vectors, dtype=np.float32))
    return index


def has_exact_distances(index: faiss.Index) -> bool:
    """True for an index whose distances are exact (``Flat``, ``IVF...,Flat``), False when it compresses the keys."""
    base = faiss.downcast_index(index)
    ivf = faiss.try_extract_index_ivf(index)
    ivf = faiss.downcast_index(ivf) if ivf is not None else None
    return isinstance(base, faiss.IndexFlat) or isinstance(ivf, faiss.IndexIVFFlat)


def load_index_mmap(path: str | os.PathLike[str], nprobe: int = 32) -> faiss.Index:
    """Read an index memory-mapped: IVF inverted lists (``IO_FLAG_MMAP``) or flat codes (``IO_FLAG_MMAP_IFC``) stay
    in the file and reach RAM through the page cache, so the resident part is the quantizer (+ tables)."""
    path = _index_file(path, nprobe)
    ivf = "IVF" in _sidecar_factory(path)
    flags = (faiss.IO_FLAG_MMAP | faiss.IO_FLAG_READ_ONLY) if ivf else faiss.IO_FLAG_MMAP_IFC
    try:
        index = faiss.read_index(str(path), flags)
    except RuntimeError:
        try:  # the sidecar guessed wrong: the other kind of mapping, then a plain read
            index = faiss.read_index(str(path), faiss.IO_FLAG_MMAP_IFC if ivf else faiss.IO_FLAG_MMAP)
        except RuntimeError as err:
            raise MemlmError(
                f"index file {path} is corrupt or truncated ({_faiss_reason(err)}); rebuild the index"
            ) from None
    set_nprobe(index, nprobe)
    return index


# ----------------------------------------------------------------------------------------------- search


def _check_queries(queries: np.ndarray, d: int) -> np.ndarray:
    q = np.ascontiguousarray(queries, dtype=np.float32)
    if q.ndim != 2 or q.shape[1] != d:
        raise MemlmError(
            f"queries must be [Q, {d}] to match the keys, got shape {tuple(q.shape)}; "
            "use the same model and layer as the datastore"
        )
    return q


def _check_k(k: int) -> int:
    if k < 1:
        raise MemlmError(f"k must be >= 1, got {k}; the kNN-LM default is 1024")
    return int(k)


def search(index: faiss.Index, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Top-``k`` neighbours of ``queries`` ([Q, D]) in ``index``.

    Returns ``(scores, ids)``: ``float32 [Q, k]`` similarities (``-squared L2`` for l2 indexes, inner product
    for ip; larger = closer, rows sorted descending) and ``int64 [Q, k]`` key ids. Slots with no neighbour
    (``k > index.ntotal``, or too few keys in the probed IVF lists) get ``id = -1`` and ``score = -inf``.
    A plain CPU flat index searched with at least ``FLAT_BATCH_QUERIES`` (20) queries is scored by
    :func:`exact_search` on its own vectors (:func:`flat_vectors`); fewer queries, and every other index, by FAISS.
    """
    k = _check_k(k)
    q = _check_queries(queries, int(index.d))
    ntotal = int(index.ntotal)
    kk = min(k, ntotal)
    if kk == 0:
        return np.full((q.shape[0], k), -np.inf, np.float32), np.full((q.shape[0], k), -1, np.int64)
    flat = flat_vectors(index)
    if flat is not None and q.shape[0] >= FLAT_BATCH_QUERIES:
        # exact either way; torch's matmul + top-k is ~1.9x FAISS's per-query scan at k = 1024 here. Fewer queries
        # go to FAISS one by one, as before: their scores then do not depend on the batch (blas_threshold).
        return exact_search(flat[0], q, k, flat[1], chunk_size=_FLAT_CHUNK)
    dist, ids = index.search(q, kk)
    return _to_similarities(dist, ids, index.metric_type == faiss.METRIC_L2, k)


def flat_vectors(index: Any) -> tuple[np.ndarray, str] | None:
    """``(vectors [ntotal, d] float32, metric)`` of a plain CPU flat index (``IndexFlat``, ``IndexFlatL2``,
    ``IndexFlatIP``), a view of the index's own memory (no copy; valid while the index lives); ``None`` for any other
    index (IVF, PQ, HNSW, a GPU index, a wrapper) or an empty one.

    :func:`search` answers such an index with :func:`exact_search` on these vectors instead of FAISS's own search:
    both are exact (every key scored), but FAISS keeps one heap per query, which at the kNN-LM's k = 1,024 costs
    ~1 ms per query on 2 cores (43,344 keys: 1,074 queries/s), against 2,009 for torch's matmul and ``topk``
    (``docs/results/speed/bench_search_flat_n43344.json``). Scores agree to float32 rounding (the same
    ``||q||^2 - 2 q.k + ||k||^2``, summed in another order); neighbours tied to the last bit may come in another order.
    Fewer than ``FLAT_BATCH_QUERIES`` queries still go to FAISS (see :func:`blas_threshold`).
    """
    if type(index).__name__ not in ("IndexFlat", "IndexFlatL2", "IndexFlatIP") or int(index.ntotal) == 0:
        return None
    metric = {faiss.METRIC_L2: "l2", faiss.METRIC_INNER_PRODUCT: "ip"}.get(index.metric_type)
    if metric is None:
        return None
    n, d = int(index.ntotal), int(index.d)
    return faiss.rev_swig_ptr(index.get_xb(), n * d).reshape(n, d), metric


def _to_similarities(dist: np.ndarray, ids: np.ndarray, is_l2: bool, k: int) -> tuple[np.ndarray, np.ndarray]:
    """FAISS ``(distances, ids)`` -> memlm ``(scores, ids)``, in place: negate l2, -inf at id -1, pad to k."""
    if is_l2:
        np.negative(dist, out=dist)
    missing = ids < 0
    if missing.any():
        dist[missing] = -np.inf
    return _pad_to_k(dist, ids, k)


def _pad_to_k(scores: np.ndarray, ids: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """``(scores, ids)`` padded to ``k`` columns with empty slots (score ``-inf``, id ``-1``)."""
    if scores.shape[1] >= k:
        return scores, ids
    pad = ((0, 0), (0, k - scores.shape[1]))
    return np.pad(scores, pad, constant_values=-np.inf), np.pad(ids, pad, constant_values=-1)


def exact_scores(keys: np.ndarray, ids: np.ndarray, queries: np.ndarray, metric: str) -> np.ndarray:
    """Exact similarities between each query and its neighbours, recomputed from the stored keys.

    ``ids`` is ``[Q, k]`` (e.g. from :func:`search`), ``queries`` ``[Q, D]``. Returns ``float32 [Q, k]``:
    ``-||q - k||^2`` for l2 or ``q . k`` for ip, and ``-inf`` where ``id == -1``. Keys are read once per
    block of queries, by unique sorted id (fast on a memmap), and cast to float32.
    """
    _check_metric(metric)
    n, d = _check_keys(keys)
    q = _check_queries(queries, d)
    ids = np.asarray(ids)
    if ids.ndim != 2 or ids.shape[0] != q.shape[0]:
        raise MemlmError(
            f"ids must be [Q, k] with Q = {q.shape[0]} queries, got shape {ids.shape}; pass ids from search()"
        )
    if ids.size and int(ids.max()) >= n:
        raise MemlmError(
            f"neighbour id {int(ids.max())} is out of range for a datastore of {n:,} keys; the index was "
            "built for a different datastore, rebuild it with `memlm index build DIR`"
        )
    nq, k = ids.shape
    out = np.full((nq, k), -np.inf, dtype=np.float32)
    if k == 0:
        return out
    block = max(1, _RESCORE_BLOCK_BYTES // (k * d * 4))
    f16 = np.dtype(getattr(keys, "dtype", np.float32)) == np.float16
    buf = torch.empty((min(block, nq) * k, d), dtype=torch.float32) if f16 else None  # reused float32 rows
    for s in range(0, nq, block):
        e = min(s + block, nq)
        bids = ids[s:e]
        valid = bids >= 0
        if not valid.any():
            continue
        uniq, inv = np.unique(bids[valid], return_inverse=True)
        if f16:  # read once per unique id, expand in float16, cast (exact) into the reused buffer with torch
            k16 = np.ascontiguousarray(np.asarray(keys[uniq])[inv])
            kv = buf[: len(k16)].copy_(torch.from_numpy(k16.view(np.int16)).view(torch.float16)).numpy()
        else:
            kv = _as_f32(keys[uniq])[inv]  # [n_valid, D]
        # each valid (query, neighbour) pair's query row, in the row-major order of the mask: the same contiguous
        # [n_valid, D] operands (so the same einsum and the same bits) as np.broadcast_to(q[:, None], ...)[valid]
        qv = q[s:e][np.nonzero(valid)[0]]  # [n_valid, D]
        if metric == "l2":
            diff = qv - kv
            vals = -np.einsum("nd,nd->n", diff, diff)
        else:
            vals = np.einsum("nd,nd->n", qv, kv)
        out[s:e][valid] = vals
    return out


def exact_search(
    keys: np.ndarray,
    queries: np.ndarray,
    k: int,
    metric: str,
    chunk_size: int = 16384,
    device: str | torch.device | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Brute-force top-``k`` over *all* keys (the "real mask" of Xu et al.), same output as :func:`search`.

    Keys are read ``chunk_size`` rows at a time (cast to float32), scored against all queries with a torch
    matmul (l2 via ``||q||^2 - 2 q.k + ||k||^2``), reduced with ``torch.topk`` and merged into a running
    top-``k``. Memory stays bounded by one key chunk plus ``[Q, k]`` results. ``device`` (default CPU) can
    be a CUDA device. Missing slots (``k > N``) get ``id = -1`` and ``score = -inf``.
    """
    _check_metric(metric)
    k = _check_k(k)
    n, d = _check_keys(keys)
    q_np = _check_queries(queries, d)
    if chunk_size <= 0:
        raise MemlmError(f"chunk_size must be positive, got {chunk_size}; use e.g. 16384")
    dev = torch.device(device) if device is not None else torch.device("cpu")
    nq = q_np.shape[0]
    kk = min(k, n)
    q = torch.from_numpy(q_np).to(dev)
    best_s = torch.full((nq, 0), -torch.inf, dtype=torch.float32, device=dev)
    best_i = torch.empty((nq, 0), dtype=torch.int64, device=dev)
    # split queries so one [q_block, chunk] score matrix stays within the block budget
    q_block = max(1, _EXACT_BLOCK_BYTES // (4 * min(chunk_size, n)))
    with torch.inference_mode():
        for s in range(0, n, chunk_size):
            e = min(s + chunk_size, n)
            kc = torch.from_numpy(_as_f32(keys[s:e])).to(dev)
            knorm = (kc * kc).sum(1) if metric == "l2" else None
            new_s, new_i = [], []
            for qs in range(0, nq, q_block):
                sims = q[qs : qs + q_block] @ kc.T
                if knorm is not None:
                    sims.mul_(2).sub_(knorm)  # -(||k||^2 - 2 q.k); ||q||^2 is added at the end
                top_s, top_i = torch.topk(sims, min(kk, e - s), dim=1)
                new_s.append(top_s)
                new_i.append(top_i + s)
            cat_s = torch.cat([best_s, torch.cat(new_s)], dim=1)
            cat_i = torch.cat([best_i, torch.cat(new_i)], dim=1)
            best_s, pos = torch.topk(cat_s, min(kk, cat_s.shape[1]), dim=1)
            best_i = torch.gather(cat_i, 1, pos)
        if metric == "l2":
            best_s = (best_s - (q * q).sum(1, keepdim=True)).clamp_(max=0.0)
    scores = best_s.cpu().numpy().astype(np.float32, copy=False)
    ids = best_i.cpu().numpy().astype(np.int64, copy=False)
    return _pad_to_k(scores, ids, k)
