"""Train a causal LM on named corpora or files: from scratch (GPT-2-style, a BPE trained here) or continued.

:class:`LmObjective` is the objective ``lm`` of ``memlm train`` (and the base of TRIME's, which swap in their loss
and batches: :mod:`memlm.trime.training`); :func:`train_lm` runs it through the shared driver
:func:`memlm.training.driver.train_objective`. Everything goes under one folder, and rerunning the same command
resumes::

    out/tokenizer/    the tokenizer (trained once, reused on resume)
    out/checkpoint-N/ resumable checkpoints (model + tokenizer + optimizer state)
    out/final/        the trained model + tokenizer: ``--model out/final`` in every other memlm command
    out/log.json      loss, learning rate, tokens/s and validation perplexity per update
    out/run.json      what the run is trained on (a rerun with other settings is refused)
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from memlm.data.corpora import Document, load_corpora
from memlm.errors import MemlmError
from memlm.training.driver import Objective, TrainSetup, run_tokenizer, train_objective
from memlm.training.loop import (
    LossFn,
    TrainConfig,
    TrainResult,
    causal_lm_loss,
    describe_callable,
    gpt2_shape_config,
    lm_batches,
    parse_arch,
)

# load_corpora lives in memlm.data.corpora and parse_arch in memlm.training.loop; both stay importable from here
__all__ = ["DEFAULT_TOKENIZER", "LmObjective", "parse_arch", "scratch_gpt2", "load_corpora", "train_lm"]

DEFAULT_TOKENIZER = "bpe:8192"


def scratch_gpt2(size: str, tokenizer, n_positions: int = 1024, dropout: float = 0.1, seed: int = 0):
    """A randomly initialised ``GPT2LMHeadModel`` of ``size`` (:func:`parse_arch`) for ``tokenizer``'s vocabulary."""
    from transformers import GPT2LMHeadModel

    eos = tokenizer.eos_token_id
    cfg = gpt2_shape_config(*parse_arch(size), len(tokenizer), n_positions, dropout, bos_token_id=eos,
                            eos_token_id=eos, pad_token_id=eos)  # fmt: skip
    torch.manual_seed(seed)
    return GPT2LMHeadModel(cfg)


class LmObjective(Objective):
    """A causal LM trained with ``loss_fn`` (default: next-token cross-entropy,
    :func:`memlm.training.loop.causal_lm_loss`).

    Model: a GPT-2 of size ``setup.scratch`` (:func:`scratch_gpt2`, ``setup.n_positions`` default 1024) with the
    tokenizer ``setup.tokenizer`` (default ``bpe:8192``, trained here on the training text), or the pretrained LM
    ``setup.model`` with its tokenizer. Batches: ``batches(documents, tokenizer)`` when given, else the documents
    (each + EOS) concatenated and cut into ``seq_len`` chunks (:func:`memlm.training.loop.lm_batches`). Validation: the
    loop's perplexity of the first ``valid_tokens`` validation tokens (whole chunks, at least one).
    """

    name = "lm"
    validation = "loop"

    def __init__(self, loss_fn: LossFn = causal_lm_loss, warmup_loss: LossFn | None = causal_lm_loss, batches=None):
        self.loss_fn = loss_fn
        self.warmup_loss = warmup_loss
        self.batch_factory = batches  # (documents, tokenizer) -> train_batches, or None: plain chunks

    def prepare(self, setup: TrainSetup) -> None:
        if (setup.scratch is None) == (setup.model is None):
            raise MemlmError(
                "give exactly one of scratch (a size, e.g. 6x384) or model (a pretrained model to continue)"
            )

    def identity(self, setup: TrainSetup) -> dict[str, Any]:
        scratch = setup.scratch is not None
        return {
            "init": f"scratch {setup.scratch}" if scratch else f"model {setup.model}",
            "tokenizer_spec": (setup.tokenizer or DEFAULT_TOKENIZER) if scratch else f"the tokenizer of {setup.model}",
            "n_positions": (setup.n_positions or 1024) if scratch else None,
            "dropout": setup.dropout if scratch else None,
            "batches": describe_callable(self.batch_factory),
        }

    def build(self, setup: TrainSetup, docs: list[Document]):
        if setup.model is not None:
            from memlm.models.resources import load_causal_lm

            lm, tok = load_causal_lm(setup.model, dtype="float32")
            lm.train()
            return lm, tok
        tok = run_tokenizer(setup.folder, setup.tokenizer or DEFAULT_TOKENIZER, [d.text for d in docs])
        return scratch_gpt2(setup.scratch, tok, setup.n_positions or 1024, setup.dropout, setup.config.seed), tok

    def batches(self, docs: list[Document], tokenizer, config: TrainConfig):
        if self.batch_factory is not None:
            return self.batch_factory(docs, tokenizer)
        return lm_batches(docs, tokenizer, config.seq_len, config.batch_size, config.seed)

    def valid_batches(self, docs: list[Document], tokenizer, setup: TrainSetup):
        config = setup.config
        vb = lm_batches(docs, tokenizer, config.seq_len, config.batch_size, shuffle=False)
        if setup.valid_tokens is not None:
            keep = max(1, setup.valid_tokens // config.seq_len)
            vb.chunks = np.ascontiguousarray(vb.chunks[:keep])
        return vb


def train_lm(
    out: str | os.PathLike,
    corpus: str | Sequence[str],
    config: TrainConfig,
    scratch: str | None = None,
    model: str | None = None,
    tokenizer: str = DEFAULT_TOKENIZER,
    valid_corpus: str | Sequence[str] | None = None,
    valid_tokens: int | None = 200_000,
    n_positions: int = 1024,
    dropout: float = 0.1,
    loss_fn: LossFn = causal_lm_loss,
    warmup_loss: LossFn | None = causal_lm_loss,
    batches=None,
    resume: bool = True,
    stop_after: int | None = None,
    progress: bool = True,
) -> TrainResult:
    """Train an LM from scratch (``scratch``: a size) or continue a pretrained one (``model``: any memlm model name).

    ``corpus`` is read at split ``train`` and ``valid_corpus`` (default: the same corpora) at split ``valid``; the
    first ``valid_tokens`` validation tokens are scored every ``config.eval_every`` updates. ``batches`` replaces the
    plain LM batches (a callable ``(documents, tokenizer) -> train_batches``, e.g. TRIME's packed batches).
    """
    setup = TrainSetup(out, corpus, config, scratch=scratch, model=model, tokenizer=tokenizer,
                       valid_corpus=valid_corpus, valid_tokens=valid_tokens, n_positions=n_positions, dropout=dropout,
                       resume=resume, stop_after=stop_after, progress=progress)  # fmt: skip
    return train_objective(LmObjective(loss_fn, warmup_loss, batches), setup)
