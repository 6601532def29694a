"""The parametric baseline of NPM (Min et al. 2023, §5.2/§6.2): the same encoder with a masked-LM head.

The named encoder ``minilm-l6`` ships without an MLM head, so the baseline is made here: :func:`mlm_model` puts a
``BertForMaskedLM``-style head on the encoder (``AutoModelForMaskedLM.from_config(encoder.config)``: a transform
``dense -> gelu -> LayerNorm`` and a decoder whose weight is tied to the input word embeddings, plus a bias), copies
the encoder's weights into it, and :class:`MlmTrainObjective` trains it with the standard BERT objective (Devlin et
al. 2019) on the same corpus and batches as NPM (:func:`memlm.npm.objective.npm_batches`, via the shared loop
:func:`memlm.training.loop.train`): ``memlm train --objective mlm``.

Masking (:func:`mlm_mask`): every non-special token is selected with probability ``p = 0.15`` (independently, as
Hugging Face's ``DataCollatorForLanguageModeling``); a selected token becomes ``[MASK]`` with probability 0.8, a
uniformly drawn non-special vocabulary token with probability 0.1, and stays unchanged with probability 0.1. A
sequence batch in which nothing was selected gets one selected token (the first eligible one in draw order), so the
loss is always defined. The loss is the mean cross-entropy over selected positions::

    L = - 1/|M| sum_{t in M} log softmax(W h_t + b)[x_t]

The draw is a function of ``(seed, batch["mask_seed"])`` only, so a resumed run masks exactly as the first one.

Predictions (the paper's note, §6.2: an encoder-only model fills one ``[MASK]`` with one token): :func:`mlm_fill`
ranks single tokens for a query's ``[MASK]``; :func:`mlm_classify` scores labels by the MLM probabilities of their
single-token verbalizers (closed set, ``score(y) = sum_{v in f(y)} P(v | query)``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from memlm.errors import MemlmError
from memlm.models.forward import right_pad
from memlm.npm.encoder import _cls_sep_pad, mask_ids, masked_query, max_block_tokens
from memlm.npm.encoder import special_ids as _special_ids
from memlm.npm.inference import LabelScores, PhrasePrediction, normalize_text
from memlm.npm.objective import NpmBatches, npm_batches
from memlm.npm.train_npm import EncoderObjective, mean_eval_loss
from memlm.training.driver import TrainSetup
from memlm.training.loop import TrainConfig

__all__ = [
    "MLM_PROB",
    "MlmObjective",
    "MlmTrainObjective",
    "load_mlm",
    "mlm_classify",
    "mlm_fill",
    "mlm_mask",
    "mlm_model",
    "mlm_valid_loss",
    "verbalizer_token_ids",
]

MLM_PROB = 0.15


def mlm_model(encoder, dropout: float | None = None):
    """A masked LM (``AutoModelForMaskedLM`` of the encoder's config: BERT's head, decoder tied to the input
    embeddings) holding ``encoder``'s weights; the head's transform and bias are newly initialised. An encoder that
    already is a masked LM is returned as is."""
    from transformers import AutoModelForMaskedLM

    if _is_mlm(encoder):
        return encoder
    cfg = encoder.config
    if dropout is not None:
        cfg.hidden_dropout_prob = cfg.attention_probs_dropout_prob = dropout
    try:
        model = AutoModelForMaskedLM.from_config(cfg)
    except ValueError as e:
        raise MemlmError(f"{type(encoder).__name__} has no masked-LM class in transformers: {e}") from e
    base = model.base_model
    missing, unexpected = base.load_state_dict(encoder.state_dict(), strict=False)
    unexpected = [k for k in unexpected if not k.startswith("pooler.")]  # the MLM has no pooler
    if missing or unexpected:
        raise MemlmError(f"the encoder's weights do not fit {type(model).__name__}: missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]}")  # fmt: skip
    model.tie_weights()
    model.config.memlm_name = getattr(cfg, "memlm_name", None)
    return model.to(next(encoder.parameters()).dtype)


def _is_mlm(model) -> bool:
    return type(model).__name__.endswith("ForMaskedLM")


def load_mlm(name_or_path: str, dtype: str | torch.dtype = "float32"):
    """``(model, tokenizer)`` of a trained masked LM (``out/final`` of ``memlm train --objective mlm``), in eval mode.

    Refuses a folder whose weights hold no MLM head (a plain encoder): its head would be random."""
    from transformers import AutoConfig, AutoModelForMaskedLM, AutoTokenizer

    from memlm.models.resources import _finish, _from_pretrained, _load_error, _record_name, parse_dtype

    try:
        cfg = _from_pretrained(AutoConfig, name_or_path)
    except Exception as error:
        raise _load_error(name_or_path, "masked LM", error) from error
    if not any(str(a).endswith("ForMaskedLM") for a in getattr(cfg, "architectures", None) or []):
        raise MemlmError(
            f"{name_or_path} is not a masked LM (architectures {getattr(cfg, 'architectures', None)}): train the "
            "baseline with `memlm train --objective mlm` and pass its OUT/final"
        )
    try:
        tok = _from_pretrained(AutoTokenizer, name_or_path)
        model = _from_pretrained(AutoModelForMaskedLM, name_or_path, dtype=parse_dtype(dtype))
    except Exception as error:
        raise _load_error(name_or_path, "masked LM", error) from error
    return _finish(model, tok, _record_name(name_or_path), parse_dtype(dtype))


# ---------------------------------------------------------------------------------------------------------------
# Masking and loss


def mlm_mask(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    mask_id: int,
    special: Sequence[int],
    vocab_size: int,
    rng: np.random.Generator,
    prob: float = MLM_PROB,
) -> tuple[torch.Tensor, torch.Tensor]:
    """BERT masking (module docstring): ``(masked input_ids, labels)`` with ``labels = -100`` where not selected.

    Selection ``~ Bernoulli(prob)`` per non-special, non-padding token; then 80 % ``[MASK]``, 10 % a random non-special
    token, 10 % unchanged."""
    if not 0 < prob < 1:
        raise MemlmError(f"the MLM masking probability must be in (0, 1), got {prob}")
    ids = input_ids.detach().cpu().numpy().astype(np.int64)
    eligible = ~np.isin(ids, np.asarray(list(special), dtype=np.int64))
    if attention_mask is not None:
        eligible &= attention_mask.detach().cpu().numpy().astype(bool)
    u = rng.random(ids.shape)
    selected = eligible & (u < prob)
    if not selected.any() and eligible.any():  # at least one target per batch
        flat = np.flatnonzero(eligible.reshape(-1))
        selected.reshape(-1)[flat[np.argmin(u.reshape(-1)[flat])]] = True
    kind = rng.random(ids.shape)
    allowed = np.setdiff1d(np.arange(vocab_size, dtype=np.int64), np.asarray(list(special), dtype=np.int64))
    random_tok = allowed[rng.integers(0, len(allowed), size=ids.shape)]
    masked = ids.copy()
    masked[selected & (kind < 0.8)] = mask_id
    swap = selected & (kind >= 0.8) & (kind < 0.9)
    masked[swap] = random_tok[swap]
    labels = np.where(selected, ids, -100)
    return torch.from_numpy(masked).to(input_ids.device), torch.from_numpy(labels).to(input_ids.device)


class MlmObjective:
    """The masked-LM loss for the shared trainer: ``loss_fn(model, batch) -> mean CE over selected tokens``."""

    def __init__(self, tokenizer=None, *, prob: float = MLM_PROB, seed: int = 0) -> None:
        if not 0 < prob < 1:
            raise MemlmError(f"the MLM masking probability must be in (0, 1), got {prob}")
        self.prob, self.seed = float(prob), int(seed)
        self.mask_id: int | None = None
        self.special: list[int] = []
        self.vocab_size = 0
        if tokenizer is not None:
            self.configure(tokenizer)

    def __repr__(self) -> str:
        return f"MlmObjective(prob={self.prob})"

    def configure(self, tokenizer) -> MlmObjective:
        """Take the ``[MASK]``, special ids and vocabulary size from ``tokenizer``."""
        self.mask_id = mask_ids(tokenizer)[0]
        _cls_sep_pad(tokenizer)
        self.special = _special_ids(tokenizer)
        self.vocab_size = len(tokenizer)
        return self

    def mask(self, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(masked input_ids, labels)`` of a batch, a function of ``(seed, batch["mask_seed"])``."""
        if self.mask_id is None:
            raise MemlmError("MlmObjective has no tokenizer: pass tokenizer= or call configure(tokenizer) first")
        ids = batch["input_ids"]
        if ids.dim() != 2:
            raise MemlmError(f"input_ids must be [B, T], got {tuple(ids.shape)}")
        rng = np.random.default_rng([self.seed, int(batch.get("mask_seed", 0))])
        return mlm_mask(ids, batch.get("attention_mask"), self.mask_id, self.special, self.vocab_size, rng, self.prob)

    def losses(self, model: torch.nn.Module, batch: dict[str, Any]) -> torch.Tensor:
        """``[M]`` cross-entropy of each selected token (float32)."""
        device = next(model.parameters()).device  # validation batches arrive on the CPU
        masked, labels = (t.to(device) for t in self.mask(batch))
        att = batch.get("attention_mask")
        logits = model(input_ids=masked, attention_mask=None if att is None else att.to(device)).logits
        keep = labels != -100
        with torch.autocast(device_type=logits.device.type, enabled=False):
            return F.cross_entropy(logits[keep].float(), labels[keep], reduction="none")

    def __call__(self, model: torch.nn.Module, batch: dict[str, Any]) -> torch.Tensor:
        return self.losses(model, batch).mean()


def mlm_valid_loss(model, loss_fn: MlmObjective, batches: NpmBatches) -> float | None:
    """Mean cross-entropy per masked token over one pass of ``batches`` (eval mode, deterministic masking)."""
    return mean_eval_loss(model, lambda batch: loss_fn.losses(model, batch), batches)


class MlmTrainObjective(EncoderObjective):
    """The MLM baseline as an objective of the training driver (``memlm train --objective mlm``): the encoder of
    :class:`~memlm.npm.train_npm.EncoderObjective` with a masked-LM head (:func:`mlm_model`, the head drawn from
    ``seed``), NPM's document-grouped batches, :class:`MlmObjective` (``prob``: masking probability, default 0.15).
    Validation: mean cross-entropy per masked token."""

    name = "mlm"
    title = "MLM"

    def __init__(self, prob: float | None = None) -> None:
        self.prob = MLM_PROB if prob is None else prob

    def build(self, setup: TrainSetup, docs):
        encoder, tok = super().build(setup, docs)
        torch.manual_seed(setup.config.seed)  # the head's initialisation
        model = mlm_model(encoder)
        model.train()
        return model, tok

    def batches(self, docs, tokenizer, config: TrainConfig) -> NpmBatches:
        self.loss_fn = MlmObjective(tokenizer, prob=self.prob, seed=config.seed)
        return npm_batches(docs, tokenizer, seq_len=config.seq_len, batch_size=config.batch_size, seed=config.seed)

    def valid_loss_of(self, model, batches: NpmBatches) -> float | None:
        return mlm_valid_loss(model, self.loss_fn, batches)


# ---------------------------------------------------------------------------------------------------------------
# Predictions


@torch.no_grad()
def _mask_log_probs(model, tokenizer, query: str) -> torch.Tensor:
    """``[V]`` log-probabilities of the query's single ``[MASK]`` (kept as one token, as an MLM predicts)."""
    if not _is_mlm(model):
        raise MemlmError(f"{type(model).__name__} has no masked-LM head: load the baseline with load_mlm")
    ids, t, _ = masked_query(tokenizer, query, single=True)
    limit = max_block_tokens(model, tokenizer) + 2
    if len(ids) > limit:
        raise MemlmError(f"the query is {len(ids)} tokens, longer than the model's {limit}: shorten it")
    x, att = right_pad([ids], tokenizer.pad_token_id)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        logits = model(input_ids=x.to(device), attention_mask=att.to(device)).logits[0, t].float()
    finally:
        model.train(was_training)
    logits[_special_ids(tokenizer)] = -math.inf  # never predict [CLS], [SEP], [MASK], ...
    return torch.log_softmax(logits, dim=-1).cpu()


def mlm_fill(model, tokenizer, query: str, top: int = 10) -> list[PhrasePrediction]:
    """The MLM baseline's ranked single-token fillers of the query's ``[MASK]`` (``argmax_v P(v | query)``), as
    :class:`~memlm.npm.inference.PhrasePrediction` (``score = prob = P(v)``, no spans)."""
    if top < 1:
        raise MemlmError(f"top must be >= 1, got {top}")
    logp = _mask_log_probs(model, tokenizer, query)
    vals, ids = torch.topk(logp, min(top, logp.numel()))
    out = []
    for lp, i in zip(vals.tolist(), ids.tolist(), strict=True):
        out.append(PhrasePrediction(tokenizer.decode([i]).strip(), math.exp(lp), math.exp(lp), lp, ()))
    return out


def verbalizer_token_ids(tokenizer, verbalizers: Mapping[str, Sequence[str] | str]) -> dict[str, list[int]]:
    """label -> the ids of its verbalizers that are one token (the only ones an MLM can score, §6.2)."""
    out: dict[str, list[int]] = {}
    for label, words in verbalizers.items():
        ids = set()
        for w in [words] if isinstance(words, str) else list(words):
            enc = tokenizer(normalize_text(w), add_special_tokens=False)["input_ids"]
            if len(enc) == 1 and enc[0] != tokenizer.unk_token_id:
                ids.add(int(enc[0]))
        if not ids:
            raise MemlmError(f"label {label!r} has no single-token verbalizer for the MLM: add one ({words!r})")
        out[label] = sorted(ids)
    return out


def mlm_classify(model, tokenizer, query: str, verbalizers: Mapping[str, Sequence[str] | str]) -> LabelScores:
    """Closed-set classification with the MLM baseline: ``score(y) = sum_{v in f(y), |v| = 1} P(v | query)``,
    normalised over labels (multi-token verbalizers are skipped)."""
    if not verbalizers:
        raise MemlmError("give at least one label with its verbalizer strings")
    ids = verbalizer_token_ids(tokenizer, verbalizers)
    logp = _mask_log_probs(model, tokenizer, query).double()
    logs = {y: float(torch.logsumexp(logp[v], 0)) for y, v in ids.items()}
    z = float(np.logaddexp.reduce(list(logs.values())))
    return LabelScores({y: math.exp(v - z) for y, v in logs.items()}, logs, True)
