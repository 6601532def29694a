"""NPM: nonparametric masked language modelling (Min et al. 2023) -- masking, loss, objective, phrase index, inference,
evaluation tasks (:mod:`memlm.experiments.npm_tasks`: BBC topics, cloze probes, corpus update) and the MLM baseline
(:mod:`memlm.npm.mlm`).

The encoder, phrase-index, inference, objective, tasks and mlm modules are imported on use:
``from memlm.npm.inference import ...``.
"""

from memlm.npm.loss import npm_contrastive_loss, npm_single_loss, npm_span_loss, npm_span_targets
from memlm.npm.masking import (
    MaskedBatch,
    MaskedSpan,
    Occurrence,
    mask_batch,
    mask_batch_single,
    truncated_geometric_pmf,
)

__all__ = [
    "MaskedBatch",
    "MaskedSpan",
    "Occurrence",
    "mask_batch",
    "mask_batch_single",
    "truncated_geometric_pmf",
    "npm_contrastive_loss",
    "npm_span_targets",
    "npm_span_loss",
    "npm_single_loss",
]
