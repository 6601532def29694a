"""Adaptive retrieval (He, Neubig, Berg-Kirkpatrick 2021, "Efficient Nearest Neighbor Language Models", Sec. 4).

The kNN-LM searches the datastore for every token although most tokens gain nothing from it. He et al. train a small
"retrieval adaptor" ``g`` that reads cheap features of the context and predicts a per-token interpolation weight::

    p(w | x) = (1 - λ(x)) p_LM(w | x) + λ(x) p_kNN(w | x),        λ(x) = sigmoid(MLP(f(x))) in (0, 1)

trained on held-out tokens (not the datastore's) by maximum likelihood of the interpolated target probability,
He et al.'s objective::

    L = - mean_t log( (1 - λ(x_t)) p_LM(w_t | x_t) + λ(x_t) p_kNN(w_t | x_t) )

with ``p_kNN`` computed at the chosen temperature τ (and k) from a per-token dump
(:class:`memlm.knnlm.table.TokenTable`).
At inference, tokens whose predicted λ is below a threshold skip the search: their λ is set to 0 and ``p = p_LM``;
:func:`threshold_for_fraction` picks the threshold that searches a given fraction of the tokens.

Features (:data:`FEATURE_NAMES`, :func:`gate_features`), all from the LM's own forward pass, one row per target:

* ``lm_entropy``: ``H(p_LM(. | x)) = -sum_w p_LM(w) log p_LM(w)`` in nats;
* ``lm_max_logprob``: ``max_w log p_LM(w | x)`` (the LM's confidence);
* ``log_position``: ``log(1 + position)``, the target's position in its document (its datastore-style ``offset``):
  early tokens have little context.

(He et al. also use the context vector, unigram frequency and "fertility" features; the two LM features carry most of
the signal in their ablation and are free to compute.) Features are standardised with the training set's mean and
standard deviation, stored in the gate. Training is full-batch (or seeded mini-batch) Adam from a seeded
initialisation: the same data and seed give bit-identical gates on the same machine.

**It stays a separate efficiency strategy, not a use of the stored mixture's weights.** The learned mixture
(:mod:`memlm.core.mixture`, the default weights of every consumer) reads features of the retrieval itself (the best
neighbour's score, the log-sum-exp of the scores, the top value's share), so its weight is known only after the
search; a gate that decides *whether to search* can read only what exists before it, the LM's own forward pass. Its
λ here is used for that decision (and, where the search runs, as the kNN-LM's weight, as He et al. do); which
weights mix the searched tokens is the mixture's business, and skipping a search is a trade of perplexity for time
that the mixture's maximum-likelihood fit never makes. Folding the two would either make the mixture blind to the
retrieval (worse weights) or make the skip decision depend on a search already paid for (no saving).
"""

from __future__ import annotations

import io
import json
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch import nn

from memlm.core.distribution import mix
from memlm.errors import MemlmError
from memlm.io.fileio import atomic_write_bytes, dumps_json

__all__ = [
    "FEATURE_NAMES",
    "AdaptiveGate",
    "gate_features",
    "gate_lambdas",
    "gate_loss",
    "threshold_for_fraction",
    "train_gate",
]

FEATURE_NAMES = ("lm_entropy", "lm_max_logprob", "log_position")
_FORMAT = "memlm-adaptive-gate"
_VERSION = 1


def gate_features(lm_entropy: np.ndarray, lm_max_logprob: np.ndarray, position: np.ndarray) -> np.ndarray:
    """The gate's input ``[N, 3]`` float32: ``H(p_LM)``, ``max log p_LM``, ``log(1 + position)`` (see the module)."""
    cols = [np.asarray(a, dtype=np.float64).reshape(-1) for a in (lm_entropy, lm_max_logprob, position)]
    if len({len(c) for c in cols}) != 1:
        raise MemlmError(f"gate features need one value per token each, got lengths {[len(c) for c in cols]}")
    if (cols[2] < 0).any():
        raise MemlmError("positions must be >= 0 (the target's offset in its document)")
    out = np.stack([cols[0], cols[1], np.log1p(cols[2])], axis=1).astype(np.float32)
    if not np.isfinite(out).all():
        raise MemlmError("gate features must be finite (an entropy or max log-prob is nan or inf)")
    return out


class AdaptiveGate(nn.Module):
    """``λ(x) = sigmoid(MLP((f(x) - mean) / std))``: an MLP with ``layers`` ReLU hidden layers of ``hidden`` units."""

    def __init__(self, feature_names: Sequence[str] = FEATURE_NAMES, hidden: int = 32, layers: int = 2):
        super().__init__()
        if hidden < 1 or layers < 0:
            raise MemlmError(f"the gate needs hidden >= 1 and layers >= 0, got {hidden}, {layers}")
        self.feature_names = tuple(feature_names)
        self.hidden, self.layers = int(hidden), int(layers)
        nf = len(self.feature_names)
        self.register_buffer("mean", torch.zeros(nf))
        self.register_buffer("std", torch.ones(nf))
        mods: list[nn.Module] = []
        width = nf
        for _ in range(self.layers):
            mods += [nn.Linear(width, self.hidden), nn.ReLU()]
            width = self.hidden
        mods.append(nn.Linear(width, 1))
        self.mlp = nn.Sequential(*mods)

    def config(self) -> dict:
        return {"feature_names": list(self.feature_names), "hidden": self.hidden, "layers": self.layers}

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """``z`` with ``λ = sigmoid(z)``: ``[N, F] -> [N]``."""
        if features.ndim != 2 or features.shape[1] != len(self.feature_names):
            raise MemlmError(
                f"the gate reads [N, {len(self.feature_names)}] features ({', '.join(self.feature_names)}), "
                f"got shape {tuple(features.shape)}"
            )
        x = (features.to(self.mean.dtype) - self.mean) / self.std
        return self.mlp(x).squeeze(-1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """``λ(x)`` for ``[N, F]`` features: ``[N]`` in (0, 1)."""
        return torch.sigmoid(self.logits(features))

    @torch.no_grad()
    def lambdas(self, features: np.ndarray) -> np.ndarray:
        """``λ(x)`` as float64 NumPy (no gradient), for thresholds and scoring."""
        return self.forward(torch.as_tensor(np.asarray(features), dtype=torch.float32)).double().numpy()

    def save(self, path: str | Path) -> None:
        """Write the gate to one ``.npz`` (JSON config + float32 tensors, no pickle), atomically."""
        arrays = {f"param/{k}": v.detach().cpu().numpy() for k, v in self.state_dict().items()}
        meta = {"format": _FORMAT, "version": _VERSION, **self.config()}
        buf = io.BytesIO()
        np.savez(buf, config=np.array(dumps_json(meta, indent=None)), **arrays)
        atomic_write_bytes(Path(path), buf.getvalue())

    @classmethod
    def load(cls, path: str | Path, feature_names: Sequence[str] = FEATURE_NAMES) -> AdaptiveGate:
        """Read a gate written by :meth:`save`; refuse one trained on other features than ``feature_names``."""
        path = Path(path)
        fix = "retrain it with memlm.knnlm.adaptive.train_gate"
        try:
            with np.load(path, allow_pickle=False) as z:
                meta = json.loads(str(z["config"]))
                state = {k[len("param/") :]: torch.from_numpy(z[k].copy()) for k in z.files if k.startswith("param/")}
        except (OSError, ValueError, KeyError, EOFError) as e:
            raise MemlmError(f"{path} is not a memlm adaptive-retrieval gate ({e}); {fix}") from None
        if not isinstance(meta, dict) or meta.get("format") != _FORMAT or meta.get("version") != _VERSION:
            raise MemlmError(f"{path} is not a memlm adaptive-retrieval gate (format {meta!r:.80}); {fix}")
        if tuple(meta.get("feature_names", ())) != tuple(feature_names):
            raise MemlmError(
                f"gate {path} was trained on features {meta.get('feature_names')}, not {list(feature_names)}; {fix}"
            )
        gate = cls(meta["feature_names"], meta["hidden"], meta["layers"])
        try:
            gate.load_state_dict(state, strict=True)
        except RuntimeError as e:
            raise MemlmError(f"gate {path} has tensors that do not fit its config ({e}); {fix}") from None
        return gate.eval()


def gate_loss(gate: AdaptiveGate, features: torch.Tensor, lm: torch.Tensor, knn: torch.Tensor) -> torch.Tensor:
    """He et al.'s objective ``-mean log((1 - λ) p_LM + λ p_kNN)``, with ``log λ`` and ``log(1 - λ)`` as log-sigmoids
    (stable for saturated gates); ``knn = -inf`` (target not retrieved) contributes ``(1 - λ) p_LM`` only."""
    z = gate.logits(features)
    return -mix([lm, knn], [torch.nn.functional.logsigmoid(-z), torch.nn.functional.logsigmoid(z)]).mean()


def train_gate(
    features: np.ndarray,
    lm_logprob: np.ndarray,
    knn_logprob: np.ndarray,
    steps: int = 300,
    lr: float = 1e-2,
    hidden: int = 32,
    layers: int = 2,
    batch_size: int | None = None,
    seed: int = 0,
    feature_names: Sequence[str] = FEATURE_NAMES,
) -> AdaptiveGate:
    """Fit an :class:`AdaptiveGate` on held-out tokens by Adam on :func:`gate_loss` (He et al. 2021 Sec. 4).

    ``features`` ``[N, F]`` (:func:`gate_features`), ``lm_logprob`` ``[N]`` = ``log p_LM(target)`` and ``knn_logprob``
    ``[N]`` = ``log p_kNN(target)`` at the chosen τ and k (``-inf`` where the target was not retrieved). ``steps``
    Adam updates on the full set, or on mini-batches of ``batch_size`` drawn with ``seed``; the initial weights come
    from ``seed`` too (the global torch RNG is left untouched). Deterministic for the same inputs.
    """
    x = torch.as_tensor(np.asarray(features), dtype=torch.float32)
    lm = torch.as_tensor(np.asarray(lm_logprob), dtype=torch.float32).reshape(-1)
    knn = torch.as_tensor(np.asarray(knn_logprob), dtype=torch.float32).reshape(-1)
    n = len(lm)
    if x.ndim != 2 or len(x) != n or len(knn) != n or n == 0:
        raise MemlmError(
            f"train_gate needs features [N, F], lm_logprob [N] and knn_logprob [N] for the same N > 0 tokens, got "
            f"{tuple(x.shape)}, {tuple(lm.shape)}, {tuple(knn.shape)}"
        )
    if not torch.isfinite(lm).all() or torch.isnan(knn).any() or (knn == float("inf")).any():
        raise MemlmError("lm_logprob must be finite and knn_logprob finite or -inf")
    knn = knn.clamp(min=-1e4)  # exp(-1e4) == 0: the same objective without inf arithmetic in the gradient
    gen = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        gate = AdaptiveGate(feature_names, hidden, layers)
    gate.mean.copy_(x.mean(0))
    gate.std.copy_(x.std(0, unbiased=False).clamp(min=1e-6))
    opt = torch.optim.Adam(gate.parameters(), lr=lr)
    gate.train()
    for _ in range(int(steps)):
        if batch_size is not None and batch_size < n:
            idx = torch.randint(0, n, (batch_size,), generator=gen)
            loss = gate_loss(gate, x[idx], lm[idx], knn[idx])
        else:
            loss = gate_loss(gate, x, lm, knn)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return gate.eval()


def threshold_for_fraction(gate: AdaptiveGate, features: np.ndarray, fraction: float) -> float:
    """The threshold on ``λ(x)`` such that ``round(fraction * N)`` of these tokens have ``λ >= threshold`` (searched).

    ``fraction = 0`` gives ``inf`` (no search), ``1`` the smallest λ (every token). Tokens with exactly the threshold's
    λ (ties) are all searched, so the fraction can come out slightly higher on tied gates.
    """
    if not 0.0 <= fraction <= 1.0:
        raise MemlmError(f"fraction must be in [0, 1], got {fraction}")
    lam = gate.lambdas(features)
    m = round(fraction * len(lam))
    if m == 0:
        return math.inf
    return float(np.sort(lam)[::-1][m - 1])


def gate_lambdas(gate: AdaptiveGate, features: np.ndarray, threshold: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """``(λ, searched)`` per token at inference: ``searched = λ(x) >= threshold``; skipped tokens get ``λ = 0``."""
    lam = gate.lambdas(features)
    searched = lam >= threshold
    return np.where(searched, lam, 0.0), searched
