"""NPM's multi-positive contrastive loss (Min et al. 2023, §3.2.2; NPM SINGLE, App. A.3).

One loss per concept:

* :func:`npm_contrastive_loss` -- the generic multi-positive InfoNCE over a candidate set::

      l(q) = -log( sum_{y in Y+(q)} exp(sim(q, y)) / sum_{y in Y+(q) u Y-(q)} exp(sim(q, y)) ),
      sim(h1, h2) = h1 . h2 / sqrt(h)

  (``sim`` is the scaled inner product of §3.1; ``h`` the hidden size). With one positive it is the cross-entropy
  of the softmax over candidates.

* :func:`npm_span_loss` -- the NPM objective for a masked batch (§3.2.2): for each masked span ``g^i_t``, the
  ``[MASK_s]`` vector ``x-hat^i_t`` is the start query and the ``[MASK_e]`` vector ``x-hat^i_{t+1}`` the end query;
  candidates are all token vectors of the *unmasked* sequences ``j != i`` of the batch; start positives ``Y_s^+`` are
  the first tokens, end positives ``Y_e^+`` the last tokens of the occurrences of ``g^i_t`` in those sequences. The
  span's loss is ``l_start + l_end`` and the objective is summed over all masked spans (the paper's
  ``reduction="sum"``; ``"mean"`` averages over spans). With ``mask_start == mask_end`` (NPM SINGLE masking) and
  length-1 spans it reduces to the NPM SINGLE objective of App. A.3 counted twice; use
  :func:`npm_single_loss` for the exact one.
"""

from __future__ import annotations

import math

import torch

from memlm.core.distribution import memory_lse
from memlm.errors import MemlmError
from memlm.npm.masking import MaskedBatch

__all__ = ["npm_contrastive_loss", "npm_span_targets", "npm_span_loss", "npm_single_loss"]

_REDUCTIONS = ("sum", "mean", "none")


def _reduce(loss: torch.Tensor, reduction: str) -> torch.Tensor:
    if reduction == "sum":
        return loss.sum()
    if reduction == "mean":
        return loss.mean()
    return loss


def npm_contrastive_loss(
    queries: torch.Tensor,
    candidates: torch.Tensor,
    positive_mask: torch.Tensor,
    candidate_mask: torch.Tensor | None = None,
    reduction: str = "sum",
) -> torch.Tensor:
    """Multi-positive contrastive loss (§3.2.2)::

        l(q) = -log( sum_{c: pos[q, c]} exp(q . h_c / sqrt(H)) / sum_{c: cand[q, c]} exp(q . h_c / sqrt(H)) )

    computed stably as ``logsumexp_{cand}(s) - logsumexp_{pos}(s)``.

    Args:
        queries: ``[Q, H]`` query vectors (encoder outputs at ``[MASK_s]`` or ``[MASK_e]``).
        candidates: ``[C, H]`` candidate token vectors (the unmasked sequences of the batch, flattened).
        positive_mask: bool ``[Q, C]``, ``True`` where candidate ``c`` is a positive of query ``q`` (``Y+``).
        candidate_mask: bool ``[Q, C]``, ``True`` where ``c`` is in ``Y+ u Y-`` for ``q`` (e.g. ``False`` on the query's
            own sequence and on padding); ``None``: every candidate. Positives must be candidates.
        reduction: ``"sum"`` over queries (the paper's objective), ``"mean"``, or ``"none"`` (``[Q]``).

    Raises:
        MemlmError: on bad shapes or dtypes, an unknown reduction, a positive outside the candidate set, or a query
            without any positive (its loss would be infinite: the masker guarantees one, so this is a data bug).
    """
    if reduction not in _REDUCTIONS:
        raise MemlmError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    if queries.dim() != 2 or candidates.dim() != 2:
        raise MemlmError(
            f"queries must be [Q, H] and candidates [C, H], got {tuple(queries.shape)} and {tuple(candidates.shape)}"
        )
    if queries.shape[1] != candidates.shape[1]:
        raise MemlmError(
            f"queries {tuple(queries.shape)} and candidates {tuple(candidates.shape)} must share the hidden size H"
        )
    q_n, c_n = queries.shape[0], candidates.shape[0]
    if positive_mask.shape != (q_n, c_n) or positive_mask.dtype != torch.bool:
        raise MemlmError(
            f"positive_mask must be a bool tensor [Q, C] = [{q_n}, {c_n}], got {tuple(positive_mask.shape)} "
            f"{positive_mask.dtype}"
        )
    if candidate_mask is not None:
        if candidate_mask.shape != (q_n, c_n) or candidate_mask.dtype != torch.bool:
            raise MemlmError(
                f"candidate_mask must be a bool tensor [Q, C] = [{q_n}, {c_n}], got "
                f"{tuple(candidate_mask.shape)} {candidate_mask.dtype}"
            )
        if bool((positive_mask & ~candidate_mask).any()):
            raise MemlmError(
                "positive_mask marks a candidate that candidate_mask excludes; positives must be candidates"
            )
    if q_n and not bool(positive_mask.any(dim=1).all()):
        bad = int((~positive_mask.any(dim=1)).nonzero()[0, 0])
        raise MemlmError(f"query {bad} has no positive: every query needs at least one in-batch positive")

    dtype = torch.promote_types(queries.dtype, torch.float32)  # fp16/bf16 -> fp32 for the softmax
    scores = (queries.to(dtype) @ candidates.to(dtype).T) / math.sqrt(queries.shape[1])
    # a candidate's value is 1 when it is a positive, 0 otherwise, -1 (empty) when it is not a candidate: the loss is
    # -log p_mem(1), the retrieved-entry softmax of core.distribution with the positives as the target's entries
    values = positive_mask.long() if candidate_mask is None else positive_mask.long().masked_fill(~candidate_mask, -1)
    all_, hit = memory_lse(scores, values, torch.ones(q_n, dtype=torch.long, device=scores.device))
    loss = all_ - hit
    return _reduce(loss, reduction)


def npm_span_targets(batch: MaskedBatch, seq_len: int | None = None) -> tuple[torch.Tensor, ...]:
    """Index and mask tensors that link a :class:`MaskedBatch` to padded encoder outputs.

    The unmasked batch is assumed encoded as ``[B, L, H]`` (``L = seq_len``, default the longest original sequence)
    and flattened to ``C = B * L`` candidates, candidate ``j * L + m`` being token ``m`` of sequence ``j``.

    Returns ``(query_seq, query_start, query_end, start_pos, end_pos, cand)``: ``[S]`` long tensors giving, per masked
    span (order of :attr:`MaskedBatch.all_spans`), its sequence and the masked-sequence positions of ``[MASK_s]`` /
    ``[MASK_e]``; bool ``[S, C]`` start positives ``Y_s^+``, end positives ``Y_e^+`` and candidates
    ``Y^+ u Y^-`` (tokens of the other sequences, padding excluded).
    """
    lengths = [len(s) for s in batch.original_ids]
    L = max(lengths, default=0) if seq_len is None else seq_len
    if lengths and L < max(lengths):
        raise MemlmError(f"seq_len {L} is shorter than the longest sequence ({max(lengths)})")
    spans = batch.all_spans
    B, S = len(lengths), len(spans)
    real = torch.zeros(B, L, dtype=torch.bool)
    for j, n in enumerate(lengths):
        real[j, :n] = True
    seq_idx = torch.tensor([s.seq for s in spans], dtype=torch.long)
    other = seq_idx.unsqueeze(1) != torch.arange(B).unsqueeze(0)  # [S, B]
    cand = (other.unsqueeze(2) & real.unsqueeze(0)).reshape(S, B * L)
    start_pos = torch.zeros(S, B * L, dtype=torch.bool)
    end_pos = torch.zeros(S, B * L, dtype=torch.bool)
    for q, span in enumerate(spans):
        for occ in span.positives:
            start_pos[q, occ.seq * L + occ.start] = True
            end_pos[q, occ.seq * L + occ.end] = True
    q_start = torch.tensor([s.mask_start for s in spans], dtype=torch.long)
    q_end = torch.tensor([s.mask_end for s in spans], dtype=torch.long)
    return seq_idx, q_start, q_end, start_pos, end_pos, cand


def _check_hidden(masked_hidden: torch.Tensor, unmasked_hidden: torch.Tensor, batch: MaskedBatch) -> None:
    if masked_hidden.dim() != 3 or unmasked_hidden.dim() != 3:
        raise MemlmError(
            f"hidden states must be [B, L, H], got {tuple(masked_hidden.shape)} and {tuple(unmasked_hidden.shape)}"
        )
    B = len(batch.original_ids)
    if masked_hidden.shape[0] != B or unmasked_hidden.shape[0] != B:
        raise MemlmError(
            f"hidden states have batch sizes {masked_hidden.shape[0]}, {unmasked_hidden.shape[0]}; "
            f"the masked batch has {B} sequences"
        )
    if masked_hidden.shape[2] != unmasked_hidden.shape[2]:
        raise MemlmError("masked and unmasked hidden states must share the hidden size H")
    if batch.input_ids and masked_hidden.shape[1] < max(len(s) for s in batch.input_ids):
        raise MemlmError("masked_hidden is shorter than the longest masked sequence: pad, do not truncate")


def _masked_loss(masked_hidden, unmasked_hidden, batch: MaskedBatch, reduction: str, both_ends: bool) -> torch.Tensor:
    """The contrastive loss at each span's ``[MASK_s]`` (plus at its ``[MASK_e]`` with ``both_ends``), reduced."""
    if reduction not in _REDUCTIONS:
        raise MemlmError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    _check_hidden(masked_hidden, unmasked_hidden, batch)
    targets = npm_span_targets(batch, unmasked_hidden.shape[1])
    seq_idx, q_start, q_end, start_pos, end_pos, cand = (t.to(masked_hidden.device) for t in targets)
    if seq_idx.numel() == 0:
        return masked_hidden.sum() * 0.0  # no masked span: zero loss that keeps the graph
    candidates = unmasked_hidden.reshape(-1, unmasked_hidden.shape[2])
    loss = npm_contrastive_loss(masked_hidden[seq_idx, q_start], candidates, start_pos, cand, reduction="none")
    if both_ends:
        loss = loss + npm_contrastive_loss(masked_hidden[seq_idx, q_end], candidates, end_pos, cand, reduction="none")
    return _reduce(loss, reduction)


def npm_span_loss(
    masked_hidden: torch.Tensor, unmasked_hidden: torch.Tensor, batch: MaskedBatch, reduction: str = "sum"
) -> torch.Tensor:
    """The NPM training objective (§3.2.2), per masked span ``g^i_t``::

        l(g^i_t) = -log( sum_{y in Y_s^+} exp(sim(q_s, y)) / sum_{y in Y_s^+ u Y_s^-} exp(sim(q_s, y)) )
                   -log( sum_{y in Y_e^+} exp(sim(q_e, y)) / sum_{y in Y_e^+ u Y_e^-} exp(sim(q_e, y)) )

    with ``q_s = x-hat^i_t`` (the ``[MASK_s]`` vector) and ``q_e = x-hat^i_{t+1}`` (the ``[MASK_e]`` vector),

    summed over spans (``reduction="sum"``, the paper) or averaged (``"mean"``); ``"none"`` gives ``[S]``.

    Args:
        masked_hidden: ``[B, Lm, H]`` encoder outputs of ``batch.input_ids`` (right-padded).
        unmasked_hidden: ``[B, L, H]`` encoder outputs of ``batch.original_ids`` (right-padded, same ``B`` order).
        batch: the output of :func:`memlm.npm.masking.mask_batch`.
    """
    return _masked_loss(masked_hidden, unmasked_hidden, batch, reduction, both_ends=True)


def npm_single_loss(
    masked_hidden: torch.Tensor, unmasked_hidden: torch.Tensor, batch: MaskedBatch, reduction: str = "sum"
) -> torch.Tensor:
    """NPM SINGLE objective (App. A.3) for a batch from :func:`memlm.npm.masking.mask_batch_single`::

        l(x^i_t) = -log( sum_{y in Y+(x^i_t)} exp(sim(x-hat^i_t, y)) / sum_{y in Y+ u Y-} exp(sim(x-hat^i_t, y)) )

    with ``Y+`` the tokens of the other sequences equal to ``x^i_t`` and ``Y-`` the rest of the other sequences;
    summed over masked tokens (``"sum"``, the paper) or averaged (``"mean"``).
    """
    return _masked_loss(masked_hidden, unmasked_hidden, batch, reduction, both_ends=False)
