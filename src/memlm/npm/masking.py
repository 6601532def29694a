"""Span masking with in-batch positives for NPM training (Min et al. 2023, §3.2.1 and App. A.2; NPM SINGLE, App. A.3).

NPM is trained to *retrieve* a masked phrase from the other sequences of the batch, so a span may be masked only if
the same n-gram also occurs in another sequence of the batch (an in-batch positive). Following App. A.2:

1. candidate spans are all n-grams ``x^i_s .. x^i_{s+n-1}`` (``1 <= n <= max_span``, no special token inside) whose
   token string also occurs in a sequence ``j != i`` of the batch;
2. span lengths are drawn from a geometric distribution with ``p = 0.5`` (SpanBERT, Joshi et al. 2020), truncated
   at ``max_span`` (default 10) and renormalised::

       P(n) = p (1 - p)^(n - 1) / sum_{k=1}^{max_span} p (1 - p)^(k - 1),   n = 1 .. max_span

   (mean 1.99 for p = 0.5, max_span = 10; see :func:`truncated_geometric_pmf`);
3. spans are masked until the per-sequence budget is spent: at most ``floor(budget * n_tokens)`` tokens, where
   ``n_tokens`` counts the non-special tokens of the sequence (rounding is *down*, so the masked fraction never
   exceeds ``budget``; a sequence with fewer than ``1 / budget`` tokens gets no mask). At most ``max_spans`` (128)
   spans per sequence; a span string is masked at most ``max_repeat`` (10) times in the whole batch; spans never
   overlap.

Each masked span is replaced by the TWO tokens ``[MASK_s] [MASK_e]``, so a masked sequence is shorter than the
original by ``sum(n - 2)`` tokens (longer by one for a single-token span). Their encoder outputs are the start and end
queries of :func:`memlm.npm.loss.npm_span_loss`.

Representing ``[MASK_s]`` / ``[MASK_e]``: the caller passes their ids (``mask_s``, ``mask_e``). The paper uses the
tokenizer's single ``[MASK]`` for both (App. A.2: "it is not necessary to use different tokens ... since the
Transformer can handle positional information"), so ``mask_s == mask_e == tokenizer.mask_token_id`` (103 for the
uncased MiniLM/BERT WordPiece) is the default choice; a caller who wants distinct tokens adds them with
``tokenizer.add_special_tokens`` and resizes the encoder's embeddings.

Sampling procedure (one sequence at a time, sequences visited in a random order so that the per-batch repeat cap does
not always favour the first sequences): draw ``n`` from ``P(n)`` restricted to the lengths that can still be placed
(``n <= remaining budget`` and at least one free candidate of length ``n`` whose string is under the repeat cap), then
draw its start uniformly among those free candidates. Lengths found infeasible stay infeasible (coverage and repeat
counts only grow), so rejection sampling from ``P(n)`` restricted to feasible lengths is exact. Masking stops when the
budget is spent, ``max_spans`` is reached, or no candidate fits. Everything is driven by the ``numpy`` generator passed
in, so a seed reproduces the batch exactly.

Positions: all ``start``/``end`` indices of a span or an occurrence are in the *unmasked* (original) sequence and
``end`` is **inclusive** (``tokens == original[start : end + 1]``), matching the paper's start token ``x_m`` and end
token ``x_{m+|g|-1}``. ``mask_start``/``mask_end`` index the masked sequence.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from memlm.errors import MemlmError

__all__ = [
    "Occurrence",
    "MaskedSpan",
    "MaskedBatch",
    "truncated_geometric_pmf",
    "mask_batch",
    "mask_batch_single",
]


@dataclass(frozen=True)
class Occurrence:
    """An in-batch positive: ``original[seq][start : end + 1]`` equals the masked span (``end`` inclusive)."""

    seq: int
    start: int
    end: int


@dataclass(frozen=True)
class MaskedSpan:
    """One masked span ``g^i_t`` of sequence ``seq``.

    ``start``/``end`` (inclusive) locate it in the original sequence; ``tokens`` is the original n-gram;
    ``mask_start``/``mask_end`` are the positions of ``[MASK_s]``/``[MASK_e]`` in the masked sequence (equal for NPM
    SINGLE, where a token is replaced by one ``[MASK]``); ``positives`` are all occurrences of ``tokens`` in the *other*
    unmasked sequences of the batch (``Y_s^+`` are their starts, ``Y_e^+`` their ends, §3.2.2).
    """

    seq: int
    start: int
    end: int
    tokens: tuple[int, ...]
    mask_start: int
    mask_end: int
    positives: tuple[Occurrence, ...]


@dataclass(frozen=True)
class MaskedBatch:
    """Result of masking a batch.

    ``input_ids[i]`` is the masked sequence ``x-hat^i``; ``original_ids[i]`` the unmasked ``x^i``; ``spans[i]`` the
    masked spans of sequence ``i`` in left-to-right order.
    """

    input_ids: list[list[int]]
    original_ids: list[list[int]]
    spans: list[list[MaskedSpan]]

    @property
    def all_spans(self) -> list[MaskedSpan]:
        """Every masked span of the batch, sequence by sequence, left to right (the query order of the loss)."""
        return [s for per_seq in self.spans for s in per_seq]


def truncated_geometric_pmf(p: float = 0.5, max_span: int = 10) -> np.ndarray:
    """``P(n) = p (1-p)^(n-1) / Z`` for ``n = 1 .. max_span`` (index ``n - 1``); ``Z`` renormalises the truncation."""
    if not 0.0 < p <= 1.0:
        raise MemlmError(f"geometric p must be in (0, 1], got {p}")
    if max_span < 1:
        raise MemlmError(f"max_span must be >= 1, got {max_span}")
    n = np.arange(1, max_span + 1)
    w = p * (1.0 - p) ** (n - 1)
    return w / w.sum()


def _check_common(sequences: Sequence[Sequence[int]], budget: float, max_repeat: int | None) -> None:
    if not 0.0 < budget <= 1.0:
        raise MemlmError(f"masking budget must be in (0, 1], got {budget}")
    if max_repeat is not None and max_repeat < 1:
        raise MemlmError(f"max_repeat must be >= 1 (or None for no cap), got {max_repeat}")
    for i, seq in enumerate(sequences):
        if any(not isinstance(t, int | np.integer) for t in seq):
            raise MemlmError(f"sequence {i} must be a list of integer token ids")


def _budget_tokens(seq: Sequence[int], special: frozenset[int], budget: float) -> int:
    n_tokens = sum(1 for t in seq if t not in special)
    return int(np.floor(budget * n_tokens + 1e-9))  # floor: never more than `budget` of the tokens


def _batch_ngrams(sequences: Sequence[Sequence[int]], max_span: int, special_ids: Iterable[int]) -> tuple:
    """``(special ids, index, n_seqs_with)``: every n-gram (1 <= n <= max_span, no special token) -> its occurrences
    ``(seq, start)`` in the batch, and -> the number of sequences it occurs in."""
    special = frozenset(int(t) for t in special_ids)
    index: dict[tuple[int, ...], list[tuple[int, int]]] = defaultdict(list)
    for j, seq in enumerate(sequences):
        length = len(seq)
        for s in range(length):
            for n in range(1, max_span + 1):
                e = s + n
                if e > length or seq[e - 1] in special:
                    break
                index[tuple(seq[s:e])].append((j, s))
    return special, index, {g: len({j for j, _ in occ}) for g, occ in index.items()}


def _masked_batch(
    sequences: Sequence[Sequence[int]],
    chosen: list[list[tuple[int, int]]],
    mask_s: int,
    mask_e: int | None,
    index: dict[tuple[int, ...], list[tuple[int, int]]],
) -> MaskedBatch:
    """Replace the chosen ``(start, n)`` spans of each sequence by ``[MASK_s][MASK_e]`` (one ``mask_s`` if mask_e
    None), each span with its positives: its occurrences in the other sequences."""
    input_ids: list[list[int]] = []
    spans: list[list[MaskedSpan]] = []
    for i, seq in enumerate(sequences):
        out: list[int] = []
        spans.append([])
        pos = 0
        for start, n in sorted(chosen[i]):
            out.extend(seq[pos:start])
            tokens = tuple(int(t) for t in seq[start : start + n])
            mask_start = len(out)
            out.extend([mask_s] if mask_e is None else [mask_s, mask_e])
            positives = tuple(Occurrence(j, m, m + n - 1) for j, m in index[tokens] if j != i)
            spans[i].append(MaskedSpan(i, start, start + n - 1, tokens, mask_start, len(out) - 1, positives))
            pos = start + n
        input_ids.append([int(t) for t in [*out, *seq[pos:]]])
    return MaskedBatch(input_ids, [[int(t) for t in seq] for seq in sequences], spans)


def mask_batch(
    sequences: Sequence[Sequence[int]],
    mask_s: int,
    mask_e: int,
    rng: np.random.Generator,
    budget: float = 0.15,
    p: float = 0.5,
    max_span: int = 10,
    max_spans: int = 128,
    max_repeat: int | None = 10,
    special_ids: Iterable[int] = (),
) -> MaskedBatch:
    """NPM span masking with in-batch positives (§3.2.1, App. A.2); see the module docstring for the procedure.

    Args:
        sequences: the batch, one list of token ids per sequence (unpadded; may include [CLS]/[SEP]).
        mask_s, mask_e: ids written for ``[MASK_s]`` and ``[MASK_e]`` (may be equal: the paper uses one [MASK]).
        rng: the only source of randomness (``np.random.default_rng(seed)``).
        budget: fraction of the non-special tokens of each sequence that may be masked (floored), 0.15 in the paper.
        p, max_span: span length ``n ~ Geometric(p)`` truncated to ``1 .. max_span`` and renormalised.
        max_spans: at most this many spans per sequence (128).
        max_repeat: a given span string is masked at most this many times in the batch (10); ``None``: no cap.
        special_ids: ids never masked, never part of a span or a positive, and not counted in the budget
            (e.g. ``tokenizer.all_special_ids``).

    Returns:
        :class:`MaskedBatch` with masked ids, original ids and, per masked span, its original position and tokens,
        the positions of ``[MASK_s]``/``[MASK_e]``, and its positive occurrences in the other (unmasked) sequences.
    """
    _check_common(sequences, budget, max_repeat)
    if max_spans < 0:
        raise MemlmError(f"max_spans must be >= 0, got {max_spans}")
    pmf = truncated_geometric_pmf(p, max_span)
    special, index, n_seqs_with = _batch_ngrams(sequences, max_span, special_ids)
    repeats: dict[tuple[int, ...], int] = defaultdict(int)
    chosen: list[list[tuple[int, int]]] = [[] for _ in sequences]

    for i in rng.permutation(len(sequences)).tolist():
        seq = sequences[i]
        # candidate starts per length: the n-gram also occurs in another sequence of the batch
        cand: dict[int, list[int]] = defaultdict(list)
        for s in range(len(seq)):
            for n in range(1, max_span + 1):
                if s + n > len(seq) or seq[s + n - 1] in special:
                    break
                if n_seqs_with[tuple(seq[s : s + n])] >= 2:
                    cand[n].append(s)
        covered = np.zeros(len(seq), dtype=bool)
        remaining = _budget_tokens(seq, special, budget)
        infeasible: set[int] = set()
        while remaining > 0 and len(chosen[i]) < max_spans:
            lengths = [n for n in range(1, min(max_span, remaining) + 1) if n not in infeasible and cand.get(n)]
            if not lengths:
                break
            weights = pmf[np.array(lengths) - 1]
            n = lengths[int(rng.choice(len(lengths), p=weights / weights.sum()))]
            free = [
                s
                for s in cand[n]
                if not covered[s : s + n].any() and (max_repeat is None or repeats[tuple(seq[s : s + n])] < max_repeat)
            ]
            if not free:
                infeasible.add(n)  # coverage and repeat counts only grow: n stays infeasible for this sequence
                continue
            s = free[int(rng.integers(len(free)))]
            covered[s : s + n] = True
            repeats[tuple(seq[s : s + n])] += 1
            chosen[i].append((s, n))
            remaining -= n

    return _masked_batch(sequences, chosen, mask_s, mask_e, index)


def mask_batch_single(
    sequences: Sequence[Sequence[int]],
    mask_id: int,
    rng: np.random.Generator,
    budget: float = 0.15,
    max_repeat: int | None = None,
    special_ids: Iterable[int] = (),
) -> MaskedBatch:
    """NPM SINGLE masking (App. A.3): single tokens, each replaced by one ``[MASK]``, with in-batch positives.

    A token ``x^i_t`` may be masked only if the same token id occurs in another sequence ``j != i``; its positives are
    ``Y^+(x^i_t) = {x^j_m | x^j_m = x^i_t, j != i}``. Up to ``floor(budget * n_tokens)`` tokens per sequence are drawn
    uniformly without replacement among the candidates. The paper gives no repeat cap for NPM SINGLE, so
    ``max_repeat`` defaults to ``None`` (a value caps how often one token id is masked in the batch). Spans in the
    result have length 1 and ``mask_start == mask_end``; masked sequences keep their length.
    """
    _check_common(sequences, budget, max_repeat)
    special, index, n_seqs_with = _batch_ngrams(sequences, 1, special_ids)
    repeats: dict[tuple[int, ...], int] = defaultdict(int)
    chosen: list[list[tuple[int, int]]] = [[] for _ in sequences]
    for i in rng.permutation(len(sequences)).tolist():
        seq = sequences[i]
        remaining = _budget_tokens(seq, special, budget)
        cands = [s for s in range(len(seq)) if seq[s] not in special and n_seqs_with[(seq[s],)] >= 2]
        for s in rng.permutation(np.array(cands, dtype=np.int64)).tolist():
            if remaining <= 0:
                break
            g = (seq[s],)
            if max_repeat is not None and repeats[g] >= max_repeat:
                continue
            repeats[g] += 1
            chosen[i].append((s, 1))
            remaining -= 1
    return _masked_batch(sequences, chosen, mask_id, None, index)
