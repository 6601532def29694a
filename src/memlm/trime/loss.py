"""TRIME's training objective: one softmax over the vocabulary and the in-batch memory (Zhong et al. 2022, Eq. 5).

Zhong, Lei & Chen (2022), "Training Language Models with Memory Augmentation" (TRIME), Eq. 5::

    P(w | c) ∝ exp(E_w · f(c))  +  Σ_{(c_j, x_j) ∈ M_train, x_j = w} exp(sim(g(c), g(c_j)))

    sim(q, k) = q · k / sqrt(d)                    (scaled dot product)
    loss      = -log P(x_target | c)

``f(c)`` is the hidden state the output softmax reads (so ``E · f(c)`` are the model's logits), ``g(c)`` the input of
the last feed-forward block (memlm's ``ffn_in`` role at layer ``-1``; capture it with
``KeyCapture(model, KeySpec("ffn_in", -1), detach=False)`` so that gradients reach it). Unlike the kNN-LM (Eq. 3 in
``memlm.core.distribution``) this is *one*
normalisation over ``|V|`` logits and ``|M|`` memory scores, not an interpolation: a
memory entry whose value is ``w`` adds its mass to ``w``; every visible entry adds to the denominator.

Memory entries and indices. Over a batch of ``B`` segments of length ``T`` flattened to ``N = B * T`` positions,
position ``i`` holds the context ``c_i = x_1 .. x_i`` (the tokens up to and including input token ``i``), its query
``g(c_i)`` and its target ``x_{i+1}`` (the label the LM predicts at ``i``). Memory entry ``j`` is the pair
``(g(c_j), x_{j+1})``: key = the representation at position ``j``, value = the *target* at ``j`` (the next token).
Query ``i`` may see entry ``j`` only when ``j`` is strictly before ``i`` in the same segment (Eq. 2: ``j < t``), since
entry ``i`` itself has the answer as its value. Which other entries it sees depends on the memory (Section 4):

============  ==================================================================================================
``local``     TrimeLM (Sec. 4.1): earlier positions of the same segment.
``long``      TrimeLM_long (Sec. 4.2): earlier positions of the same *document*; the batch packs consecutive
              segments of a document, so this is the own segment's earlier positions plus every position of the
              document's earlier segments in the batch.
``external``  TrimeLM_ext (Sec. 4.3): every position of the *other* segments in the batch, plus the own segment's
              earlier positions; during training the local part is dropped with probability ``p`` (0.9 in the
              paper, App. H), one draw per batch as in the authors' code (``trime_ext_loss.py``,
              ``only_cross_sent=random.random() < cross_sent_ratio``).
============  ==================================================================================================

Entries with a negative value (``-1`` empty slot, ``-100`` an ignored / padded target) are never visible. Gradients flow
into the queries *and* the memory keys: they come from the same forward pass.

At test time (App. A, Eq. 6) the memory term gets a temperature, ``exp(sim(g(c), g(c_j)) / τ)``: pass
``temperature``. (App. A's extra interpolation with a separate memory distribution, Eq. 8-9, is
``memlm.core.distribution``.)
"""

from __future__ import annotations

import math
from typing import Literal

import torch

from memlm.core.distribution import joint_target_logprob, memory_lse
from memlm.errors import MemlmError

__all__ = [
    "MemoryKind",
    "MEMORY_KINDS",
    "segment_layout",
    "memory_visibility",
    "sample_drop_local",
    "trime_logprob",
    "trime_loss",
]

MemoryKind = Literal["local", "long", "external"]
MEMORY_KINDS: tuple[str, ...] = ("local", "long", "external")


def segment_layout(
    batch: int,
    seq_len: int,
    segment_doc: torch.Tensor | None = None,
    segment_index_in_doc: torch.Tensor | None = None,
    device: torch.device | str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-position ``(segment_ids, positions, doc_ids)`` of ``B`` segments of length ``T`` flattened to ``N = B * T``.

    TRIME Sec. 4.2 divides a document into consecutive segments ``s_1 .. s_m`` of ``L = T`` contexts each; segment
    ``b`` is the ``segment_index_in_doc[b]``-th segment of document ``segment_doc[b]``. Flattened position
    ``i = b * T + t`` gets ``segment_ids[i] = b``, ``doc_ids[i] = segment_doc[b]`` and
    ``positions[i] = segment_index_in_doc[b] * T + t``: its place in the document's token stream (so ``t`` within a
    segment). Defaults: every segment is its own document (``segment_doc = arange(B)``, index 0).
    """
    if batch <= 0 or seq_len <= 0:
        raise MemlmError(f"batch and seq_len must be > 0, got batch={batch}, seq_len={seq_len}")
    if segment_doc is None:
        segment_doc = torch.arange(batch, device=device)
    if segment_index_in_doc is None:
        segment_index_in_doc = torch.zeros(batch, dtype=torch.long, device=segment_doc.device)
    for name, t in (("segment_doc", segment_doc), ("segment_index_in_doc", segment_index_in_doc)):
        if t.shape != (batch,) or t.is_floating_point() or t.dtype == torch.bool:
            raise MemlmError(f"{name} must be an integer tensor of shape ({batch},), got {t.dtype} {tuple(t.shape)}")
    if bool((segment_index_in_doc < 0).any()):
        raise MemlmError("segment_index_in_doc must be >= 0")
    dev = segment_doc.device
    t = torch.arange(seq_len, device=dev)
    segment_ids = torch.arange(batch, device=dev).repeat_interleave(seq_len)
    doc_ids = segment_doc.long().repeat_interleave(seq_len)
    positions = (segment_index_in_doc.long().to(dev)[:, None] * seq_len + t[None, :]).reshape(-1)
    return segment_ids, positions, doc_ids


def memory_visibility(
    kind: MemoryKind,
    segment_ids: torch.Tensor,
    positions: torch.Tensor,
    doc_ids: torch.Tensor | None = None,
    drop_local: bool = False,
) -> torch.Tensor:
    """``visible[i, j]``: may query ``i`` use memory entry ``j`` (TRIME Sec. 4, Eq. 2-4 / Fig. 2)? ``[N, N]`` bool.

    Memory = the batch's own ``N`` positions (entry ``j`` = ``(g(c_j), x_{j+1})``, see the module docstring)::

        local:     seg_j = seg_i  and pos_j < pos_i                                   (M_local,  Sec. 4.1)
        long:      doc_j = doc_i  and pos_j < pos_i                                   (M_long,   Sec. 4.2)
        external:  seg_j != seg_i  or (seg_j = seg_i and pos_j < pos_i and not drop_local)   (M_ext, Sec. 4.3)

    ``positions`` orders the positions of a segment (for ``long``: the position in the document's stream, as
    :func:`segment_layout` returns). ``doc_ids`` is required for ``long``. ``drop_local`` (only for ``external``)
    removes the own segment's entries (the local-memory dropout of Sec. 4.3, see :func:`sample_drop_local`).
    """
    if kind not in MEMORY_KINDS:
        raise MemlmError(f"unknown memory kind {kind!r}; use one of {', '.join(MEMORY_KINDS)}")
    if segment_ids.dim() != 1 or positions.shape != segment_ids.shape:
        raise MemlmError(
            f"segment_ids {tuple(segment_ids.shape)} and positions {tuple(positions.shape)} must both be [N]"
        )
    if drop_local and kind != "external":
        raise MemlmError(f"drop_local only applies to the external memory, not {kind!r}")
    earlier = positions[None, :] < positions[:, None]  # [i, j]: pos_j < pos_i
    same_seg = segment_ids[None, :] == segment_ids[:, None]
    if kind == "local":
        return same_seg & earlier
    if kind == "long":
        if doc_ids is None or doc_ids.shape != segment_ids.shape:
            raise MemlmError("the long-term memory needs doc_ids [N] (the document of each position)")
        return (doc_ids[None, :] == doc_ids[:, None]) & earlier
    local = torch.zeros_like(same_seg) if drop_local else same_seg & earlier
    return ~same_seg | local


def sample_drop_local(p: float, generator: torch.Generator | None = None) -> bool:
    """One Bernoulli(``p``) draw: drop the local memory for this batch (TRIME Sec. 4.3, App. H: ``p = 0.9``).

    The paper excludes the local memory from ``M_train`` "with a probability of p"; the authors' code draws once per
    batch (``random.random() < cross_sent_ratio``), which this follows. Pass a seeded ``generator`` for determinism.
    """
    if not 0.0 <= p <= 1.0:
        raise MemlmError(f"local-memory drop probability must be in [0, 1], got {p}")
    return bool(torch.rand((), generator=generator) < p)


def _check_inputs(
    logits: torch.Tensor,
    queries: torch.Tensor,
    mem_keys: torch.Tensor,
    mem_values: torch.Tensor,
    visible: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int,
) -> None:
    if logits.dim() not in (2, 3):
        raise MemlmError(
            f"logits must be [N, V] (or [G, N, V] for G groups), got {tuple(logits.shape)}; flatten batch and time "
            "first"
        )
    lead = tuple(logits.shape[:-2])  # () or (G,)
    others = {"queries": queries, "mem_keys": mem_keys, "targets": targets}
    flat = [name for name, x in others.items() if x.dim() != logits.dim() - (name == "targets")]
    if flat:
        raise MemlmError(
            f"logits is {tuple(logits.shape)} but {', '.join(flat)} {'has' if len(flat) == 1 else 'have'} another "
            "number of dimensions: flatten batch and time first ([N, V], [N, D], [M, D], [N]), or give every argument "
            "the same leading group dimension G"
        )
    n, v = logits.shape[-2:]
    if tuple(queries.shape[:-1]) != (*lead, n):
        raise MemlmError(f"queries must be [{'G, ' if lead else ''}N={n}, D], got {tuple(queries.shape)}")
    d = queries.shape[-1]
    if tuple(mem_keys.shape[:-2]) != lead or mem_keys.shape[-1] != d:
        raise MemlmError(f"mem_keys must be [{'G, ' if lead else ''}M, D={d}], got {tuple(mem_keys.shape)}")
    m = mem_keys.shape[-2]
    if tuple(mem_values.shape) != (*lead, m) or mem_values.is_floating_point() or mem_values.dtype == torch.bool:
        raise MemlmError(
            f"mem_values must be an integer tensor [{'G, ' if lead else ''}M={m}], got {mem_values.dtype} "
            f"{tuple(mem_values.shape)}"
        )
    if tuple(visible.shape) not in ((*lead, n, m), (n, m)) or visible.dtype != torch.bool:
        raise MemlmError(f"visible must be a bool tensor [N={n}, M={m}] (or [G, N, M]), got {visible.dtype} "
                         f"{tuple(visible.shape)}")  # fmt: skip
    if tuple(targets.shape) != (*lead, n) or targets.is_floating_point() or targets.dtype == torch.bool:
        raise MemlmError(
            f"targets must be an integer tensor [{'G, ' if lead else ''}N={n}], got {targets.dtype} "
            f"{tuple(targets.shape)}"
        )
    for name, t in (("logits", logits), ("queries", queries), ("mem_keys", mem_keys)):
        if not t.is_floating_point():
            raise MemlmError(f"{name} must be a floating-point tensor, got {t.dtype}")
    bad = (targets != ignore_index) & ((targets < 0) | (targets >= v))
    if bool(bad.any()):
        raise MemlmError(
            f"target {int(targets[bad][0])} is out of range for a vocabulary of {v} (ignore_index={ignore_index})"
        )
    if mem_values.numel() and int(mem_values.max()) >= v:
        raise MemlmError(f"memory value {int(mem_values.max())} is out of range for a vocabulary of {v}")


def trime_logprob(
    logits: torch.Tensor,
    queries: torch.Tensor,
    mem_keys: torch.Tensor,
    mem_values: torch.Tensor,
    visible: torch.Tensor,
    targets: torch.Tensor,
    scale: float | None = None,
    temperature: float = 1.0,
    ignore_index: int = -100,
) -> torch.Tensor:
    """``log P(target | c)`` under TRIME's Eq. 5 (Eq. 6 with ``temperature``) for each of ``N`` queries -> ``[N]``.

    With ``s_ij = scale * g_i · k_j / τ`` (``scale`` defaults to ``1 / sqrt(D)``) over the visible entries ``j``
    (``visible[i, j]`` and ``mem_values[j] >= 0``)::

        log P(w | c_i) = logsumexp({E_w f_i} ∪ {s_ij : v_j = w})  -  logsumexp({E_v f_i : v ∈ V} ∪ {s_ij : all j})

    A row with no visible entry reduces to ``log_softmax(logits)[target]``. Shapes: ``logits [N, V]`` (``E · f(c)``),
    ``queries [N, D]`` (``g(c)``), ``mem_keys [M, D]`` (``g(c_j)``), ``mem_values [M]`` (``x_j``, the next token at
    ``j``), ``visible`` bool ``[N, M]``, ``targets [N]``. Rows whose target is ``ignore_index`` return 0. Computed in
    at least float32; gradients flow into ``logits``, ``queries`` and ``mem_keys``. Memory: a few ``[N, M]`` tensors.

    Batched form: every argument may carry a leading group dimension ``G`` (``logits [G, N, V]``, ``queries
    [G, N, D]``, ``mem_keys [G, M, D]``, ``mem_values [G, M]``, ``targets [G, N]``, ``visible [G, N, M]`` or one
    ``[N, M]`` shared by all groups) -> ``[G, N]``: ``G`` independent memories in one call, each exactly as above.
    """
    _check_inputs(logits, queries, mem_keys, mem_values, visible, targets, ignore_index)
    if temperature <= 0:
        raise MemlmError(f"temperature must be > 0, got {temperature}")
    if scale is None:
        scale = 1.0 / math.sqrt(queries.shape[-1])
    dtype = torch.promote_types(torch.promote_types(logits.dtype, queries.dtype), torch.float32)
    logits = logits.to(dtype)
    scores = (queries.to(dtype) @ mem_keys.to(dtype).transpose(-1, -2)) * scale  # [(G,) N, M]
    usable = visible & (mem_values >= 0).unsqueeze(-2)
    values = mem_values.long().unsqueeze(-2).expand(scores.shape).masked_fill(~usable, -1)  # -1: not visible
    ignored = targets == ignore_index
    safe_targets = targets.masked_fill(ignored, 0).long()
    target_logit = logits.gather(-1, safe_targets.unsqueeze(-1)).squeeze(-1)  # [(G,) N]
    memory = memory_lse(scores, values, safe_targets, temperature)  # (all, hit) [(G,) N]
    out = joint_target_logprob(target_logit, torch.logsumexp(logits, dim=-1), [memory])
    return out.masked_fill(ignored, 0.0)


def trime_loss(
    logits: torch.Tensor,
    queries: torch.Tensor,
    mem_keys: torch.Tensor,
    mem_values: torch.Tensor,
    visible: torch.Tensor,
    targets: torch.Tensor,
    scale: float | None = None,
    temperature: float = 1.0,
    ignore_index: int = -100,
) -> torch.Tensor:
    """TRIME's training loss (Eq. 5): the mean of ``-log P(target | c)`` over targets that are not ``ignore_index``.

    Arguments as :func:`trime_logprob`. A scalar; ``0`` (with a graph) when every target is ignored.
    """
    logp = trime_logprob(logits, queries, mem_keys, mem_values, visible, targets, scale, temperature, ignore_index)
    keep = targets != ignore_index
    count = keep.sum()
    return -(logp * keep).sum() / count.clamp(min=1)
