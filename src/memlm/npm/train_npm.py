"""Train a BERT-like encoder with the NPM objective (Min et al. 2023, §3.2; NPM SINGLE, App. A.3).

This is the job behind ``memlm train --objective npm|npm-single``: it loads the encoder (:func:`memlm.resources.
load_encoder`, default the named ``minilm-l6``) or makes a small random BERT for an encoder's tokenizer
(``scratch``), builds document-grouped batches and the loss with :func:`memlm.npm.objective.npm_objective`, and runs
the shared loop :func:`memlm.train.train` with ``warmup_loss=None`` (its default warm-up loss is a causal-LM loss).
Everything goes under one folder and rerunning the same call resumes::

    out/checkpoint-N/ resumable checkpoints (encoder + tokenizer + optimizer state)
    out/final/        the trained encoder + tokenizer: ``--encoder out/final`` in ``memlm npm index``
    out/log.json      loss and learning rate per update (the validation loss is added to the last entry)

Validation. The shared loop's periodic validation scores causal-LM perplexity, which an encoder has none of, so it
is not used; with ``valid_tokens != 0`` the NPM loss of the first ``valid_tokens`` validation tokens is computed once
at the end, in eval mode with the objective's deterministic masking, as the mean over masked spans (NPM) or masked
tokens (NPM SINGLE) of the contrastive loss (``valid_loss`` in the last log entry; :attr:`NpmTrainResult.valid_loss`).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from memlm.errors import MemlmError
from memlm.fileio import atomic_write_json
from memlm.npm.loss import npm_single_loss, npm_span_loss
from memlm.npm.objective import OBJECTIVES, NpmBatches, NpmObjective, npm_batches, npm_objective
from memlm.train import TrainConfig, TrainResult, train

__all__ = [
    "DEFAULT_ENCODER",
    "NpmTrainResult",
    "limit_encoder_documents",
    "npm_validation_batches",
    "npm_valid_loss",
    "scratch_bert",
    "train_npm",
]

DEFAULT_ENCODER = "minilm-l6"


@dataclasses.dataclass
class NpmTrainResult(TrainResult):
    """:class:`memlm.train.TrainResult` plus the final validation loss (``None`` when not computed)."""

    valid_loss: float | None = None


def scratch_bert(size: str, tokenizer, n_positions: int = 512, dropout: float = 0.1, seed: int = 0):
    """A randomly initialised ``BertModel`` of ``size`` (``<layers>x<dim>`` or a preset of
    :func:`memlm.train_lm.parse_arch`; 64-dim heads, FFN 4x) for ``tokenizer``'s vocabulary."""
    from transformers import BertConfig, BertModel

    from memlm.train_lm import parse_arch

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


def encoder_run_identity(
    corpus: str | Sequence[str], docs: Sequence, encoder: str, scratch: str | None, tokenizer
) -> dict[str, Any]:
    """What an encoder run (NPM, NPM SINGLE, MLM) trains on, for ``run.json``: resuming with another corpus, encoder
    or tokenizer is refused with the differences named (:func:`memlm.train.check_run_identity`)."""
    from memlm.corpora import corpus_fingerprint
    from memlm.resources import tokenizer_fingerprint

    return {
        "corpus": corpus if isinstance(corpus, str) else ",".join(corpus),
        "corpus_fingerprint": corpus_fingerprint(docs),
        "init": f"scratch {scratch}" if scratch is not None else f"encoder {encoder}",
        "tokenizer": tokenizer_fingerprint(tokenizer),
    }


def limit_encoder_documents(docs: Sequence, tokenizer, max_tokens: int | None) -> list:
    """The leading documents whose tokens (no special tokens) add up to at most ``max_tokens`` (a first document longer
    than that is cut to its leading part within the budget); an
    encoder tokenizer has no EOS, so :func:`memlm.windows.limit_documents` does not apply."""
    if max_tokens is None:
        return list(docs)
    kept, total = [], 0
    for d in docs:
        n = len(tokenizer(d if isinstance(d, str) else d.text, add_special_tokens=False)["input_ids"])
        if total + n > max_tokens:
            if not kept:  # one document longer than the budget: its leading part, not all of it
                from memlm.windows import truncate_document

                kept.append(truncate_document(d, tokenizer, max_tokens, extra_tokens=0))
            break
        kept.append(d)
        total += n
    return kept


def npm_validation_batches(
    corpus: str | Sequence[str], tokenizer, tokens: int | None, seq_len: int, batch_size: int, seed: int = 0
) -> NpmBatches:
    """The batches NPM / MLM validation scores: the leading ``tokens`` tokens of ``corpus`` at split ``valid``, in
    document-grouped batches of ``batch_size`` sequences of ``seq_len`` tokens (as training builds them)."""
    from memlm.train_lm import load_corpora

    docs = limit_encoder_documents(load_corpora(corpus, "valid"), tokenizer, tokens)
    return npm_batches(docs, tokenizer, seq_len=seq_len, batch_size=batch_size, seed=seed)


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


def finish_training(
    res: TrainResult,
    out: Path,
    config: TrainConfig,
    tokenizer,
    valid_corpus: str | Sequence[str],
    valid_tokens: int | None,
    valid_loss: Callable[[NpmBatches], float | None],
) -> NpmTrainResult:
    """The trainer's result plus, once training is complete, ``valid_loss`` over ``valid_tokens`` tokens of
    ``valid_corpus`` (split valid, :func:`npm_validation_batches`), also written into the last entry of
    ``out/log.json``."""
    result = NpmTrainResult(**{f.name: getattr(res, f.name) for f in dataclasses.fields(TrainResult)})
    if res.final_dir is not None and valid_tokens != 0:
        vb = npm_validation_batches(valid_corpus, tokenizer, valid_tokens, config.seq_len, config.batch_size,
                                    config.seed)  # fmt: skip
        result.valid_loss = valid_loss(vb)
        if result.valid_loss is not None and result.log:
            result.log[-1]["valid_loss"] = result.valid_loss
            _rewrite_log(out, config, result.log)
    return result


def train_npm(
    out: str | os.PathLike,
    corpus: str | Sequence[str],
    config: TrainConfig,
    encoder: str | None = None,
    scratch: str | None = None,
    objective: str = "npm",
    valid_corpus: str | Sequence[str] | None = None,
    valid_tokens: int | None = 200_000,
    n_positions: int = 512,
    dropout: float = 0.1,
    budget: float | None = None,
    max_span: int | None = None,
    resume: bool = True,
    stop_after: int | None = None,
    progress: bool = True,
) -> NpmTrainResult:
    """Train an encoder with NPM (``objective="npm"``) or NPM SINGLE (``"npm-single"``); see the module docstring.

    ``encoder``: the encoder to continue (named, HF id or folder; default ``minilm-l6``). ``scratch``: instead a new
    random BERT of this size (:func:`scratch_bert`) using ``encoder``'s tokenizer. ``corpus`` is read at split
    ``train``, ``valid_corpus`` (default: the same corpora) at split ``valid``. ``config.seq_len`` is the encoder
    input length (CLS and SEP included) and ``config.batch_size`` the sequences per batch; ``budget`` (masking budget,
    0.15) and ``max_span`` (10) go to the masking. ``config.warmup_loss_steps`` must be 0 and ``eval_every`` is not
    used (validation runs once, at the end).
    """
    from memlm.resources import load_encoder
    from memlm.train_lm import load_corpora

    if objective not in OBJECTIVES:
        raise MemlmError(f"unknown NPM objective {objective!r}; use one of {', '.join(OBJECTIVES)}")
    if config.resolved_warmup_loss():
        raise MemlmError("NPM training has no warm-up loss: use warmup_loss_steps=0")
    if valid_tokens is not None and valid_tokens < 0:
        raise MemlmError(f"valid_tokens must be >= 0 or None, got {valid_tokens}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    docs = load_corpora(corpus, "train")
    model, tok = load_encoder(encoder or DEFAULT_ENCODER, dtype="float32")
    if scratch is not None:
        model = scratch_bert(scratch, tok, n_positions, dropout, config.seed)
        model.config.memlm_name = str(out.resolve() / "final")
    model.train()
    loss_fn, factory = npm_objective(
        objective,
        seq_len=config.seq_len,
        batch_size=config.batch_size,
        seed=config.seed,
        budget=budget,
        max_span=max_span if objective == "npm" else None,
    )
    train_batches = factory(docs, tok)  # also configures loss_fn with the tokenizer's ids
    res = train(
        model,
        config,
        train_batches,
        None,
        loss_fn=loss_fn,
        out_dir=out,
        resume=resume,
        warmup_loss=None,
        stop_after=stop_after,
        progress=progress,
        tokenizer=tok,
        identity=encoder_run_identity(corpus, docs, encoder or DEFAULT_ENCODER, scratch, tok),
    )
    return finish_training(
        res, out, config, tok, valid_corpus or corpus, valid_tokens, lambda vb: npm_valid_loss(model, loss_fn, vb)
    )


def _rewrite_log(out: Path, config: TrainConfig, log: list[dict[str, Any]]) -> None:
    atomic_write_json(out / "log.json", {"config": dataclasses.asdict(config), "log": log})
