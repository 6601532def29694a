"""memlm as an lm-evaluation-harness model: any causal LM plus its memories, scored by EleutherAI's ``lm_eval``.

Every score is the memory-augmented distribution of Khandelwal et al. (2020, Eq. 3), with the continuous cache of
Grave et al. (2017c) as an optional third component (Khandelwal et al., Table 1)::

    p(w | c) = (1 - λ - λc) p_LM(w | c) + λ p_kNN(w | c) + λc p_cache(w | c)

    p_kNN(w | c)   = sum_{(k_i, v_i) in top-k of the datastore} 1[v_i = w] softmax_i(s(h_ds(c), k_i) / τ)
    p_cache(w | c) = the same over the evaluated sequence's own earlier (h, next token) pairs, temperature τc

The three lm_eval request types:

- ``loglikelihood(context, continuation)``: ``sum_t log p(cont_t | context, cont_<t)`` and whether every
  continuation token is the argmax of ``p`` (the interpolated distribution, not the bare LM's).
- ``loglikelihood_rolling(text)``: ``sum_t log p(x_t | x_<t)`` over the whole text, the first token predicted from
  a prefix token (BOS, else EOS; as lm_eval's ``hf`` model). Long texts go through memlm's sliding windows
  (:func:`memlm.data.windows.sliding_windows` + :func:`memlm.models.forward.forward_windows`): every window is
  ``window`` tokens and every scored token but those of the first window has at least ``min_context`` tokens of context,
  so the cost is linear in the text length. A text of at most ``window`` tokens is one forward pass.
- ``generate_until(context, gen_kwargs)``: greedy (or sampled) decoding from ``p`` through
  :class:`memlm.knnlm.generate.KNNLogitsProcessor`, stopped at any ``until`` string.

With an ∞-gram index (``ngram=DIR``, Liu et al. 2024; :mod:`memlm.ngram`) P∞ joins as one more component whose
weight depends on the token: ``λ_∞(c) = λ_sparse`` where one token follows every occurrence of the context's longest
matching suffix, ``λ_dense`` elsewhere (``memlm eval``'s mixture)::

    p(w | c) = (1 - λ - λc - λ_∞(c)) p_LM + λ p_kNN + λc p_cache + λ_∞(c) P∞(w | c)

Several indexes (``ngram=[DIR1, DIR2]``, or ``ngram=DIR1|DIR2`` in lm_eval's ``--model_args``) each join with their
own pair of weights (``ngram_lambda_sparse=[a, b]`` or ``a|b``; one value: every index), as ``memlm eval --ngram A
--ngram B`` mixes them (:func:`memlm.ngram.mixture.multi_ngram_mixture`)::

    p(w | c) = (1 - λ - λc - Σ_r λ_r(c)) p_LM + λ p_kNN + λc p_cache + Σ_r λ_r(c) P∞_r(w | c)

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

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from tqdm.auto import tqdm

from memlm.core.config import DEFAULT_MIN_CONTEXT, DEFAULT_WINDOW, RetrievalConfig
from memlm.core.distribution import knn_distribution, mix_logprobs
from memlm.core.memory import Memory
from memlm.errors import MemlmError
from memlm.knnlm.cache import continuous_cache
from memlm.knnlm.calibration import knn_parameters
from memlm.knnlm.evaluate import CACHE_KEY, memory_logprob
from memlm.models.forward import rolling_forward
from memlm.models.keys import KeyCapture, KeySpec, num_layers
from memlm.retrieval import as_memory
from memlm.storage.datastore import DatastoreBase
from memlm.storage.sharded import open_datastore

__all__ = ["MemlmLM"]


def _one_or_all(values: list) -> Any:
    """A setting of one ∞-gram index as itself (as before several were taken), of several as the list."""
    return values[0] if len(values) == 1 else values


def _as_bool(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes", "on")
    return bool(value)


def _batch_size(value: Any) -> int:
    return 4 if str(value).startswith("auto") else int(value)  # lm_eval's "auto": 4, as before


def _per_index(value: Any) -> Any:
    """One value, or one per ∞-gram index: a list, or from lm_eval's ``--model_args`` a string ``a|b``."""
    return value.split("|") if isinstance(value, str) and "|" in value else value


def _floats(value: Any) -> float | list[float]:
    value = _per_index(value)
    return [float(v) for v in value] if isinstance(value, list | tuple) else float(value)


# lm_eval's model arguments by group, each with its type (values from the command line arrive as strings)
_RETRIEVAL_ARGUMENTS = {"lam": float, "temperature": float, "k": int, "nprobe": int, "cache": _as_bool,
                        "cache_lambda": float, "cache_temperature": float, "cache_k": int, "cache_max_len": int,
                        "window": int, "min_context": int}  # fmt: skip
_HARNESS_ARGUMENTS = {"max_length": int, "batch_size": _batch_size, "dtype": str, "prefix_token_id": int,
                      "max_gen_toks": int, "progress": _as_bool}  # fmt: skip
_NGRAM_ARGUMENTS = {"ngram_lambda_sparse": _floats, "ngram_lambda_dense": _floats, "ngram_max_n": int}
_ARGUMENTS = ("model", "datastore", "config", "ngram", *_RETRIEVAL_ARGUMENTS, *_HARNESS_ARGUMENTS, *_NGRAM_ARGUMENTS)

LMEVAL_RETRIEVAL = RetrievalConfig(window=DEFAULT_WINDOW, min_context=DEFAULT_MIN_CONTEXT, cache_lambda=0.1)
"""MemlmLM's defaults: scoring's (k 1024, nprobe 32, windows 1024 / 512); the cache, when on, weighs 0.1."""


def _settings(options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """MemlmLM's keyword ``options`` (lm_eval's ``--model_args``) as typed (retrieval, harness, ∞-gram) settings;
    an unknown name is refused with the known ones. ``None`` stays ``None`` (not set)."""
    unknown = sorted(set(options) - set(_ARGUMENTS))
    if unknown:
        raise MemlmError(f"unknown MemlmLM argument(s) {unknown}: use {', '.join(_ARGUMENTS)}")
    groups: list[dict[str, Any]] = [{}, {}, {}]
    for group, types in zip(groups, (_RETRIEVAL_ARGUMENTS, _HARNESS_ARGUMENTS, _NGRAM_ARGUMENTS), strict=True):
        for name, convert in types.items():
            if name in options:
                group[name] = None if options[name] is None else convert(options[name])
    return groups[0], groups[1], groups[2]


@register_model("memlm")
class MemlmLM(TemplateLM):
    """An lm_eval ``LM`` over a memlm model with a kNN-LM datastore and/or a continuous cache.

    ``model`` is a named model (``memlm models``), a local folder or HF id, or an already loaded
    ``PreTrainedModel`` (then pass ``tokenizer``). ``datastore`` is a folder built by ``memlm datastore build`` with
    this model; ``lam`` / ``temperature`` / ``k`` / ``nprobe`` are Eq. 3's λ, τ, the number of neighbours and the
    IVF probes. ``cache=True`` adds the continuous cache with weight ``cache_lambda``. ``window`` and
    ``min_context`` are the sliding windows of ``loglikelihood_rolling``; ``max_length`` (default ``window``) caps
    the tokens of a ``loglikelihood`` request (its context is cut on the left). From the lm_eval command line:
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
        **options: Any,
    ) -> None:
        super().__init__()
        retrieval, harness, ngram_options = _settings(options)
        config = RetrievalConfig.with_options(config or LMEVAL_RETRIEVAL, **retrieval)
        if isinstance(model, str | Path):
            from memlm.models.resources import load_causal_lm

            model, tokenizer = load_causal_lm(str(model), dtype=harness.get("dtype", "auto"))
        elif tokenizer is None:
            raise MemlmError("MemlmLM got a loaded model but no tokenizer: pass tokenizer= as well")
        self.model, self.tokenizer = model.eval(), tokenizer
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        source = open_datastore(datastore) if isinstance(datastore, str | Path) else datastore  # or any memory
        self.datastore = source if isinstance(source, DatastoreBase) else getattr(source, "datastore", None)
        self.cache = config.cache
        self.parameters_from = None
        lam, temperature = config.lam, config.temperature
        if source is not None:  # λ/τ not given: the datastore's calibrated values (memlm.knnlm.calibration)
            setting = {"k": config.k, "nprobe": config.nprobe, "search": "index"}  # a notice if calibrated otherwise
            lam, temperature, self.parameters_from = knn_parameters(source, lam, temperature, setting=setting)
        self.lam = float(lam) if lam is not None else 0.0
        self.cache_lambda = float(config.cache_lambda) if self.cache else 0.0
        if source is None and self.lam:
            raise MemlmError(f"lam={self.lam} needs a datastore: pass datastore=DIR (or lam=0)")
        if not 0.0 <= self.lam + self.cache_lambda <= 1.0 or self.lam < 0 or self.cache_lambda < 0:
            raise MemlmError(f"lam={self.lam} and cache_lambda={self.cache_lambda} must be >= 0 and sum to at most 1")
        self.temperature = 1.0 if temperature is None else float(temperature)
        self.config = config.replace(lam=self.lam, temperature=self.temperature, cache_lambda=self.cache_lambda)
        self.window, self.min_context = int(config.window or DEFAULT_WINDOW), int(config.min_context or 0)
        if self.window < 2 or not 1 <= self.min_context < self.window:
            raise MemlmError(
                f"window={self.window} and min_context={self.min_context}: "
                "need window >= 2 and 1 <= min_context < window"
            )
        self.ngrams, self.ngram_weights = [], []
        self._approximate: dict[str, dict[str, Any]] = {}  # what was approximate, by request type (memory_settings)
        if ngram is not None:
            self.ngrams, self.ngram_weights = self._open_ngrams(
                ngram,
                ngram_options.get("ngram_max_n"),
                ngram_options.get("ngram_lambda_sparse"),
                ngram_options.get("ngram_lambda_dense"),
            )
        max_length = harness.get("max_length")
        self._max_length = int(max_length) if max_length is not None else self.window
        self.batch_size = harness.get("batch_size", 4)
        self._max_gen_toks = harness.get("max_gen_toks", 256)
        self.progress = harness.get("progress", False)
        self._open_memories(source)
        bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else self.eot_token_id
        prefix_token_id = harness.get("prefix_token_id")
        self._prefix = int(prefix_token_id if prefix_token_id is not None else bos)  # an empty context's prefix
        pad = tokenizer.pad_token_id
        self.pad_id = int(pad) if pad is not None else int(self.eot_token_id)

    def _open_ngrams(self, ngram, max_n, lambda_sparse, lambda_dense) -> tuple[list, list[tuple[float, float]]]:
        """The ∞-gram memories (index folders or open :class:`NgramMemory`: one, a list, or ``DIR1|DIR2``) checked
        against the tokenizer, and each one's (λ_sparse, λ_dense) (given: one value or one per index; else its
        calibration) as ``memlm eval`` shares the weights beside the kNN term and the cache
        (:func:`memlm.ngram.mixture.shared_weights`)."""
        from memlm.ngram.memory import NgramMemory
        from memlm.ngram.mixture import ngram_parameters, per_index_lambdas, shared_weights

        sources = _per_index(ngram)
        sources = list(sources) if isinstance(sources, list | tuple) else [sources]
        memories = [s if isinstance(s, NgramMemory) else NgramMemory(s, max_n) for s in sources]
        paths = [Path(m.index.path).resolve() for m in memories]
        if not memories or len(set(paths)) < len(paths):
            raise MemlmError(f"ngram= needs each ∞-gram index once, got {[str(p) for p in paths]}")
        given = per_index_lambdas(lambda_sparse, lambda_dense, len(memories), ("ngram_lambda_sparse",
                                                                                "ngram_lambda_dense"))  # fmt: skip
        weights = []
        for memory, pair in zip(memories, given, strict=True):
            memory.index.check_tokenizer(self.tokenizer)
            weights.append(ngram_parameters(memory.index, *pair, announce=False)[:2])
        return memories, shared_weights(self.lam + self.cache_lambda, weights)

    def _open_memories(self, source) -> None:
        """The datastore (plain or sharded, on its own index) or memory searched, and the continuous cache: the key
        specs one forward pass must capture."""
        self.specs: list[KeySpec] = []
        self.index = self.memory = None
        if source is not None:
            check = getattr(source, "check_compatible", None)  # a datastore's: before its index is read
            if check is not None:
                check(self.model, self.tokenizer)
            self.memory = as_memory(source, self.config.nprobe)
            self.index = getattr(self.memory, "searcher", None)
            self.specs.append(self.memory.key_spec)
        self.cache_spec = CACHE_KEY.normalized(num_layers(self.model)) if self.cache else None
        if self.cache_spec is not None and self.cache_spec not in self.specs:
            self.specs.append(self.cache_spec)

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
        """What this LM interpolates, for result files."""
        return {
            "datastore": str(self.datastore.path) if self.datastore is not None else None,
            "lambda": self.lam,
            "temperature": self.temperature,
            "parameters_from": self.parameters_from,
            "k": self.config.k,
            "nprobe": self.config.nprobe,
            "cache": self.cache,
            "cache_lambda": self.cache_lambda,
            "cache_temperature": self.config.cache_temperature,
            "window": self.window,
            "min_context": self.min_context,
            "max_length": self.max_length,
            "prefix_token_id": self.prefix_token_id,
            "ngram": _one_or_all([str(m.index.path) for m in self.ngrams]) if self.ngrams else None,
            "ngram_lambda_sparse": _one_or_all([w[0] for w in self.ngram_weights or [(0.0, 0.0)]]),
            "ngram_lambda_dense": _one_or_all([w[1] for w in self.ngram_weights or [(0.0, 0.0)]]),
            "approximate": dict(self._approximate) or None,
        }

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

    def _weights(self) -> list[float]:
        """The mixture weights, LM first, then the datastore's and the cache's (those present)."""
        weights = [1.0 - self.lam - self.cache_lambda]
        if self.memory is not None:
            weights.append(self.lam)
        if self.cache:
            weights.append(self.cache_lambda)
        return weights

    def _ngram_targets(self, doc: Sequence[int], positions: np.ndarray) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(log P∞_r(doc[p] | doc[:p]), sparse_r)`` of every index ``r`` for each ``p`` in ``positions`` (exact
        counts)."""
        out = []
        for memory in self.ngrams:
            r = memory.score_documents([np.asarray(doc, dtype=np.int64)], [positions])
            out.append((torch.from_numpy(r.logprob), torch.as_tensor(r.sparse)))
        return out

    def _ngram_full(self, doc: Sequence[int], targets: np.ndarray) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(log P∞_r(. | doc[:t]) [n, V], sparse_r [n, 1])`` of every index ``r`` for each target offset ``t``;
        a row that leaves some mass unassigned is noted (:meth:`_note_approximate`)."""
        from memlm.ngram.generate import next_token_distribution

        contexts = [list(doc[:t]) for t in targets.tolist()]
        out, notes = [], {}
        for r, memory in enumerate(self.ngrams):
            dist, sparse, nt = next_token_distribution(memory, contexts, self.vocab_size)
            out.append((dist, sparse[:, None]))
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

    def _with_ngrams(self, comps: list[torch.Tensor], refs) -> torch.Tensor:
        """``comps`` (the LM, then the datastore's and the cache's log-probabilities) mixed with every ∞-gram
        ``refs`` (``(log P∞_r, sparse_r)``, each at its own (λ_sparse, λ_dense)): ``memlm eval``'s mixture."""
        from memlm.ngram.mixture import multi_ngram_mixture

        others = list(zip(comps[1:], self._weights()[1:], strict=True))
        return multi_ngram_mixture(comps[0], refs, self.ngram_weights, others=others)

    def _memories(self, keys: dict[KeySpec, np.ndarray], targets: np.ndarray, rows: np.ndarray) -> list[tuple]:
        """(scores, values, τ, log counts or None) of each memory for the positions ``rows`` of one sequence.

        ``keys[spec]`` holds the key at every position of the sequence that predicts a token (``targets`` are those
        tokens); the cache of row ``n`` sees positions ``< n`` of the same sequence only.
        """
        out = []
        if self.memory is not None:
            r = self.memory.search(keys[self.memory.key_spec][rows], self.config.k)
            out.append((r.scores, r.values, self.temperature, r.log_counts))
        if self.cache_spec is not None:
            c = self.config
            doc = np.zeros(len(targets), dtype=np.int32)
            cs, cv = continuous_cache(keys[self.cache_spec], targets, doc, c.cache_k, c.cache_max_len)
            out.append((cs[rows], cv[rows], self.config.cache_temperature, None))
        return out

    def _mixed_target_logprob(self, lm: np.ndarray, targets: np.ndarray, memories, ngram=None) -> torch.Tensor:
        """``log p(target)`` per position under the interpolation (Eq. 3; + cache; + each ∞-gram's
        ``(log P∞_r, sparse_r)``)."""
        comps = [torch.from_numpy(np.asarray(lm, dtype=np.float32))]
        for sc, val, tau, counts in memories:
            comps.append(memory_logprob(sc, val, np.asarray(targets, dtype=np.int64), tau, None, counts))
        if not ngram:
            return mix_logprobs(comps, self._weights())
        return self._with_ngrams(comps, ngram)

    def _mixed_distribution(self, lm_full: torch.Tensor, memories, ngram=None) -> torch.Tensor:
        """``log p(. | c)`` over the vocabulary, ``[n, V]`` (for greedy checks)."""
        comps = [lm_full]
        for sc, val, tau, counts in memories:
            counts = None if counts is None else torch.from_numpy(counts)
            comps.append(knn_distribution(torch.from_numpy(sc), torch.from_numpy(val), lm_full.shape[-1], tau, counts))
        if not ngram:
            return mix_logprobs(comps, self._weights())
        return self._with_ngrams(comps, ngram)

    # ------------------------------------------------------------------------------------------- loglikelihood

    @torch.inference_mode()
    def _loglikelihood_tokens(
        self, requests: list[tuple[tuple[str, str], list[int], list[int]]], disable_tqdm: bool = False, **kwargs
    ) -> list[tuple[float, bool]]:
        """Score continuation tokens after their contexts; ``(sum log p, all greedy)`` per request.

        Each request's tokens are cut on the left to ``max_length``; requests are batched right-padded (causal
        attention never reads the padding on its right).
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
                memories = self._memories(keys, targets, positions)
                full = target = None
                if self.ngrams:  # the same targets in the ∞-gram's (uncut) document
                    at = np.arange(len(docs[b]) - n, len(docs[b]))
                    full = self._ngram_full(docs[b], at)
                    target = self._ngram_targets(docs[b], at)
                mixed = self._mixed_distribution(lm_full, memories, full)
                tgt = torch.from_numpy(targets[positions])
                if target is None:
                    logp = mixed.gather(-1, tgt[:, None]).squeeze(-1)
                else:  # the target's P∞ from exact counts (the vocabulary-wide one may be sampled)
                    lm_t = lm_full.gather(-1, tgt[:, None]).squeeze(-1).numpy()
                    logp = self._mixed_target_logprob(lm_t, targets[positions], memories, target)
                greedy = bool((mixed.argmax(-1) == tgt).all())
                results[i] = (float(logp.double().sum()), greedy)
                self.cache_hook.add_partial("loglikelihood", requests[i][0], results[i])
            bar.update(len(idx))
        bar.close()
        return results

    # ------------------------------------------------------------------------------------------- rolling

    def rolling_token_logprobs(self, tokens: Sequence[int]) -> np.ndarray:
        """``log p(x_t | prefix, x_<t)`` for every token of ``tokens`` (float64 ``[n]``), through sliding windows.

        The stream ``[prefix] + tokens`` is cut by :func:`memlm.data.windows.sliding_windows` into windows of ``window``
        tokens advancing by ``window - min_context``; :func:`memlm.models.forward.forward_windows` gives each target's
        LM log-probability and its queries, then the memories are attached. Linear in ``len(tokens)``.
        """
        if not len(tokens):
            return np.zeros(0)
        lm_lp, tgt, _, all_keys = rolling_forward(
            self.model, [tokens], self.specs, self.window, self.min_context, self.batch_size, self.prefix_token_id,
            self.pad_id,
        )  # fmt: skip
        if len(tgt) != len(tokens):
            raise MemlmError(f"internal error: {len(tgt)} scored targets for {len(tokens)} tokens")
        if not self.specs and not self.ngrams:
            return lm_lp.astype(np.float64)
        memories = self._memories(all_keys, tgt, np.arange(len(tgt))) if self.specs else []
        ngram = self._ngram_targets(tokens, np.arange(len(tokens))) if self.ngrams else None
        return self._mixed_target_logprob(lm_lp, tgt, memories, ngram).double().numpy()

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

    def _ngram_processor(self, prefix: Sequence[int] = ()) -> tuple[Any, Any]:
        """``(processor, ∞-gram step)``: the generation step with the ∞-gram(s) (and the datastore when there is one),
        as ``memlm generate``'s; ``prefix``: the context's tokens cut off for the LM, which the ∞-gram still reads."""
        from memlm.knnlm.generate import KNNLogitsProcessor
        from memlm.ngram.generate import ngram_logits_processor

        ngram = ngram_logits_processor(self.ngrams, self.ngram_weights)
        ngram.set_prefix(prefix)
        if self.memory is None or not self.lam:
            return ngram, ngram
        return KNNLogitsProcessor(self.model, self.memory, self.config, ngram=ngram), ngram

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
            processor, step = self._ngram_processor(whole[: len(whole) - len(ctx)]) if self.ngrams else (None, None)
            text = generate_text(
                self.model,
                self.tokenizer,
                [ctx],
                datastore=self.memory,
                config=self.config,
                max_new_tokens=max_new,
                do_sample=do_sample,
                sampling_temperature=temperature if do_sample else None,
                stop=[*until, eos_text] if eos_text else until,
                processor=processor,  # None: the datastore's
            )[0]
            if step is not None:
                self._note_approximate("generate_until", step.approximate())
            for stop in until:
                if stop and stop in text:
                    text = text.split(stop, 1)[0]
            out.append(text)
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
        return out
