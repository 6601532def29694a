"""TRIME training objectives and batches for the shared trainer (:func:`memlm.training.loop.train`).

Zhong, Lei & Chen (2022), "Training Language Models with Memory Augmentation" (TRIME), Sec. 3-4. The pieces:

* :class:`TrimeObjective` — a loss ``loss_fn(model, batch) -> scalar`` for :func:`memlm.training.loop.train`.
  One forward pass gives the logits ``E f(c)`` and, through :class:`memlm.models.keys.KeyCapture` with ``detach=False``,
  ``g(c)`` = the input of the last feed-forward block (after its layer norm); it then calls
  :func:`memlm.trime.loss.trime_logprob` (Eq. 5, ``sim(q, k) = q . k / sqrt(d)``) with the memory visibility of the
  chosen kind built from the batch fields. Gradients reach both the queries and every memory key (they are the same
  tensor).
* :class:`TrimeBatches` — a callable ``epoch -> iterator of batch dicts`` of whole-document segments:
  consecutive segments of a document for the long-term memory (Sec. 4.2), BM25-packed (Algorithm 1) or random
  segments for the external memory (Sec. 4.3). The epoch's batches are a function of ``(seed, epoch)`` only, so the
  trainer's exact resume (replay the epoch, skip the consumed batches) sees the same batches.
* :func:`trime_objective` — ``(loss_fn, batches_factory)`` by name (``ce``, ``trime``, ``trime-long``,
  ``trime-ext``), for ``memlm.training.lm.train_lm(..., loss_fn=..., batches=..., warmup_loss=causal_lm_loss)`` with
  ``TrainConfig.warmup_loss_steps=0.05`` (the paper trains with plain CE for the first 5% of updates, Sec. 5.2).
* :class:`TrimeLmObjective` (``trime``), :class:`TrimeLongObjective` (``trime-long``), :class:`TrimeExtObjective`
  (``trime-ext``) — the same as objectives of the training driver (:mod:`memlm.training.driver`, ``memlm train
  --loss``).

Batch layout. A row of ``input_ids`` ``[B, T]`` is one segment; position ``t`` holds context ``x_1..x_t`` of the
segment; its target is ``input_ids[t + 1]`` (so the last position of a row, and positions whose next token is padding
(``attention_mask`` 0), have no target). This is exactly what :func:`memlm.training.loop.causal_lm_loss` scores, so the
CE warm-up and TRIME see the same targets. Memory entry ``j`` = ``(g(c_j), target_j)``; entries without a target are
never visible (``-100`` value). Segments come from :func:`memlm.trime.batching.segment_documents` with
``segment_len = seq_len - 1`` owned tokens plus the first token of the next segment, so rows have at most ``seq_len``
tokens and every token of a document but its first is a target exactly once per epoch. Extra batch fields:

==================  ==========================================================================================
``attention_mask``  ``[B, T]`` int64, 0 on right padding (rows shorter than the batch's longest)
``segment_doc``     ``[B]`` int64, the document of each row (index into the documents)
``segment_index``   ``[B]`` int64, the row's segment number inside its document (0, 1, ...)
==================  ==========================================================================================

Memories (:func:`memlm.trime.loss.memory_visibility`, over the ``N = B * T`` flattened positions):

* ``local`` (TrimeLM, Sec. 4.1): earlier positions of the same row. Needs no extra field: it runs on the plain
  ``seq_len`` chunks of :func:`memlm.training.loop.lm_batches` (same data as the CE baseline) or on segment batches.
* ``long`` (TrimeLM_long, Sec. 4.2): positions of the same document (``segment_doc``) that come earlier in the
  document (``segment_index``, then position in the row): the own row's earlier positions plus all positions of the
  document's earlier segments in the batch.
* ``external`` (TrimeLM_ext, Sec. 4.3): all positions of the other rows, plus the own row's earlier positions unless
  the local memory is dropped for this batch (probability ``drop_local_p``, 0.9 in the paper; one draw per batch in
  training mode from the global torch RNG, which the trainer checkpoints; a batch field ``drop_local`` overrides).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from memlm.errors import MemlmError
from memlm.models.forward import right_pad
from memlm.models.keys import KeyCapture, KeySpec
from memlm.training.lm import LmObjective
from memlm.training.loop import causal_lm_loss, lm_batches
from memlm.trime.batching import Segment, bm25_neighbors, chain_order, pack_consecutive, segment_documents
from memlm.trime.loss import (
    MEMORY_KINDS,
    MemoryKind,
    memory_visibility,
    sample_drop_local,
    segment_layout,
    trime_logprob,
)

__all__ = [
    "OBJECTIVES",
    "PACKINGS",
    "TrimeBatches",
    "TrimeExtObjective",
    "TrimeLmObjective",
    "TrimeLongObjective",
    "TrimeObjective",
    "TrimeSetup",
    "next_token_targets",
    "tokenize_for_trime",
    "trime_batches",
    "trime_objective",
]

OBJECTIVES: tuple[str, ...] = ("ce", "trime", "trime-long", "trime-ext")
PACKINGS: tuple[str, ...] = ("bm25", "random")
IGNORE_INDEX = -100
G_SPEC = KeySpec("ffn_in", -1)  # TRIME's g(c): input of the last feed-forward block, after its layer norm


# ---------------------------------------------------------------------------------------------------------------
# The loss


def next_token_targets(input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """``[B, T]`` targets: ``input_ids[:, t + 1]`` at ``t``, ``-100`` at the last position and where the next token is
    padding (``attention_mask`` 0): the targets :func:`memlm.training.loop.causal_lm_loss` scores, aligned with
    positions."""
    targets = torch.full_like(input_ids, IGNORE_INDEX)
    targets[:, :-1] = input_ids[:, 1:]
    if attention_mask is not None:
        targets[:, :-1] = targets[:, :-1].masked_fill(attention_mask[:, 1:] == 0, IGNORE_INDEX)
    return targets


class TrimeObjective:
    """TRIME's loss (Eq. 5) with in-batch memory of one ``kind`` as a trainer loss: ``loss_fn(model, batch)``.

    ``kind``: ``local``, ``long`` or ``external`` (module docstring). ``drop_local_p``: probability of dropping the
    local memory for a batch (``external`` only, training mode only; Sec. 4.3 / App. H). ``generator``: an optional
    torch generator for that draw (default: the global torch RNG, which :func:`memlm.training.loop.train` saves and
    restores, so resumed runs draw the same). ``scale``: the similarity scale (default ``1 / sqrt(d)``). The loss is the
    mean of ``-log P(target | c)`` over the batch's targets, computed in float32 outside any autocast.

    ``detach_memory``: the ablation "w/o back-prop to memory" (Zhong et al. 2022, App. G, Table 11): the memory keys
    ``g(c_j)`` enter Eq. 5 as constants (``g.detach()``), so gradients reach ``g`` only as the query ``g(c_i)``.
    The loss value is unchanged; only its gradient differs.
    """

    def __init__(
        self,
        kind: MemoryKind = "local",
        drop_local_p: float = 0.9,
        *,
        scale: float | None = None,
        generator: torch.Generator | None = None,
        key: KeySpec = G_SPEC,
        detach_memory: bool = False,
    ) -> None:
        if kind not in MEMORY_KINDS:
            raise MemlmError(f"unknown memory kind {kind!r}; use one of {', '.join(MEMORY_KINDS)}")
        if not isinstance(drop_local_p, (int, float)) or not 0.0 <= drop_local_p <= 1.0:
            raise MemlmError(f"drop_local_p must be a probability in [0, 1], got {drop_local_p!r}")
        self.kind: MemoryKind = kind
        self.drop_local_p = float(drop_local_p)
        self.scale = scale
        self.generator = generator
        self.key = key
        self.detach_memory = bool(detach_memory)

    def __repr__(self) -> str:
        extra = f", drop_local_p={self.drop_local_p}" if self.kind == "external" else ""
        extra += ", detach_memory=True" if self.detach_memory else ""
        return f"TrimeObjective({self.kind!r}{extra})"

    def forward(self, model: torch.nn.Module, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward pass: ``(logits [B, T, V], g [B, T, D])``, both attached to the graph."""
        ids = batch["input_ids"]
        if ids.dim() != 2:
            raise MemlmError(f"input_ids must be [B, T], got {tuple(ids.shape)}")
        with KeyCapture(model, self.key, detach=False) as cap:
            out = model(input_ids=ids, attention_mask=batch.get("attention_mask"), use_cache=False)
            keys = cap.keys
        if keys is None or keys.shape[:2] != ids.shape:
            raise MemlmError(f"could not capture g(c) ({self.key}) for a batch of shape {tuple(ids.shape)}")
        return out.logits, keys

    def drop_local(self, model: torch.nn.Module, batch: dict[str, Any]) -> bool:
        """Whether this batch's local memory is dropped: ``external`` in training mode with probability ``p``."""
        if self.kind != "external":
            return False
        if "drop_local" in batch:
            return bool(batch["drop_local"])
        return bool(model.training) and sample_drop_local(self.drop_local_p, self.generator)

    def visibility(self, batch: dict[str, Any], drop_local: bool = False) -> torch.Tensor:
        """``[N, N]`` bool: may position ``i`` use memory entry ``j`` (flattened ``B * T``; module docstring)."""
        ids = batch["input_ids"]
        b, t = ids.shape
        seg_doc, seg_index = batch.get("segment_doc"), batch.get("segment_index")
        if self.kind == "long" and (seg_doc is None or seg_index is None):
            raise MemlmError(
                "the long-term memory needs batches with segment_doc and segment_index (consecutive segments of a "
                "document): build them with trime_batches('long', ...)"
            )
        if self.kind != "long":  # local / external only need the rows; positions within a row order them
            seg_doc = seg_index = None
        seg, pos, doc = segment_layout(b, t, seg_doc, seg_index, device=ids.device)
        return memory_visibility(self.kind, seg, pos, doc, drop_local=drop_local)

    def row_groups(self, batch: dict[str, Any]) -> list[torch.Tensor] | None:
        """Rows whose positions may see each other's memory: each row alone (``local``), the rows of one document
        (``long``), or ``None``: the whole batch (``external``). No entry is visible across groups, so Eq. 5 can be
        computed group by group on ``[n_g, n_g]`` score blocks instead of one ``[N, N]`` matrix (same result)."""
        ids = batch["input_ids"]
        if self.kind == "local":
            return [torch.tensor([r], device=ids.device) for r in range(ids.shape[0])]
        if self.kind == "long" and batch.get("segment_doc") is not None:
            doc = batch["segment_doc"]
            return [torch.nonzero(doc == d).reshape(-1) for d in torch.unique(doc)]
        return None

    def group_buckets(self, batch: dict[str, Any], drop_local: bool = False) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """:meth:`row_groups` stacked by size: ``(rows [G, s], visible)`` per distinct group size ``s``, with
        ``visible`` the ``[G, s*T, s*T]`` visibility of each group (one ``[T, T]`` shared by every row for ``local``),
        so Eq. 5 runs as one batched call per bucket rather than one call per group."""
        ids = batch["input_ids"]
        b = ids.shape[0]
        groups = self.row_groups(batch) or [torch.arange(b, device=ids.device)]
        by_size: dict[int, list[torch.Tensor]] = {}
        for rows in groups:
            by_size.setdefault(len(rows), []).append(rows)

        def vis(rows: torch.Tensor) -> torch.Tensor:
            sub = {k: v[rows] for k, v in batch.items() if isinstance(v, torch.Tensor) and v.dim() >= 1}
            return self.visibility(sub, drop_local)

        shared = self.kind == "local"  # every row has the same causal [T, T] visibility
        return [(torch.stack(bucket), vis(bucket[0]) if shared else torch.stack([vis(r) for r in bucket]))
                for bucket in by_size.values()]  # fmt: skip

    def __call__(self, model: torch.nn.Module, batch: dict[str, Any]) -> torch.Tensor:
        logits, g = self.forward(model, batch)
        drop = self.drop_local(model, batch)
        ids = batch["input_ids"]
        b, t = ids.shape
        targets = next_token_targets(ids, batch.get("attention_mask"))
        in_order = torch.arange(b, device=ids.device)
        with torch.autocast(device_type=ids.device.type, enabled=False):
            dtype = torch.promote_types(logits.dtype, torch.float32)  # float32 at least, also under bf16 autocast
            total = logits.new_zeros((), dtype=dtype)
            for rows, visible in self.group_buckets(batch, drop):
                n_groups, n = rows.shape[0], rows.shape[1] * t
                flat = rows.reshape(-1)
                if flat.shape == in_order.shape and torch.equal(flat, in_order):  # the batch in order: views
                    lg, q, y = logits, g, targets
                else:
                    lg, q, y = logits[flat], g[flat], targets[flat]
                q = q.reshape(n_groups, n, -1).to(dtype)
                y = y.reshape(n_groups, n)
                keys = q.detach() if self.detach_memory else q  # App. G: no back-propagation into the memory
                lp = trime_logprob(lg.reshape(n_groups, n, -1).to(dtype), q, keys, y, visible, y, scale=self.scale)
                total = total - lp.sum()  # ignored targets give 0
            return total / (targets != -100).sum().clamp(min=1)


# ---------------------------------------------------------------------------------------------------------------
# Batches


def tokenize_for_trime(documents: Sequence, tokenizer=None) -> list[np.ndarray]:
    """Token arrays of ``documents``: objects with ``.text`` are tokenized (EOS appended, as
    :func:`memlm.training.loop.lm_batches` does); array-likes of token ids are used as they are."""
    docs = list(documents)
    if docs and all(hasattr(d, "text") for d in docs):
        if tokenizer is None:
            raise MemlmError("TRIME batches need a tokenizer to tokenize documents (or pass token-id arrays)")
        from memlm.data.windows import tokenize_documents

        return [c.tokens for c in tokenize_documents(docs, tokenizer)]
    try:
        return [np.asarray(d, dtype=np.int64).reshape(-1) for d in docs]
    except (TypeError, ValueError) as e:
        raise MemlmError(f"documents must all have .text or all be token-id arrays: {e}") from e


def _epoch_seed(seed: int, epoch: int, salt: int) -> int:
    return int(np.random.SeedSequence([int(seed), int(epoch), salt]).generate_state(1)[0])


class TrimeBatches:
    """Callable ``epoch -> iterator of batch dicts`` of document segments for TRIME (module docstring for fields).

    ``kind``: ``long`` (each batch holds runs of ``segments_per_doc`` consecutive segments of a document,
    :func:`memlm.trime.batching.pack_consecutive`), ``external`` (``packing="bm25"``: Algorithm 1 chains over BM25
    neighbours of the segments' token ids, ``bm25_k`` per segment, cut into batches; ``"random"``: a random permutation,
    the App. H ablation) or ``local`` (random segments). BM25 neighbours are computed once; each epoch redraws the
    random parts (run order, chain starts, batch order) from ``(seed, epoch)``. The last batch of an epoch may be
    smaller. ``len()`` is the number of batches of epoch 0.
    """

    def __init__(
        self,
        kind: MemoryKind,
        token_docs: Sequence[np.ndarray],
        seq_len: int,
        batch_size: int,
        seed: int = 0,
        segments_per_doc: int | None = None,
        packing: str = "bm25",
        bm25_k: int = 20,
        pad_id: int = 0,
    ) -> None:
        if kind not in MEMORY_KINDS:
            raise MemlmError(f"unknown memory kind {kind!r}; use one of {', '.join(MEMORY_KINDS)}")
        if not isinstance(seq_len, int) or seq_len < 2:
            raise MemlmError(f"seq_len must be an integer >= 2, got {seq_len!r}")
        if not isinstance(batch_size, int) or batch_size < 1:
            raise MemlmError(f"batch_size must be an integer >= 1, got {batch_size!r}")
        if packing not in PACKINGS:
            raise MemlmError(f"unknown packing {packing!r}; use one of {', '.join(PACKINGS)}")
        m = batch_size if segments_per_doc is None else segments_per_doc
        if kind == "long" and (not isinstance(m, int) or not 1 <= m <= batch_size):
            raise MemlmError(f"segments_per_doc must be an integer in [1, batch_size={batch_size}], got {m!r}")
        if not isinstance(bm25_k, int) or bm25_k < 1:
            raise MemlmError(f"bm25_k must be an integer >= 1, got {bm25_k!r}")
        self.kind: MemoryKind = kind
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.seed = int(seed)
        self.segments_per_doc = m
        self.packing = packing
        self.pad_id = int(pad_id)
        # a segment needs >= 2 tokens to hold a target; shorter ones (a 1-token tail) add nothing, also as memory
        self.segments: list[Segment] = [s for s in segment_documents(token_docs, seq_len - 1) if len(s.tokens) >= 2]
        if not self.segments:
            raise MemlmError("the training documents have no segment with a next-token target: give more text")
        self._neighbors = None
        if kind == "external" and packing == "bm25":
            self._neighbors = bm25_neighbors(self.segments, k=bm25_k)
        self._plans: dict[int, list[list[int]]] = {}

    def plan(self, epoch: int = 0) -> list[list[int]]:
        """The epoch's batches as lists of indices into :attr:`segments` (a function of ``seed`` and ``epoch``)."""
        if epoch in self._plans:
            return self._plans[epoch]
        n, bs = len(self.segments), self.batch_size
        if self.kind == "long":
            batches = pack_consecutive(self.segments, bs, self.segments_per_doc, _epoch_seed(self.seed, epoch, 1))
        else:
            if self._neighbors is not None:
                order = chain_order(self._neighbors, seed=_epoch_seed(self.seed, epoch, 2))
            else:
                order = np.random.default_rng([self.seed, epoch, 3]).permutation(n).tolist()
            batches = [order[i : i + bs] for i in range(0, n, bs)]
            if self._neighbors is not None:  # the chain keeps neighbours adjacent: decorrelate consecutive updates
                perm = np.random.default_rng([self.seed, epoch, 4]).permutation(len(batches))
                batches = [batches[i] for i in perm]
        self._plans = {epoch: batches}  # keep one epoch: the trainer asks for each epoch in turn
        return batches

    def collate(self, indices: Sequence[int]) -> dict[str, torch.Tensor]:
        """The batch dict of segments ``indices``: right-padded to the longest row (module docstring)."""
        segs = [self.segments[i] for i in indices]
        ids, mask = right_pad([s.tokens for s in segs], self.pad_id)
        return {
            "input_ids": ids,
            "attention_mask": mask,
            "segment_doc": torch.tensor([s.doc_index for s in segs], dtype=torch.long),
            "segment_index": torch.tensor([s.index for s in segs], dtype=torch.long),
        }

    def __len__(self) -> int:
        return len(self.plan(0))

    def __call__(self, epoch: int = 0) -> Iterator[dict[str, torch.Tensor]]:
        for indices in self.plan(epoch):
            yield self.collate(indices)


def pad_id_of(tokenizer) -> int:
    """The pad id, else the EOS id, else 0 (right padding under an attention mask: its value is never read)."""
    for name in ("pad_token_id", "eos_token_id"):
        value = getattr(tokenizer, name, None)
        if isinstance(value, int):
            return value
    return 0


def trime_batches(
    kind: MemoryKind,
    documents: Sequence,
    tokenizer=None,
    seq_len: int = 256,
    batch_size: int = 8,
    seed: int = 0,
    segments_per_doc: int | None = None,
    packing: str = "bm25",
    bm25_k: int = 20,
):
    """Training batches for a TRIME memory ``kind``: a callable ``epoch -> batches`` for
    :func:`memlm.training.loop.train`.

    ``local``: the plain ``seq_len`` chunks of :func:`memlm.training.loop.lm_batches` (documents + EOS concatenated; the
    CE baseline's data). ``long`` / ``external``: a :class:`TrimeBatches` of document segments (``segments_per_doc``
    for ``long``, default ``batch_size``; ``packing`` bm25 or random for ``external``). ``documents`` are objects with
    ``.text`` (tokenized with ``tokenizer``) or token-id arrays.
    """
    if kind not in MEMORY_KINDS:
        raise MemlmError(f"unknown memory kind {kind!r}; use one of {', '.join(MEMORY_KINDS)}")
    token_docs = tokenize_for_trime(documents, tokenizer)
    if kind == "local":
        stream = np.concatenate(token_docs) if token_docs else np.zeros(0, dtype=np.int64)
        return lm_batches(stream, seq_len=seq_len, batch_size=batch_size, seed=seed)
    return TrimeBatches(
        kind, token_docs, seq_len, batch_size, seed, segments_per_doc, packing, bm25_k, pad_id_of(tokenizer)
    )


# ---------------------------------------------------------------------------------------------------------------
# By name


class TrimeSetup(NamedTuple):
    """What :func:`trime_objective` returns: unpack as ``loss_fn, batches = trime_objective(...)``."""

    loss_fn: Callable[[torch.nn.Module, dict[str, Any]], torch.Tensor]
    batches: Callable[[Sequence, Any], Any]  # (documents, tokenizer) -> train_batches


_KIND = {"trime": "local", "trime-long": "long", "trime-ext": "external"}
_COMMON = ("seq_len", "batch_size", "seed")
_TRIME_ONLY = ("detach_memory",)  # every TRIME objective, not ce
_ONLY = {"segments_per_doc": ("trime-long",), "drop_local_p": ("trime-ext",), "packing": ("trime-ext",),
         "bm25_k": ("trime-ext",)}  # fmt: skip


def _check_int(name: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise MemlmError(f"{name} must be an integer >= {low}, got {value!r}")
    return int(value)


def trime_objective(name: str, **options: Any) -> TrimeSetup:
    """``(loss_fn, batches_factory)`` of a training objective, for ``train_lm(..., loss_fn=..., batches=...)``.

    ``name``: ``ce`` (plain next-token cross-entropy), ``trime`` (TrimeLM, local memory), ``trime-long``
    (TrimeLM_long, long-term memory over consecutive segments) or ``trime-ext`` (TrimeLM_ext, external memory over
    BM25-packed segments). ``batches_factory(documents, tokenizer)`` returns the trainer's ``train_batches``.

    Options (``None`` means "not given"): ``seq_len`` (256; use ``TrainConfig.seq_len``), ``batch_size`` (8; use
    ``TrainConfig.batch_size``), ``seed`` (0), ``segments_per_doc`` (``m``, trime-long only; default ``batch_size``),
    ``drop_local_p`` (trime-ext only; 0.9), ``packing`` (trime-ext only; ``bm25`` or ``random``), ``bm25_k``
    (trime-ext only; 20), ``detach_memory`` (TRIME objectives; False: App. G's "w/o back-prop to memory" ablation).
    Train with ``warmup_loss=causal_lm_loss`` and ``TrainConfig.warmup_loss_steps=0.05``.
    """
    if name not in OBJECTIVES:
        raise MemlmError(f"unknown training objective {name!r}; use one of {', '.join(OBJECTIVES)}")
    given = {k: v for k, v in options.items() if v is not None}
    unknown = sorted(k for k in given if k not in _COMMON and k not in _ONLY and k not in _TRIME_ONLY)
    if unknown:
        known = ", ".join([*_COMMON, *_ONLY])
        raise MemlmError(f"unknown option(s) {', '.join(unknown)} for objective {name!r}; known: {known}")
    for key, names in _ONLY.items():
        if key in given and name not in names:
            raise MemlmError(f"option {key} only applies to objective {' / '.join(names)}, not {name!r}")
    detach = given.get("detach_memory", False)
    if not isinstance(detach, bool):
        raise MemlmError(f"detach_memory must be True or False, got {detach!r}")
    if detach and name == "ce":
        raise MemlmError("detach_memory applies to the TRIME objectives (trime, trime-long, trime-ext), not 'ce'")
    seq_len = _check_int("seq_len", given.get("seq_len", 256), 2)
    batch_size = _check_int("batch_size", given.get("batch_size", 8), 1)
    seed = _check_int("seed", given.get("seed", 0), 0)
    m = given.get("segments_per_doc")
    if m is not None:
        m = _check_int("segments_per_doc", m, 1)
        if m > batch_size:
            raise MemlmError(f"segments_per_doc must be at most batch_size={batch_size}, got {m}")
    p = given.get("drop_local_p", 0.9)
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p <= 1.0 or math.isnan(p):
        raise MemlmError(f"drop_local_p must be a probability in [0, 1], got {p!r}")
    packing = given.get("packing", "bm25")
    if packing not in PACKINGS:
        raise MemlmError(f"unknown packing {packing!r}; use one of {', '.join(PACKINGS)}")
    bm25_k = _check_int("bm25_k", given.get("bm25_k", 20), 1)

    if name == "ce":
        loss_fn: Callable = causal_lm_loss
        kind: MemoryKind = "local"  # plain chunks, like the CE baseline
    else:
        kind = _KIND[name]  # type: ignore[assignment]
        loss_fn = TrimeObjective(kind, float(p), detach_memory=detach)

    def batches(documents: Sequence, tokenizer=None):
        return trime_batches(kind, documents, tokenizer, seq_len=seq_len, batch_size=batch_size, seed=seed,
                             segments_per_doc=m, packing=packing, bm25_k=bm25_k)  # fmt: skip

    return TrimeSetup(loss_fn, batches)


# ---------------------------------------------------------------------------------------------------------------
# Objectives of the training driver


class TrimeLmObjective(LmObjective):
    """TrimeLM (local memory) as an objective of :func:`memlm.training.driver.train_objective`: the causal LM of
    :class:`memlm.training.lm.LmObjective` trained with the loss and batches of :func:`trime_objective` (its
    ``seq_len``, ``batch_size`` and ``seed`` from the ``TrainConfig``), after plain cross-entropy for the first
    ``TrainConfig.warmup_loss_steps`` updates (5% in the paper, Sec. 5.2). ``options``: those of
    :func:`trime_objective` for this objective (``detach_memory``; ``segments_per_doc`` for trime-long;
    ``drop_local_p``, ``packing``, ``bm25_k`` for trime-ext)."""

    name = "trime"

    def __init__(self, **options: Any) -> None:
        super().__init__(warmup_loss=causal_lm_loss)
        self.options = options

    def prepare(self, setup) -> None:
        c = setup.config
        self.loss_fn, self.batch_factory = trime_objective(self.name, seq_len=c.seq_len, batch_size=c.batch_size,
                                                           seed=c.seed, **self.options)  # fmt: skip
        super().prepare(setup)


class TrimeLongObjective(TrimeLmObjective):
    """TrimeLM_long (Sec. 4.2): local + long-term memory over consecutive segments of a document."""

    name = "trime-long"


class TrimeExtObjective(TrimeLmObjective):
    """TrimeLM_ext (Sec. 4.3): external memory over BM25-packed segments, the local one dropped with p=0.9."""

    name = "trime-ext"
