"""TRIME (Zhong, Lei & Chen 2022, "Training Language Models with Memory Augmentation"): in-batch memory training."""

from memlm.trime.inference import (
    TrimeScores,
    score_trime,
    trime_log_distribution,
    trime_perplexity,
    trime_target_logprobs,
    tune_trime_inference,
)
from memlm.trime.loss import (
    MEMORY_KINDS,
    MemoryKind,
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
    "TrimeObjective",
    "TrimeScores",
    "TrimeSetup",
    "memory_visibility",
    "sample_drop_local",
    "score_trime",
    "segment_layout",
    "trime_logprob",
    "trime_batches",
    "trime_log_distribution",
    "trime_loss",
    "trime_objective",
    "trime_perplexity",
    "trime_target_logprobs",
    "tune_trime_inference",
]
