"""Generation through the one mixture of the LM and its memories: a ``transformers`` LogitsProcessor that replaces
the LM's next-token distribution by the mixture's::

    P(w | c) = sum_i λ_i(c) P_i(w | c),     λ(c) = softmax(W φ(c) + b)

over the LM and every memory given as one list (:mod:`memlm.mixing.step`): datastores, plain or sharded, with
p_kNN(w | c) = sum_{(k_i, v_i) in top-k} 1[v_i = w] softmax_i(s(h_ds(c), k_i) / τ) (Khandelwal et al. 2020, Eq. 2),
and ∞-gram indexes with P∞ (Liu et al. 2024). The weights are a fitted :class:`memlm.core.mixture.Mixture` (``memlm
tune --mixture gate``) or, without one, the fixed-weight rule of each memory's own weights: for one datastore
``(1 - λ) p_LM + λ p_kNN`` (Eq. 3).

Usage::

    with MixtureLogitsProcessor(model, [datastore, ngram_index]) as proc:
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
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import torch
from transformers import LogitsProcessor, StoppingCriteria, StoppingCriteriaList, TextStreamer

from memlm.core.config import RetrievalConfig
from memlm.core.memory import Memory
from memlm.core.mixture import Mixture
from memlm.errors import MemlmError
from memlm.mixing.step import DatastoreStep, StepInputs, StepMixture, load_fit
from memlm.models.keys import KeyCapture
from memlm.retrieval import as_memory
from memlm.storage.datastore import Datastore, DatastoreBase
from memlm.storage.folder import is_ngram_index

__all__ = [
    "Decoding",
    "KNNLogitsProcessor",
    "MixtureLogitsProcessor",
    "generate_text",
    "memory_steps",
    "ngram_logits_processor",
    "NeighbourStreamer",
    "SourceLookup",
    "Neighbour",
]


def weights_given(config: RetrievalConfig, ngram_lambdas: Any = None) -> bool:
    """Whether fixed weights were given (λ, τ or an ∞-gram's λ_sparse / λ_dense): then they are used, not the
    memories' stored fits."""
    return config.lam is not None or config.temperature is not None or any(w is not None for w in ngram_lambdas or ())


def _per_memory(value: Any, n: int, what: str) -> list:
    """One value per memory of a kind: the same for all (a number or None), or one each."""
    values = list(value) if isinstance(value, list | tuple) else [value] * n
    if len(values) != n:
        raise MemlmError(f"{len(values)} values of {what} for {n} memories: give one, or one per memory")
    return values


def memory_steps(
    memories: Sequence,
    config: RetrievalConfig,
    fit: Any = None,
    *,
    index: Any = None,
    record: bool = False,
    ngram_lambdas: tuple[Any, Any] = (None, None),
    announce: bool = False,
) -> list:
    """Each memory as its step, datastores first, then ∞-gram indexes (the components' order, :class:`StepMixture`).

    ``memories``: datastores (open, or folders: plain or sharded), any memory with a ``key_spec``, ∞-gram indexes
    (:class:`memlm.ngram.memory.NgramMemory`, :class:`memlm.ngram.index.NgramIndex` or folders), or steps already
    made (:class:`DatastoreStep`, :class:`memlm.ngram.generate.NgramStep`: kept as they are). A datastore's k is
    ``config.k``, its λ and τ ``config.lam`` / ``config.temperature`` (one for all, or a list, one per datastore;
    None: each datastore's calibration, :func:`memlm.knnlm.calibration.knn_parameters`); an index's (λ_sparse,
    λ_dense) ``ngram_lambdas`` (each one value or one per index; None: its calibration). ``fit`` (a
    :class:`memlm.mixing.dump.DumpMixture`): the kNN terms take the τ and k it was fitted with. ``index``: a
    FAISS index already loaded, for the first datastore; ``record``: keep each datastore step's retrievals."""
    from memlm.knnlm.calibration import knn_parameters

    items = list(memories)
    ngram_items = [m for m in items if is_ngram_index(m)]
    dense_items = [m for m in items if not is_ngram_index(m)]
    k = int(fit.k) if fit is not None and getattr(fit, "k", None) else config.k
    lams = _per_memory(config.lam, len(dense_items), "λ")
    taus = _per_memory(config.temperature if fit is None or fit.temperature is None else fit.temperature,
                       len(dense_items), "τ")  # fmt: skip
    steps: list = []
    for i, (item, lam, tau) in enumerate(zip(dense_items, lams, taus, strict=True)):
        if isinstance(item, DatastoreStep):
            steps.append(item)
            continue
        if isinstance(item, str | Path):
            from memlm.storage.sharded import open_datastore

            item = open_datastore(item)
        if not isinstance(item, DatastoreBase | Memory):
            raise MemlmError(f"memories holds a {type(item).__name__}: give datastores (open or folders), memories "
                             "(search + key_spec) or ∞-gram indexes (NgramMemory or folders)")  # fmt: skip
        memory = as_memory(item, config.nprobe, index if i == 0 else None)
        setting = {"k": k, "nprobe": config.nprobe, "search": "index"}
        lam, tau, _ = knn_parameters(memory, lam, tau, announce=announce, setting=setting)
        steps.append(DatastoreStep(memory, k, lam, tau, record))
    steps += _ngram_steps(ngram_items, ngram_lambdas, announce)
    return steps


def _ngram_steps(items: Sequence, ngram_lambdas: tuple[Any, Any], announce: bool) -> list:
    if not items:
        return []
    from memlm.ngram.memory import NgramMemory
    from memlm.ngram.mixture import ngram_parameters, per_index_lambdas
    from memlm.ngram.step import NgramStep

    steps = []
    given = per_index_lambdas(*ngram_lambdas, len(items))
    for item, (ls, ld) in zip(items, given, strict=True):
        if isinstance(item, NgramStep):
            steps.append(item)
            continue
        memory = item if isinstance(item, NgramMemory) else NgramMemory(item)
        steps.append(NgramStep(memory, *ngram_parameters(memory.index, ls, ld, announce=announce)[:2]))
    return steps


class MixtureLogitsProcessor(LogitsProcessor):
    """Each generation step's distribution replaced by the mixture of the LM and ``memories`` (one list: datastores,
    any memory with a ``key_spec``, ∞-gram indexes; :func:`memory_steps`), mixed by one
    :class:`~memlm.core.mixture.Mixture` (:class:`~memlm.mixing.step.StepMixture`).

    ``mixture``: a fit (:class:`memlm.mixing.dump.DumpMixture`, its record or JSON file: its τ and k set the
    kNN terms; a :class:`Mixture`), refused with one MemlmError, before any step, when it was fitted on other
    memories; None: with no weights given and one memory, its stored fit
    (:func:`memlm.knnlm.default_mixture.library_default`; ``default=False``: not looked up), else the fixed-weight
    rule of each memory's weights (steps already made keep theirs). ``config``
    (:class:`memlm.core.config.RetrievalConfig`; default its defaults, k = :data:`~memlm.core.config.DEFAULT_K`
    as every path) gives k, λ, τ and
    nprobe (λ, τ None: each datastore's calibrated values); ``options`` set its fields by name (``k=8, lam=0.5``),
    and ``ngram_lambdas=(λ_sparse, λ_dense)`` the ∞-grams' weights (each one value or one per index; unset: each
    index's calibration). ``record=True``: every datastore step keeps, for every call, the ``(scores, ids)`` of its
    retrieved entries (``[rows, k]``) in its ``history`` (``steps``). ``index`` reuses an already loaded FAISS index
    (the first datastore's). ``model`` may be None when no memory reads the model's hidden states (∞-grams only).
    """

    def __init__(self, model, memories: Sequence, mixture: Any = None, config: RetrievalConfig | None = None, *,
                 index=None, record: bool = False, default: bool = True, **options: Any) -> None:  # fmt: skip
        ngram_lambdas = options.pop("ngram_lambdas", None) or (None, None)
        self.config = RetrievalConfig.with_options(config, **options)
        fit = load_fit(mixture)
        given = weights_given(self.config, ngram_lambdas)
        if fit is None and default:
            from memlm.knnlm.default_mixture import library_default

            fit = library_default(None, None, list(memories), given)  # no weights given: one memory's stored fit
        dump_fit = None if fit is None or isinstance(fit, Mixture) else fit
        steps = memory_steps(memories, self.config, dump_fit, index=index, record=record, ngram_lambdas=ngram_lambdas)
        self.model, self.fit = model, dump_fit
        self.mixture = StepMixture(steps, fit if dump_fit is None else dump_fit.mixture)
        self.steps = self.mixture.steps
        dense = [s for s in self.steps if isinstance(s, DatastoreStep)]
        self.specs = list(dict.fromkeys(s.key_spec for s in dense))
        if self.specs and model is None:
            raise MemlmError("a datastore reads the model's hidden states: give the model")
        self._capture = KeyCapture(model, self.specs) if self.specs else None

    @property
    def ngram_steps(self) -> list:
        return [s for s in self.steps if s.kind == "ngram"]

    @property
    def ngram_memories(self) -> list:
        """The ∞-gram indexes mixed, in order (their sources, their leakage checks)."""
        return [s.memory for s in self.ngram_steps]

    def set_prefix(self, tokens: Sequence[int]) -> None:
        """Every ∞-gram's context starts with ``tokens`` (:class:`memlm.ngram.generate.NgramStep`)."""
        for step in self.ngram_steps:
            step.set_prefix(tokens)

    def approximate(self) -> dict | None:
        """None when every ∞-gram step's P∞ was exact over the vocabulary; else the one index's note, or each
        index's that is not None by position (``reference 1``, ...)."""
        notes = {f"reference {i + 1}": a for i, s in enumerate(self.ngram_steps) if (a := s.approximate()) is not None}
        if len(self.ngram_steps) == 1:
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
        inputs = StepInputs(queries, lambda: [row.tolist() for row in input_ids.cpu()], lm.shape[-1], lm.device)
        return self.mixture.mix(lm, inputs).to(scores.dtype)


class KNNLogitsProcessor(MixtureLogitsProcessor):
    """:class:`MixtureLogitsProcessor` of one ``datastore`` (a datastore, plain or sharded, searched with its own
    index, or any memory with a ``key_spec``): ``(1 - λ) p_LM + λ p_kNN`` (Eq. 3) at each step. ``ngram``: ∞-gram
    steps (a :class:`memlm.ngram.generate.NgramStep`, a list of them, or a :class:`MixtureLogitsProcessor` of them)
    mixed in too, each with its own (λ_sparse, λ_dense), as ``memlm eval`` mixes them."""

    def __init__(self, model, datastore: DatastoreBase | Memory, config: RetrievalConfig | None = None, *,
                 index=None, record: bool = False, ngram=None, **options: Any) -> None:  # fmt: skip
        if isinstance(ngram, MixtureLogitsProcessor):
            ngram = ngram.steps
        ngrams = [] if ngram is None else list(ngram) if isinstance(ngram, list | tuple) else [ngram]
        super().__init__(model, [datastore, *ngrams], None, config, index=index, record=record, **options)


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


def _split_options(options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``options`` of :func:`generate_text` into (decoding fields, retrieval fields)."""
    names = {f.name for f in dataclasses.fields(Decoding)}
    return {k: v for k, v in options.items() if k in names}, {k: v for k, v in options.items() if k not in names}


@torch.inference_mode()
def generate_text(
    model,
    tokenizer,
    prompts: Sequence[str] | Sequence[Sequence[int]],
    memories: Any = None,
    config: RetrievalConfig | None = None,
    decoding: Decoding | None = None,
    *,
    mixture: Any = None,
    streamer=None,
    processor: MixtureLogitsProcessor | None = None,
    **options: Any,
) -> list[str]:
    """Continue each prompt (strings or token-id lists) from the mixture of the LM and ``memories`` (the bare LM
    when there are none).

    ``memories``: one list (or one memory) of datastores, memories with a ``key_spec`` and ∞-gram indexes
    (:class:`MixtureLogitsProcessor`; ``datastore=`` is one more, first); ``mixture`` a fit (else the fixed-weight
    rule of their weights); ``config`` the retrieval settings (default ``RetrievalConfig()``: k =
    :data:`~memlm.core.config.DEFAULT_K`, as scoring and calibration), ``decoding``
    how to decode (:class:`Decoding`); ``options`` set fields of either by name (``k=8, lam=0.5, max_new_tokens=5,
    num_beams=4``), ``ngram_lambdas`` the ∞-grams' weights and ``index`` a loaded FAISS index of the first datastore.
    Prompts are left-padded into one batch. ``processor``: a :class:`MixtureLogitsProcessor` already made (then
    ``memories``, ``mixture`` and ``config`` are not used). Returns the generated text of each prompt (no prompt).
    """
    items = [] if memories is None else list(memories) if isinstance(memories, list | tuple) else [memories]
    if options.get("datastore") is not None:
        items.insert(0, options["datastore"])
    step_options = {k: options.pop(k) for k in ("datastore", "index", "ngram_lambdas") if k in options}
    decode_options, retrieval_options = _split_options(options)
    decoding = dataclasses.replace(decoding or Decoding(), **decode_options)
    config = RetrievalConfig.with_options(config, **retrieval_options)
    if streamer is not None and len(prompts) * decoding.num_beams != 1:
        raise MemlmError("streaming shows one sequence: pass one prompt and num_beams=1 to stream")
    if processor is None and items and mixture is None:
        from memlm.knnlm.default_mixture import library_default

        given = weights_given(config, step_options.get("ngram_lambdas"))
        mixture = library_default(model, tokenizer, items, given, config)  # no weights given: the stored fits
    if processor is None and items:
        processor = MixtureLogitsProcessor(model, items, mixture, config, index=step_options.get("index"),
                                           ngram_lambdas=step_options.get("ngram_lambdas"), default=False)  # fmt: skip
        if processor.mixture.lm_alone:  # every memory at weight 0 (λ = 0): the LM's own distribution
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
        for step in self.processor.steps:
            if isinstance(step, DatastoreStep) and step.datastore is self.lookup.datastore:
                return step.history
        return []

    def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
        print(text, file=self.out, flush=True, end="" if not stream_end else "\n")


def ngram_logits_processor(memories: Sequence, weights: Sequence[Sequence[float]]):
    """The generation step of the LM and the ∞-gram ``memories``, each with its ``(λ_sparse, λ_dense)`` in the
    fixed-weight rule (:func:`memlm.core.mixture.rule_mixture`): a
    :class:`MixtureLogitsProcessor` of :class:`memlm.ngram.step.NgramStep` s (also the ``ngram=`` of a
    :class:`KNNLogitsProcessor`, which mixes them with its datastore by one rule)."""
    from memlm.ngram.step import NgramStep

    if not memories:
        raise MemlmError("no ∞-gram memory to generate with")
    return MixtureLogitsProcessor(None, [NgramStep(m, w[0], w[1]) for m, w in zip(memories, weights, strict=True)])
