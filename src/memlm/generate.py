"""Sampling from a kNN-LM: a ``transformers`` LogitsProcessor that replaces the LM's next-token distribution by Eq. 3.

    p(w | c) = (1 - λ) p_LM(w | c) + λ p_kNN(w | c)

Usage::

    with KNNLogitsProcessor(model, datastore, k=64, lam=0.25) as knn:
        out = model.generate(**inputs, logits_processor=[knn], do_sample=True)

The processor hooks the model (the datastore's key role) while the ``with`` block is open, reads the query of the
newest position at each step, searches the datastore and returns interpolated log-probabilities as the new scores.
"""

from __future__ import annotations

import numpy as np
import torch
from transformers import LogitsProcessor

from memlm.datastore import Datastore
from memlm.keys import KeyCapture
from memlm.knn import interpolate, knn_distribution
from memlm.sharded_index import open_index, search_index

__all__ = ["KNNLogitsProcessor"]


class KNNLogitsProcessor(LogitsProcessor):
    """Interpolate each generation step's distribution with the kNN distribution from ``datastore`` (Eq. 2-3)."""

    def __init__(
        self,
        model,
        datastore: Datastore,
        k: int = 64,
        lam: float = 0.25,
        temperature: float = 1.0,
        nprobe: int = 32,
    ) -> None:
        self.model = model
        self.datastore = datastore
        self.k, self.lam, self.temperature = k, lam, temperature
        self.index = open_index(datastore, nprobe=nprobe)  # a FAISS index, or a sharded datastore's searcher
        self._capture = KeyCapture(model, [datastore.key_spec])

    def __enter__(self) -> KNNLogitsProcessor:
        self._capture.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._capture.__exit__(*exc)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        keys = self._capture.keys_by_spec[self.datastore.key_spec]
        if keys is None:
            raise RuntimeError("KNNLogitsProcessor must be used inside its `with` block")
        query = keys[:, -1].float().cpu().numpy()  # [B, D]: the newest position's context
        sc, ids = search_index(self.index, query, self.k)
        valid = ids >= 0
        values = np.where(valid, self.datastore.values[np.where(valid, ids, 0).ravel()].reshape(ids.shape), -1)
        sc = np.where(valid, sc, -np.inf)
        lm = torch.log_softmax(scores.float(), dim=-1)
        knn = knn_distribution(
            torch.from_numpy(sc).to(lm.device),
            torch.from_numpy(values).long().to(lm.device),
            lm.shape[-1],
            self.temperature,
        )
        return interpolate(lm, knn, self.lam).to(scores.dtype)
