"""The weights every consumer uses when none are given: the memories' own calibrated mixtures.

Each memory's calibration (``memlm datastore build`` / ``calibrate``, ``memlm ngram build``) stores one guarded
mixture of the LM and that memory (:func:`memlm.knnlm.calibration.stored_mixture`; :func:`memlm.core.mixture.
fit_guarded`, τ and k of a datastore searched on a small grid). Without ``--lambda``, ``--temperature``,
``--ngram-lambda-sparse`` / ``--ngram-lambda-dense`` or ``--mixture``:

* **one memory**: its stored fit, as it is (what ``memlm eval --mixture stored`` applied);
* **several memories**, each calibrated against the LM alone: their fits are combined into one mixture of every
  component by the rule *each memory keeps its own odds against the LM* (:func:`combine`)::

      λ_0(c) ∝ 1,   λ_i(c) ∝ exp(a_i(c)),   a_i(c) = W_i z_i(c) + b_i  (memory i's gate, relative to the LM)

  so a memory's weight relative to the LM is what its own calibration chose, and the LM's share shrinks as more
  memories vouch for the token. Memories that predict the same tokens then take too much from the LM, so the
  combination is **guarded** (:func:`choose`): each memory's calibration slice (the text it was fitted on, stored
  with it) is scored once with the LM and every memory, and the combination is used only if its mean
  log-likelihood per token there beats the best single memory's own mixture (the others at weight 0) by more than
  two standard errors (:func:`paired_gain`); otherwise the best single memory's mixture is used. Slice documents
  another memory holds (by text hash or the 13-gram rule of :mod:`memlm.leakage`) are left out, and a text held out
  by several memories is scored once.

Where no fit can be used (a memory without a stored fit, several datastores, the continuous cache, whose weight no
calibration fits) the fixed-weight rule is used, each memory at its stored fit's summary as the rule (its mean weight
on its calibration slice, an ∞-gram's per sparse / dense state: :attr:`memlm.mixing.dump.DumpMixture.rule_weights`),
and the line says so.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from memlm.core.mixture import FitOptions, Mixture, MixtureFit

__all__ = [
    "DefaultMixture",
    "Resolved",
    "choose",
    "combine",
    "default_mixture",
    "calibrated_weights",
    "memory_name",
    "resolve_mixture",
    "stored_fits",
    "with_fit_settings",
]


@dataclass
class DefaultMixture:
    """The mixture chosen (``fit``: a :class:`~memlm.mixing.dump.DumpMixture`, None: the fixed-weight rule)
    and ``origin``, the one line that says which and where it came from."""

    fit: Any
    origin: str

    def announce(self, file=None) -> None:
        print(f"mixture: {self.origin}", file=file or sys.stderr, flush=True)


def memory_name(memory) -> str:
    """A memory's folder, for messages."""
    for owner in (memory, getattr(memory, "datastore", None), getattr(memory, "index", None)):
        if owner is not None and getattr(owner, "path", None) is not None:
            return str(owner.path)
    return type(memory).__name__


def stored_fits(memories: Sequence) -> list:
    """Each memory's stored fit (:func:`memlm.knnlm.calibration.stored_mixture`; None where it has none, or where
    the memory is not one that records a calibration)."""
    from memlm.errors import MemlmError
    from memlm.knnlm.calibration import _calibrated, stored_mixture

    out = []
    for m in memories:
        try:
            _calibrated(m)
        except MemlmError:
            out.append(None)
            continue
        out.append(stored_mixture(m))
    return out


def _own_features(fit, name: str) -> list[tuple[str, str]]:
    """``(stored name, name in the combination)`` of a one-memory fit's features: the LM's as they are, the memory's
    renamed from its kind (``knn_*``, ``ngram_*``) to its component (``knn2_*``, ``ngram2_*``)."""
    kind = fit.mixture.components[1]
    out = []
    for f in fit.mixture.feature_names:
        out.append((f, f if f.startswith("lm_") else name + f[len(kind) :]))
    return out


def combine(fits: Sequence, names: Sequence[str], keep: Sequence[bool] | None = None):
    """One :class:`~memlm.mixing.dump.DumpMixture` of the LM and every memory from their one-memory fits
    (``fits[i]`` mixes ``lm`` and memory ``names[i]``), each memory at its own odds against the LM (module
    docstring); ``keep[i]`` False puts memory i at weight 0 (``b_i = -inf``: one memory's fit in the space of all).

    The combination standardises the LM's features as the first fit does and each memory's as its own fit: memory
    i's logit ``W_i (φ - m_i) / s_i + b_i`` is rewritten exactly on those (``W'_f = W_if s_f / s_if``,
    ``b'_i = b_i + Σ_f W_if (m_f - m_if) / s_if``)."""
    from memlm.mixing.dump import DumpMixture

    keep = [True] * len(fits) if keep is None else list(keep)
    lm_names = [f for f in fits[0].mixture.feature_names if f.startswith("lm_")]
    first = fits[0].mixture
    mean = {f: first.mean[first.feature_names.index(f)] for f in lm_names}
    std = {f: first.std[first.feature_names.index(f)] for f in lm_names}
    for fit, name in zip(fits, names, strict=True):
        for old, new in _own_features(fit, name):
            if not new.startswith("lm_"):
                i = fit.mixture.feature_names.index(old)
                mean[new], std[new] = fit.mixture.mean[i], fit.mixture.std[i]
    feature_names = list(mean)
    W = np.zeros((len(fits) + 1, len(feature_names)))
    b = np.zeros(len(fits) + 1)
    for r, (fit, name, on) in enumerate(zip(fits, names, keep, strict=True), 1):
        m = fit.mixture
        b[r] = m.b[1] if on else -math.inf
        if not on or math.isinf(m.b[1]):
            continue
        for (old, new), w in zip(_own_features(fit, name), m.W[1], strict=True):
            i = m.feature_names.index(old)
            W[r, feature_names.index(new)] = w * std[new] / m.std[i]
            b[r] += w * (mean[new] - m.mean[i]) / m.std[i]
    form = "gate" if W.any() else "constant" if np.isfinite(b[1:]).any() else "lm"
    mixture = Mixture(("lm", *names), tuple(feature_names), W, b, np.asarray(list(mean.values())),
                      np.asarray(list(std.values())), form)  # fmt: skip
    used = [f.fit for f, on in zip(fits, keep, strict=True) if on] or [fits[0].fit]
    record = MixtureFit(mixture, sum(f.tokens for f in used), sum(f.documents for f in used),
                        sum(f.fit_tokens for f in used), sum(f.kept_tokens for f in used), "combined", {},
                        [], [w for f in used for w in f.warnings], FitOptions())  # fmt: skip
    knn = [f for f, n in zip(fits, names, strict=True) if n.startswith("knn")]
    return DumpMixture(record, knn[0].temperature if knn else None, knn[0].k if knn else None)


def _slices(memories: Sequence, tokenizer, datastore, ngram) -> list:
    """The documents of every memory's calibration slice (the same text once), less those another memory holds."""
    from memlm.data.corpora import Document
    from memlm.knnlm.calibration import _calibrated, _current_calibration
    from memlm.leakage import Evaluated, _memories, find_overlap

    seen, docs = set(), []
    for memory in memories:
        owner, kind = _calibrated(memory)
        for d in (_current_calibration(owner, counted=kind == "knn") or {}).get("slice") or []:
            if d["text"] not in seen:
                seen.add(d["text"])
                docs.append(Document(d["id"], d["text"]))
    held = _memories(datastore, ngram)
    return [d for d in docs if not find_overlap(Evaluated([d]), held, tokenizer)[0]]


def choose(candidates: dict, model, tokenizer, datastore, ngram, config, batch_size: int = 4,
           scores=None) -> tuple[str, dict]:  # fmt: skip
    """The guard (module docstring): ``(name of the candidate chosen, {candidate: mean log-likelihood per token on
    the slices})``; ``candidates`` by name, ``"combined"`` and one per memory. ``("", {})`` when there is no slice
    text left to score (then the caller falls back to the rule). ``scores``: the slices already scored with the LM and
    every memory (a :class:`~memlm.knnlm.table.TokenTable`, e.g. the one pass of
    :func:`memlm.knnlm.calibration.calibrate_shared` over the slice two memories both held out), used instead of
    scoring them again."""
    ts = scores if scores is not None else _score_slices(candidates, model, tokenizer, datastore, ngram, config,
                                                         batch_size)  # fmt: skip
    if ts is None:
        return "", {}
    lp = {name: c.logprob(ts, "the calibration slices").numpy() for name, c in candidates.items()}
    ll = {name: float(v.mean()) for name, v in lp.items()}
    singles = {n: v for n, v in ll.items() if n != "combined"}
    best = max(singles, key=lambda n: singles[n])
    gain, se = paired_gain(lp["combined"] - lp[best], ts.doc_index)
    ll.update(combined_gain=gain, combined_gain_se=se)
    return ("combined" if gain > SE_MARGIN * se and gain > 0 else best), ll


def _score_slices(candidates: dict, model, tokenizer, datastore, ngram, config, batch_size: int):
    """The memories' calibration slices (:func:`_slices`) scored with the LM and every memory, at the widest k of
    the candidates; None when no slice text is left."""
    import dataclasses

    from memlm.knnlm.scoring import score_tokens

    memories = [*([] if datastore is None else [datastore]), *getattr(ngram, "memories", [ngram] if ngram else [])]
    docs = _slices(memories, tokenizer, datastore, ngram)
    if not docs:
        return None
    k = max([config.k] + [int(c.k) for c in candidates.values() if c.k])
    cfg = dataclasses.replace(config, k=k)
    return score_tokens(model, tokenizer, docs, memories, cfg, batch_size=batch_size, progress=False)


SE_MARGIN = 2.0
"""The combination is chosen only if its gain over the best single memory on the slices is more than this many
standard errors (:func:`paired_gain`): a gain within the noise of a few thousand tokens does not carry over."""


def paired_gain(diff, doc_index) -> tuple[float, float]:
    """``(D, SE)``: the mean per-token log-likelihood gain ``D = mean_t d_t`` and its standard error over 512-token
    blocks (:func:`memlm.core.mixture.token_blocks`, every document cut; tokens of one block are correlated, blocks
    are treated as independent): ``SE = sqrt(Σ_b n_b^2 (d̄_b - D)^2) / N``, the cluster-robust error of a mean."""
    from memlm.core.mixture import token_blocks

    diff = np.asarray(diff, dtype=np.float64)
    blocks = token_blocks(doc_index, min_documents=len(diff) + 1)
    n = np.bincount(blocks).astype(np.float64)
    mean_b = np.bincount(blocks, weights=diff) / n
    gain = float(diff.mean())
    return gain, float(np.sqrt(((n * (mean_b - gain)) ** 2).sum()) / len(diff))


def default_mixture(model, tokenizer, datastores: Sequence, ngram, config, cache: bool = False,
                    batch_size: int = 4, slice_scores=None) -> DefaultMixture:  # fmt: skip
    """The mixture a run uses when no weights are given (module docstring): ``datastores`` (open), ``ngram`` (an
    :class:`~memlm.ngram.memory.NgramMemory`, ``NgramMemories`` or None), ``config`` the run's retrieval settings
    (its k and windows score the calibration slices when several memories are combined; ``slice_scores``: those
    slices already scored, see :func:`choose`)."""
    from memlm.mixing.component import component_name

    ngrams = list(getattr(ngram, "memories", [ngram] if ngram is not None else []))
    memories = [*datastores, *ngrams]
    names = [component_name("knn", r) for r in range(len(datastores))]
    names += [component_name("ngram", r) for r in range(len(ngrams))]
    rule = "the fixed-weight rule of each memory's calibrated mixture's mean weights (as --lambda, --ngram-lambda-*)"
    if not memories:
        return DefaultMixture(None, "the LM alone (no memory)")
    if cache:
        return DefaultMixture(None, f"{rule}: no calibration fits the cache's weight")
    fits = stored_fits(memories)
    missing = [memory_name(m) for m, f in zip(memories, fits, strict=True) if f is None]
    if missing:
        return DefaultMixture(None, f"{rule}: {', '.join(missing)} records no fitted mixture (calibrate it)")
    if len(datastores) > 1:
        return DefaultMixture(None, f"{rule}: the stored fits of several datastores are not combined")
    wide = [f.k for f in fits if f.k is not None and int(f.k) > int(config.k)]
    if wide:
        return DefaultMixture(None, f"{rule}: the stored fit reads k={wide[0]} neighbours, this run retrieves "
                                    f"k={config.k} (give --k {wide[0]} to use it)")  # fmt: skip
    if len(memories) == 1:
        return single(fits[0], memories[0])
    candidates = {"combined": combine(fits, names)}
    for i, name in enumerate(names):
        candidates[name] = combine(fits, names, [j == i for j in range(len(names))])
    chosen, ll = choose(candidates, model, tokenizer, datastores[0] if datastores else None,
                        ngram if ngrams else None, config, batch_size, slice_scores)  # fmt: skip
    if not chosen:
        return DefaultMixture(None, f"{rule}: no calibration slice text to check the stored fits' combination on")
    dm = candidates[chosen]
    dm.fit.heldout_loglik = ll
    gain, se = ll.pop("combined_gain"), ll.pop("combined_gain_se")
    lls = ", ".join(f"{n} {v:.4f}" for n, v in ll.items())
    lls += f"; the combination's gain over the best alone {gain:+.4f} ± {se:.4f}"
    what = ("the memories' stored fits combined (each at its own odds against the LM)" if chosen == "combined"
            else f"{chosen}'s stored fit alone (the others at weight 0): their combination did not beat it by "
            f"{SE_MARGIN:g} standard errors")  # fmt: skip
    return DefaultMixture(dm, f"{what}, checked on the calibration slices (log-likelihood per token: {lls})")


def single(fit, memory) -> DefaultMixture:
    """One memory's stored fit as the default, with the line that says so."""
    return DefaultMixture(fit, f"{fit.fit.form} ({describe(fit)}), stored with {memory_name(memory)}'s calibration on "
                               f"{fit.fit.tokens:,} held-out tokens")  # fmt: skip


def describe(fit) -> str:
    """τ and k of a fit's kNN term, when it has one."""
    return f"τ={fit.temperature:g}, k={fit.k}" if fit.temperature is not None else "∞-gram"


def calibrated_weights(components: Sequence) -> dict[str, Any]:
    """Each memory's weight in the fixed-weight rule when none is given (by component name,
    :func:`memlm.mixing.component.component_names`): a datastore's stored fit's mean weight
    (:func:`memlm.knnlm.calibration.knn_parameters`), an ∞-gram index's ``(λ_sparse, λ_dense)`` of its stored fit
    (:func:`memlm.knnlm.calibration.ngram_parameters`; each a fallback where the memory records none), the cache's
    :data:`~memlm.core.config.DEFAULT_CACHE_LAMBDA`. Another kind has no default weight: one MemlmError."""
    from memlm.core.config import DEFAULT_CACHE_LAMBDA
    from memlm.errors import MemlmError
    from memlm.knnlm.calibration import knn_parameters, ngram_parameters
    from memlm.mixing.component import component_names

    out: dict[str, Any] = {}
    for name, c in zip(component_names(components)[1:], components, strict=True):
        if c.kind == "knn":
            out[name] = knn_parameters(c.memory, None, c.temperature, announce=False)[0]
        elif c.kind == "ngram":
            out[name] = tuple(ngram_parameters(c.memory.index, announce=False)[:2])
        elif c.kind == "cache":
            out[name] = DEFAULT_CACHE_LAMBDA
        else:
            raise MemlmError(f"memory {name} ({type(c).__name__}) has no calibrated weight: give the weights, "
                             f"mixture='{name}=0.25' (memlm.mixing.weights), or a fitted mixture")  # fmt: skip
    return out


@dataclass
class Resolved:
    """A consumer's memories and the one :class:`~memlm.core.mixture.Mixture` over them: ``components`` (a fit's
    τ and k set its kNN terms, its τc the cache's), ``mixture``, and ``fit`` (the
    :class:`~memlm.mixing.dump.DumpMixture` it came from, or None)."""

    components: list
    mixture: Mixture
    fit: Any = None


def with_fit_settings(components: Sequence, fit) -> list:
    """``components`` with a fit's kNN τ and k (every datastore's) and its cache τc: the settings it was fitted at
    (new components; those given are left as they are)."""
    from memlm.knnlm.cache import CacheComponent
    from memlm.mixing.datastore import DatastoreComponent

    out = []
    for c in components:
        if isinstance(c, DatastoreComponent) and (fit.temperature is not None or fit.k):
            tau = c.temperature if fit.temperature is None else fit.temperature
            c = DatastoreComponent(c.memory, int(fit.k or c.k), tau, c.record)
        elif isinstance(c, CacheComponent) and getattr(fit, "cache_temperature", None) is not None:
            c = CacheComponent(c.k, c.max_len, c.metric, float(fit.cache_temperature))
        out.append(c)
    return out


def resolve_mixture(components: Sequence, mixture: Any = None, model=None, tokenizer=None) -> Resolved:
    """The mixture every consumer (generation, ``memlm.wrap``, lm-eval) applies over ``components``:

    * a :class:`~memlm.core.mixture.Mixture` (e.g. :func:`memlm.mixing.weights.fixed_mixture`), as it is;
    * a weights string ``knn=0.25;ngram=0.5/0.1`` (:func:`memlm.mixing.weights.parse_weights`): the fixed-weight rule;
    * a fit (a ``memlm tune --json`` file, its record, a :class:`~memlm.mixing.dump.DumpMixture`): its
      mixture, its τ and k set the kNN terms;
    * None or ``"stored"``: the memories' stored fits (module docstring; several combined and checked on their
      calibration slices only given ``model`` and ``tokenizer``), else the fixed-weight rule of their calibrated
      weights (:func:`calibrated_weights`; ``"stored"`` refuses that), with one line saying which and where from.

    A mixture of other components than these is refused with one MemlmError."""
    from memlm.mixing.component import component_names
    from memlm.mixing.step import check_components, load_fit
    from memlm.mixing.weights import fixed_mixture, is_weights, parse_weights

    components = list(components)
    names = component_names(components)
    if mixture is None or mixture == "stored":
        found = _default(components, model, tokenizer, required=mixture == "stored")
    elif isinstance(mixture, Mixture):
        found = Resolved(components, mixture)
    elif is_weights(mixture):
        found = Resolved(components, fixed_mixture(components, parse_weights(mixture)))
    else:
        fit = load_fit(mixture)
        found = Resolved(components, fit) if isinstance(fit, Mixture) else _from_fit(components, fit)
    check_components(found.mixture, names)
    return found


def _from_fit(components: Sequence, fit) -> Resolved:
    return Resolved(with_fit_settings(components, fit), fit.mixture, fit)


def _default(components: list, model, tokenizer, required: bool) -> Resolved:
    """The stored fits of ``components`` (one memory's as it is; several combined and checked), else the rule."""
    from memlm.core.config import RetrievalConfig
    from memlm.errors import MemlmError
    from memlm.mixing.weights import fixed_mixture, weights_text

    if not components:
        return Resolved([], Mixture.lm_only(("lm",)))
    knn = [c for c in components if c.kind == "knn"]
    config = RetrievalConfig(k=min((c.k for c in knn), default=RetrievalConfig().k))
    rule = "the fixed-weight rule of each memory's calibrated mixture's mean weights"
    others = [c.kind for c in components if c.kind not in ("knn", "ngram")]
    memories = [c.memory for c in components if c.kind in ("knn", "ngram")]
    if others:
        chosen = DefaultMixture(None, f"{rule}: no calibration fits the {others[0]}'s weight")
    elif len(components) == 1:
        fits = stored_fits(memories)
        why = f"{rule}: {memory_name(memories[0])} records no fitted mixture (calibrate it)"
        chosen = single(fits[0], memories[0]) if fits[0] is not None else DefaultMixture(None, why)
    elif model is None or tokenizer is None:
        chosen = DefaultMixture(None, f"{rule}: several memories' stored fits are combined and checked on their "
                                      "slices, which needs the model and its tokenizer")  # fmt: skip
    else:
        chosen = _several(model, tokenizer, components, config)
    if chosen.fit is not None and chosen.fit.k is not None and knn and int(chosen.fit.k) > config.k:
        chosen = DefaultMixture(None, f"{rule}: the stored fit reads k={chosen.fit.k} neighbours, these memories "
                                      f"retrieve k={config.k} (give k={chosen.fit.k} to use it)")  # fmt: skip
    if chosen.fit is None and required:
        raise MemlmError(f"mixture=stored: no stored fit applies ({chosen.origin.split(': ', 1)[-1]})")
    if chosen.fit is not None:
        chosen.announce()
        return _from_fit(components, chosen.fit)
    weights = calibrated_weights(components)
    DefaultMixture(None, f"{chosen.origin} ({weights_text(weights)})").announce()
    return Resolved(components, fixed_mixture(components, weights))


def _several(model, tokenizer, components: list, config) -> DefaultMixture:
    """Several memories' stored fits combined and checked on their calibration slices (:func:`default_mixture`)."""
    from memlm.ngram.memory import NgramMemories

    dense = [getattr(c.memory, "datastore", None) or c.memory for c in components if c.kind == "knn"]
    ngrams = [c.memory for c in components if c.kind == "ngram"]
    ngram = None if not ngrams else ngrams[0] if len(ngrams) == 1 else NgramMemories(ngrams)
    return default_mixture(model, tokenizer, dense, ngram, config)
