"""Generation through the one mixture of the LM and its memories: a ``transformers`` LogitsProcessor that replaces
the LM's next-token distribution by the mixture's::

    P(w | c) = sum_i λ_i(c) P_i(w | c),     λ(c) = softmax(W φ(c) + b)

over the LM and every memory given as one list or one spec string (:func:`memlm.knnlm.memories.open_memories`):
datastores, plain or sharded, with p_kNN(w | c) = sum_{(k_i, v_i) in top-k} 1[v_i = w] softmax_i(s(h_ds(c), k_i) / τ)
(Khandelwal et al. 2020, Eq. 2), and ∞-gram indexes with P∞ (Liu et al. 2024). The weights are one
:class:`memlm.core.mixture.Mixture` (:func:`memlm.knnlm.default_mixture.resolve_mixture`): a fit (``memlm
tune``), fixed weights (:func:`memlm.mixing.weights.fixed_mixture`, or ``"knn=0.25;ngram=0.5/0.1"``; for
one datastore ``(1 - λ) p_LM + λ p_kNN``, Eq. 3), or by default the memories' stored fits.

Usage::

    with MixtureLogitsProcessor(model, "knn:ds/wiki;ngram:idx/wt2") as proc:
        out = model.generate(**inputs, logits_processor=[proc], do_sample=True)

The processor hooks the model (each datastore's key role) while the ``with`` block is open, reads the query of the
newest position of every row at each step, searches each memory and returns the mixture's log-probabilities as the
new scores. Every row is handled on its own, so it works with batched prompts (left padding: the newest position is
the last column) and with beam search (rows are batch x beams; transformers reorders the KV cache, and the hooked
forward pass always computes the keys of the rows it is asked to score).

:func:`generate_text` wraps ``model.generate`` for batched prompts (left-padded), beam search, stop strings, and a
streamer; :class:`NeighbourStreamer` prints each token as it is generated together with the datastore entries
retrieved for it, traced back to their source text (:class:`SourceLookup`).
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TextIO

import numpy as np
import torch
from transformers import LogitsProcessor, StoppingCriteria, StoppingCriteriaList, TextStreamer

from memlm.errors import MemlmError
from memlm.knnlm.default_mixture import resolve_mixture
from memlm.knnlm.memories import open_memories
from memlm.mixing.component import Batch
from memlm.mixing.datastore import DatastoreComponent
from memlm.mixing.step import StepMixture
from memlm.models.keys import KeyCapture
from memlm.storage.datastore import Datastore

__all__ = [
    "Decoding",
    "MixtureLogitsProcessor",
    "generate_text",
    "NeighbourStreamer",
    "SourceLookup",
    "Neighbour",
]


class MixtureLogitsProcessor(LogitsProcessor):
    """Each generation step's distribution replaced by the mixture of the LM and ``memories`` (one list or one spec
    string: :func:`memlm.knnlm.memories.open_memories`) by ``mixture``
    (:func:`memlm.knnlm.default_mixture.resolve_mixture`: a :class:`~memlm.core.mixture.Mixture`, a weights string,
    a fit; None: the memories' stored fits, several combined only given ``tokenizer``), refused with one MemlmError,
    before any step, when it mixes other components. ``model`` may be None when no memory reads the model's hidden
    states (∞-grams only). A datastore component made with ``record=True`` keeps each call's retrievals."""

    def __init__(self, model, memories: Any, mixture: Any = None, *, tokenizer: Any = None) -> None:
        found = resolve_mixture(open_memories(memories), mixture, model, tokenizer)
        self.model, self.fit = model, found.fit
        self.mixture = StepMixture(found.components, found.mixture)
        self.components = self.mixture.components
        self.specs = self.mixture.key_specs
        if self.specs and model is None:
            raise MemlmError("a datastore reads the model's hidden states: give the model")
        self._capture = KeyCapture(model, self.specs) if self.specs else None

    @property
    def ngram_components(self) -> list:
        """The ∞-gram indexes mixed, in order."""
        return self.mixture.of_kind("ngram")

    def set_prefix(self, tokens: Sequence[int]) -> None:
        """Every ∞-gram's context starts with ``tokens`` (:class:`memlm.ngram.step.NgramComponent`)."""
        for c in self.ngram_components:
            c.set_prefix(tokens)

    def approximate(self) -> dict | None:
        """None when every ∞-gram step's P∞ was exact over the vocabulary; else the one index's note, or each
        index's that is not None by position (``reference 1``, ...)."""
        ngrams = self.ngram_components
        notes = {f"reference {i + 1}": a for i, c in enumerate(ngrams) if (a := c.approximate()) is not None}
        if len(ngrams) == 1:
            return notes.get("reference 1")
        return notes or None

    def __enter__(self) -> MixtureLogitsProcessor:
        if self._capture is not None:
            self._capture.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._capture is not None:
            self._capture.__exit__(*exc)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        queries = {}
        for spec in self.specs:
            keys = self._capture.keys_by_spec[spec]
            if keys is None:
                raise RuntimeError(f"{type(self).__name__} must be used inside its `with` block")
            if keys.shape[0] != scores.shape[0]:
                raise RuntimeError(f"hooked {keys.shape[0]} rows but got scores for {scores.shape[0]}")
            queries[spec] = keys[:, -1].float().cpu().numpy()  # [rows, D]: each row's newest position (left padding)
        lm = torch.log_softmax(scores.float(), dim=-1)
        batch = Batch(queries, make_contexts=lambda: [row.tolist() for row in input_ids.cpu()], vocab=lm.shape[-1],
                      device=lm.device)  # fmt: skip
        return self.mixture.mix(lm, batch).to(scores.dtype)


class _Temperature(LogitsProcessor):
    """Divide log-probabilities by a sampling temperature (applied after the interpolation)."""

    def __init__(self, temperature: float) -> None:
        self.temperature = temperature

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        return scores / self.temperature


class _StopOnStrings(StoppingCriteria):
    """Stop a row once its generated text contains any of ``stops``."""

    def __init__(self, tokenizer, stops: Sequence[str], prompt_len: int) -> None:
        self.tokenizer, self.stops, self.prompt_len = tokenizer, [s for s in stops if s], prompt_len

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs) -> torch.BoolTensor:
        texts = self.tokenizer.batch_decode(input_ids[:, self.prompt_len :], skip_special_tokens=False)
        return torch.tensor([any(s in t for s in self.stops) for t in texts], device=input_ids.device)


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)`` ``[B, max len]`` with each prompt right-aligned (padding on the left)."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise MemlmError("every prompt needs at least one token")
    length = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), length), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(prompts):
        ids[b, length - len(p) :] = torch.as_tensor(list(p), dtype=torch.long)
        mask[b, length - len(p) :] = 1
    return ids, mask


@dataclass(frozen=True)
class Decoding:
    """How :func:`generate_text` decodes: greedy by default; ``num_beams > 1`` beam search; ``do_sample`` samples at
    ``sampling_temperature`` (applied after the interpolation); a row stops at EOS, after ``max_new_tokens``, or once
    its text holds one of ``stop``."""

    max_new_tokens: int = 40
    do_sample: bool = False
    sampling_temperature: float | None = None
    num_beams: int = 1
    stop: Sequence[str] = ()


def _decoding(decoding: Decoding | None, options: dict[str, Any]) -> Decoding:
    """``decoding`` with the fields ``options`` set by name; any other name is refused (memories and weights are
    ``memories=`` and ``mixture=``)."""
    names = {f.name for f in dataclasses.fields(Decoding)}
    unknown = sorted(set(options) - names)
    if unknown:
        raise MemlmError(f"generate_text got {', '.join(unknown)}: decoding takes {', '.join(sorted(names))}; "
                         "memories and their settings are memories= (a list or a spec string, e.g. "
                         "'knn:ds/wiki?k=64&temperature=2'), weights are mixture= (e.g. 'knn=0.25')")  # fmt: skip
    return dataclasses.replace(decoding or Decoding(), **options)


@torch.inference_mode()
def generate_text(
    model,
    tokenizer,
    prompts: Sequence[str] | Sequence[Sequence[int]],
    memories: Any = None,
    mixture: Any = None,
    decoding: Decoding | None = None,
    *,
    streamer=None,
    processor: MixtureLogitsProcessor | None = None,
    **options: Any,
) -> list[str]:
    """Continue each prompt (strings or token-id lists) from the mixture of the LM and ``memories`` (the bare LM
    when there are none).

    ``memories``: one list or one spec string (:func:`memlm.knnlm.memories.open_memories`: datastores, ∞-gram
    indexes, components; k is :data:`~memlm.core.config.DEFAULT_K` unless the spec says); ``mixture``: the weights
    (:func:`memlm.knnlm.default_mixture.resolve_mixture`; None: the memories' stored fits); ``decoding``: how to
    decode (:class:`Decoding`), its fields also by name in ``options`` (``max_new_tokens=5, num_beams=4``). Prompts
    are left-padded into one batch. ``processor``: a :class:`MixtureLogitsProcessor` already made (then
    ``memories`` and ``mixture`` are not used). Returns the generated text of each prompt (no prompt)."""
    decoding = _decoding(decoding, options)
    if streamer is not None and len(prompts) * decoding.num_beams != 1:
        raise MemlmError("streaming shows one sequence: pass one prompt and num_beams=1 to stream")
    if processor is None and memories is not None:
        processor = MixtureLogitsProcessor(model, memories, mixture, tokenizer=tokenizer)
    if processor is not None and processor.mixture.lm_alone:  # every memory at weight 0: the LM's distribution
        processor = None
    token_prompts = [
        list(tokenizer(p, add_special_tokens=False)["input_ids"]) if isinstance(p, str) else list(p) for p in prompts
    ]
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    ids, mask = left_pad(token_prompts, pad_id)
    device = next(model.parameters()).device
    ids, mask = ids.to(device), mask.to(device)
    processors: list[LogitsProcessor] = [] if processor is None else [processor]
    if decoding.do_sample and decoding.sampling_temperature not in (None, 1.0):
        processors.append(_Temperature(float(decoding.sampling_temperature)))
    kwargs: dict[str, Any] = {
        "max_new_tokens": decoding.max_new_tokens,
        "do_sample": decoding.do_sample,
        "num_beams": decoding.num_beams,
        "pad_token_id": pad_id,
        "eos_token_id": tokenizer.eos_token_id,
        # no warpers of the model's generation config: they would run before the mixture
        "temperature": 1.0,
        "top_k": None,
        "top_p": None,
        "min_p": None,
        "repetition_penalty": None,
        "logits_processor": processors,
        "streamer": streamer,
    }
    if decoding.stop:
        kwargs["stopping_criteria"] = StoppingCriteriaList([_StopOnStrings(tokenizer, decoding.stop, ids.shape[1])])
    if processor is not None:
        with processor:
            out = model.generate(input_ids=ids, attention_mask=mask, **kwargs)
    else:
        out = model.generate(input_ids=ids, attention_mask=mask, **kwargs)
    return tokenizer.batch_decode(out[:, ids.shape[1] :], skip_special_tokens=True)


# ---------------------------------------------------------------------------------------------------------------
# Where did that token come from?


@dataclass
class Neighbour:
    """One retrieved datastore entry, traced back to its document."""

    entry: int
    score: float
    value: str  # the entry's next token, decoded
    doc_id: str | None
    before: str  # a few tokens before the entry's target in its document
    after: str  # a few tokens after it

    def describe(self) -> str:
        where = self.doc_id if self.doc_id is not None else "unknown document"
        return f"[{where}] ...{self.before}[[{self.value}]]{self.after}... (score {self.score:.2f})"


class SourceLookup:
    """Map datastore entries to their source text through ``doc_hash`` / ``offset`` and the datastore's corpora.

    The datastore's manifest records each source (corpus, split, number of leading documents); their documents are
    loaded again and hashed (:func:`memlm.data.windows.doc_hash`) to find an entry's document; the entry's ``offset`` is
    the position of its value (the next token) in that document's tokens.
    """

    def __init__(self, datastore: Datastore, tokenizer, context_tokens: int = 8) -> None:
        from memlm.data.corpora import load_corpora
        from memlm.data.windows import doc_hash

        self.datastore, self.tokenizer, self.context_tokens = datastore, tokenizer, context_tokens
        self.docs: dict[int, Any] = {}
        for source in datastore.manifest.get("sources", []):
            try:
                docs = load_corpora(source["corpus"], source.get("split"))
            except MemlmError as error:
                print(f"memlm: cannot show text of source {source['corpus']}: {error}", file=sys.stderr)
                continue
            for doc in docs[: source.get("documents", len(docs))]:
                self.docs[doc_hash(doc.id, doc.text)] = doc
        self._tokens: dict[int, list[int]] = {}

    def _doc_tokens(self, h: int) -> list[int]:
        if h not in self._tokens:
            doc = self.docs[h]
            self._tokens[h] = [*self.tokenizer(doc.text, add_special_tokens=False)["input_ids"]]
        return self._tokens[h]

    def neighbour(self, entry: int, score: float) -> Neighbour:
        value = self.tokenizer.decode([int(self.datastore.values[entry])])
        h, off = int(self.datastore.doc_hash[entry]), int(self.datastore.offset[entry])
        if h not in self.docs:
            return Neighbour(entry, score, value, None, "", "")
        toks = self._doc_tokens(h)
        before = self.tokenizer.decode(toks[max(0, off - self.context_tokens) : off])
        after = self.tokenizer.decode(toks[off + 1 : off + 1 + self.context_tokens // 2])
        return Neighbour(entry, score, value, self.docs[h].id, before, after)

    def neighbours(self, scores: np.ndarray, ids: np.ndarray, n: int) -> list[Neighbour]:
        """The ``n`` best entries of one retrieval (``scores``, ``ids`` ``[k]``)."""
        return [self.neighbour(int(i), float(s)) for s, i in zip(scores[:n], ids[:n], strict=True) if i >= 0]


class NeighbourStreamer(TextStreamer):
    """Print the generated text as it comes; with ``lookup``, print under each token its nearest neighbours' source.

    ``processor`` must record its retrievals (``record=True``): the token passed to ``put`` was drawn from the
    distribution of the processor's latest call, whose retrievals from ``lookup``'s datastore are shown.
    """

    def __init__(
        self,
        tokenizer,
        processor: MixtureLogitsProcessor | None = None,
        lookup: SourceLookup | None = None,
        n_neighbours: int = 3,
        out: TextIO | None = None,
    ) -> None:
        super().__init__(tokenizer, skip_prompt=True, skip_special_tokens=True)
        self.processor, self.lookup, self.n_neighbours = processor, lookup, n_neighbours
        self.out = out if out is not None else sys.stdout

    def put(self, value: torch.Tensor) -> None:
        if self.lookup is None or self.processor is None:
            return super().put(value)
        if self.skip_prompt and self.next_tokens_are_prompt:
            self.next_tokens_are_prompt = False
            return None
        token = int(value.reshape(-1)[0])
        text = self.tokenizer.decode([token], skip_special_tokens=True)
        print(f"{text!r}", file=self.out, flush=True)
        history = self._history()
        if history:
            sc, ids = history[-1]
            for nb in self.lookup.neighbours(sc[0], ids[0], self.n_neighbours):
                print(f"    {nb.describe()}", file=self.out, flush=True)
        return None

    def _history(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """The retrievals of the processor's step that searches ``lookup``'s datastore (none: empty)."""
        for c in self.processor.components:
            if isinstance(c, DatastoreComponent) and c.datastore is self.lookup.datastore:
                return c.history
        return []

    def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
        print(text, file=self.out, flush=True, end="" if not stream_end else "\n")
