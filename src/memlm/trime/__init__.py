"""TRIME (Zhong, Lei & Chen 2022, "Training Language Models with Memory Augmentation"): in-batch memory training."""

from memlm.trime.loss import (
    MEMORY_KINDS,
    MemoryKind,
    TrimeLoss,
    memory_visibility,
    sample_drop_local,
    segment_layout,
    trime_logprob,
    trime_loss,
)
from memlm.trime.training import (
    OBJECTIVES,
    TrimeBatches,
    TrimeObjective,
    TrimeSetup,
    trime_batches,
    trime_objective,
)

__all__ = [
    "MEMORY_KINDS",
    "MemoryKind",
    "OBJECTIVES",
    "TrimeBatches",
    "TrimeLoss",
    "TrimeObjective",
    "TrimeSetup",
    "memory_visibility",
    "sample_drop_local",
    "segment_layout",
    "trime_logprob",
    "trime_batches",
    "trime_loss",
    "trime_objective",
]
