"""Any Hugging Face causal LM with memories in one line: ``model = memlm.wrap(model, "ds/wiki")``.

The wrapped model's ``forward`` returns, at every position, the log of the mixture's next-token distribution in place
of the logits (log-probabilities are logits: their softmax is the distribution itself), and the loss on ``labels``
under it. The mixture is the one every consumer uses (:class:`memlm.mixing.step.StepMixture`): the LM and every
memory given (one list or one spec string: datastores, ∞-gram indexes, :func:`memlm.knnlm.memories.open_memories`),
weighted by one :class:`memlm.core.mixture.Mixture` (:func:`memlm.knnlm.default_mixture.resolve_mixture`: a fit,
fixed weights, by default the memories' stored fits); with fixed weights and one datastore, the kNN-LM (Khandelwal
et al. 2020, Eq. 2-3)::

    p(w | c) = (1 - λ) p_LM(w | c) + λ p_kNN(w | c)
    p_kNN(w | c) ∝ Σ_{(k_i, v_i) ∈ top-k} 1[v_i = w] exp(s(h(c), k_i) / τ)

``generate`` decodes from the same mixture (:class:`memlm.knnlm.generate.MixtureLogitsProcessor`). Everything else
(config, device, tokenizer-facing attributes) is the wrapped model's.
"""

from __future__ import annotations

from typing import Any

import torch

from memlm.errors import MemlmError
from memlm.knnlm.default_mixture import resolve_mixture
from memlm.knnlm.memories import open_memories
from memlm.mixing.component import Batch
from memlm.mixing.step import StepMixture
from memlm.models.keys import KeyCapture
from memlm.storage.datastore import DatastoreBase

__all__ = ["KNNLM", "wrap"]

POSITIONS_PER_CHUNK = 256
"""Positions mixed at once by ``forward`` (each component is ``[positions, V]``)."""


class KNNLM:
    """A causal LM whose outputs are the mixture's (module docstring). Build it with :func:`wrap`.

    ``memories``: one list or one spec string (:func:`memlm.knnlm.memories.open_memories`); ``mixture``: the
    weights (:func:`memlm.knnlm.default_mixture.resolve_mixture`; None: the memories' stored fits, several of them
    combined only given ``tokenizer``)."""

    def __init__(self, model, memories: Any, mixture: Any = None, tokenizer: Any = None) -> None:
        self.model = model
        found = resolve_mixture(open_memories(memories), mixture, model, tokenizer)
        self.mixture = StepMixture(found.components, found.mixture)
        self.fit = found.fit
        self.specs = self.mixture.key_specs

    def __getattr__(self, name: str) -> Any:  # config, device, dtype, ...: the wrapped model's
        if name == "model":
            raise AttributeError(name)
        return getattr(self.model, name)

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, labels=None, **kwargs):
        """The model's output with ``logits`` = log P of the mixture at every position ``[B, T, V]`` (float32) and,
        with ``labels`` (as Hugging Face's: shifted inside, -100 ignored), ``loss`` = their mean negative
        log-likelihood. Every position of every row is searched (padding too: mask it out of what you read); an
        ∞-gram reads each position's row up to it, its masked tokens left out."""
        with KeyCapture(self.model, self.specs) as cap:
            out = self.model(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
            keys = {spec: cap.keys_by_spec[spec] for spec in self.specs}
        lm = torch.log_softmax(out.logits.float(), dim=-1)
        b, t, v = lm.shape
        lm = lm.reshape(b * t, v)
        queries = {spec: q.reshape(b * t, -1).float().cpu().numpy() for spec, q in keys.items()}
        ids = input_ids.cpu()
        kept = torch.ones_like(ids, dtype=torch.bool) if attention_mask is None else attention_mask.cpu().bool()
        rows = [ids[i][kept[i]].tolist() for i in range(b)]
        ends = torch.cumsum(kept.long(), dim=1).reshape(-1).tolist()  # tokens of its row up to each position

        def contexts(lo: int, hi: int):
            return lambda: [rows[p // t][: ends[p]] for p in range(lo, hi)]

        mixed = torch.empty_like(lm)
        for lo in range(0, b * t, POSITIONS_PER_CHUNK):
            hi = min(lo + POSITIONS_PER_CHUNK, b * t)
            batch = Batch({s: q[lo:hi] for s, q in queries.items()}, make_contexts=contexts(lo, hi), vocab=v,
                          device=lm.device)  # fmt: skip
            mixed[lo:hi] = self.mixture.mix(lm[lo:hi], batch).float()
        mixed = mixed.reshape(b, t, v)
        out.logits = mixed
        if labels is not None:
            target = labels[:, 1:].to(mixed.device)
            logp = mixed[:, :-1].gather(-1, target.clamp(min=0).unsqueeze(-1)).squeeze(-1)
            keep = target != -100
            out.loss = -(logp * keep).sum() / keep.sum().clamp(min=1)
        return out

    def generate(self, *args, **kwargs):
        """``model.generate`` from the same mixture; the model's own sampling warpers (temperature, top-k, top-p) are
        off unless passed, since they would act before the mixture."""
        from transformers import LogitsProcessorList

        from memlm.knnlm.generate import MixtureLogitsProcessor

        for name, off in (("temperature", 1.0), ("top_k", None), ("top_p", None), ("min_p", None)):
            kwargs.setdefault(name, off)
        extra = list(kwargs.pop("logits_processor", None) or [])
        proc = MixtureLogitsProcessor(self.model, self.mixture.components, self.mixture.mixture)
        with proc:
            return self.model.generate(*args, logits_processor=LogitsProcessorList([proc, *extra]), **kwargs)


def _check_model(model, component, tokenizer) -> None:
    """A datastore (or a memory that can check) built with another model is refused."""
    datastore = getattr(component, "datastore", None)
    if tokenizer is not None or not isinstance(datastore, DatastoreBase):
        if tokenizer is not None:
            component.check_compatible(model, tokenizer)
        return
    from memlm.models.resources import model_fingerprint

    want = datastore.manifest["model"]["fingerprint"]
    if model_fingerprint(model) != want:
        raise MemlmError(
            f"datastore {datastore.path} was built with model {datastore.model_name} ({want[:12]}), not this "
            "one: keys from different models are not comparable; wrap the model it was built with or build a "
            "datastore for this model"
        )


def wrap(model, memories: Any, mixture: Any = None, *, tokenizer: Any = None) -> KNNLM:
    """``model`` (any Hugging Face causal LM) with its memories: ``forward`` and ``generate`` give the mixture's
    distribution. ``memories``: one list or one spec string (:func:`memlm.knnlm.memories.open_memories`: datastore
    folders built with this model, opened datastores, ∞-gram indexes, components; ``"knn:ds/wiki?k=64;ngram:idx"``);
    ``mixture``: the weights (:func:`memlm.knnlm.default_mixture.resolve_mixture`: a fit, fixed weights as a
    :class:`~memlm.core.mixture.Mixture` (:func:`memlm.mixing.weights.fixed_mixture`) or ``"knn=0.25"``; None: the
    memories' stored fits). Each datastore's model (and, given ``tokenizer``, its tokenizer) is checked against
    ``model``."""
    components = open_memories(memories)
    if not components:
        raise MemlmError("wrap needs a memory: a datastore folder, an ∞-gram index, a list or a spec string")
    for c in components:
        _check_model(model, c, tokenizer)
    return KNNLM(model, components, mixture, tokenizer)
