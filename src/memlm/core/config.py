"""``RetrievalConfig``: every setting that decides what a memory returns and how it is scored, in one record.

Each dump and result file memlm writes carries ``meta["retrieval"] = RetrievalConfig(...).to_dict()``, so a number
can always be traced to its k, τ, λ, search and score mode, nprobe, windows and efficiency options.

Efficiency options of the kNN-LM (all off by default; :mod:`memlm.knnlm`):

* ``adaptive``: path of a trained gate (He et al. 2021, Sec. 4); ``adaptive_fraction`` the share of tokens searched
  (the gate's threshold is set to reach it on the evaluated text);
* ``pointer_min``: RetoMaton's pointer reuse (Alon et al. 2022): search only when fewer than this many pointers
  survive (0 = off); ``pointer_rule``: what a search row scores with, "retomaton" (search results + surviving
  pointers, the authors') or "replace" (search results only);
* ``pipeline``: the FAISS search of one batch runs while the model computes the next.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from memlm.errors import MemlmError

__all__ = [
    "DEFAULT_CACHE_LAMBDA",
    "DEFAULT_K",
    "DEFAULT_MIN_CONTEXT",
    "DEFAULT_WINDOW",
    "RetrievalConfig",
    "replace_fields",
]

DEFAULT_WINDOW, DEFAULT_MIN_CONTEXT = 1024, 512  # the evaluation windows when none are given (Khandelwal et al.)

DEFAULT_K = 1024
"""Neighbours per query wherever a datastore is searched and none is given: scoring (``memlm eval``,
:func:`memlm.knnlm.scoring.score_tokens`), calibration, and every generation path (:func:`memlm.knnlm.generate.
generate_text`, ``memlm generate``, :func:`memlm.wrap`, lm-eval's ``generate_until``). Khandelwal et al. (2020)
retrieve 1024. Generation searches as many as scoring because each datastore's mixture is calibrated at this k
(:func:`memlm.knnlm.calibration.knn_parameters`): a smaller k would generate from another distribution than the one
evaluated and calibrated. It costs little per generated token: one step's search and p_kNN on a 200k-entry IVF
datastore (d 576, nprobe 32, vocabulary 49,152, one CPU thread) took 21.7 ms at k = 1024 against 17.6 ms at k = 64,
4 ms more against the LM's own step of 265 ms (SmolLM2-135M's shape, 256 tokens of KV cache): under 2% of a
generated token (benchmarks/speed/generation_k.py, docs/results/speed/generation_k.json; on a 2-core AVX2-only AMD
EPYC while other work ran, load about 13, so the milliseconds are rough)."""

DEFAULT_CACHE_LAMBDA = 0.1
"""The continuous cache's weight λc (Grave et al. 2017) in the fixed-weight rule when the cache is one of the
memories (``cache`` in a memory spec) and no weight is given: no calibration fits the cache's weight, so this is the
one cache weight of every path. ``memlm tune`` fits λc on valid text (on SmolLM2 and Wikipedia it is smaller:
docs/results/knnlm.md, 0.02 beside the kNN-LM); 0.1 keeps ``memlm eval`` and lm-eval results comparable."""


def replace_fields(record: Any, what: str, **options: Any) -> Any:
    """The dataclass ``record`` with ``options`` set by field name; an unknown name is refused with the known ones
    (``what``: the kind of settings, for the message)."""
    names = {f.name for f in dataclasses.fields(record)}
    unknown = sorted(set(options) - names)
    if unknown:
        raise MemlmError(f"unknown {what} settings {unknown}; known: {sorted(names)}")
    return dataclasses.replace(record, **options)


@dataclass(frozen=True)
class RetrievalConfig:
    """Retrieval and scoring settings (see the module docstring); ``None`` = not set / the datastore's default."""

    k: int = DEFAULT_K
    search: str = "index"  # "index" (FAISS, approximate) | "exact" (all keys)
    scores: str = "index"  # "index" | "exact" (recomputed from the stored keys)
    nprobe: int = 32
    index: str | None = None  # the index file searched (None: exact search, or not recorded)
    metric: str | None = None  # None: the index's
    drop_self_matches: bool = False
    window: int | None = None
    stride: int | None = None
    min_context: int | None = None
    block_start: str = "skip"  # non-overlapping blocks (stride = window): first token "skip"ped or scored after "bos"
    adaptive: str | None = None
    adaptive_fraction: float | None = None
    pointer_min: int = 0
    pointer_rule: str = "retomaton"
    pipeline: bool = False

    def __post_init__(self) -> None:
        if self.k < 1:
            raise MemlmError(f"k must be >= 1, got {self.k}")
        if self.search not in ("index", "exact") or self.scores not in ("index", "exact"):
            raise MemlmError("search and scores must each be 'index' or 'exact'")
        if self.adaptive_fraction is not None and not 0.0 <= self.adaptive_fraction <= 1.0:
            raise MemlmError(f"adaptive_fraction must be in [0, 1], got {self.adaptive_fraction}")
        if self.pointer_min < 0:
            raise MemlmError(f"pointer_min must be >= 0, got {self.pointer_min}")
        if self.pipeline and (self.adaptive is not None or self.pointer_min):
            raise MemlmError("--pipeline searches each batch as it comes; adaptive retrieval and pointer reuse need "
                             "every query first: use one or the other")  # fmt: skip
        if self.pointer_rule not in ("retomaton", "replace"):
            raise MemlmError(f"pointer_rule must be 'retomaton' or 'replace', got {self.pointer_rule!r}")

    @property
    def efficiency(self) -> str:
        """The kNN-LM's efficiency strategy these settings choose: "pointer", "adaptive", "pipeline" or "none"."""
        if self.pointer_min:
            return "pointer"
        if self.adaptive is not None:
            return "adaptive"
        return "pipeline" if self.pipeline else "none"

    @classmethod
    def with_options(cls, config: RetrievalConfig | None = None, **options: Any) -> RetrievalConfig:
        """``config`` (default: all defaults) with ``options`` set by field name; ``index_path`` is ``index`` (the
        older keyword of the scorer). Unknown names are refused with the known ones."""
        if "index_path" in options:
            path = options.pop("index_path")
            options["index"] = None if path is None else str(path)
        if "adaptive" in options and options["adaptive"] is not None:
            options["adaptive"] = str(options["adaptive"])
        return replace_fields(config or cls(), "retrieval", **options)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of every field (recorded in dumps and result files)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RetrievalConfig:
        """The config a file recorded (unknown keys refused with their names)."""
        return replace_fields(cls(), "retrieval", **d)

    def replace(self, **changes: Any) -> RetrievalConfig:
        return dataclasses.replace(self, **changes)
