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

__all__ = [
    "MEMORY_KINDS",
    "MemoryKind",
    "TrimeLoss",
    "memory_visibility",
    "sample_drop_local",
    "segment_layout",
    "trime_logprob",
    "trime_loss",
]
