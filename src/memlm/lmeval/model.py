"""memlm as an lm-evaluation-harness model: any causal LM plus its memories, scored by EleutherAI's ``lm_eval``.

Every score is one :class:`memlm.core.mixture.Mixture` of the LM and its memories, per scored token::

    p(w | c) = sum_i λ_i(c) p_i(w | c),     i = lm, knn, knn2, ..., ngram, ngram2, ..., cache

    p_knn(w | c)   = sum_{(k_j, v_j) in top-k of the datastore} 1[v_j = w] softmax_j(s(h_ds(c), k_j) / τ)   (Eq. 2)
    p_cache(w | c) = the same over the evaluated sequence's own earlier (h, next token) pairs, temperature τc
    P∞(w | c)      = cnt(suffix · w) / cnt(suffix), the context's longest suffix found in the index (Liu et al. 2024)

Memories are one spec string or list (``memories=``, :func:`memlm.knnlm.memories.open_memories`:
``knn:DIR?k=64&temperature=2;ngram:DIR;cache``), named by kind and order
(:func:`memlm.mixing.component.component_names`); each one's k and τ are its own. The weights λ(c) are one
:class:`memlm.core.mixture.Mixture` (``mixture=``, :func:`memlm.knnlm.default_mixture.resolve_mixture`):

- fixed weights, ``mixture=knn=0.25;ngram=0.5/0.1;cache=0.1`` or a :class:`~memlm.core.mixture.Mixture`
  (:func:`memlm.mixing.weights.fixed_mixture`): the fixed-weight rule (:func:`memlm.core.mixture.rule_mixture`),
  each datastore's λ (Khandelwal et al. 2020, Eq. 3), the cache's λc (Grave et al. 2017c; Khandelwal et al.,
  Table 1), each ∞-gram's λ_sparse where P∞ is sparse, λ_dense elsewhere (Liu et al. 2024, Sec. 5); the LM takes
  the rest;
- a fit (``mixture=FIT.json``, from ``memlm tune --json``: a
  :class:`memlm.mixing.dump.DumpMixture`): its gate ``λ(c) = softmax(W φ(c) + b)`` over each memory's features
  (:mod:`memlm.mixing.inputs`) at the τ, k and τc it was fitted with; a fit made for other memories is refused
  before the model loads;
- none (or ``mixture=stored``): the memories' stored fits (:mod:`memlm.knnlm.default_mixture`), else the
  fixed-weight rule of their calibrated weights.

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

Several datastores or ∞-gram indexes are several memories of the spec (``knn:DS1;knn:DS2``), each with its own
weight (``mixture=knn=0.2;knn2=0.1``).

A request's context starts the ∞-gram's document (the suffix can reach back to its first token; the prefix token of
an empty context is not part of it). The ∞-gram reads the whole request even where the LM reads only its last
``max_length`` tokens (``loglikelihood``) or ``max_length - max_gen_toks`` (``generate_until``): the suffix search is
logarithmic in the context's length, so this costs little. Target log-probabilities use the exact counts
(:meth:`memlm.ngram.memory.NgramMemory.score_documents`); the greedy check of ``loglikelihood`` and generation read
P∞ over the vocabulary (:func:`memlm.ngram.generate.next_token_distribution`: exact counts of the 1,000 most frequent
next tokens, recounted where the engine samples past 1,000 occurrences); where that leaves some next tokens'
mass unassigned, ``memory_settings["approximate"]`` counts the requests it touched and says why.

With ``mixture=knn=0``, no cache and no ∞-gram, every score is the bare LM's: the memory term has weight 0 and adds
exactly nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from tqdm.auto import tqdm

from memlm.core.config import DEFAULT_MIN_CONTEXT, DEFAULT_WINDOW
from memlm.core.distribution import knn_distribution
from memlm.core.mixture import Mixture, rule_mixture, sparse_state_features
from memlm.errors import MemlmError
from memlm.knnlm.cache import continuous_cache
from memlm.knnlm.default_mixture import resolve_mixture
from memlm.knnlm.memories import memory_spec, open_memories
from memlm.mixing.component import component_names
from memlm.mixing.dump import DumpMixture
from memlm.mixing.inputs import lm_features, memory_logprob, ngram_features, retrieval_features
from memlm.models.forward import right_pad, rolling_forward
from memlm.models.keys import KeyCapture, KeySpec, num_layers
from memlm.storage.datastore import DatastoreBase

__all__ = ["MemlmLM"]


def _as_bool(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes", "on")
    return bool(value)


def _batch_size(value: Any) -> int:
    return 4 if str(value).startswith("auto") else int(value)  # lm_eval's "auto": 4, as before


# lm_eval's model arguments besides model, tokenizer, memories and mixture, each with its type (values from the
# command line arrive as strings)
_ARGUMENTS = {"window": int, "min_context": int, "max_length": int, "batch_size": _batch_size, "dtype": str,
              "prefix_token_id": int, "max_gen_toks": int, "progress": _as_bool}  # fmt: skip
_MOVED = {"datastore": "memories=knn:DIR", "ngram": "memories=ngram:DIR", "config": "memories= and mixture=",
          "k": "memories=knn:DIR?k=N", "nprobe": "memories=knn:DIR?nprobe=N",
          "temperature": "memories=knn:DIR?temperature=T", "cache": "memories=...;cache",
          "cache_temperature": "memories=...;cache?temperature=T", "cache_k": "memories=...;cache?k=N",
          "cache_max_len": "memories=...;cache?max_len=N", "ngram_max_n": "memories=ngram:DIR?max_n=N",
          "lam": "mixture=knn=λ", "cache_lambda": "mixture=...;cache=λ",
          "ngram_lambda_sparse": "mixture=ngram=λ_sparse/λ_dense",
          "ngram_lambda_dense": "mixture=ngram=λ_sparse/λ_dense"}  # fmt: skip


def _settings(options: dict[str, Any]) -> dict[str, Any]:
    """MemlmLM's keyword ``options`` (lm_eval's ``--model_args``) as typed settings; a memory or weight argument of
    older versions is refused naming its key now (``memories=``, ``mixture=``), an unknown name with the known ones.
    ``None`` is left out (not set)."""
    moved = sorted(set(options) & set(_MOVED))
    if moved:
        raise MemlmError(f"MemlmLM takes its memories as memories= (one spec string or list) and their weights as "
                         f"mixture=: instead of {', '.join(f'{m}=' for m in moved)} give "
                         f"{'; '.join(dict.fromkeys(_MOVED[m] for m in moved))}")  # fmt: skip
    unknown = sorted(set(options) - set(_ARGUMENTS))
    if unknown:
        known = ", ".join(["model", "tokenizer", "memories", "mixture", *_ARGUMENTS])
        raise MemlmError(f"unknown MemlmLM argument(s) {unknown}: use {known}")
    return {name: convert(options[name]) for name, convert in _ARGUMENTS.items() if options.get(name) is not None}


def _fit_record(fit: DumpMixture) -> dict[str, Any]:
    """How a fit was made (its τ, k, τc, sizes, held-out log-likelihoods, warnings), for result files."""
    made = {k: v for k, v in fit.fit.to_dict().items() if k != "mixture"}  # the mixture is recorded beside it
    return {"temperature": fit.temperature, "k": fit.k, "cache_temperature": fit.cache_temperature, **made}


@dataclass
class _Dense:
    """A dense memory of the mixture (a datastore, plain or sharded, or any memory): its component name, what is
    searched, its k and τ."""

    name: str
    memory: Any
    k: int
    temperature: float

    @property
    def datastore(self) -> DatastoreBase | None:
        return getattr(self.memory, "datastore", None)


@register_model("memlm")
class MemlmLM(TemplateLM):
    """An lm_eval ``LM`` over a memlm model mixed with its memories through one :class:`Mixture`.

    ``model`` is a named model (``memlm models``), a local folder or HF id, or an already loaded
    ``PreTrainedModel`` (then pass ``tokenizer``). ``memories``: one spec string or list
    (:func:`memlm.knnlm.memories.open_memories`: datastores, ∞-gram indexes, the cache, with their k and τ);
    ``mixture``: the weights (:func:`memlm.knnlm.default_mixture.resolve_mixture`: a fit's JSON file, ``stored``,
    fixed weights ``knn=0.25;ngram=0.5/0.1`` or a :class:`Mixture`; None: the memories' stored fits). ``window`` and
    ``min_context`` are the sliding windows of ``loglikelihood_rolling``; ``max_length`` (default ``window``) caps
    the tokens of a ``loglikelihood`` request (its context is cut on the left). From the lm_eval command line:
    ``--model memlm --model_args model=smollm2-135m,memories=knn:DIR?k=64,mixture=knn=0.25``.
    """

    def __init__(self, model: Any = "smollm2-135m", tokenizer: Any = None, memories: Any = None, mixture: Any = None,
                 **options: Any) -> None:  # fmt: skip
        super().__init__()
        harness = _settings(options)
        components = open_memories(memories)
        found = None if mixture is None else resolve_mixture(components, mixture)  # checked before the model loads
        if isinstance(model, str | Path):
            from memlm.models.resources import load_causal_lm

            model, tokenizer = load_causal_lm(str(model), dtype=harness.get("dtype", "auto"))
        elif tokenizer is None:
            raise MemlmError("MemlmLM got a loaded model but no tokenizer: pass tokenizer= as well")
        self.model, self.tokenizer = model.eval(), tokenizer
        for c in components:
            c.check_compatible(model, tokenizer)
        found = found or resolve_mixture(components, None, model, tokenizer)  # the stored fits, else the rule
        self.fit, self.mixture = found.fit, found.mixture
        self._open(found.components)
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.window = int(harness.get("window", DEFAULT_WINDOW))
        self.min_context = int(harness.get("min_context", DEFAULT_MIN_CONTEXT))
        if self.window < 2 or not 1 <= self.min_context < self.window:
            raise MemlmError(
                f"window={self.window} and min_context={self.min_context}: "
                "need window >= 2 and 1 <= min_context < window"
            )
        self._approximate: dict[str, dict[str, Any]] = {}  # what was approximate, by request type (memory_settings)
        max_length = harness.get("max_length")
        self._max_length = int(max_length) if max_length is not None else self.window
        self.batch_size = harness.get("batch_size", 4)
        self._max_gen_toks = harness.get("max_gen_toks", 256)
        self.progress = harness.get("progress", False)
        bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else self.eot_token_id
        prefix_token_id = harness.get("prefix_token_id")
        self._prefix = int(prefix_token_id if prefix_token_id is not None else bos)  # an empty context's prefix
        pad = tokenizer.pad_token_id
        self.pad_id = int(pad) if pad is not None else int(self.eot_token_id)

    def _open(self, components: list) -> None:
        """The memories by kind (each datastore's memory, k and τ; each ∞-gram index; the cache) and the key specs
        one forward pass must capture."""
        names = component_names(components)
        self.memory_components, self.components = components, names
        kinds = {c.kind for c in components} - {"knn", "ngram", "cache"}
        if kinds:
            raise MemlmError(f"MemlmLM mixes datastores, ∞-gram indexes and the cache; not {', '.join(sorted(kinds))}")
        self.dense = [_Dense(n, c.memory, c.k, c.temperature)
                      for n, c in zip(names[1:], components, strict=True) if c.kind == "knn"]  # fmt: skip
        pairs = [(n, c) for n, c in zip(names[1:], components, strict=True) if c.kind == "ngram"]
        self.ngram_names, self.ngrams = [n for n, _ in pairs], [c.memory for _, c in pairs]
        paths = [Path(m.index.path).resolve() for m in self.ngrams]
        if len(set(paths)) < len(paths):
            raise MemlmError(f"memories= needs each ∞-gram index once, got {[str(p) for p in paths]}")
        caches = [c for c in components if c.kind == "cache"]
        self.cache = caches[0] if caches else None
        self.specs: list[KeySpec] = list(dict.fromkeys(d.memory.key_spec for d in self.dense))
        self.cache_spec = None if self.cache is None else self.cache.key_spec.normalized(num_layers(self.model))
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
        """What this LM mixes, for result files: ``memories``, the memory spec string
        (:func:`memlm.knnlm.memories.memory_spec`: each memory's kind, path, k and τ), ``components``, each one's
        description, the windows, and ``mixture``, the :class:`Mixture` every score went through (the weights
        used), with ``mixture_fit``, how a fit was made."""
        return {
            "memories": memory_spec(self.memory_components),
            "components": [
                {"component": n, **c.describe()}
                for n, c in zip(self.components[1:], self.memory_components, strict=True)
            ],  # fmt: skip
            "window": self.window,
            "min_context": self.min_context,
            "max_length": self.max_length,
            "prefix_token_id": self.prefix_token_id,
            "mixture": self.mixture.to_dict(),
            "mixture_fit": None if self.fit is None else _fit_record(self.fit),
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
            r = d.memory.search(keys[d.memory.key_spec][rows], d.k)
            out.append((d.name, r.scores, r.values, d.temperature, r.log_counts, False))
        if self.cache is not None:
            c = self.cache
            doc = np.zeros(len(targets), dtype=np.int32)
            cs, cv = continuous_cache(keys[self.cache_spec], targets, doc, c.k, c.max_len, c.metric)
            out.append(("cache", cs[rows], cv[rows], c.temperature, None, True))
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
            ids, mask = right_pad(seqs, self.pad_id)
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

    def _generation_mixture(self) -> Mixture:
        """The mixture of a generation step: this one, or without the cache (generation has none) its share given to
        the LM: each memory keeps the weight it has here in every joint sparse state of the ∞-grams (the fixed-weight
        rule over the others). A fit, or a mixture that reads the cache's features, is refused."""
        if "cache" not in self.mixture.components:
            return self.mixture
        if self.fit is not None or any(f.startswith("cache_") for f in self.mixture.feature_names):
            raise MemlmError("generate_until has no continuous cache, and this mixture was fitted with one: fit "
                             "one without the cache for generation tasks")  # fmt: skip
        states = sparse_state_features({n: torch.tensor([True, False]) for n in self.ngram_names})
        w = self.mixture.log_weights(self.mixture.features_of(states, 2)).exp()
        weights = {c: (float(w[0, i]), float(w[1, i])) if c in self.ngram_names else float(w[0, i])
                   for i, c in enumerate(self.components) if c not in ("lm", "cache")}  # fmt: skip
        return rule_mixture([c for c in self.components if c != "cache"], weights)

    def _generation_processor(self, prefix: Sequence[int] = ()) -> Any:
        """The generation step over every memory but the cache (:class:`memlm.knnlm.generate.MixtureLogitsProcessor`,
        one :class:`~memlm.core.mixture.Mixture` as ``memlm generate``'s: :meth:`_generation_mixture`), or None when
        the LM is alone. ``prefix``: the context's tokens cut off for the LM, which the ∞-grams still read."""
        from memlm.knnlm.generate import MixtureLogitsProcessor

        mixture = self._generation_mixture()
        if mixture.form == "lm":
            return None
        memories = [c for c in self.memory_components if c.kind != "cache"]
        processor = MixtureLogitsProcessor(self.model, memories, mixture)
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
                max_new_tokens=max_new,
                do_sample=do_sample,
                sampling_temperature=temperature if do_sample else None,
                stop=[*until, eos_text] if eos_text else until,
                processor=processor,  # None: the LM alone
            )[0]
            if processor is not None and processor.ngram_components:
                self._note_approximate("generate_until", processor.approximate())
            for stop in until:
                if stop and stop in text:
                    text = text.split(stop, 1)[0]
            out.append(text)
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
        return out
