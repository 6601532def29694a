"""Generation from a kNN-LM: a ``transformers`` LogitsProcessor that replaces the LM's next-token distribution by Eq. 3.

    p(w | c) = (1 - λ) p_LM(w | c) + λ p_kNN(w | c)
    p_kNN(w | c) = sum_{(k_i, v_i) in top-k} 1[v_i = w] softmax_i(s(h_ds(c), k_i) / τ)     (Khandelwal et al. 2020)

Usage::

    with KNNLogitsProcessor(model, datastore, k=64, lam=0.25) as knn:
        out = model.generate(**inputs, logits_processor=[knn], do_sample=True)

The processor hooks the model (the datastore's key role) while the ``with`` block is open, reads the query of the
newest position of every row at each step, searches the datastore and returns interpolated log-probabilities as the
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

from memlm.core.config import GENERATION_RETRIEVAL, RetrievalConfig
from memlm.core.distribution import interpolate, knn_distribution
from memlm.core.memory import Memory
from memlm.errors import MemlmError
from memlm.models.keys import KeyCapture
from memlm.retrieval import as_memory
from memlm.storage.datastore import Datastore, DatastoreBase

__all__ = [
    "Decoding",
    "KNNLogitsProcessor",
    "generate_text",
    "NeighbourStreamer",
    "SourceLookup",
    "Neighbour",
]


class KNNLogitsProcessor(LogitsProcessor):
    """Interpolate each generation step's distribution with the kNN distribution from ``datastore`` (Eq. 2-3): a
    datastore (plain or sharded, searched with its own index) or any memory with a ``key_spec``
    (:func:`memlm.retrieval.as_memory`; λ, τ then given or the defaults).

    ``config`` (:class:`memlm.core.config.RetrievalConfig`; default :data:`GENERATION_RETRIEVAL`, k = 64) gives k, λ, τ
    and nprobe (λ, τ None: the datastore's calibrated values); ``options`` set its fields by name (``k=8, lam=0.5``).
    ``record=True`` keeps, for every call, the ``(scores, ids)`` of the retrieved entries (``[rows, k]``) in
    ``history`` (used to show where a generated token came from). ``index`` reuses an already loaded FAISS index.
    ``ngram`` (a :class:`memlm.ngram.generate.NgramLogitsProcessor`) adds the ∞-gram as a third component, as
    ``memlm eval`` mixes them: ``(1 - λ - λ_∞(c)) p_LM + λ p_kNN + λ_∞(c) P∞`` (λ_∞ = λ_sparse or λ_dense per step);
    a :class:`memlm.ngram.generate.MultiNgramLogitsProcessor` adds several, each with its own λ_r(c).
    """

    def __init__(
        self,
        model,
        datastore: DatastoreBase | Memory,
        config: RetrievalConfig | None = None,
        *,
        index=None,
        record: bool = False,
        ngram=None,
        **options: Any,
    ) -> None:
        from memlm.knnlm.calibration import knn_parameters

        config = RetrievalConfig.with_options(config or GENERATION_RETRIEVAL, **options)
        self.model, self.config = model, config
        self.memory = as_memory(datastore, config.nprobe, index)  # a datastore (its own index) or any memory
        self.datastore = getattr(self.memory, "datastore", None)  # where calibrated λ, τ are recorded
        lam, temperature, _ = knn_parameters(self.memory, config.lam, config.temperature, announce=False)
        self.k, self.lam, self.temperature = config.k, lam, temperature  # λ, τ: given, else calibrated
        self._capture = KeyCapture(model, [self.memory.key_spec])
        self.record = record
        self.history: list[tuple[np.ndarray, np.ndarray]] = []
        self.ngram = ngram
        if ngram is not None and lam + ngram.max_weight > 1 + 1e-9:  # weights scaled to fit can round past 1
            raise MemlmError(
                f"λ {lam} + λ_∞ {ngram.max_weight} exceed 1: the LM's weight "
                "1 - λ - λ_∞ would be negative; give smaller weights"
            )

    def __enter__(self) -> KNNLogitsProcessor:
        self._capture.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._capture.__exit__(*exc)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        keys = self._capture.keys_by_spec[self.memory.key_spec]
        if keys is None:
            raise RuntimeError("KNNLogitsProcessor must be used inside its `with` block")
        if keys.shape[0] != scores.shape[0]:
            raise RuntimeError(f"hooked {keys.shape[0]} rows but got scores for {scores.shape[0]}")
        query = keys[:, -1].float().cpu().numpy()  # [rows, D]: each row's newest position (left padding)
        r = self.memory.search(query, self.k)
        r_scores, r_values, counts = r.tensors()
        if self.record:
            self.history.append((r_scores.numpy().copy(), torch.as_tensor(r.ids).numpy().copy()))
        lm = torch.log_softmax(scores.float(), dim=-1)
        knn = knn_distribution(
            r_scores.to(lm.device), r_values.to(lm.device), lm.shape[-1], self.temperature,
            None if counts is None else counts.to(lm.device),
        )  # fmt: skip
        if self.ngram is None:
            return interpolate(lm, knn, self.lam).to(scores.dtype)
        return self.ngram.mix(input_ids, lm, knn, self.lam).to(scores.dtype)


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
    datastore: DatastoreBase | Memory | None = None,
    config: RetrievalConfig | None = None,
    decoding: Decoding | None = None,
    *,
    index=None,
    streamer=None,
    processor: KNNLogitsProcessor | None = None,
    **options: Any,
) -> list[str]:
    """Continue each prompt (strings or token-id lists) from the kNN-LM (bare LM when ``datastore`` is None).

    ``datastore``: a datastore or any memory (:class:`KNNLogitsProcessor`); ``config`` its retrieval settings
    (default :data:`GENERATION_RETRIEVAL`), ``decoding`` how to decode (:class:`Decoding`); ``options`` set fields of
    either by name (``k=8, lam=0.5, max_new_tokens=5, num_beams=4``). Prompts are left-padded into one batch.
    ``processor``: a :class:`KNNLogitsProcessor` already made (then ``datastore`` and ``config`` are not used).
    Returns the generated text of each prompt (no prompt).
    """
    decode_options, retrieval_options = _split_options(options)
    decoding = dataclasses.replace(decoding or Decoding(), **decode_options)
    config = RetrievalConfig.with_options(config or GENERATION_RETRIEVAL, **retrieval_options)
    if streamer is not None and len(prompts) * decoding.num_beams != 1:
        raise MemlmError("streaming shows one sequence: pass one prompt and num_beams=1 to stream")
    token_prompts = [
        list(tokenizer(p, add_special_tokens=False)["input_ids"]) if isinstance(p, str) else list(p) for p in prompts
    ]
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    ids, mask = left_pad(token_prompts, pad_id)
    device = next(model.parameters()).device
    ids, mask = ids.to(device), mask.to(device)
    processors: list[LogitsProcessor] = []
    if processor is None and datastore is not None:
        from memlm.knnlm.calibration import knn_parameters

        lam, temperature, _ = knn_parameters(datastore, config.lam, config.temperature, announce=False)
        if lam:
            config = config.replace(lam=lam, temperature=temperature)
            processor = KNNLogitsProcessor(model, datastore, config, index=index)
    if processor is not None:
        processors.append(processor)
    if decoding.do_sample and decoding.sampling_temperature not in (None, 1.0):
        processors.append(_Temperature(float(decoding.sampling_temperature)))
    kwargs: dict[str, Any] = {
        "max_new_tokens": decoding.max_new_tokens,
        "do_sample": decoding.do_sample,
        "num_beams": decoding.num_beams,
        "pad_token_id": pad_id,
        "eos_token_id": tokenizer.eos_token_id,
        # no warpers of the model's generation config: they would run before the kNN interpolation
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
    distribution of the processor's latest call.
    """

    def __init__(
        self,
        tokenizer,
        processor: KNNLogitsProcessor | None = None,
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
        if self.processor.history:
            sc, ids = self.processor.history[-1]
            for nb in self.lookup.neighbours(sc[0], ids[0], self.n_neighbours):
                print(f"    {nb.describe()}", file=self.out, flush=True)
        return None

    def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
        print(text, file=self.out, flush=True, end="" if not stream_end else "\n")
