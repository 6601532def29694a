"""Train a BERT-like encoder with the NPM objective (Min et al. 2023, §3.2; NPM SINGLE, App. A.3).

:class:`NpmTrainObjective` / :class:`NpmSingleTrainObjective` are the objectives ``npm`` / ``npm-single`` of
``memlm train`` for the shared driver :func:`memlm.training.driver.train_objective` (their base
:class:`EncoderObjective` is also the MLM baseline's, :mod:`memlm.npm.mlm`): the model is the encoder
(:func:`memlm.models.resources.load_encoder`, default the named ``minilm-l6``) or a small random BERT for an encoder's
tokenizer (``scratch``); batches and loss come from :func:`memlm.npm.objective.npm_objective`; there is no warm-up loss
(the loop's default one is a causal-LM loss). Everything goes under one folder and rerunning the same call resumes::

    out/checkpoint-N/ resumable checkpoints (encoder + tokenizer + optimizer state)
    out/final/        the trained encoder + tokenizer: ``--encoder out/final`` in ``memlm npm index``
    out/log.json      loss and learning rate per update (the validation loss is added to the last entry)

Validation. The shared loop's periodic validation scores causal-LM perplexity, which an encoder has none of, so it
is not used; with ``valid_tokens != 0`` the NPM loss of the first ``valid_tokens`` validation tokens is computed once
at the end, in eval mode with the objective's deterministic masking, as the mean over masked spans (NPM) or masked
tokens (NPM SINGLE) of the contrastive loss (``valid_loss`` in the last log entry; ``ObjectiveResult.valid_loss``).
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

import torch

from memlm.data.corpora import Document, load_corpora
from memlm.errors import MemlmError, option
from memlm.npm.loss import npm_single_loss, npm_span_loss
from memlm.npm.objective import NpmBatches, NpmObjective, npm_batches, npm_objective
from memlm.training.driver import Objective, TrainSetup
from memlm.training.loop import TrainConfig, parse_arch

__all__ = [
    "DEFAULT_ENCODER",
    "EncoderObjective",
    "NpmSingleTrainObjective",
    "NpmTrainObjective",
    "encoder_valid_batches",
    "limit_encoder_documents",
    "npm_validation_batches",
    "npm_valid_loss",
    "scratch_bert",
]

DEFAULT_ENCODER = "minilm-l6"


def scratch_bert(size: str, tokenizer, n_positions: int = 512, dropout: float = 0.1, seed: int = 0):
    """A randomly initialised ``BertModel`` of ``size`` (``<layers>x<dim>`` or a preset of
    :func:`memlm.training.loop.parse_arch`; 64-dim heads, FFN 4x) for ``tokenizer``'s vocabulary."""
    from transformers import BertConfig, BertModel

    n_layer, dim, n_head = parse_arch(size)
    cfg = BertConfig(
        vocab_size=len(tokenizer),
        hidden_size=dim,
        num_hidden_layers=n_layer,
        num_attention_heads=n_head,
        intermediate_size=4 * dim,
        max_position_embeddings=n_positions,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    return BertModel(cfg)


def limit_encoder_documents(docs: Sequence, tokenizer, max_tokens: int | None) -> list:
    """The leading documents whose tokens (no special tokens) add up to at most ``max_tokens`` (a first document longer
    than that is cut to its leading part within the budget); an
    encoder tokenizer has no EOS, so :func:`memlm.data.windows.limit_documents` does not apply."""
    if max_tokens is None:
        return list(docs)
    kept, total = [], 0
    for d in docs:
        n = len(tokenizer(d if isinstance(d, str) else d.text, add_special_tokens=False)["input_ids"])
        if total + n > max_tokens:
            if not kept:  # one document longer than the budget: its leading part, not all of it
                from memlm.data.windows import truncate_document

                kept.append(truncate_document(d, tokenizer, max_tokens, extra_tokens=0))
            break
        kept.append(d)
        total += n
    return kept


def encoder_valid_batches(
    docs: Sequence, tokenizer, tokens: int | None, seq_len: int, batch_size: int, seed: int = 0
) -> NpmBatches:
    """The batches NPM / MLM validation scores: the leading ``tokens`` tokens of ``docs``, in document-grouped batches
    of ``batch_size`` sequences of ``seq_len`` tokens (as training builds them)."""
    docs = limit_encoder_documents(docs, tokenizer, tokens)
    return npm_batches(docs, tokenizer, seq_len=seq_len, batch_size=batch_size, seed=seed)


def npm_validation_batches(
    corpus: str | Sequence[str], tokenizer, tokens: int | None, seq_len: int, batch_size: int, seed: int = 0
) -> NpmBatches:
    """:func:`encoder_valid_batches` of the documents of ``corpus`` at split ``valid``."""
    return encoder_valid_batches(load_corpora(corpus, "valid"), tokenizer, tokens, seq_len, batch_size, seed)


@torch.no_grad()
def mean_eval_loss(model, per_item: Callable[[dict[str, Any]], torch.Tensor], batches: NpmBatches) -> float | None:
    """Mean of ``per_item(batch)`` (a vector of per-span / per-token losses) over one pass of ``batches``, in eval mode;
    ``None`` when no batch has anything to score. Shared by NPM and the MLM baseline."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    try:
        for batch in batches(0):
            per = per_item(batch)
            if per.dim() == 0:  # nothing masked in this batch
                continue
            total += float(per.sum())
            count += per.numel()
    finally:
        model.train(was_training)
    return total / count if count else None


def npm_valid_loss(model, loss_fn: NpmObjective, batches: NpmBatches) -> float | None:
    """Mean contrastive loss per masked span (NPM) or masked token (NPM SINGLE) over one pass of ``batches`` (eval
    mode, the objective's deterministic masking); ``None`` when no batch masks anything."""
    fn = npm_span_loss if loss_fn.kind == "npm" else npm_single_loss

    def per_item(batch: dict[str, Any]) -> torch.Tensor:
        mb, masked, unmasked = loss_fn.forward(model, batch)
        return fn(masked.float(), unmasked.float(), mb, reduction="none")

    return mean_eval_loss(model, per_item, batches)


class EncoderObjective(Objective):
    """An encoder objective of the training driver (NPM, NPM SINGLE, the MLM baseline): the encoder ``setup.model``
    (default ``minilm-l6``) continued, or a random BERT of size ``setup.scratch`` (:func:`scratch_bert`,
    ``setup.n_positions`` default 512) with that encoder's tokenizer; no warm-up loss; validation once the run is
    complete (:meth:`valid_loss_of` over :func:`encoder_valid_batches`)."""

    validation = "end"
    warmup_loss = None
    title = "NPM"  # in messages

    def prepare(self, setup: TrainSetup) -> None:
        if setup.config.resolved_warmup_loss():
            raise MemlmError(f"{self.title} training has no warm-up loss: use warmup_loss_steps=0")
        if (setup.tokenizer or "").startswith("bpe:"):
            flag = option("--tokenizer")
            raise MemlmError(f"{self.title} uses an encoder's WordPiece tokenizer: give {flag} ENCODER (folder/name)")

    def identity(self, setup: TrainSetup) -> dict[str, Any]:
        return {"init": f"scratch {setup.scratch}" if setup.scratch is not None else f"encoder {self.encoder(setup)}"}

    @staticmethod
    def encoder(setup: TrainSetup) -> str:
        """The encoder continued (``setup.model``), or whose tokenizer a model from scratch takes (``setup.model``, else
        ``setup.tokenizer``); default ``minilm-l6``."""
        return setup.model or (setup.tokenizer if setup.scratch is not None else None) or DEFAULT_ENCODER

    def build(self, setup: TrainSetup, docs: list[Document]):
        from memlm.models.resources import load_encoder

        model, tok = load_encoder(self.encoder(setup), dtype="float32")
        if setup.scratch is not None:
            model = scratch_bert(setup.scratch, tok, setup.n_positions or 512, setup.dropout, setup.config.seed)
            model.config.memlm_name = str(setup.folder.resolve() / "final")
        model.train()
        return model, tok

    def final_valid_loss(self, model, docs: list[Document], tokenizer, setup: TrainSetup) -> float | None:
        c = setup.config
        batches = encoder_valid_batches(docs, tokenizer, setup.valid_tokens, c.seq_len, c.batch_size, c.seed)
        return self.valid_loss_of(model, batches)

    @abstractmethod
    def valid_loss_of(self, model, batches: NpmBatches) -> float | None:
        """The mean validation loss per masked item over one pass of ``batches`` (``None``: nothing masked)."""


class NpmTrainObjective(EncoderObjective):
    """NPM (§3.2): spans masked with in-batch positives, the contrastive span loss; ``budget`` (masking budget,
    0.15) and ``max_span`` (10) go to the masking. Validation: mean loss per masked span."""

    name = "npm"

    def __init__(self, budget: float | None = None, max_span: int | None = None) -> None:
        self.budget, self.max_span = budget, max_span

    def batches(self, docs: list[Document], tokenizer, config: TrainConfig) -> NpmBatches:
        self.loss_fn, factory = npm_objective(self.name, seq_len=config.seq_len, batch_size=config.batch_size,
                                              seed=config.seed, budget=self.budget,
                                              max_span=self.max_span if self.name == "npm" else None)  # fmt: skip
        return factory(docs, tokenizer)  # also configures loss_fn with the tokenizer's ids

    def valid_loss_of(self, model, batches: NpmBatches) -> float | None:
        return npm_valid_loss(model, self.loss_fn, batches)


class NpmSingleTrainObjective(NpmTrainObjective):
    """NPM SINGLE (App. A.3): single tokens masked, the contrastive token loss (``max_span`` is not used).
    Validation: mean loss per masked token."""

    name = "npm-single"
