"""The ∞-gram at one step of the mixture over the vocabulary (Liu et al. 2024): P∞ of each row's longest matching
suffix and its features, a component of :class:`memlm.mixing.step.StepMixture` (generation,
``memlm.wrap``, lm-eval's ``generate_until``).

Each row's context (its tokens so far after its leading EOS padding; an EOS inside it is a token of the document,
:func:`memlm.ngram.memory.context_document`) gives P∞ over the next token
(:meth:`memlm.ngram.memory.NgramMemory.next_tokens`: the longest suffix seen in the corpus and the exact counts of
what followed it)::

    P∞(w | c) = cnt(suffix · w) / cnt(suffix),     sparse where one token follows every occurrence of the suffix

with the features a dump stores (:func:`memlm.mixing.inputs.ngram_features`: effective n, suffix count,
sparse flag); the sparse flag is what the fixed-weight rule's ``(λ_sparse, λ_dense)`` switches on.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import numpy as np
import torch

from memlm.core.distribution import value_logsumexp
from memlm.errors import MemlmError
from memlm.mixing.component import Batch, Component, Step
from memlm.mixing.inputs import ngram_features

__all__ = ["NgramComponent", "next_token_distribution"]


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


class NgramComponent(Component):
    """An ∞-gram index as a component of the mixture (:mod:`memlm.mixing.component`): at the targets, P∞ of each
    target after its document's longest matching suffix and the statistics beside it (columns ``logprob``, ``n``,
    ``count``, ``sparse``: :meth:`memlm.ngram.memory.NgramMemory.score_documents`); over the vocabulary, P∞ of each
    row's next token (:func:`next_token_distribution`, at most ``k`` distinct next tokens). Features: the effective
    n, the suffix count and the sparse flag (:func:`ngram_features`).

    ``prefix``: tokens of the document before every row's first token at a step (lm-eval's ``generate_until`` cuts
    the LM's context; the ∞-gram can read further back). ``steps`` counts the rows searched at steps,
    ``approximate_steps`` those whose P∞ left some mass unassigned (:meth:`approximate`)."""

    kind: ClassVar[str] = "ngram"

    def __init__(self, memory, k: int = 1000) -> None:
        self.memory, self.k = memory, int(k)
        self.prefix: tuple[int, ...] = ()
        self.steps = self.approximate_steps = 0
        self.max_missing = 0.0

    @classmethod
    def from_description(cls, description) -> NgramComponent:
        """Its saved columns (no index: nothing to search)."""
        return cls(None, int(description.get("k") or 1000))

    def score(self, batch: Batch) -> dict[str, np.ndarray]:
        if batch.documents is None or batch.doc_index is None or batch.position is None or batch.targets is None:
            raise MemlmError("an ∞-gram scores targets in their documents: the batch needs documents, doc_index, "
                             "position and targets")  # fmt: skip
        order = np.lexsort((batch.position, batch.doc_index))
        doc_sorted, pos_sorted = np.asarray(batch.doc_index)[order], np.asarray(batch.position)[order]
        bounds = np.flatnonzero(np.diff(doc_sorted)) + 1
        docs, positions = [], []
        for a, b in zip(np.r_[0, bounds], np.r_[bounds, len(order)], strict=True):
            tokens = np.asarray(batch.documents[int(doc_sorted[a])])
            if not np.array_equal(tokens[pos_sorted[a:b]], np.asarray(batch.targets)[order[a:b]]):
                raise MemlmError("the targets are not these documents' tokens: score the same corpus")
            docs.append(tokens)
            positions.append(pos_sorted[a:b])
        found = self.memory.score_documents(docs, positions)
        out = {}
        for name, dtype in (("logprob", np.float32), ("count", np.int64), ("n", np.int32), ("sparse", bool)):
            out[name] = np.empty(len(order), dtype)
            out[name][order] = getattr(found, name)
        return out

    def features(self, columns) -> dict[str, np.ndarray]:
        found = ngram_features("", columns["n"], columns["count"], columns["sparse"])
        return {name[1:]: value for name, value in found.items()}

    def sparse(self, columns) -> np.ndarray:
        return np.asarray(columns["sparse"], dtype=bool)

    def set_prefix(self, tokens: Sequence[int]) -> None:
        self.prefix = tuple(int(t) for t in tokens)

    def step(self, batch: Batch) -> Step:
        rows = [[*self.prefix, *c] for c in batch.contexts]
        p_inf, sparse, nt = next_token_distribution(self.memory, rows, batch.vocab, self.k)
        self.steps += len(nt.missing)
        self.approximate_steps += int((nt.missing > 0).sum())
        self.max_missing = max(self.max_missing, float(nt.missing.max(initial=0.0)))
        n = np.where(nt.retrieved.ids[:, 0] >= 0, nt.retrieved.ids[:, 0], 1)
        flags = np.asarray(sparse, dtype=bool)
        return Step(p_inf.to(batch.device), self.features({"n": n, "count": nt.count, "sparse": flags}), flags)

    def approximate(self) -> dict | None:
        """None when every step's P∞ was exact over the vocabulary, else how many were not, and why."""
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

    def check_compatible(self, model, tokenizer) -> None:
        """One MemlmError when the index was built with another tokenizer."""
        self.memory.index.check_tokenizer(tokenizer)

    def describe(self) -> dict:
        return {"kind": self.kind, **({} if self.memory is None else self.memory.describe()), "k": self.k}
