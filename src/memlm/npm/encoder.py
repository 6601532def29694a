"""Encoder helpers for NPM (Min et al. 2023, §3): token sequences -> last hidden states of a BERT-like encoder.

Representation of ``[MASK_s]`` / ``[MASK_e]`` (one choice, used identically in training and inference): both are the
tokenizer's own ``[MASK]`` id (``tokenizer.mask_token_id``, 103 for the uncased MiniLM/BERT WordPiece), exactly as the
paper does (App. A.2: "we use the [MASK] vocab from the RoBERTa tokenizer. Note that it is not necessary to use
different tokens for [MASK_s] and [MASK_e] since the Transformer can handle positional information"). No token is
added and the embeddings are not resized, so a pretrained encoder and its tokenizer are used unchanged and the
fingerprints of :func:`memlm.storage.datastore.model_identity` stay those of the loaded model.

* training (:mod:`memlm.npm.objective`): a masked span becomes ``[MASK] [MASK]`` (:func:`mask_ids`);
* inference (:func:`masked_query`): the query's single ``[MASK]`` becomes ``[MASK] [MASK]`` and ``q_start`` /
  ``q_end`` are the encoder outputs at the first / second of them (§3.1); NPM SINGLE keeps one ``[MASK]`` (App. A.3).

Sequences are encoded as ``[CLS] tokens [SEP]`` (the tokenizer's ``cls_token_id`` / ``sep_token_id``) and right-padded
with ``pad_token_id`` under an attention mask; the vectors are the last hidden states (``last_hidden_state``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from memlm.errors import MemlmError
from memlm.models.forward import right_pad

__all__ = [
    "mask_ids",
    "special_ids",
    "max_block_tokens",
    "encode_padded",
    "encode_sequences",
    "masked_query",
    "encode_query",
]


def mask_ids(tokenizer) -> tuple[int, int]:
    """``(mask_s, mask_e)``: the ids written for ``[MASK_s]`` and ``[MASK_e]`` -- both ``tokenizer.mask_token_id``."""
    mid = getattr(tokenizer, "mask_token_id", None)
    if not isinstance(mid, int):
        raise MemlmError("the tokenizer has no [MASK] token: NPM needs a masked-LM (BERT-like) encoder and tokenizer")
    return mid, mid


def special_ids(tokenizer) -> list[int]:
    """The tokenizer's special token ids (never masked, never a phrase token)."""
    return sorted({int(t) for t in getattr(tokenizer, "all_special_ids", []) or []})


def _cls_sep_pad(tokenizer) -> tuple[int, int, int]:
    cls, sep, pad = tokenizer.cls_token_id, tokenizer.sep_token_id, tokenizer.pad_token_id
    if not all(isinstance(t, int) for t in (cls, sep, pad)):
        raise MemlmError("the tokenizer needs [CLS], [SEP] and [PAD] tokens (a BERT-like encoder tokenizer)")
    return cls, sep, pad


def max_block_tokens(model, tokenizer, max_length: int | None = None) -> int:
    """How many corpus tokens fit in one encoder input next to ``[CLS]`` and ``[SEP]``."""
    limit = getattr(model.config, "max_position_embeddings", None) or 512
    tok_limit = getattr(tokenizer, "model_max_length", None)
    if isinstance(tok_limit, int) and 0 < tok_limit < limit:
        limit = tok_limit
    if max_length is not None:
        if max_length > limit:
            raise MemlmError(f"max_length {max_length} exceeds the encoder's {limit} positions")
        limit = max_length
    if limit < 3:
        raise MemlmError(f"max_length must be at least 3 (CLS, one token, SEP), got {limit}")
    return int(limit) - 2


def encode_padded(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """``[B, L, H]`` last hidden states (attached to the graph; the caller picks ``no_grad`` or not)."""
    device = next(model.parameters()).device
    out = model(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device))
    hidden = getattr(out, "last_hidden_state", None)
    if hidden is None:
        raise MemlmError(f"{type(model).__name__} returns no last_hidden_state: NPM needs an encoder (AutoModel)")
    return hidden


@torch.no_grad()
def encode_sequences(model, sequences: Sequence[Sequence[int]], pad_id: int, batch_size: int = 16) -> list[np.ndarray]:
    """Encode complete input sequences (already with their special tokens), in eval mode; one float32 ``[len, H]``
    per sequence."""
    out: list[np.ndarray] = []
    was_training = model.training
    model.eval()  # no dropout for index and query vectors
    try:
        for s in range(0, len(sequences), batch_size):
            chunk = sequences[s : s + batch_size]
            ids, mask = right_pad(chunk, pad_id)
            hidden = encode_padded(model, ids, mask).float().cpu().numpy()
            out.extend(hidden[r, : len(seq)] for r, seq in enumerate(chunk))
    finally:
        model.train(was_training)
    return out


def masked_query(tokenizer, text: str, single: bool = False) -> tuple[list[int], int, int]:
    """Tokenize a query holding exactly one ``tokenizer.mask_token`` (e.g. ``"[MASK]"``).

    Returns ``(input_ids, t_start, t_end)`` with ``[CLS]``/``[SEP]`` added and the ``[MASK]`` replaced by ``[MASK_s]
    [MASK_e]`` (``t_end = t_start + 1``, §3.1), or kept as one ``[MASK]`` for NPM SINGLE (``t_start == t_end``).
    """
    mask_s, mask_e = mask_ids(tokenizer)
    cls, sep, _ = _cls_sep_pad(tokenizer)
    mtok = tokenizer.mask_token
    if text.count(mtok) != 1:
        raise MemlmError(f"the query must contain exactly one {mtok}, got {text.count(mtok)}: {text!r}")
    left, right = text.split(mtok)
    enc = tokenizer([left, right], add_special_tokens=False)["input_ids"]
    middle = [mask_s] if single else [mask_s, mask_e]
    ids = [cls, *enc[0], *middle, *enc[1], sep]
    t = 1 + len(enc[0])
    return [int(i) for i in ids], t, t + len(middle) - 1


def encode_query(model, tokenizer, text: str, single: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """``(q_start, q_end)`` float32 ``[H]`` for a query with one ``[MASK]`` (equal vectors for NPM SINGLE)."""
    ids, t_s, t_e = masked_query(tokenizer, text, single=single)
    limit = max_block_tokens(model, tokenizer) + 2
    if len(ids) > limit:
        raise MemlmError(f"the query is {len(ids)} tokens, longer than the encoder's {limit}: shorten it")
    (hidden,) = encode_sequences(model, [ids], tokenizer.pad_token_id)
    return hidden[t_s].copy(), hidden[t_e].copy()
