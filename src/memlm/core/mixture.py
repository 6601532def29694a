"""One learned mixture of the LM and its memories: per-token weights from a small gate, fitted on held-out tokens.

Every memory-augmented LM in memlm ends in the same formula: the kNN-LM (Khandelwal et al. 2020, Eq. 3), the
continuous cache beside it (Grave et al. 2017; Khandelwal et al. 2020, Table 1), the ∞-gram (Liu et al. 2024,
Sec. 5)::

    P(w | c) = sum_i λ_i(c) P_i(w | c),        i = 0 (the LM), 1 .. m (the memories)

Here the weights come from a gate over per-token features φ(c) of the LM and of each memory's retrieval (He et al.
2021 predict λ from the LM's features; Drozdov et al. 2022 set it from retrieval quality)::

    λ(c) = softmax(W z(c) + b),    z(c) = (φ(c) - mean) / std,    W_0 = 0, b_0 = 0 (the LM is the reference)

``W = 0`` is a constant mixture (every paper's fixed λ: :meth:`Mixture.constant`); infini-gram's λ_sparse /
λ_dense is a gate on the sparse flag alone. Fitted by maximum likelihood on held-out tokens:

* constant weights by EM (Dempster et al. 1977): ``r_ti = λ_i p_ti / sum_j λ_j p_tj``, ``λ_i <- mean_t r_ti``. The
  mean log-likelihood is concave in λ on the simplex, and the fixed point is its maximum (no grid);
* the gate by L-BFGS on ``NLL(W, b) = -mean_t log sum_i λ_ti p_ti + (l2 / 2) ||W||^2``, whose gradient is
  ``d(-log P_t) / d a_ti = λ_ti - r_ti`` for the logits ``a = W z + b``, started from EM's weights (``b = log λ``);
* guarded (:func:`fit_guarded`): part of the slice is kept apart, and the gate is used only where it beats the
  constant mixture there, the constant mixture only where it beats the LM alone.

Inputs per scored token: ``logprobs [N, C]``, each component's log-probability of the target (``-inf`` where a
memory gives it 0; the LM, component 0, is finite everywhere), and ``features [N, F]`` (finite), named.
Normalisations and the mixing go through :mod:`memlm.core.distribution` (:func:`log_weights_from_logits`,
:func:`mix`, :func:`mix_posterior`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

from memlm.core.distribution import log_weights_from_logits, mix, mix_posterior
from memlm.errors import MemlmError

__all__ = [
    "FORMS",
    "MIN_FIT_DOCUMENTS",
    "MIN_FIT_TOKENS",
    "FitOptions",
    "Mixture",
    "MixtureFit",
    "LOG_WEIGHT_FLOOR",
    "rule_mixture",
    "sparse_state_features",
    "FIT_FORMS",
    "fit",
    "fit_constant",
    "fit_rule",
    "fit_gate",
    "fit_guarded",
    "gate_objective",
    "kept_apart",
    "token_blocks",
    "BLOCK_TOKENS",
]

log = logging.getLogger(__name__)

FORMS = ("lm", "constant", "gate", "rule")
"""The forms a mixture takes: the LM alone, constant weights, the gate, and the fixed-weight rule (constant weights
switched by each ∞-gram's sparse flag, :func:`rule_mixture`)."""

LOG_WEIGHT_FLOOR = -700.0
"""The log-weight a rule gives a component whose weight is 0 in some states only (a gate's logits are finite):
e^-700 < 1e-304, below float64's precision beside the LM's term (log p_LM > -700 on any real token)."""

# Below these sizes the guard's comparison is mostly noise and the slice rarely represents the text it will be used
# on. The kept quarter of 4,096 tokens holds 1,024. On the stdlib case (benchmarks/quality/mixture_stdlib.py) the
# per-token log-likelihood difference between the LM and its ∞-gram mixtures has a standard deviation of 0.4-1.0
# nats, so over 1,024 tokens the standard error of the mean difference is 0.01-0.03 nats (1-3% of perplexity, more
# since tokens of one document are correlated): the size of the gains at stake. Eight documents: text varies most
# between documents (a one-module slice of 887 tokens tuned λ_sparse to 0.5 and made test perplexity 10%
# worse than the LM's).
MIN_FIT_TOKENS = 4096
MIN_FIT_DOCUMENTS = 8
BLOCK_TOKENS = 512
"""The size of the blocks a slice of few documents is cut into (:func:`token_blocks`): a 4,096-token slice (the
calibration's smallest) gives 8 blocks, the fit's minimum number of documents."""
_MIN_SPLIT_DOCUMENTS = 4  # fewer documents: the kept part is the last tokens, not the last documents
_MIN_WEIGHT = 1e-12  # EM weights below this start the gate at log(1e-12), not at -inf


def _float64(x: Any, name: str) -> torch.Tensor:
    t = x.detach() if isinstance(x, torch.Tensor) else torch.as_tensor(np.asarray(x))
    if t.is_complex():
        raise MemlmError(f"{name} must be real numbers, got {t.dtype}")
    return t.to("cpu", torch.float64)


def _check_logprobs(logprobs: Any, n_components: int | None = None) -> torch.Tensor:
    """``logprobs [N, C]`` as float64 (C = ``n_components`` when given), or one MemlmError naming the problem."""
    lp = _float64(logprobs, "logprobs")
    c = n_components if n_components is not None else (lp.shape[1] if lp.ndim == 2 else "C")
    if lp.ndim != 2 or lp.shape[1] != c:
        raise MemlmError(f"logprobs must be [tokens, {c}] (one column per component), got {tuple(lp.shape)}")
    if lp.shape[0] == 0:
        raise MemlmError("no tokens: the mixture needs at least one scored token")
    if bool(torch.isnan(lp).any()):
        raise MemlmError("logprobs hold NaN: each component must give every token a log-probability (-inf for 0)")
    if bool((lp > 1e-4).any()):
        raise MemlmError(f"logprobs must be log-probabilities (<= 0), got a maximum of {float(lp.max()):g}")
    if not bool(torch.isfinite(lp[:, 0]).all()):
        raise MemlmError("component 0 (the LM) gives some token probability 0: the LM must be finite at every token")
    return lp.clamp(max=0.0)


def _check_inputs(logprobs: Any, features: Any, n_components: int, n_features: int) -> tuple[torch.Tensor, ...]:
    """``(logprobs [N, C], features [N, F])`` as float64, or one MemlmError naming what is wrong and the fix."""
    lp = _check_logprobs(logprobs, n_components)
    if features is None:
        features = torch.zeros(lp.shape[0], 0, dtype=torch.float64)
    ft = _float64(features, "features")
    if ft.ndim != 2 or ft.shape != (lp.shape[0], n_features):
        raise MemlmError(f"features must be [tokens, {n_features}] = [{lp.shape[0]}, {n_features}] to match logprobs "
                         f"and the feature names, got {tuple(ft.shape)}")  # fmt: skip
    if not bool(torch.isfinite(ft).all()):
        raise MemlmError("features hold NaN or inf: fill a missing retrieval's feature with a finite value")
    return lp, ft


def _check_memories_score(lp: torch.Tensor, components: Sequence[str]) -> None:
    for i in range(1, lp.shape[1]):
        if not bool(torch.isfinite(lp[:, i]).any()):
            raise MemlmError(f"component {components[i]!r} gives every token probability 0: nothing to fit a weight "
                             "for; leave that memory out or check its scores")  # fmt: skip


@dataclass(frozen=True)
class Mixture:
    """``log P_t = logsumexp_i(log λ_ti + log p_ti)`` with ``λ_t = softmax(W (φ_t - mean) / std + b)``.

    ``W [C, F]`` and ``b [C]`` with row 0 (the LM) zero; ``b_i = -inf`` is weight 0. ``form`` says what it is:
    ``"lm"`` (the LM alone), ``"constant"`` (W = 0) or ``"gate"``.
    """

    components: tuple[str, ...]
    feature_names: tuple[str, ...]
    W: np.ndarray
    b: np.ndarray
    mean: np.ndarray
    std: np.ndarray
    form: str = "gate"

    def __post_init__(self) -> None:
        c, f = len(self.components), len(self.feature_names)
        if c < 1 or len(set(self.components)) != c or len(set(self.feature_names)) != f:
            raise MemlmError(f"a mixture needs distinct component and feature names, got {self.components} and "
                             f"{self.feature_names}")  # fmt: skip
        if self.form not in FORMS:
            raise MemlmError(f"unknown mixture form {self.form!r}; use one of {', '.join(FORMS)}")
        shapes = {"W": ((c, f), self.W), "b": ((c,), self.b), "mean": ((f,), self.mean), "std": ((f,), self.std)}
        for name, (shape, value) in shapes.items():
            object.__setattr__(self, name, np.asarray(value, dtype=np.float64).reshape(shape))
        if self.W[0].any() or self.b[0] != 0 or not np.isfinite(self.W).all() or np.isnan(self.b).any():
            raise MemlmError("the gate's row 0 (the LM, the reference) must be zero and W, b finite (b may be -inf)")
        if not (np.isfinite(self.std).all() and (self.std > 0).all() and np.isfinite(self.mean).all()):
            raise MemlmError("the gate's feature standardisation needs finite means and std > 0")

    @classmethod
    def constant(cls, components: Sequence[str], weights: Sequence[float], feature_names: Sequence[str] = ()):
        """The fixed mixture ``sum_i w_i p_i`` (weights >= 0 summing to 1, the LM's > 0): every paper's λ."""
        w = np.asarray(weights, dtype=np.float64)
        if w.shape != (len(components),) or (w < 0).any() or not math.isclose(w.sum(), 1.0, abs_tol=1e-9):
            raise MemlmError(f"constant weights must be one per component, >= 0, summing to 1; got {list(weights)}")
        if not w[0] > 0:
            raise MemlmError("the LM's weight (component 0) must be > 0: it is the gate's reference")
        with np.errstate(divide="ignore"):
            b = np.log(w) - np.log(w[0])
        f = len(feature_names)
        form = "lm" if not w[1:].any() else "constant"
        return cls(tuple(components), tuple(feature_names), np.zeros((len(w), f)), b, np.zeros(f), np.ones(f), form)

    @classmethod
    def lm_only(cls, components: Sequence[str], feature_names: Sequence[str] = ()):
        """The LM alone (every memory at weight 0)."""
        return cls.constant(components, [1.0] + [0.0] * (len(components) - 1), feature_names)

    def _inputs(self, logprobs: Any, features: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return _check_inputs(logprobs, features, len(self.components), len(self.feature_names))

    def _log_weights(self, ft: torch.Tensor) -> torch.Tensor:
        z = (ft - torch.from_numpy(self.mean)) / torch.from_numpy(self.std)
        return log_weights_from_logits(z @ torch.from_numpy(self.W).T + torch.from_numpy(self.b))

    def log_weights(self, features: Any) -> torch.Tensor:
        """``log λ(c)`` per token, float64 ``[N, C]``."""
        ft = _float64(features, "features")
        if ft.ndim != 2 or ft.shape[1] != len(self.feature_names) or not bool(torch.isfinite(ft).all()):
            raise MemlmError(f"features must be finite [tokens, {len(self.feature_names)}], got {tuple(ft.shape)}")
        return self._log_weights(ft)

    def logprob(self, logprobs: Any, features: Any = None) -> torch.Tensor:
        """``log P(target)`` per token, float64 ``[N]``."""
        lp, ft = self._inputs(logprobs, features)
        return mix(lp.T, self._log_weights(ft).T)

    def features_of(self, named: Mapping[str, Any], rows: int) -> torch.Tensor:
        """``φ [rows, F]`` float64 from features given by name (each ``[rows]``): the columns this mixture uses, in
        its order, or one MemlmError naming the features missing."""
        missing = [f for f in self.feature_names if f not in named]
        if missing:
            raise MemlmError(f"the mixture needs the features {', '.join(missing)}, which its memories did not give "
                             f"(it was made for components {', '.join(self.components)}): give the same memories "
                             "it was fitted on")  # fmt: skip
        if not self.feature_names:
            return torch.zeros(rows, 0, dtype=torch.float64)
        return torch.stack([_float64(named[f], f).reshape(rows) for f in self.feature_names], dim=1)

    def mix(self, logprobs: Mapping[str, Any], features: Mapping[str, Any] | None = None) -> torch.Tensor:
        """``log P`` of the mixture from each component's log-probabilities by name: ``[N]`` (of each target) or
        ``[N, V]`` (over the vocabulary: a generation step, a wrapped forward pass), and the features by name
        (:meth:`features_of`); one row of weights ``λ(c_t)`` per context. The one place every consumer mixes."""
        missing = [c for c in self.components if c not in logprobs]
        extra = [c for c in logprobs if c not in self.components]
        if missing or extra:
            raise MemlmError(f"the mixture mixes {', '.join(self.components)}; the memories gave "
                             f"{', '.join(logprobs) or 'nothing'}: give the memories it was made for, in any order "
                             "(a stored fit: the ones it was fitted on)")  # fmt: skip
        comps = [torch.as_tensor(logprobs[c]) for c in self.components]
        rows, per_target = comps[0].shape[0], comps[0].ndim == 1
        log_w = self._log_weights(self.features_of(features or {}, rows)).T  # [C, N] float64
        if per_target:  # one value per row: mixed in float64, as the weights
            return mix([c.double() for c in comps], log_w)
        return mix(comps, log_w.reshape(*log_w.shape, *([1] * (comps[0].ndim - 1))))  # the weights per row

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe (``b = -inf``, weight 0, is written as null)."""
        return {
            "form": self.form,
            "components": list(self.components),
            "feature_names": list(self.feature_names),
            "W": self.W.tolist(),
            "b": [None if math.isinf(x) else float(x) for x in self.b],
            "feature_mean": self.mean.tolist(),
            "feature_std": self.std.tolist(),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Mixture:
        try:
            b = [-math.inf if x is None else float(x) for x in d["b"]]
            return cls(tuple(d["components"]), tuple(d["feature_names"]), np.asarray(d["W"], dtype=np.float64)
                       .reshape(len(d["components"]), len(d["feature_names"])), np.asarray(b), np.asarray(
                           d["feature_mean"]), np.asarray(d["feature_std"]), d["form"])  # fmt: skip
        except (KeyError, TypeError, ValueError) as error:
            raise MemlmError(
                f"not a stored mixture ({type(error).__name__}: {error}): expected Mixture.to_dict's "
                "fields form, components, feature_names, W, b, feature_mean, feature_std"
            ) from error


# ------------------------------------------------------------------------------------------------------- fitting


def fit_constant(logprobs: Any, tol: float = 1e-10, max_iter: int = 10_000) -> tuple[np.ndarray, int, bool]:
    """The constant weights of maximum likelihood by EM: ``λ_i <- mean_t r_ti``, ``r_ti = λ_i p_ti / P_t``, from
    uniform weights until no weight moves by more than ``tol``. Returns ``(λ [C], iterations, converged)``."""
    lp = _check_logprobs(logprobs)
    lam = torch.full((lp.shape[1],), 1.0 / lp.shape[1], dtype=torch.float64)
    for it in range(1, max_iter + 1):
        with np.errstate(divide="ignore"):
            log_lam = lam.log()
        new = mix_posterior(lp.T, log_lam)[1].exp().mean(1)
        new = new / new.sum()
        moved = float((new - lam).abs().max())
        lam = new
        if moved < tol:
            return lam.numpy(), it, True
    return lam.numpy(), max_iter, False


def gate_objective(theta: torch.Tensor, logprobs: torch.Tensor, z: torch.Tensor, l2: float):
    """``(NLL, dNLL/dθ)`` of the gate at ``θ = [W_1..W_{C-1} (row-major), b_1..b_{C-1}]`` (rows 0 fixed at 0)::

        NLL = -mean_t log sum_i λ_ti p_ti + (l2 / 2) ||W||^2,   dNLL/dW_i = mean_t (λ_ti - r_ti) z_t + l2 W_i,
        dNLL/db_i = mean_t (λ_ti - r_ti)

    ``logprobs [N, C]``, ``z [N, F]`` (standardised features), float64."""
    n, c = logprobs.shape
    f = z.shape[1]
    W = torch.cat([torch.zeros(1, f, dtype=theta.dtype), theta[: (c - 1) * f].reshape(c - 1, f)])
    b = torch.cat([torch.zeros(1, dtype=theta.dtype), theta[(c - 1) * f :]])
    log_lam = log_weights_from_logits(z @ W.T + b)
    log_p, log_r = mix_posterior(logprobs.T, log_lam.T)
    value = -log_p.mean() + 0.5 * l2 * (W * W).sum()
    g = (log_lam.exp() - log_r.T.exp()) / n  # [N, C]: d(-mean log P)/da
    grad_w = g.T @ z + l2 * W
    return value, torch.cat([grad_w[1:].reshape(-1), g.sum(0)[1:]])


def fit_gate(logprobs: Any, z: Any, init_weights: Sequence[float], l2: float = 1e-3, max_iter: int = 500):
    """The gate's ``(W [C, F], b [C])`` minimising :func:`gate_objective` by L-BFGS (strong-Wolfe line search) from
    ``W = 0``, ``b = log λ - log λ_0`` with ``λ = init_weights`` (EM's constant weights)."""
    lp, zt = torch.as_tensor(logprobs, dtype=torch.float64), torch.as_tensor(z, dtype=torch.float64)
    c, f = lp.shape[1], zt.shape[1]
    lam = np.maximum(np.asarray(init_weights, dtype=np.float64), _MIN_WEIGHT)
    b0 = torch.from_numpy(np.log(lam[1:]) - np.log(lam[0]))
    x = torch.nn.Parameter(torch.cat([torch.zeros((c - 1) * f, dtype=torch.float64), b0]))
    opt = torch.optim.LBFGS([x], lr=1.0, max_iter=max_iter, tolerance_grad=1e-9, tolerance_change=1e-13,
                            history_size=20, line_search_fn="strong_wolfe")  # fmt: skip

    def closure() -> torch.Tensor:
        value, grad = gate_objective(x.detach(), lp, zt, l2)
        x.grad = grad
        return value

    opt.step(closure)
    theta = x.detach()
    W = torch.cat([torch.zeros(1, f, dtype=torch.float64), theta[: (c - 1) * f].reshape(c - 1, f)])
    return W.numpy(), np.concatenate([[0.0], theta[(c - 1) * f :].numpy()])


@dataclass(frozen=True)
class FitOptions:
    """How :func:`fit_guarded` fits: the share of documents kept apart, the gate's L2 weight on W (standardised
    features, mean NLL per token), EM's tolerance, the sizes below which it warns, the margin in nats per token by
    which a richer form must beat a simpler one on the kept part."""

    kept_share: float = 0.25
    l2: float = 1e-3
    em_tol: float = 1e-10
    min_tokens: int = MIN_FIT_TOKENS
    min_documents: int = MIN_FIT_DOCUMENTS
    margin: float = 0.0


@dataclass
class MixtureFit:
    """A fitted mixture and how it was chosen: held-out mean log-likelihood (nats per token) of each form on the
    kept part, the sizes it fitted on, and warnings."""

    mixture: Mixture
    tokens: int
    documents: int
    fit_tokens: int
    kept_tokens: int
    split: str
    heldout_loglik: dict[str, float]
    mean_weights: list[float]
    warnings: list[str] = field(default_factory=list)
    options: FitOptions = field(default_factory=FitOptions)

    @property
    def form(self) -> str:
        return self.mixture.form

    def to_dict(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in ("tokens", "documents", "fit_tokens", "kept_tokens", "split",
                                             "heldout_loglik", "mean_weights", "warnings")}  # fmt: skip
        return {"form": self.form, "mixture": self.mixture.to_dict(), **out, "options": asdict(self.options)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> MixtureFit:
        try:
            rest = {k: d[k] for k in ("tokens", "documents", "fit_tokens", "kept_tokens", "split", "heldout_loglik",
                                      "mean_weights", "warnings")}  # fmt: skip
            return cls(Mixture.from_dict(d["mixture"]), **rest, options=FitOptions(**d["options"]))
        except (KeyError, TypeError) as error:
            raise MemlmError(f"not a stored mixture fit ({type(error).__name__}: {error})") from error


def kept_apart(doc_index: Any, share: float) -> tuple[np.ndarray, str]:
    """The tokens kept apart to check a fit: the last ``share`` of the documents (by ``doc_index`` order, at least
    one), or, with fewer than 4 documents, the last ``share`` of the tokens. Returns ``(mask [N], how)``."""
    doc = np.asarray(doc_index)
    if not 0 < share < 1:
        raise MemlmError(f"the kept share must be in (0, 1), got {share}")
    if doc.ndim != 1 or len(doc) < 2:
        raise MemlmError(f"a guarded fit needs >= 2 tokens with one document index each, got {doc.shape}")
    docs = np.unique(doc)
    if len(docs) >= _MIN_SPLIT_DOCUMENTS:
        keep = docs[len(docs) - max(1, round(share * len(docs))) :]
        return np.isin(doc, keep), "documents"
    n_keep = min(len(doc) - 1, max(1, round(share * len(doc))))
    return np.arange(len(doc)) >= len(doc) - n_keep, "tokens"


def token_blocks(doc_index: Any, min_documents: int = MIN_FIT_DOCUMENTS, size: int = BLOCK_TOKENS) -> np.ndarray:
    """The units a fit and its bootstrap treat as documents: ``doc_index`` itself when it holds ``min_documents``
    documents or more, else each document cut into blocks of ``size`` consecutive tokens (the last block of a
    document may be shorter; a document of fewer tokens stays one block). A calibration slice of one file is one
    document (its tail); cut this way, its kept-apart part is its last blocks and its intervals resample blocks.
    Tokens of one block are still correlated with its neighbours, so these intervals are narrower than intervals
    over real documents would be. Returns a new index ``[N]`` (0, 1, ... in token order)."""
    doc = np.asarray(doc_index)
    if doc.ndim != 1 or len(np.unique(doc)) >= min_documents:
        return doc
    if size < 1:
        raise MemlmError(f"the block size must be >= 1 token, got {size}")
    new_doc = np.r_[True, doc[1:] != doc[:-1]] if len(doc) else np.zeros(0, dtype=bool)
    start = np.maximum.accumulate(np.where(new_doc, np.arange(len(doc)), 0))  # each token's document start
    block = (np.arange(len(doc)) - start) // size
    return np.unique(np.stack([np.cumsum(new_doc), block]), axis=1, return_inverse=True)[1].reshape(-1)


def _standardised(ft: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    mean = ft.mean(0).numpy() if len(ft) else np.zeros(ft.shape[1])
    std = ft.std(0, unbiased=False).numpy() if len(ft) else np.ones(ft.shape[1])
    return mean, np.where(std > 1e-12, std, 1.0)


def _fit_forms(lp: torch.Tensor, ft: torch.Tensor, names: tuple, forms: Sequence[str], options: FitOptions) -> dict:
    """Each of ``forms`` fitted on these tokens: ``{form: Mixture}``."""
    components, feature_names = names
    out = {"lm": Mixture.lm_only(components, feature_names)}
    if forms == ("lm",):
        return out
    weights, _, converged = fit_constant(lp, options.em_tol)
    if not converged:
        log.warning("EM stopped before converging (tolerance %g)", options.em_tol)
    out["constant"] = Mixture.constant(components, weights, feature_names)
    if "gate" in forms:
        mean, std = _standardised(ft)
        z = (ft - torch.from_numpy(mean)) / torch.from_numpy(std)
        W, b = fit_gate(lp, z, weights, options.l2)
        out["gate"] = Mixture(components, feature_names, W, b, mean, std, "gate")
    return out


def fit_guarded(
    logprobs: Any,
    features: Any,
    doc_index: Any,
    components: Sequence[str],
    feature_names: Sequence[str],
    options: FitOptions = FitOptions(),
) -> MixtureFit:
    """Fit the mixture on held-out tokens, guarded against a small or unrepresentative slice.

    The last ``kept_share`` of the documents (:func:`kept_apart`) is kept apart; the LM alone, EM's constant weights
    and the gate are fitted on the rest and scored on the kept part (mean log-likelihood per token). The gate is
    chosen only if it beats the constant mixture there by more than ``margin``, the constant mixture only if it
    beats the LM alone; the chosen form is then refitted on the whole slice. Warns (in ``warnings`` and the log)
    below ``min_tokens`` tokens or ``min_documents`` documents.
    """
    names = (tuple(components), tuple(feature_names))
    lp, ft = _check_inputs(logprobs, features, len(names[0]), len(names[1]))
    _check_memories_score(lp, names[0])
    doc = np.asarray(doc_index)
    if doc.shape != (lp.shape[0],):
        raise MemlmError(f"doc_index must give one document per token ({lp.shape[0]}), got shape {doc.shape}")
    kept, split = kept_apart(doc, options.kept_share)
    kept_t = torch.from_numpy(kept)
    forms = FORMS if ft.shape[1] else FORMS[:2]
    trial = _fit_forms(lp[~kept_t], ft[~kept_t], names, forms, options)
    heldout = {f: float(m.logprob(lp[kept_t], ft[kept_t]).mean()) for f, m in trial.items()}
    chosen = "lm"
    if heldout["constant"] > heldout["lm"] + options.margin:
        chosen = "constant"
        if "gate" in heldout and heldout["gate"] > heldout["constant"] + options.margin:
            chosen = "gate"
    mixture = _fit_forms(lp, ft, names, (chosen,), options)[chosen]
    n_docs = len(np.unique(doc))
    warnings = _size_warnings(lp.shape[0], n_docs, options)
    mean_weights = mixture.log_weights(ft).exp().mean(0).tolist()
    return MixtureFit(mixture, int(lp.shape[0]), n_docs, int((~kept).sum()), int(kept.sum()), split, heldout,
                      mean_weights, warnings, options)  # fmt: skip


FIT_FORMS = ("constant", "rule", "gate", "guarded")
"""What :func:`fit` fits: constant weights (EM), the papers' rule (constant weights per joint sparse state of the
∞-grams, by EM), the gate (L-BFGS), or the guarded choice among the LM alone, constant weights and the gate."""


def fit_rule(logprobs: Any, features: Any, feature_names: Sequence[str], components: Sequence[str],
             tol: float = 1e-10) -> Mixture:  # fmt: skip
    """The papers' rule fitted by maximum likelihood: one constant weight vector per joint sparse state of the
    ∞-grams (Liu et al. 2024, Sec. 5: λ_sparse where P∞ is sparse, λ_dense elsewhere; Khandelwal et al. 2020 Eq. 3's
    constant λ when no ∞-gram is mixed), each by EM (:func:`fit_constant`) on the tokens of its state: the joint
    log-likelihood is a sum over states, so each state's maximum is the whole's. No grid. A state with no token
    keeps uniform weights (never used on these tokens). The states are read from ``features`` columns named by
    :func:`sparse_state_features`."""
    lp = _check_logprobs(logprobs, len(components))
    names = list(feature_names)
    state_cols = [i for i, n in enumerate(names) if n.startswith("sparse_state:")]
    if not state_cols:
        weights, _, _ = fit_constant(lp, tol)
        return _table_mixture(tuple(components), [], {(): list(weights)})
    ft = _float64(features, "features")
    ngrams = [part.split("=")[0] for part in names[state_cols[0]].split(":", 1)[1].split(",")]
    table = {}
    for bits in _states(len(ngrams)):
        col = names.index(_state_name(ngrams, bits))
        rows = ft[:, col] > 0.5
        if bool(rows.any()):
            table[bits] = list(fit_constant(lp[rows], tol)[0])
        else:
            table[bits] = [1.0 / lp.shape[1]] * lp.shape[1]
    return _table_mixture(tuple(components), ngrams, table)


def fit(
    logprobs: Any,
    features: Any,
    doc_index: Any,
    components: Sequence[str],
    feature_names: Sequence[str],
    form: str = "guarded",
    options: FitOptions = FitOptions(),
) -> MixtureFit:
    """The one fitter: a :class:`Mixture` of ``form`` (:data:`FIT_FORMS`) by maximum likelihood on held-out tokens
    (``logprobs [N, C]``, ``features [N, F]``, each token's document ``doc_index [N]``). ``guarded`` is
    :func:`fit_guarded`; the other forms are fitted on every token (constant: EM; rule: :func:`fit_rule`; gate:
    L-BFGS from EM's weights), with the same size warnings."""
    if form not in FIT_FORMS:
        raise MemlmError(f"unknown mixture form {form!r}: use one of {', '.join(FIT_FORMS)}")
    if form == "guarded":
        return fit_guarded(logprobs, features, doc_index, components, feature_names, options)
    names = (tuple(components), tuple(feature_names))
    lp, ft = _check_inputs(logprobs, features, len(names[0]), len(names[1]))
    _check_memories_score(lp, names[0])
    if form == "rule":
        mixture = fit_rule(lp, ft, names[1], names[0], options.em_tol)
        ft = ft[:, [names[1].index(f) for f in mixture.feature_names]]  # the state columns the rule switches on
    else:
        mixture = _fit_forms(lp, ft, names, ("lm", form) if form == "constant" else FORMS, options)[form]
    doc = np.asarray(doc_index)
    n_docs = len(np.unique(doc))
    warnings = _size_warnings(lp.shape[0], n_docs, options)
    loglik = float(mixture.logprob(lp, ft).mean())
    return MixtureFit(mixture, int(lp.shape[0]), n_docs, int(lp.shape[0]), 0, "none", {form: loglik},
                      mixture.log_weights(ft).exp().mean(0).tolist(), warnings, options)  # fmt: skip


def _size_warnings(tokens: int, documents: int, options: FitOptions) -> list[str]:
    """One warning (also logged) when a fit had fewer tokens or documents than the options' minimums."""
    short = [f"{have:,} {what} (fewer than {need:,})" for have, need, what in
             ((tokens, options.min_tokens, "tokens"), (documents, options.min_documents, "documents"))
             if have < need]  # fmt: skip
    if not short:
        return []
    warning = (f"fitted on {' and '.join(short)}: the weights may not carry over to other text; fit on a larger "
               "held-out slice")  # fmt: skip
    log.warning(warning)
    return [warning]


# ---------------------------------------------------------------------------------------------- the fixed-weight rule


def sparse_state_features(flags: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """One-hot columns of the joint state of each ∞-gram's sparse flag (by component name, in the order given):
    ``sparse_state:<c1>=0,<c2>=1`` is 1 where ``c1``'s P∞ is not sparse and ``c2``'s is. A gate on them is any
    table of weights per state (:func:`rule_mixture`)."""
    names = list(flags)
    cols = [torch.as_tensor(np.asarray(flags[c])).reshape(-1).bool() for c in names]
    out = {}
    for bits in _states(len(names)):
        on = torch.ones_like(cols[0]) if cols else torch.ones(0, dtype=torch.bool)
        for col, bit in zip(cols, bits, strict=True):
            on = on & (col if bit else ~col)
        out[_state_name(names, bits)] = on.double()
    return out


def _states(r: int) -> list[tuple[bool, ...]]:
    return [tuple(bool(i >> (r - 1 - j) & 1) for j in range(r)) for i in range(2**r)]


def _state_name(names: Sequence[str], bits: Sequence[bool]) -> str:
    return "sparse_state:" + ",".join(f"{c}={int(b)}" for c, b in zip(names, bits, strict=True))


def rule_mixture(components: Sequence[str], weights: Mapping[str, float | Sequence[float]]) -> Mixture:
    """The fixed-weight rule as a :class:`Mixture`: every paper's constant λ, and infini-gram's λ_sparse / λ_dense.

    ``weights`` by component (missing: 0): a number is a constant weight (the kNN-LM's λ, Khandelwal et al. 2020
    Eq. 3; the cache's λc, Table 1); a pair ``(λ_sparse, λ_dense)`` is an ∞-gram's weight, λ_sparse where its P∞ is
    sparse (Liu et al. 2024, Sec. 5). The LM takes what is left::

        λ_0(c) = 1 - Σ_j λ_j - Σ_r λ_r(c),     λ_r(c) = λ_sparse,r if P∞_r(· | c) is sparse else λ_dense,r

    When the ∞-gram weights do not fit beside the constant ones (Λ + S > 1, ``Λ = Σ_j λ_j``,
    ``S = Σ_r max(λ_sparse,r, λ_dense,r)``: weights calibrated apart, one memory at a time), they are all scaled by
    ``(1 - Λ) W / S`` (W the largest of them): the references share, in proportion, what one reference of weight W
    would get beside the constant ones, so the LM keeps at least ``(1 - Λ)(1 - W)``. Constant weights alone must
    leave the LM > 0. With ∞-grams the result is a gate on :func:`sparse_state_features` (one weight table per joint
    state, exact for any number of references; a weight 0 in some states only is :data:`LOG_WEIGHT_FLOOR`)."""
    components = tuple(components)
    if not components or components[0] != "lm":
        raise MemlmError(f"the rule's components start with the LM ('lm'), got {components}")
    unknown = [c for c in weights if c not in components[1:]]
    if unknown:
        raise MemlmError(f"weights given for {', '.join(unknown)}, which are not memories of this mixture "
                         f"({', '.join(components[1:]) or 'none'})")  # fmt: skip
    fixed: dict[str, float] = {}
    pairs: dict[str, tuple[float, float]] = {}
    for c in components[1:]:
        w = weights.get(c, 0.0)
        if isinstance(w, int | float):
            fixed[c] = float(w)
        else:
            w = tuple(float(x) for x in w)
            if len(w) != 2:
                raise MemlmError(f"{c}: give one weight, or (λ_sparse, λ_dense); got {w}")
            pairs[c] = w  # type: ignore[assignment]
    values = list(fixed.values()) + [x for p in pairs.values() for x in p]
    if any(not math.isfinite(v) or v < 0 or v > 1 for v in values):
        raise MemlmError(f"every weight must be in [0, 1], got {dict(weights)}")
    total_fixed = sum(fixed.values())
    if total_fixed >= 1.0 - 1e-12 and (total_fixed > 1.0 + 1e-9 or any(max(p) > 0 for p in pairs.values())):
        raise MemlmError(f"the memories' constant weights sum to {total_fixed:g}: the LM's weight would be <= 0; "
                         "give smaller weights")  # fmt: skip
    tops = [max(p) for p in pairs.values()]
    if tops and total_fixed + sum(tops) > 1.0:
        scale = (1.0 - total_fixed) * max(tops) / sum(tops)
        pairs = {c: (p[0] * scale, p[1] * scale) for c, p in pairs.items()}
    if not pairs:
        w0 = max(0.0, 1.0 - total_fixed)
        if w0 <= 0:  # λ = 1: the memory alone (a tuning grid's end); the LM keeps e^-700, below float precision
            return _table_mixture(components, [], {(): [math.exp(LOG_WEIGHT_FLOOR), *fixed.values()]})
        return Mixture.constant(components, [w0, *(fixed[c] for c in components[1:])])
    names = list(pairs)
    table = {}
    for bits in _states(len(names)):
        w = {c: (pairs[c][0] if bit else pairs[c][1]) for c, bit in zip(names, bits, strict=True)}
        w.update(fixed)
        table[bits] = [max(0.0, 1.0 - sum(w.values())), *(w[c] for c in components[1:])]
    return _table_mixture(components, names, table)


def _table_mixture(components: tuple[str, ...], names: list[str], table: dict) -> Mixture:
    """A gate on :func:`sparse_state_features` of ``names`` giving ``table[state]`` (weights, LM first) in each
    state: ``b = 0``, ``W[i, state] = log(λ_i / λ_0)`` there (floored), ``b_i = -inf`` for a memory at 0 in every
    state. Without states (``names`` empty) a constant mixture whose weights may floor the LM."""
    states = list(table)
    feature_names = tuple(_state_name(names, bits) for bits in states) if names else ()
    W = np.zeros((len(components), len(feature_names)))
    b = np.zeros(len(components))
    with np.errstate(divide="ignore"):
        logs = {s: np.maximum(np.log(np.asarray(table[s], dtype=np.float64)), LOG_WEIGHT_FLOOR) for s in states}
    for i in range(1, len(components)):
        if all(table[s][i] == 0 for s in states):
            b[i] = -math.inf
        elif not names:
            b[i] = logs[()][i] - logs[()][0]
        else:
            W[i] = [logs[s][i] - logs[s][0] for s in states]
    f = len(feature_names)
    return Mixture(components, feature_names, W, b, np.zeros(f), np.ones(f), "rule")
