"""Any Hugging Face causal LM as a kNN-LM in one line: ``model = memlm.wrap(model, datastore)``.

The wrapped model's ``forward`` returns, at every position, the log of the kNN-LM's next-token distribution
(Khandelwal et al. 2020, Eq. 2-3) in place of the logits (log-probabilities are logits: their softmax is the
distribution itself), and the loss on ``labels`` under it::

    p(w | c) = (1 - λ) p_LM(w | c) + λ p_kNN(w | c)
    p_kNN(w | c) ∝ Σ_{(k_i, v_i) ∈ top-k} 1[v_i = w] exp(s(h(c), k_i) / τ)

``generate`` decodes from the same distribution (:class:`memlm.knnlm.generate.KNNLogitsProcessor`, plus an ∞-gram
when given). λ and τ default to the datastore's calibration, as every ``memlm`` command's. Everything else (config,
device, tokenizer-facing attributes) is the wrapped model's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from memlm.core.distribution import interpolate, knn_distribution
from memlm.errors import MemlmError
from memlm.knnlm.calibration import knn_parameters
from memlm.models.keys import KeyCapture
from memlm.retrieval import as_memory
from memlm.storage.datastore import DatastoreBase
from memlm.storage.sharded import open_datastore

__all__ = ["KNNLM", "wrap"]


class KNNLM:
    """A causal LM whose outputs are the kNN-LM's (module docstring). Build it with :func:`wrap`."""

    def __init__(
        self,
        model,
        datastore,
        k: int = 1024,
        lam: float | None = None,
        temperature: float | None = None,
        nprobe: int = 32,
        ngram=None,
        ngram_lambdas: tuple[Any, Any] = (None, None),
    ) -> None:
        if isinstance(datastore, str | Path):
            datastore = open_datastore(datastore)
        self.model, self.k, self.nprobe = model, int(k), int(nprobe)
        self.lam, self.temperature, self.parameters_from = knn_parameters(
            datastore, lam, temperature, setting={"k": self.k, "nprobe": self.nprobe, "search": "index"}
        )
        self.memory = as_memory(datastore, self.nprobe)  # a datastore (plain or sharded) on its own index, or a memory
        self.datastore = getattr(self.memory, "datastore", None)
        self.ngram = None
        if ngram is not None:  # one index (folder or NgramMemory) or a list, each with its own (λ_sparse, λ_dense)
            from memlm.ngram.generate import ngram_logits_processor
            from memlm.ngram.memory import NgramMemory
            from memlm.ngram.mixture import ngram_parameters, per_index_lambdas, shared_weights

            refs = list(ngram) if isinstance(ngram, list | tuple) else [ngram]
            memories = [m if isinstance(m, NgramMemory) else NgramMemory(m) for m in refs]
            given = per_index_lambdas(*ngram_lambdas, len(memories))
            weights = [ngram_parameters(m.index, *g, announce=False)[:2] for m, g in zip(memories, given, strict=True)]
            self.ngram = ngram_logits_processor(memories, shared_weights(self.lam, weights))

    def __getattr__(self, name: str) -> Any:  # config, device, dtype, ...: the wrapped model's
        if name == "model":
            raise AttributeError(name)
        return getattr(self.model, name)

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, labels=None, **kwargs):
        """The model's output with ``logits`` = log p_kNN-LM at every position ``[B, T, V]`` (float32) and, with
        ``labels`` (as Hugging Face's: shifted inside, -100 ignored), ``loss`` = their mean negative log-likelihood.
        Every position of every row is searched (padding too: mask it out of what you read)."""
        if self.ngram is not None:
            raise MemlmError("wrap(..., ngram=) mixes the ∞-gram in generate only; forward is the kNN-LM's")
        spec = self.memory.key_spec
        with KeyCapture(self.model, [spec]) as cap:
            out = self.model(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
            keys = cap.keys_by_spec[spec]
        lm = torch.log_softmax(out.logits.float(), dim=-1)
        b, t, v = lm.shape
        scores, values, counts = self.memory.search(keys.reshape(b * t, -1).float().cpu().numpy(), self.k).tensors()
        knn = knn_distribution(scores, values, v, self.temperature, counts)
        mixed = interpolate(lm.reshape(b * t, v), knn.to(lm.device), self.lam).reshape(b, t, v).float()
        out.logits = mixed
        if labels is not None:
            target = labels[:, 1:].to(mixed.device)
            logp = mixed[:, :-1].gather(-1, target.clamp(min=0).unsqueeze(-1)).squeeze(-1)
            keep = target != -100
            out.loss = -(logp * keep).sum() / keep.sum().clamp(min=1)
        return out

    def generate(self, *args, **kwargs):
        """``model.generate`` from the kNN-LM's distribution (and the ∞-gram's, when given); the model's own
        sampling warpers (temperature, top-k, top-p) are off unless passed, since they would act before the
        interpolation."""
        from transformers import LogitsProcessorList

        from memlm.knnlm.generate import KNNLogitsProcessor

        for name, off in (("temperature", 1.0), ("top_k", None), ("top_p", None), ("min_p", None)):
            kwargs.setdefault(name, off)
        extra = list(kwargs.pop("logits_processor", None) or [])
        with KNNLogitsProcessor(self.model, self.memory, k=self.k, lam=self.lam, temperature=self.temperature,
                                ngram=self.ngram) as proc:  # fmt: skip
            return self.model.generate(*args, logits_processor=LogitsProcessorList([proc, *extra]), **kwargs)


def wrap(model, datastore, **options: Any) -> KNNLM:
    """``model`` (any Hugging Face causal LM) as a kNN-LM over ``datastore`` (a folder or an opened datastore built
    with this model): ``forward`` and ``generate`` give the interpolated distribution. ``options``: ``k`` (1024),
    ``lam`` / ``temperature`` (default: the datastore's calibration), ``nprobe`` (32), ``ngram`` (an ∞-gram index
    folder or :class:`~memlm.ngram.memory.NgramMemory` for generation, or a list of them, each index with its own
    weights) and ``ngram_lambdas`` (``(λ_sparse, λ_dense)``, each one value for every index or one per index; unset,
    each index's calibration). The datastore's model (and, given ``tokenizer=``, its tokenizer) is
    checked against ``model``."""
    if isinstance(datastore, str | Path):
        datastore = open_datastore(datastore)
    tokenizer = options.pop("tokenizer", None)
    if not isinstance(datastore, DatastoreBase):  # any memory (memlm.retrieval.as_memory): its own check, if any
        check = getattr(datastore, "check_compatible", None)
        if check is not None and tokenizer is not None:
            check(model, tokenizer)
    elif tokenizer is not None:
        datastore.check_compatible(model, tokenizer)
    else:
        from memlm.models.resources import model_fingerprint

        want = datastore.manifest["model"]["fingerprint"]
        if model_fingerprint(model) != want:
            raise MemlmError(
                f"datastore {datastore.path} was built with model {datastore.model_name} ({want[:12]}), not this "
                "one: keys from different models are not comparable; wrap the model it was built with or build a "
                "datastore for this model"
            )
    return KNNLM(model, datastore, **options)
