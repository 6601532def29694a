"""Any Hugging Face causal LM with memories in one line: ``model = memlm.wrap(model, datastore)``.

The wrapped model's ``forward`` returns, at every position, the log of the mixture's next-token distribution in place
of the logits (log-probabilities are logits: their softmax is the distribution itself), and the loss on ``labels``
under it. The mixture is the one every consumer uses (:class:`memlm.mixing.step.StepMixture`): the
LM and every memory given (datastores, ∞-gram indexes; ``memories=[...]``), weighted by a fitted
:class:`memlm.core.mixture.Mixture` or by the fixed-weight rule; for one datastore the kNN-LM (Khandelwal et al.
2020, Eq. 2-3)::

    p(w | c) = (1 - λ) p_LM(w | c) + λ p_kNN(w | c)
    p_kNN(w | c) ∝ Σ_{(k_i, v_i) ∈ top-k} 1[v_i = w] exp(s(h(c), k_i) / τ)

``generate`` decodes from the same mixture (:class:`memlm.knnlm.generate.MixtureLogitsProcessor`). λ and τ default to
the datastore's calibration, (λ_sparse, λ_dense) to each index's, as every ``memlm`` command's. Everything else
(config, device, tokenizer-facing attributes) is the wrapped model's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from memlm.core.config import DEFAULT_K, RetrievalConfig
from memlm.core.mixture import Mixture
from memlm.errors import MemlmError
from memlm.knnlm.generate import memory_steps
from memlm.mixing.step import DatastoreStep, StepInputs, StepMixture, load_fit
from memlm.models.keys import KeyCapture
from memlm.storage.datastore import DatastoreBase
from memlm.storage.folder import is_ngram_index
from memlm.storage.sharded import open_datastore

__all__ = ["KNNLM", "wrap"]

POSITIONS_PER_CHUNK = 256
"""Positions mixed at once by ``forward`` (each component is ``[positions, V]``)."""


def _as_list(items: Any) -> list:
    return [] if items is None else list(items) if isinstance(items, list | tuple) else [items]


class KNNLM:
    """A causal LM whose outputs are the mixture's (module docstring). Build it with :func:`wrap`.

    ``memories``: datastores, memories with a ``key_spec`` and ∞-gram indexes, one list
    (:func:`memlm.knnlm.generate.memory_steps`; ``ngram``: more indexes); ``mixture``: a fit (its τ and k set
    the kNN terms) or None (no weights given: the memories' stored fits,
    :func:`memlm.knnlm.default_mixture.library_default`, several of them combined only given ``tokenizer``; else
    the fixed-weight rule: ``lam`` / ``temperature`` one value or one per datastore, ``ngram_lambdas``
    ``(λ_sparse, λ_dense)``, each one value or one per index; unset: calibrated)."""

    def __init__(
        self,
        model,
        memories: Any,
        mixture: Any = None,
        k: int = DEFAULT_K,
        lam: Any = None,
        temperature: Any = None,
        nprobe: int = 32,
        ngram: Any = None,
        ngram_lambdas: tuple[Any, Any] = (None, None),
        tokenizer: Any = None,
    ) -> None:
        self.model = model
        config = RetrievalConfig(k=int(k), lam=lam, temperature=temperature, nprobe=int(nprobe))
        fit = load_fit(mixture)
        items = [*_as_list(memories), *_as_list(ngram)]
        if fit is None:
            from memlm.knnlm.default_mixture import library_default

            given = lam is not None or temperature is not None or any(w is not None for w in ngram_lambdas)
            fit = library_default(model, tokenizer, items, given, config)  # no weights given: the stored fits
        dump_fit = None if fit is None or isinstance(fit, Mixture) else fit
        steps = memory_steps(items, config, dump_fit, ngram_lambdas=ngram_lambdas, announce=True)
        self.mixture = StepMixture(steps, fit if dump_fit is None else dump_fit.mixture)
        self.fit = dump_fit
        self.specs = list(dict.fromkeys(s.key_spec for s in steps if isinstance(s, DatastoreStep)))

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
            inputs = StepInputs({s: q[lo:hi] for s, q in queries.items()}, contexts(lo, hi), v, lm.device)
            mixed[lo:hi] = self.mixture.mix(lm[lo:hi], inputs).float()
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
        proc = MixtureLogitsProcessor(self.model, self.mixture.steps, self.fit or self.mixture.mixture)
        with proc:
            return self.model.generate(*args, logits_processor=LogitsProcessorList([proc, *extra]), **kwargs)


def _check_model(model, memory, tokenizer) -> None:
    """A datastore (or a memory that can check) built with another model is refused."""
    if not isinstance(memory, DatastoreBase):  # any memory (memlm.retrieval.as_memory): its own check, if any
        check = getattr(memory, "check_compatible", None)
        if check is not None and tokenizer is not None:
            check(model, tokenizer)
    elif tokenizer is not None:
        memory.check_compatible(model, tokenizer)
    else:
        from memlm.models.resources import model_fingerprint

        want = memory.manifest["model"]["fingerprint"]
        if model_fingerprint(model) != want:
            raise MemlmError(
                f"datastore {memory.path} was built with model {memory.model_name} ({want[:12]}), not this "
                "one: keys from different models are not comparable; wrap the model it was built with or build a "
                "datastore for this model"
            )


def wrap(model, datastore: Any = None, **options: Any) -> KNNLM:
    """``model`` (any Hugging Face causal LM) with its memories: ``forward`` and ``generate`` give the mixture's
    distribution. ``datastore``: a folder or an opened datastore built with this model (or any memory); ``options``:
    ``memories`` (more memories, one list: datastores, ∞-gram indexes), ``mixture`` (a fit: a ``memlm tune --mixture
    gate`` JSON file, its record or :class:`~memlm.mixing.dump.DumpMixture`; None: the fixed-weight rule),
    ``k`` (:data:`~memlm.core.config.DEFAULT_K`, 1024, as every path), ``lam`` / ``temperature`` (default: each
    datastore's calibration), ``nprobe`` (32), ``ngram`` (an ∞-gram index folder or
    :class:`~memlm.ngram.memory.NgramMemory`, or a list of them) and ``ngram_lambdas`` (``(λ_sparse, λ_dense)``, each
    one value for every index or one per index; unset, each index's calibration).
    Each datastore's model (and, given ``tokenizer=``, its tokenizer) is checked against ``model``."""
    tokenizer = options.pop("tokenizer", None)
    memories = [*_as_list(datastore), *_as_list(options.pop("memories", None))]
    if not memories and options.get("ngram") is None:
        raise MemlmError("wrap needs a memory: a datastore, memories=[...] or ngram=")
    for i, item in enumerate(memories):
        if isinstance(item, str | Path) and not is_ngram_index(item):
            memories[i] = item = open_datastore(item)
        if not is_ngram_index(item) and not isinstance(item, DatastoreStep):
            _check_model(model, item, tokenizer)
    return KNNLM(model, memories, tokenizer=tokenizer, **options)
