"""memlm as an lm-evaluation-harness model: any causal LM plus its memories, scored by EleutherAI's ``lm_eval``.

Every score is one :class:`memlm.core.mixture.Mixture` of the LM and its memories, per scored token::

    p(w | c) = sum_i λ_i(c) p_i(w | c),     i = lm, knn, knn2, ..., ngram, ngram2, ..., cache

    p_knn(w | c)   = sum_{(k_j, v_j) in top-k of the datastore} 1[v_j = w] softmax_j(s(h_ds(c), k_j) / τ)   (Eq. 2)
    p_cache(w | c) = the same over the evaluated sequence's own earlier (h, next token) pairs, temperature τc
    P∞(w | c)      = cnt(suffix · w) / cnt(suffix), the context's longest suffix found in the index (Liu et al. 2024)

Memories are one list (``memories=[...]``: datastores, plain or sharded, any memory with a ``key_spec``, ∞-gram
indexes; the older ``datastore=`` and ``ngram=`` are folded into it), named by kind and order
(:func:`memlm.mixing.inputs.component_name`). The weights λ(c) are:

- without a fit, the fixed-weight rule (:func:`memlm.core.mixture.rule_mixture`): each datastore's λ (Khandelwal et
  al. 2020, Eq. 3; given, else its calibration), the cache's λc (Grave et al. 2017c; Khandelwal et al., Table 1),
  each ∞-gram's λ_sparse where P∞ is sparse, λ_dense elsewhere (Liu et al. 2024, Sec. 5; given, one value or one
  per index, else its calibration), shared beside the others as ``memlm eval`` shares them; the LM takes the rest;
- with ``mixture=`` (``memlm tune --mixture gate --json FIT``: a
  :class:`memlm.mixing.dump.DumpMixture`), its gate ``λ(c) = softmax(W φ(c) + b)`` over each memory's
  features (:mod:`memlm.mixing.inputs`) at the τ, k and τc it was fitted with; a fit made for other memories
  is refused before anything is scored.

The three lm_eval request types:

- ``loglikelihood(context, continuation)``: ``sum_t log p(cont_t | context, cont_<t)`` and whether every
  continuation token is the argmax of ``p`` (the mixed distribution, not the bare LM's).
- ``loglikelihood_rolling(text)``: ``sum_t log p(x_t | x_<t)`` over the whole text, the first token predicted from
  a prefix token (BOS, else EOS; as lm_eval's ``hf`` model). Long texts go through memlm's sliding windows
  (:func:`memlm.data.windows.sliding_windows` + :func:`memlm.models.forward.forward_windows`): every window is
  ``window`` tokens and every scored token but those of the first window has at least ``min_context`` tokens of context,
  so the cost is linear in the text length. A text of at most ``window`` tokens is one forward pass.
- ``generate_until(context, gen_kwargs)``: greedy (or sampled) decoding from ``p`` through
  :class:`memlm.knnlm.generate.MixtureLogitsProcessor` over every memory (the fit, or the fixed-weight rule), stopped
  at any ``until`` string (the cache takes no part in generation: a fit made with the cache is refused there).

Several ∞-gram indexes come as ``ngram=[DIR1, DIR2]`` (or ``ngram=DIR1|DIR2`` in lm_eval's ``--model_args``), each
with its own weights (``ngram_lambda_sparse=[a, b]`` or ``a|b``; one value: every index); several datastores as
``memories=[DS1, DS2]`` with ``lam=[a, b]`` (one value: every datastore).

A request's context starts the ∞-gram's document (the suffix can reach back to its first token; the prefix token of
an empty context is not part of it). The ∞-gram reads the whole request even where the LM reads only its last
``max_length`` tokens (``loglikelihood``) or ``max_length - max_gen_toks`` (``generate_until``): the suffix search is
logarithmic in the context's length, so this costs little. Target log-probabilities use the exact counts
(:meth:`memlm.ngram.memory.NgramMemory.score_documents`); the greedy check of ``loglikelihood`` and generation read
P∞ over the vocabulary (:func:`memlm.ngram.generate.next_token_distribution`: exact counts of the 1,000 most frequent
next tokens, recounted where the engine samples past 1,000 occurrences); where that leaves some next tokens'
mass unassigned, ``memory_settings["approximate"]`` counts the requests it touched and says why.

With ``lam=0``, no cache and no ∞-gram, every score is the bare LM's: the memory term has weight 0 and adds exactly
nothing.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from tqdm.auto import tqdm

from memlm.core.config import DEFAULT_MIN_CONTEXT, DEFAULT_WINDOW, RetrievalConfig
from memlm.core.distribution import knn_distribution
from memlm.core.memory import Memory
from memlm.core.mixture import Mixture, rule_mixture, sparse_state_features
from memlm.errors import MemlmError
from memlm.knnlm.cache import continuous_cache
from memlm.knnlm.calibration import knn_parameters
from memlm.knnlm.evaluate import CACHE_KEY
from memlm.mixing.dump import DumpMixture
from memlm.mixing.inputs import component_name, lm_features, memory_logprob, ngram_features, retrieval_features
from memlm.mixing.step import load_fit
from memlm.models.forward import rolling_forward
from memlm.models.keys import KeyCapture, KeySpec, num_layers
from memlm.retrieval import as_memory, describe_memory
from memlm.storage.datastore import DatastoreBase
from memlm.storage.folder import artifact_kind
from memlm.storage.sharded import open_datastore

__all__ = ["MemlmLM"]


def _as_bool(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes", "on")
    return bool(value)


def _batch_size(value: Any) -> int:
    return 4 if str(value).startswith("auto") else int(value)  # lm_eval's "auto": 4, as before


def _per_index(value: Any) -> Any:
    """One value, or one per memory of a kind: a list, or from lm_eval's ``--model_args`` a string ``a|b``."""
    return value.split("|") if isinstance(value, str) and "|" in value else value


def _floats(value: Any) -> float | list[float]:
    value = _per_index(value)
    return [float(v) for v in value] if isinstance(value, list | tuple) else float(value)


def _as_list(value: Any) -> list:
    value = _per_index(value)
    return [] if value is None else list(value) if isinstance(value, list | tuple) else [value]


# lm_eval's model arguments by group, each with its type (values from the command line arrive as strings); lam and
# temperature: one value, or one per datastore
_RETRIEVAL_ARGUMENTS = {"lam": _floats, "temperature": _floats, "k": int, "nprobe": int, "cache": _as_bool,
                        "cache_lambda": float, "cache_temperature": float, "cache_k": int, "cache_max_len": int,
                        "window": int, "min_context": int}  # fmt: skip
_HARNESS_ARGUMENTS = {"max_length": int, "batch_size": _batch_size, "dtype": str, "prefix_token_id": int,
                      "max_gen_toks": int, "progress": _as_bool}  # fmt: skip
_NGRAM_ARGUMENTS = {"ngram_lambda_sparse": _floats, "ngram_lambda_dense": _floats, "ngram_max_n": int}
_ARGUMENTS = ("model", "datastore", "config", "ngram", "memories", "mixture", *_RETRIEVAL_ARGUMENTS,
              *_HARNESS_ARGUMENTS, *_NGRAM_ARGUMENTS)  # fmt: skip
_WEIGHT_ARGUMENTS = ("lam", "cache_lambda", "ngram_lambda_sparse", "ngram_lambda_dense")  # the rule's, not a fit's

LMEVAL_RETRIEVAL = RetrievalConfig(window=DEFAULT_WINDOW, min_context=DEFAULT_MIN_CONTEXT)
"""MemlmLM's defaults: every path's (k :data:`~memlm.core.config.DEFAULT_K` for scoring and generation, nprobe 32,
the cache, when on, at :data:`~memlm.core.config.DEFAULT_CACHE_LAMBDA`) and the windows 1024 / 512."""


def _settings(options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """MemlmLM's keyword ``options`` (lm_eval's ``--model_args``) as typed (retrieval, harness, ∞-gram) settings;
    an unknown name is refused with the known ones. ``None`` is left out (not set)."""
    unknown = sorted(set(options) - set(_ARGUMENTS))
    if unknown:
        raise MemlmError(f"unknown MemlmLM argument(s) {unknown}: use {', '.join(_ARGUMENTS)}")
    groups: list[dict[str, Any]] = [{}, {}, {}]
    for group, types in zip(groups, (_RETRIEVAL_ARGUMENTS, _HARNESS_ARGUMENTS, _NGRAM_ARGUMENTS), strict=True):
        for name, convert in types.items():
            if options.get(name) is not None:
                group[name] = convert(options[name])
    return groups[0], groups[1], groups[2]


def _split_memories(datastore: Any, ngram: Any, memories: Any, max_n: int | None) -> tuple[list, list]:
    """``(dense, ngram)``: each memory by kind, in order (``datastore=``'s, then ``ngram=``'s, then ``memories``).
    A folder of ``memories`` is opened as what it holds (a datastore, plain or sharded, or an ∞-gram index;
    :func:`memlm.storage.folder.artifact_kind`), one of ``datastore=`` / ``ngram=`` as that kind (another kind is
    refused, named); an open datastore, any memory with a ``key_spec``, an open
    :class:`memlm.ngram.memory.NgramMemory` or :class:`memlm.ngram.index.NgramIndex` is taken as it is."""
    dense, ngrams = [], []
    for kind, items in (("datastore", datastore), ("∞-gram index", ngram), (None, memories)):
        for item in _as_list(items):
            path = isinstance(item, str | Path)
            opened = type(item).__name__ in ("NgramMemory", "NgramIndex")  # without importing infini-gram
            if opened or (kind or (artifact_kind(item) if path else None)) == "∞-gram index":
                from memlm.ngram.memory import NgramMemory

                ngrams.append(item if isinstance(item, NgramMemory) else NgramMemory(item, max_n))
            elif path:
                dense.append(open_datastore(item))
            elif isinstance(item, DatastoreBase | Memory):
                dense.append(item)
            else:
                raise MemlmError(f"memories= holds a {type(item).__name__}: give datastore or ∞-gram index folders, "
                                 "open datastores, memories (search + key_spec) or NgramMemory objects")  # fmt: skip
    return dense, ngrams


def _fit_record(fit: DumpMixture) -> dict[str, Any]:
    """How a fit was made (its τ, k, τc, sizes, held-out log-likelihoods, warnings), for result files."""
    made = {k: v for k, v in fit.fit.to_dict().items() if k != "mixture"}  # the mixture is recorded beside it
    return {"temperature": fit.temperature, "k": fit.k, "cache_temperature": fit.cache_temperature, **made}


@dataclass
class _Dense:
    """A dense memory of the mixture (a datastore, plain or sharded, or any memory): its component name, what was
    given, what is searched, the rule's λ and τ, and where they came from."""

    name: str
    source: Any
    memory: Any
    lam: float | None
    temperature: float
    parameters_from: str | None

    @property
    def datastore(self) -> DatastoreBase | None:
        return self.source if isinstance(self.source, DatastoreBase) else getattr(self.source, "datastore", None)


@register_model("memlm")
class MemlmLM(TemplateLM):
    """An lm_eval ``LM`` over a memlm model mixed with its memories through one :class:`Mixture`.

    ``model`` is a named model (``memlm models``), a local folder or HF id, or an already loaded
    ``PreTrainedModel`` (then pass ``tokenizer``). ``memories`` is the list of memories (module docstring);
    ``datastore`` (a folder built by ``memlm datastore build`` with this model, or a memory) and ``ngram`` (∞-gram
    indexes) are added to it. ``lam`` / ``temperature`` / ``k`` / ``nprobe`` are Eq. 3's λ, τ, the number of
    neighbours and the IVF probes. ``cache=True`` adds the continuous cache with weight ``cache_lambda``. ``mixture``:
    a fitted mixture (module docstring) instead of the fixed weights. ``window`` and ``min_context`` are the sliding
    windows of ``loglikelihood_rolling``; ``max_length`` (default ``window``) caps the tokens of a ``loglikelihood``
    request (its context is cut on the left). From the lm_eval command line:
    ``--model memlm --model_args model=smollm2-135m,datastore=DIR,lam=0.25``.
    """

    def __init__(
        self,
        model: Any = "smollm2-135m",
        tokenizer: Any = None,
        datastore: str | Path | DatastoreBase | Memory | None = None,
        config: RetrievalConfig | None = None,
        *,
        ngram: Any = None,
        memories: Sequence[Any] | str | None = None,
        mixture: Any = None,
        **options: Any,
    ) -> None:
        super().__init__()
        retrieval, harness, ngram_options = _settings(options)
        weights = {"lam": retrieval.pop("lam", None), "temperature": retrieval.pop("temperature", None)}
        config = RetrievalConfig.with_options(config or LMEVAL_RETRIEVAL, **retrieval)
        self.fit = load_fit(mixture)
        given = [n for n in _WEIGHT_ARGUMENTS if (weights | retrieval | ngram_options).get(n) is not None]
        if self.fit is not None and given:
            raise MemlmError(f"mixture= gives the weights; {', '.join(given)} would be ignored: leave them out, or "
                             "drop mixture= to mix with the fixed weights")  # fmt: skip
        dense, ngrams = _split_memories(datastore, ngram, memories, ngram_options.get("ngram_max_n"))
        self.cache = config.cache
        default = self.fit is None and not given and len(dense) + len(ngrams) > 1 and not self.cache
        if self.fit is None and len(dense) + len(ngrams) == 1:
            from memlm.knnlm.default_mixture import stored_default

            self.fit = stored_default([*dense, *ngrams], bool(given), self.cache)  # one memory: its stored fit
            if self.fit is not None and self.fit.k is not None and retrieval.get("k") not in (None, self.fit.k):
                print(f"mixture: the fixed-weight rule instead: k={retrieval['k']} given, the stored fit was made "
                      f"with k={self.fit.k}", file=sys.stderr)  # fmt: skip
                self.fit = None
        self.ngram_names = [component_name("ngram", r) for r in range(len(ngrams))]
        self.components = ("lm", *(component_name("knn", r) for r in range(len(dense))), *self.ngram_names,
                           *(["cache"] if self.cache else []))  # fmt: skip
        self._check_fit()  # before the model loads
        if isinstance(model, str | Path):
            from memlm.models.resources import load_causal_lm

            model, tokenizer = load_causal_lm(str(model), dtype=harness.get("dtype", "auto"))
        elif tokenizer is None:
            raise MemlmError("MemlmLM got a loaded model but no tokenizer: pass tokenizer= as well")
        self.model, self.tokenizer = model.eval(), tokenizer
        if default:  # several memories, no weights given: their stored fits combined and checked on their slices
            from memlm.knnlm.default_mixture import library_default

            self.fit = library_default(model, tokenizer, [*dense, *ngrams], False, config)
            self._check_fit()
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        config = self._open_dense(dense, config, weights, retrieval.get("k"))
        self.window, self.min_context = int(config.window or DEFAULT_WINDOW), int(config.min_context or 0)
        if self.window < 2 or not 1 <= self.min_context < self.window:
            raise MemlmError(
                f"window={self.window} and min_context={self.min_context}: "
                "need window >= 2 and 1 <= min_context < window"
            )
        self._approximate: dict[str, dict[str, Any]] = {}  # what was approximate, by request type (memory_settings)
        self.ngrams, self.ngram_weights = self._open_ngrams(ngrams, ngram_options)
        self.mixture = self._make_mixture()
        max_length = harness.get("max_length")
        self._max_length = int(max_length) if max_length is not None else self.window
        self.batch_size = harness.get("batch_size", 4)
        self._max_gen_toks = harness.get("max_gen_toks", 256)
        self.progress = harness.get("progress", False)
        self._open_memories()
        bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else self.eot_token_id
        prefix_token_id = harness.get("prefix_token_id")
        self._prefix = int(prefix_token_id if prefix_token_id is not None else bos)  # an empty context's prefix
        pad = tokenizer.pad_token_id
        self.pad_id = int(pad) if pad is not None else int(self.eot_token_id)

    def _open_dense(self, sources: list, config: RetrievalConfig, weights: dict, k_given: int | None):
        """Each dense memory's λ and τ (given: one value or one per datastore; else its calibration, see
        :func:`memlm.knnlm.calibration.knn_parameters`; a fit: its τ and k), checked; returns the config that
        records them (one λ and τ per dense memory)."""
        from memlm.ngram.mixture import per_index_lambdas

        fit = self.fit if isinstance(self.fit, DumpMixture) else None
        k = config.k
        if fit is not None and fit.k is not None:
            if k_given is not None and k_given != fit.k:
                raise MemlmError(f"k={k_given}, but the mixture was fitted with k={fit.k}: leave k out (the fit's "
                                 "is used) or fit again with this k")  # fmt: skip
            k = fit.k
        lam = config.lam if weights["lam"] is None else weights["lam"]
        tau = config.temperature if weights["temperature"] is None else weights["temperature"]
        if not sources and lam:
            raise MemlmError(f"lam={lam} needs a datastore: pass datastore=DIR (or lam=0)")
        for name, value in (("lam", lam), ("temperature", tau)):
            if isinstance(value, list) and len(value) not in (1, len(sources)):
                raise MemlmError(f"{name} got {len(value)} values for {len(sources)} datastore(s): give one, or one "
                                 "per datastore")  # fmt: skip
        pairs = per_index_lambdas(lam, tau, len(sources), ("lam", "temperature")) if sources else []
        setting = {"k": k, "nprobe": config.nprobe, "search": "index"}  # a notice if calibrated otherwise
        self.dense = []
        for r, (source, (lam_r, tau_r)) in enumerate(zip(sources, pairs, strict=True)):
            name, origin = component_name("knn", r), None
            if fit is None:  # λ/τ not given: the datastore's calibrated values (memlm.knnlm.calibration)
                lam_r, tau_r, origin = knn_parameters(source, lam_r, tau_r, setting=setting)
            elif fit.temperature is not None:  # the fit's kNN τ: every datastore's
                tau_r, origin = fit.temperature, "the fitted mixture's"
            self.dense.append(_Dense(name, source, None, lam_r, 1.0 if tau_r is None else float(tau_r), origin))
        self.cache_lambda = float(config.cache_lambda) if self.cache and self.fit is None else 0.0
        lams = [float(d.lam or 0.0) for d in self.dense]
        over = sum(lams) + self.cache_lambda > 1.0 + 1e-9 and self.fit is None  # a fit's λ are its own
        if any(x < 0 for x in lams) or self.cache_lambda < 0 or over:
            raise MemlmError(f"lam={'|'.join(f'{x:g}' for x in lams) or 0} and cache_lambda={self.cache_lambda} must "
                             "be >= 0 and sum to at most 1")  # fmt: skip
        cache_temperature = config.cache_temperature
        if fit is not None and fit.cache_temperature is not None:
            cache_temperature = fit.cache_temperature
        taus = [d.temperature for d in self.dense]
        self.config = config.replace(lam=lams or None, temperature=taus or None, cache_lambda=self.cache_lambda, k=k,
                                     cache_temperature=cache_temperature)  # fmt: skip
        return self.config

    def _open_ngrams(self, memories: list, options: dict) -> tuple[list, list[tuple[float, float]]]:
        """The ∞-gram memories checked against the tokenizer (each index once) and each one's (λ_sparse, λ_dense)
        (given: one value or one per index; else its calibration; none with a fit)."""
        from memlm.ngram.mixture import ngram_parameters, per_index_lambdas

        if not memories:
            return [], []
        paths = [Path(m.index.path).resolve() for m in memories]
        if len(set(paths)) < len(paths):
            raise MemlmError(f"ngram= needs each ∞-gram index once, got {[str(p) for p in paths]}")
        for memory in memories:
            memory.index.check_tokenizer(self.tokenizer)
        if self.fit is not None:
            return memories, []
        given = per_index_lambdas(options.get("ngram_lambda_sparse"), options.get("ngram_lambda_dense"),
                                  len(memories), ("ngram_lambda_sparse", "ngram_lambda_dense"))  # fmt: skip
        weights = [ngram_parameters(m.index, *p, announce=False)[:2] for m, p in zip(memories, given, strict=True)]
        return memories, weights

    def _check_fit(self) -> None:
        """A fit made for other memories (other kinds, counts or cache) is refused, naming both."""
        if self.fit is None:
            return
        mixture = self.fit.mixture if isinstance(self.fit, DumpMixture) else self.fit
        if tuple(mixture.components) != self.components:
            raise MemlmError(
                f"the mixture mixes {', '.join(mixture.components)}; these memories give "
                f"{', '.join(self.components)}: give the memories it was fitted on (each datastore and ∞-gram "
                "index in the same order, the cache if it had one), or fit again with memlm tune --mixture gate"
            )

    def _make_mixture(self) -> Mixture:
        """The fit's mixture (:meth:`_check_fit`); else the fixed-weight rule of the weights (each datastore's λ,
        each ∞-gram's (λ_sparse, λ_dense), the cache's λc; shared as memlm eval shares them)."""
        if self.fit is not None:
            return self.fit.mixture if isinstance(self.fit, DumpMixture) else self.fit
        weights: dict[str, Any] = {d.name: float(d.lam or 0.0) for d in self.dense}
        weights.update(zip(self.ngram_names, self.ngram_weights, strict=True))
        if self.cache:
            weights["cache"] = self.cache_lambda
        return rule_mixture(self.components, weights)

    def _open_memories(self) -> None:
        """Each dense memory (a datastore, plain or sharded, on its own index, or any memory) checked against the
        model and opened for search, and the continuous cache: the key specs one forward pass must capture."""
        self.specs: list[KeySpec] = []
        for d in self.dense:
            check = getattr(d.source, "check_compatible", None)  # a datastore's: before its index is read
            if check is not None:
                check(self.model, self.tokenizer)
            d.memory = as_memory(d.source, self.config.nprobe)
            if d.memory.key_spec not in self.specs:
                self.specs.append(d.memory.key_spec)
        self.cache_spec = CACHE_KEY.normalized(num_layers(self.model)) if self.cache else None
        if self.cache_spec is not None and self.cache_spec not in self.specs:
            self.specs.append(self.cache_spec)

    @property
    def datastores(self) -> list[DatastoreBase]:
        """The datastores among the memories (their builds are what the leakage check reads)."""
        return [d.datastore for d in self.dense if d.datastore is not None]

    # ------------------------------------------------------------------------------------------- lm_eval plumbing

    @property
    def eot_token_id(self) -> int:
        if self.tokenizer.eos_token_id is None:
            raise MemlmError("the tokenizer has no EOS token; lm_eval needs one to end generations")
        return int(self.tokenizer.eos_token_id)

    @property
    def prefix_token_id(self) -> int:
        return self._prefix

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        """Token ids of ``string`` without special tokens (memlm never adds BOS; the prefix token does that job)."""
        return list(self.tokenizer(string, add_special_tokens=bool(add_special_tokens))["input_ids"])

    def tok_decode(self, tokens: Sequence[int], **kwargs: Any) -> str:
        return self.tokenizer.decode(list(tokens), skip_special_tokens=True)

    @property
    def memory_settings(self) -> dict[str, Any]:
        """What this LM mixes, for result files: ``memories``, each with its path and its rule weights (as given or
        calibrated, before the rule shares them: a datastore's λ, τ and where they came from, an ∞-gram index's
        λ_sparse, λ_dense, the cache's λc, τc), the settings every memory shares, and ``mixture``, the
        :class:`Mixture` every score went through (the weights used)."""
        fit = self.fit if isinstance(self.fit, DumpMixture) else None
        return {
            "k": self.config.k,
            "nprobe": self.config.nprobe,
            "window": self.window,
            "min_context": self.min_context,
            "max_length": self.max_length,
            "prefix_token_id": self.prefix_token_id,
            "memories": self._describe_memories(),
            "mixture": self.mixture.to_dict(),
            "mixture_fit": None if fit is None else _fit_record(fit),
            "approximate": dict(self._approximate) or None,
        }

    def _describe_memories(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for d in self.dense:
            where = {"path": str(d.datastore.path)} if d.datastore is not None else describe_memory(d.memory)
            out.append({"component": d.name, "kind": "datastore" if d.datastore is not None else "memory", **where,
                        "lambda": d.lam if self.fit is None else None, "temperature": d.temperature,
                        "parameters_from": d.parameters_from})  # fmt: skip
        for r, (name, m) in enumerate(zip(self.ngram_names, self.ngrams, strict=True)):
            pair = self.ngram_weights[r] if self.ngram_weights else (None, None)
            out.append({"component": name, "kind": "∞-gram index", "path": str(m.index.path),
                        "lambda_sparse": pair[0], "lambda_dense": pair[1]})  # fmt: skip
        if self.cache:
            out.append({"component": "cache", "kind": "continuous cache", "lambda": self.cache_lambda if
                        self.fit is None else None, "temperature": self.config.cache_temperature})  # fmt: skip
        return out

    def _note_approximate(self, kind: str, detail: dict[str, Any] | None) -> None:
        """Count a request of ``kind`` whose result rests on an approximate P∞ (``detail``: its reason)."""
        if detail is None:
            return
        rec = self._approximate.setdefault(kind, {"requests": 0, "max_missing_mass": 0.0})
        rec["requests"] += 1
        for x in detail.values() if "reason" not in detail else [detail]:
            rec["max_missing_mass"] = max(rec["max_missing_mass"], float(x["max_missing_mass"]))
            rec["reason"] = x["reason"]

    # ------------------------------------------------------------------------------------------- memories

    def _ngram_targets(self, doc: Sequence[int], positions: np.ndarray) -> list:
        """:class:`memlm.ngram.memory.NgramScores` (log P∞_r of the target, effective n, suffix count, sparse) of
        every index ``r`` for each ``doc[p]``, ``p`` in ``positions`` (exact counts)."""
        return [m.score_documents([np.asarray(doc, dtype=np.int64)], [positions]) for m in self.ngrams]

    def _ngram_full(self, doc: Sequence[int], targets: np.ndarray) -> list[torch.Tensor]:
        """``log P∞_r(. | doc[:t])`` ``[n, V]`` of every index ``r`` for each target offset ``t``; a row that
        leaves some mass unassigned is noted (:meth:`_note_approximate`)."""
        from memlm.ngram.generate import next_token_distribution

        contexts = [list(doc[:t]) for t in targets.tolist()]
        out, notes = [], {}
        for r, memory in enumerate(self.ngrams):
            dist, _, nt = next_token_distribution(memory, contexts, self.vocab_size)
            out.append(dist)
            if (a := nt.approximate()) is not None:
                notes[f"reference {r + 1}"] = a
        self._note_approximate("loglikelihood greedy flag", notes or None)
        return out

    def _ngram_document(self, request, ctx: Sequence[int], cont: Sequence[int]) -> list[int]:
        """The ∞-gram's document of a ``loglikelihood`` request: its whole context and continuation (not cut to
        ``max_length``), without the prefix token lm_eval puts as the context of an empty one."""
        strings = request[0] if isinstance(request[0], tuple | list) else None
        empty = strings is not None and len(strings) == 2 and strings[0] == "" and list(ctx) == [self.prefix_token_id]
        return [*([] if empty else ctx), *cont]

    def _retrieve(self, keys: dict[KeySpec, np.ndarray], targets: np.ndarray, rows: np.ndarray) -> list[tuple]:
        """``(name, scores, values, τ, log counts or None, is the cache)`` of each dense memory and the cache for the
        positions ``rows`` of one sequence.

        ``keys[spec]`` holds the key at every position of the sequence that predicts a token (``targets`` are those
        tokens); the cache of row ``n`` sees positions ``< n`` of the same sequence only.
        """
        out = []
        for d in self.dense:
            r = d.memory.search(keys[d.memory.key_spec][rows], self.config.k)
            out.append((d.name, r.scores, r.values, d.temperature, r.log_counts, False))
        if self.cache_spec is not None:
            c = self.config
            doc = np.zeros(len(targets), dtype=np.int32)
            cs, cv = continuous_cache(keys[self.cache_spec], targets, doc, c.cache_k, c.cache_max_len)
            out.append(("cache", cs[rows], cv[rows], c.cache_temperature, None, True))
        return out

    def _components(self, lm_target, lm_feats: dict, retrieved: list[tuple], targets: np.ndarray, ngram: list):
        """``(log p_i(target) [n] by component, features by name)``: the LM's, each retrieval's (Eq. 2 at its τ)
        and each ∞-gram's (exact counts), with their features (:mod:`memlm.mixing.inputs`) and the joint
        sparse state the rule reads (:func:`memlm.core.mixture.sparse_state_features`)."""
        logprobs = {"lm": torch.as_tensor(np.asarray(lm_target, dtype=np.float32))}
        features = dict(lm_feats)
        for name, scores, values, tau, counts, cache in retrieved:
            logprobs[name] = memory_logprob(scores, values, np.asarray(targets, dtype=np.int64), tau, None, counts)
            features.update(retrieval_features(name, scores, values, tau, None, counts, cache=cache))
        for name, r in zip(self.ngram_names, ngram, strict=True):
            logprobs[name] = torch.from_numpy(r.logprob)
            features.update(ngram_features(name, r.n, r.count, r.sparse))
        if ngram:
            features.update(sparse_state_features({n: r.sparse for n, r in zip(self.ngram_names, ngram, strict=True)}))
        return logprobs, features

    def _distributions(self, lm_full: torch.Tensor, retrieved: list[tuple], ngram_full: list) -> dict[str, Any]:
        """``log p_i(. | c)`` ``[n, V]`` by component (for the greedy check)."""
        out: dict[str, Any] = {"lm": lm_full}
        for name, scores, values, tau, counts, _ in retrieved:
            counts = None if counts is None else torch.from_numpy(counts)
            out[name] = knn_distribution(torch.from_numpy(scores), torch.from_numpy(values), lm_full.shape[-1], tau,
                                         counts)  # fmt: skip
        out.update(zip(self.ngram_names, ngram_full, strict=True))
        return out

    # ------------------------------------------------------------------------------------------- loglikelihood

    @torch.inference_mode()
    def _loglikelihood_tokens(
        self, requests: list[tuple[tuple[str, str], list[int], list[int]]], disable_tqdm: bool = False, **kwargs
    ) -> list[tuple[float, bool]]:
        """Score continuation tokens after their contexts; ``(sum log p, all greedy)`` per request.

        Each request's tokens are cut on the left to ``max_length``; requests are batched right-padded (causal
        attention never reads the padding on its right). ``log p`` of each target is :meth:`Mixture.mix` of the
        components' log-probabilities of it; the greedy flag reads the mixed distribution over the vocabulary.
        """
        results: list[tuple[float, bool]] = [(0.0, True)] * len(requests)
        order = sorted(range(len(requests)), key=lambda i: -len(requests[i][1]) - len(requests[i][2]))
        bar = tqdm(total=len(requests), desc="loglikelihood", disable=disable_tqdm or not self.progress)
        for start in range(0, len(order), self.batch_size):
            idx = order[start : start + self.batch_size]
            seqs, n_conts, docs = [], [], []
            for i in idx:
                _, ctx, cont = requests[i]
                if not cont:
                    raise MemlmError("an lm_eval request has an empty continuation: nothing to score")
                seqs.append((list(ctx) + list(cont))[-self.max_length :])
                n_conts.append(min(len(cont), len(seqs[-1]) - 1))
                docs.append(self._ngram_document(requests[i], ctx, cont) if self.ngrams else [])
            length = max(len(s) for s in seqs)
            ids = torch.full((len(seqs), length), self.pad_id, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for b, s in enumerate(seqs):
                ids[b, : len(s)] = torch.tensor(s)
                mask[b, : len(s)] = 1
            with KeyCapture(self.model, self.specs) as cap:
                out = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device), use_cache=False)
                captured = {s: cap.keys_by_spec[s] for s in self.specs}
            for b, i in enumerate(idx):
                seq, n = seqs[b], n_conts[b]
                positions = np.arange(len(seq) - 1 - n, len(seq) - 1)  # positions predicting the continuation
                targets = np.asarray(seq[1:], dtype=np.int64)  # target of every position 0 .. len-2
                lm_full = torch.log_softmax(out.logits[b, torch.from_numpy(positions)].float(), dim=-1).cpu()
                keys = {s: captured[s][b, : len(seq) - 1].float().cpu().numpy() for s in self.specs}
                results[i] = self._score_continuation(lm_full, keys, targets, positions, docs[b])
                self.cache_hook.add_partial("loglikelihood", requests[i][0], results[i])
            bar.update(len(idx))
        bar.close()
        return results

    def _score_continuation(self, lm_full, keys, targets: np.ndarray, positions: np.ndarray, doc) -> tuple[float, bool]:
        """``(sum log p, all greedy)`` of one request's continuation: the targets ``targets[positions]``, the LM's
        log-distribution ``lm_full [n, V]`` at them, the keys of the sequence, the ∞-gram's document ``doc``."""
        n = len(positions)
        tgt = torch.from_numpy(targets[positions])
        retrieved = self._retrieve(keys, targets, positions)
        ngram, ngram_full = [], []
        if self.ngrams:  # the same targets in the ∞-gram's (uncut) document
            at = np.arange(len(doc) - n, len(doc))
            ngram, ngram_full = self._ngram_targets(doc, at), self._ngram_full(doc, at)
        lm_target = lm_full.gather(-1, tgt[:, None]).squeeze(-1).numpy()
        logprobs, features = self._components(lm_target, lm_features(lm_full), retrieved, targets[positions], ngram)
        logp = self.mixture.mix(logprobs, features)
        mixed = self.mixture.mix(self._distributions(lm_full, retrieved, ngram_full), features)
        return float(logp.double().sum()), bool((mixed.argmax(-1) == tgt).all())

    # ------------------------------------------------------------------------------------------- rolling

    def rolling_token_logprobs(self, tokens: Sequence[int]) -> np.ndarray:
        """``log p(x_t | prefix, x_<t)`` for every token of ``tokens`` (float64 ``[n]``), through sliding windows.

        The stream ``[prefix] + tokens`` is cut by :func:`memlm.data.windows.sliding_windows` into windows of ``window``
        tokens advancing by ``window - min_context``; :func:`memlm.models.forward.forward_windows` gives each target's
        LM log-probability, its LM features and its queries, then the memories are attached and mixed
        (:meth:`Mixture.mix`). Linear in ``len(tokens)``.
        """
        if not len(tokens):
            return np.zeros(0)
        r = rolling_forward(
            self.model, [tokens], self.specs, self.window, self.min_context, self.batch_size, self.prefix_token_id,
            self.pad_id,
        )  # fmt: skip
        if len(r.targets) != len(tokens):
            raise MemlmError(f"internal error: {len(r.targets)} scored targets for {len(tokens)} tokens")
        if self.components == ("lm",):
            return r.lm_logprob.astype(np.float64)
        rows = np.arange(len(r.targets))
        memories = self._retrieve(r.keys, r.targets, rows) if self.specs else []
        ngram = self._ngram_targets(tokens, np.arange(len(tokens))) if self.ngrams else []
        lm_feats = {"lm_entropy": r.lm_entropy, "lm_max_logprob": r.lm_max_logprob}
        logprobs, features = self._components(r.lm_logprob, lm_feats, memories, r.targets, ngram)
        return self.mixture.mix(logprobs, features).double().numpy()

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Total log-likelihood of each request's text (``Instance.args == (text,)``), see
        :meth:`rolling_token_logprobs`."""
        out = []
        for req in tqdm(requests, desc="rolling", disable=disable_tqdm or not self.progress):
            (text,) = req.args
            total = float(self.rolling_token_logprobs(self.tok_encode(text)).sum())
            out.append(total)
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), total)
        return out

    # ------------------------------------------------------------------------------------------- generation

    def _shared_ngram_weights(self) -> list[tuple[float, float]]:
        """Each ∞-gram's (λ_sparse, λ_dense) as the rule mixes it (shared beside the datastore's λ and the cache's):
        its weight where every index is sparse and where none is (an index's weight depends on its own flag only)."""
        states = sparse_state_features({n: torch.tensor([True, False]) for n in self.ngram_names})
        w = self.mixture.log_weights(self.mixture.features_of(states, 2)).exp()
        return [(float(w[0, i]), float(w[1, i])) for i, c in enumerate(self.components) if c in self.ngram_names]

    def _generation_processor(self, prefix: Sequence[int] = ()) -> Any:
        """The generation step over every memory (:class:`memlm.knnlm.generate.MixtureLogitsProcessor`, one
        :class:`~memlm.core.mixture.Mixture` as ``memlm generate``'s), or None without memories: the fit, or the
        fixed-weight rule of each datastore's λ, τ and each ∞-gram's weights as loglikelihood shares them (the cache's
        share goes to the LM: generation has no cache). ``prefix``: the context's tokens cut off for the LM, which the
        ∞-grams still read."""
        from memlm.knnlm.generate import MixtureLogitsProcessor
        from memlm.mixing.step import DatastoreStep
        from memlm.ngram.step import NgramStep

        if self.fit is not None:
            if "cache" in self.mixture.components:
                raise MemlmError("generate_until has no continuous cache, and this mixture was fitted with one: fit "
                                 "one without --cache for generation tasks")  # fmt: skip
            memories = [d.memory for d in self.dense] + list(self.ngrams)
            processor = MixtureLogitsProcessor(self.model, memories, self.fit, self.config)
        else:
            steps: list = [DatastoreStep(d.memory, self.config.k, float(d.lam or 0.0), d.temperature)
                           for d in self.dense if d.lam]  # fmt: skip
            shared = self._shared_ngram_weights() if self.ngrams else []
            steps += [NgramStep(m, ls, ld) for m, (ls, ld) in zip(self.ngrams, shared, strict=True)]
            if not steps:
                return None
            processor = MixtureLogitsProcessor(self.model, steps, None, self.config)
        processor.set_prefix(prefix)
        return processor

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Decode from the interpolated distribution until one of ``gen_kwargs["until"]`` (or EOS) appears."""
        from memlm.knnlm.generate import generate_text

        out = []
        for req in tqdm(requests, desc="generate", disable=disable_tqdm or not self.progress):
            context, gen_kwargs = req.args
            kwargs = dict(gen_kwargs or {})
            until = kwargs.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            eos_text = self.tok_decode([self.eot_token_id])
            max_new = int(kwargs.pop("max_gen_toks", self.max_gen_toks))
            do_sample = bool(kwargs.pop("do_sample", False))
            temperature = float(kwargs.pop("temperature", 0.0) or 0.0)
            if temperature > 0:
                do_sample = True
            whole = self.tok_encode(context)
            ctx = whole[-max(1, self.max_length - max_new) :] or [self.prefix_token_id]
            processor = self._generation_processor(whole[: len(whole) - len(ctx)])
            text = generate_text(
                self.model,
                self.tokenizer,
                [ctx],
                config=self.config,
                max_new_tokens=max_new,
                do_sample=do_sample,
                sampling_temperature=temperature if do_sample else None,
                stop=[*until, eos_text] if eos_text else until,
                processor=processor,  # None: the LM alone
            )[0]
            if processor is not None and processor.ngram_steps:
                self._note_approximate("generate_until", processor.approximate())
            for stop in until:
                if stop and stop in text:
                    text = text.split(stop, 1)[0]
            out.append(text)
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
        return out
