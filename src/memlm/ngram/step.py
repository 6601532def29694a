"""The ∞-gram at one step of the mixture over the vocabulary (Liu et al. 2024): P∞ of each row's longest matching
suffix and its features, a component of :class:`memlm.mixing.step.StepMixture` (generation,
``memlm.wrap``).

Each row's context (its tokens so far after its leading EOS padding; an EOS inside it is a token of the document,
:func:`memlm.ngram.memory.context_document`) gives P∞ over the next token
(:meth:`memlm.ngram.memory.NgramMemory.next_tokens`: the longest suffix seen in the corpus and the exact counts of
what followed it)::

    P∞(w | c) = cnt(suffix · w) / cnt(suffix),     sparse where one token follows every occurrence of the suffix

with the features a dump stores (:func:`memlm.mixing.inputs.ngram_features`: effective n, suffix count,
sparse flag) and the weights ``(λ_sparse, λ_dense)`` the fixed-weight rule gives it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from memlm.core.distribution import value_logsumexp
from memlm.mixing.inputs import ngram_features
from memlm.mixing.step import Component, StepInputs

__all__ = ["NgramStep", "next_token_distribution"]


def next_token_distribution(memory, contexts: Sequence[Sequence[int]], vocab: int, k: int = 1000) -> tuple:
    """``(log P∞(. | c) [n, vocab], sparse [n], next_tokens)`` of each context: ``P∞(w | c) = cnt(suffix · w) /
    cnt(suffix)`` for the ``k`` most frequent next tokens ``w`` of its longest matching suffix, with exact counts
    (:meth:`memlm.ngram.memory.NgramMemory.next_tokens`, which recounts what the engine samples past ``max_support``
    occurrences), ``-inf`` elsewhere; sparse (exact) where one token follows every occurrence of that suffix.

    Each listed token's P∞ is exact. A row whose suffix has more distinct next tokens than it holds (past ``k``, or
    past the recount's budget) leaves their mass unassigned (the row sums to less than one, by ``next_tokens.missing``)
    rather than spreading it over the listed tokens: ``next_tokens.approximate()`` says so."""
    nt = memory.next_tokens(contexts, k)
    r = nt.retrieved
    log_total = torch.as_tensor(np.log(np.maximum(nt.count, 1)), dtype=torch.float32)[:, None]
    logw = torch.as_tensor(r.scores) - log_total  # log P∞ of each listed token (-inf in empty slots)
    return value_logsumexp(logw, torch.as_tensor(r.values), vocab), torch.as_tensor(nt.sparse), nt


class NgramStep:
    """An ∞-gram index at a generation step (``k``: at most this many distinct next tokens of P∞), with its weights
    ``(λ_sparse, λ_dense)`` in the fixed-weight rule.

    ``prefix``: tokens of the document before every row's first token (default none), so the ∞-gram's context can
    reach further back than the LM's window (lm_eval's ``generate_until`` cuts the context to the LM's
    ``max_length``); meant for one unpadded row. ``steps`` counts the rows searched, ``approximate_steps`` those whose
    P∞ left some mass unassigned."""

    kind = "ngram"

    def __init__(self, memory, lambda_sparse: float, lambda_dense: float, k: int = 1000) -> None:
        self.memory, self.k = memory, k
        self.lambda_sparse, self.lambda_dense = float(lambda_sparse), float(lambda_dense)
        self.prefix: tuple[int, ...] = ()
        self.steps = self.approximate_steps = 0  # rows searched, and rows whose P∞ left some mass unassigned
        self.max_missing = 0.0

    @property
    def rule_weight(self) -> tuple[float, float]:
        return self.lambda_sparse, self.lambda_dense

    def set_prefix(self, tokens: Sequence[int]) -> None:
        self.prefix = tuple(int(t) for t in tokens)

    def _next_tokens(self, contexts: Sequence[Sequence[int]], vocab: int):
        p_inf, sparse, nt = next_token_distribution(self.memory, [[*self.prefix, *c] for c in contexts], vocab, self.k)
        self.steps += len(nt.missing)
        self.approximate_steps += int((nt.missing > 0).sum())
        self.max_missing = max(self.max_missing, float(nt.missing.max(initial=0.0)))
        return p_inf, sparse, nt

    def search(self, input_ids: torch.LongTensor, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(log P∞ [rows, vocab], sparse [rows])`` of each row's next token (the row after ``prefix``): sparse
        where one token follows every occurrence of the row's longest matching suffix."""
        p_inf, sparse, _ = self._next_tokens([row.tolist() for row in input_ids.cpu()], vocab)
        return p_inf, sparse

    def component(self, name: str, inputs: StepInputs) -> Component:
        """P∞ over the vocabulary of each row of ``inputs`` and its features (:func:`ngram_features`: the effective
        n, 1 where nothing follows any suffix, the matched suffix's count, the sparse flag)."""
        p_inf, sparse, nt = self._next_tokens(inputs.contexts, inputs.vocab)
        n = np.where(nt.retrieved.ids[:, 0] >= 0, nt.retrieved.ids[:, 0], 1)
        flags = np.asarray(sparse, dtype=bool)
        return Component(p_inf.to(inputs.device), ngram_features(name, n, nt.count, flags), flags)

    def approximate(self) -> dict | None:
        """None when every step's P∞ was exact over the vocabulary, else how many were not, and why
        (:func:`next_token_distribution`)."""
        if not self.approximate_steps:
            return None
        return {
            "steps": self.approximate_steps,
            "of": self.steps,
            "max_missing_mass": self.max_missing,
            "reason": f"P∞ over the vocabulary keeps the k={self.k} most frequent next tokens of a suffix, counted "
            "exactly (also past the engine's max_support sampling, up to max_support more distinct tokens); the "
            "mass of the others is unassigned",
        }
