"""Train a causal LM on named corpora or files: from scratch (GPT-2-style, a BPE trained here) or continued.

This is the job behind ``memlm train``: it prepares the tokenizer and the model, cuts the corpora into
``seq_len`` chunks (:func:`memlm.train.lm_batches`) and runs the shared loop :func:`memlm.train.train` with the
chosen loss. Everything goes under one folder, and rerunning the same command resumes::

    out/tokenizer/    the tokenizer (trained once, reused on resume)
    out/checkpoint-N/ resumable checkpoints (model + tokenizer + optimizer state)
    out/final/        the trained model + tokenizer: ``--model out/final`` in every other memlm command
    out/log.json      loss, learning rate, tokens/s and validation perplexity per update
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from memlm.errors import MemlmError
from memlm.locking import folder_lock
from memlm.train import (
    GPT2_SIZES,
    LossFn,
    TrainConfig,
    TrainResult,
    causal_lm_loss,
    check_run_identity,
    describe_callable,
    gpt2_shape_config,
    lm_batches,
    train,
)

__all__ = ["parse_arch", "scratch_gpt2", "load_corpora", "train_lm"]


def parse_arch(size: str) -> tuple[int, int, int]:
    """``(n_layer, n_embd, n_head)`` of a preset (5m, 10m, 20m, 30m, 50m) or ``<layers>x<dim>`` (64-dim heads)."""
    key = size.strip().lower()
    if key in GPT2_SIZES:
        return GPT2_SIZES[key]
    m = re.fullmatch(r"(\d+)x(\d+)", key)
    if not m or int(m.group(1)) < 1 or int(m.group(2)) < 64 or int(m.group(2)) % 64:
        raise MemlmError(
            f"bad model size {size!r}: use a preset ({', '.join(GPT2_SIZES)}) or <layers>x<dim> with dim a multiple "
            f"of 64, e.g. 6x384"
        )
    n_layer, n_embd = int(m.group(1)), int(m.group(2))
    return n_layer, n_embd, n_embd // 64


def scratch_gpt2(size: str, tokenizer, n_positions: int = 1024, dropout: float = 0.1, seed: int = 0):
    """A randomly initialised ``GPT2LMHeadModel`` of ``size`` (:func:`parse_arch`) for ``tokenizer``'s vocabulary."""
    from transformers import GPT2LMHeadModel

    eos = tokenizer.eos_token_id
    cfg = gpt2_shape_config(*parse_arch(size), len(tokenizer), n_positions, dropout, bos_token_id=eos,
                            eos_token_id=eos, pad_token_id=eos)  # fmt: skip
    torch.manual_seed(seed)
    return GPT2LMHeadModel(cfg)


def load_corpora(names: str | Sequence[str], split: str | None) -> list:
    """Documents of one or more corpora (``"wiki,news"`` or a list), concatenated in the given order."""
    from memlm.corpora import load_documents

    parts = [n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)
    docs = []
    for name in parts:
        if name:
            docs.extend(load_documents(name, split))
    if not docs:
        raise MemlmError(f"no documents in {names!r} (split {split}): give a corpus with text")
    return docs


def _tokenizer_for(out: Path, spec: str, texts: list[str]):
    """The run's tokenizer: the saved one when resuming, else made from ``spec`` and saved atomically."""
    from transformers import AutoTokenizer

    from memlm.tokenizer import make_tokenizer

    folder = out / "tokenizer"
    if folder.is_dir():
        return AutoTokenizer.from_pretrained(folder)
    tok = make_tokenizer(spec, texts)
    tmp = out / f".tokenizer.tmp-{os.getpid()}-{os.urandom(4).hex()}"
    tok.save_pretrained(tmp)
    os.replace(tmp, folder)
    return tok


def train_lm(
    out: str | os.PathLike,
    corpus: str | Sequence[str],
    config: TrainConfig,
    scratch: str | None = None,
    model: str | None = None,
    tokenizer: str = "bpe:8192",
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
    if (scratch is None) == (model is None):
        raise MemlmError("give exactly one of scratch (a size, e.g. 6x384) or model (a pretrained model to continue)")
    out = Path(out)
    with folder_lock(out, "train"):
        return _train_lm(out, corpus, config, scratch, model, tokenizer, valid_corpus, valid_tokens, n_positions,
                         dropout, loss_fn, warmup_loss, batches, resume, stop_after, progress)  # fmt: skip


def _train_lm(out: Path, corpus, config, scratch, model, tokenizer, valid_corpus, valid_tokens, n_positions, dropout,
              loss_fn, warmup_loss, batches, resume, stop_after, progress) -> TrainResult:  # fmt: skip
    from memlm.corpora import corpus_fingerprint
    from memlm.resources import tokenizer_fingerprint

    docs = load_corpora(corpus, "train")
    names = corpus if isinstance(corpus, str) else ",".join(corpus)
    identity = {
        "corpus": names,
        "corpus_fingerprint": corpus_fingerprint(docs),
        "init": f"scratch {scratch}" if scratch is not None else f"model {model}",
        "tokenizer_spec": tokenizer if scratch is not None else f"the tokenizer of {model}",
        "n_positions": n_positions if scratch is not None else None,
        "dropout": dropout if scratch is not None else None,
        "batches": describe_callable(batches),
    }
    if resume:
        check_run_identity(out, identity)  # before a tokenizer is trained or reused in out/tokenizer
    elif scratch is not None:
        shutil.rmtree(out / "tokenizer", ignore_errors=True)  # starting over: the old run's tokenizer goes too
    for stale in out.glob(".tokenizer.tmp*"):
        shutil.rmtree(stale, ignore_errors=True)  # left by a killed run (we hold the lock)
    if model is not None:
        from memlm.resources import load_causal_lm

        lm, tok = load_causal_lm(model, dtype="float32")
        lm.train()
    else:
        tok = _tokenizer_for(out, tokenizer, [d.text for d in docs])
        lm = scratch_gpt2(scratch, tok, n_positions, dropout, config.seed)
    train_batches = (
        batches(docs, tok)
        if batches is not None
        else lm_batches(docs, tok, config.seq_len, config.batch_size, config.seed)
    )
    valid = None
    if valid_tokens != 0:
        vdocs = load_corpora(valid_corpus or corpus, "valid")
        vb = lm_batches(vdocs, tok, config.seq_len, config.batch_size, shuffle=False)
        if valid_tokens is not None:
            keep = max(1, valid_tokens // config.seq_len)
            vb.chunks = np.ascontiguousarray(vb.chunks[:keep])
        valid = vb
    return train(
        lm,
        config,
        train_batches,
        valid,
        loss_fn=loss_fn,
        out_dir=out,
        resume=resume,
        warmup_loss=warmup_loss,
        stop_after=stop_after,
        progress=progress,
        tokenizer=tok,
        identity={**identity, "tokenizer": tokenizer_fingerprint(tok)},
    )
