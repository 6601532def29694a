"""NPM training objectives and document-grouped batches for the shared trainer (:func:`memlm.training.loop.train`).

Min et al. (2023) §3.2 and App. A.2/A.3. The pieces:

* :class:`NpmObjective` -- a loss ``loss_fn(model, batch) -> scalar``. It takes the batch's unmasked sequences
  ``x^i`` (``[CLS] tokens [SEP]``), masks them with :func:`memlm.npm.masking.mask_batch` (spans with in-batch
  positives, each replaced by ``[MASK_s] [MASK_e]``; both are ``tokenizer.mask_token_id``, see
  :mod:`memlm.npm.encoder`) or :func:`~memlm.npm.masking.mask_batch_single` (NPM SINGLE), encodes the masked
  ``x-hat^i`` and the unmasked ``x^i`` with the same encoder (last hidden states), and returns
  :func:`memlm.npm.loss.npm_span_loss` / :func:`~memlm.npm.loss.npm_single_loss`: the multi-positive contrastive loss
  of the ``[MASK_s]`` / ``[MASK_e]`` vectors against the token vectors of the *other* unmasked sequences of the batch
  (computed in float32). The masking draw is a function of ``(seed, batch["mask_seed"])`` only, so a resumed run
  masks exactly as the first one.
* :class:`NpmBatches` -- a callable ``epoch -> iterator of batch dicts``. Documents are cut into sequences of at most
  ``seq_len - 2`` tokens (plus CLS/SEP); batches group the sequences of the same document (§3.2.1, "we construct the
  batch by grouping sequences from the same document and assigning them to the same batch"): each epoch shuffles the
  document order, lays every document's sequences out consecutively and cuts that list into batches of
  ``batch_size``, then shuffles the batch order. Everything is a function of ``(seed, epoch)``.
* :func:`npm_objective` -- ``(loss_fn, batches_factory)`` by name (``npm``, ``npm-single``), like
  :func:`memlm.trime.training.trime_objective`. Train with ``warmup_loss=None`` (the default warm-up loss of
  :func:`memlm.training.loop.train` is a causal-LM loss, which an encoder has no use for).

Batch fields: ``input_ids`` / ``attention_mask`` ``[B, T]`` (right padded), ``seq_doc`` ``[B]`` (document of each
row), ``mask_seed`` (a 0-d int64 tensor).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from memlm.errors import MemlmError
from memlm.models.forward import right_pad
from memlm.npm.encoder import _cls_sep_pad, encode_padded, mask_ids, special_ids
from memlm.npm.loss import npm_single_loss, npm_span_loss
from memlm.npm.masking import MaskedBatch, mask_batch, mask_batch_single

__all__ = ["OBJECTIVES", "NpmBatches", "NpmObjective", "NpmSetup", "npm_batches", "npm_objective"]

OBJECTIVES: tuple[str, ...] = ("npm", "npm-single")


class NpmObjective:
    """NPM (``kind="npm"``) or NPM SINGLE (``"npm-single"``) loss for the shared trainer (module docstring).

    Masking options are those of :func:`memlm.npm.masking.mask_batch` (``budget`` 0.15, ``p`` 0.5, ``max_span`` 10,
    ``max_spans`` 128, ``max_repeat`` 10; NPM SINGLE uses ``budget`` and ``max_repeat`` (default ``None``)).
    ``reduction``: ``"sum"`` over masked spans (the paper) or ``"mean"``. The tokenizer (mask, special and pad ids)
    is given here or later with :meth:`configure` (:func:`npm_objective`'s batches factory does it).
    """

    def __init__(
        self,
        kind: str = "npm",
        tokenizer=None,
        *,
        budget: float = 0.15,
        p: float = 0.5,
        max_span: int = 10,
        max_spans: int = 128,
        max_repeat: int | None | str = "default",
        reduction: str = "sum",
        seed: int = 0,
    ) -> None:
        if kind not in OBJECTIVES:
            raise MemlmError(f"unknown NPM objective {kind!r}; use one of {', '.join(OBJECTIVES)}")
        if reduction not in ("sum", "mean"):
            raise MemlmError(f"reduction must be 'sum' or 'mean', got {reduction!r}")
        self.kind = kind
        self.budget, self.p, self.max_span, self.max_spans = float(budget), float(p), int(max_span), int(max_spans)
        self.max_repeat = (10 if kind == "npm" else None) if max_repeat == "default" else max_repeat
        self.reduction = reduction
        self.seed = int(seed)
        self.mask_s = self.mask_e = self.pad_id = None
        self.special: list[int] = []
        if tokenizer is not None:
            self.configure(tokenizer)

    def __repr__(self) -> str:
        return f"NpmObjective({self.kind!r}, budget={self.budget}, reduction={self.reduction!r})"

    def configure(self, tokenizer) -> NpmObjective:
        """Take the ``[MASK]``, special and pad ids from ``tokenizer``."""
        self.mask_s, self.mask_e = mask_ids(tokenizer)
        self.pad_id = _cls_sep_pad(tokenizer)[2]
        self.special = special_ids(tokenizer)
        return self

    def _rng(self, batch: dict[str, Any], seqs: list[list[int]]) -> np.random.Generator:
        if "mask_seed" in batch:
            return np.random.default_rng([self.seed, int(batch["mask_seed"])])
        digest = hashlib.sha256(repr(seqs).encode()).digest()  # no mask_seed: a function of the batch content
        return np.random.default_rng([self.seed, int.from_bytes(digest[:8], "little")])

    def mask(self, batch: dict[str, Any]) -> MaskedBatch:
        """The batch's masking (deterministic given ``seed`` and the batch)."""
        if self.mask_s is None:
            raise MemlmError("NpmObjective has no tokenizer: pass tokenizer= or call configure(tokenizer) first")
        ids, att = batch["input_ids"], batch.get("attention_mask")
        if ids.dim() != 2:
            raise MemlmError(f"input_ids must be [B, T], got {tuple(ids.shape)}")
        lengths = att.sum(1).tolist() if att is not None else [ids.shape[1]] * ids.shape[0]
        seqs = [ids[r, : int(n)].tolist() for r, n in enumerate(lengths)]
        rng = self._rng(batch, seqs)
        if self.kind == "npm":
            return mask_batch(seqs, self.mask_s, self.mask_e, rng, budget=self.budget, p=self.p,
                              max_span=self.max_span, max_spans=self.max_spans, max_repeat=self.max_repeat,
                              special_ids=self.special)  # fmt: skip
        return mask_batch_single(seqs, self.mask_s, rng, budget=self.budget, max_repeat=self.max_repeat,
                                 special_ids=self.special)  # fmt: skip

    def forward(self, model: torch.nn.Module, batch: dict[str, Any]) -> tuple[MaskedBatch, torch.Tensor, torch.Tensor]:
        """``(masked batch, masked hidden [B, Lm, H], unmasked hidden [B, L, H])``, both attached to the graph."""
        mb = self.mask(batch)
        m_ids, m_att = right_pad(mb.input_ids, self.pad_id)
        u_ids, u_att = right_pad(mb.original_ids, self.pad_id)
        masked = encode_padded(model, m_ids, m_att)
        unmasked = encode_padded(model, u_ids, u_att)
        return mb, masked, unmasked

    def __call__(self, model: torch.nn.Module, batch: dict[str, Any]) -> torch.Tensor:
        mb, masked, unmasked = self.forward(model, batch)
        loss = npm_span_loss if self.kind == "npm" else npm_single_loss
        with torch.autocast(device_type=masked.device.type, enabled=False):
            return loss(masked.float(), unmasked.float(), mb, reduction=self.reduction)


# ---------------------------------------------------------------------------------------------------------------
# Batches


def _token_docs(documents: Sequence, tokenizer) -> list[np.ndarray]:
    docs = list(documents)
    if all(isinstance(d, str) or hasattr(d, "text") for d in docs):
        texts = [d if isinstance(d, str) else d.text for d in docs]
        enc = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
        return [np.asarray(e, dtype=np.int64) for e in enc]
    try:
        return [np.asarray(d, dtype=np.int64).reshape(-1) for d in docs]
    except (TypeError, ValueError) as e:
        raise MemlmError(f"documents must be strings, objects with .text, or token-id arrays: {e}") from e


class NpmBatches:
    """Callable ``epoch -> iterator of batch dicts`` of document-grouped sequences (module docstring)."""

    def __init__(
        self, token_docs: Sequence[np.ndarray], seq_len: int, batch_size: int, cls: int, sep: int, pad: int,
        seed: int = 0,
    ) -> None:  # fmt: skip
        if not isinstance(seq_len, int) or seq_len < 3:
            raise MemlmError(f"seq_len must be an integer >= 3 (CLS, a token, SEP), got {seq_len!r}")
        if not isinstance(batch_size, int) or batch_size < 1:
            raise MemlmError(f"batch_size must be an integer >= 1, got {batch_size!r}")
        self.seq_len, self.batch_size, self.seed = seq_len, batch_size, int(seed)
        self.cls, self.sep, self.pad = int(cls), int(sep), int(pad)
        body = seq_len - 2
        self.sequences: list[list[int]] = []
        self.seq_doc: list[int] = []
        self.doc_seqs: list[list[int]] = []
        for d, toks in enumerate(token_docs):
            mine = []
            for s in range(0, len(toks), body):
                mine.append(len(self.sequences))
                self.sequences.append([self.cls, *map(int, toks[s : s + body]), self.sep])
                self.seq_doc.append(d)
            self.doc_seqs.append(mine)
        if not self.sequences:
            raise MemlmError("the training documents have no tokens: give more text")

    def plan(self, epoch: int = 0) -> list[list[int]]:
        """The epoch's batches as lists of sequence indices: a function of ``(seed, epoch)``."""
        rng = np.random.default_rng([self.seed, int(epoch), 0x4E504D])
        order = [i for d in rng.permutation(len(self.doc_seqs)).tolist() for i in self.doc_seqs[d]]
        batches = [order[i : i + self.batch_size] for i in range(0, len(order), self.batch_size)]
        return [batches[i] for i in rng.permutation(len(batches)).tolist()]

    def collate(self, indices: Sequence[int], mask_seed: int) -> dict[str, torch.Tensor]:
        ids, att = right_pad([self.sequences[i] for i in indices], self.pad)
        return {
            "input_ids": ids,
            "attention_mask": att,
            "seq_doc": torch.tensor([self.seq_doc[i] for i in indices], dtype=torch.long),
            "mask_seed": torch.tensor(mask_seed, dtype=torch.long),
        }

    def __len__(self) -> int:
        return len(self.plan(0))

    def __call__(self, epoch: int = 0) -> Iterator[dict[str, torch.Tensor]]:
        for b, indices in enumerate(self.plan(epoch)):
            seed = int(np.random.SeedSequence([self.seed, int(epoch), b]).generate_state(1)[0])
            yield self.collate(indices, seed)


def npm_batches(documents: Sequence, tokenizer, seq_len: int = 256, batch_size: int = 8, seed: int = 0) -> NpmBatches:
    """Document-grouped NPM training batches (§3.2.1) from strings, objects with ``.text`` or token-id arrays."""
    cls, sep, pad = _cls_sep_pad(tokenizer)
    return NpmBatches(_token_docs(documents, tokenizer), seq_len, batch_size, cls, sep, pad, seed=seed)


class NpmSetup(NamedTuple):
    """What :func:`npm_objective` returns: unpack as ``loss_fn, batches = npm_objective(...)``."""

    loss_fn: NpmObjective
    batches: Callable[[Sequence, Any], NpmBatches]  # (documents, tokenizer) -> train_batches


_OPTIONS = ("seq_len", "batch_size", "seed", "budget", "p", "max_span", "max_spans", "max_repeat", "reduction")


def npm_objective(name: str, **options: Any) -> NpmSetup:
    """``(loss_fn, batches_factory)`` for ``memlm.training.loop.train(model, config, batches, loss_fn=loss_fn,
    warmup_loss=None)``.

    ``name``: ``npm`` (span masking, §3.2) or ``npm-single`` (App. A.3). Options (``None``: not given): ``seq_len``
    (256), ``batch_size`` (8), ``seed`` (0; batches and masks), ``budget`` (0.15), ``p`` (0.5), ``max_span`` (10),
    ``max_spans`` (128), ``max_repeat`` (10 for npm, none for npm-single), ``reduction`` (``sum``).
    ``batches_factory(documents, tokenizer)`` also gives ``loss_fn`` the tokenizer's mask/special/pad ids.
    """
    if name not in OBJECTIVES:
        raise MemlmError(f"unknown NPM objective {name!r}; use one of {', '.join(OBJECTIVES)}")
    given = {k: v for k, v in options.items() if v is not None}
    unknown = sorted(k for k in given if k not in _OPTIONS)
    if unknown:
        raise MemlmError(f"unknown option(s) {', '.join(unknown)} for objective {name!r}; known: {', '.join(_OPTIONS)}")
    seq_len, batch_size, seed = given.get("seq_len", 256), given.get("batch_size", 8), given.get("seed", 0)
    mask_opts = {k: given[k] for k in ("budget", "p", "max_span", "max_spans", "max_repeat") if k in given}
    loss_fn = NpmObjective(name, reduction=given.get("reduction", "sum"), seed=seed, **mask_opts)

    def batches(documents: Sequence, tokenizer) -> NpmBatches:
        loss_fn.configure(tokenizer)
        return npm_batches(documents, tokenizer, seq_len=seq_len, batch_size=batch_size, seed=seed)

    return NpmSetup(loss_fn, batches)
