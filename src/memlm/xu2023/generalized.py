"""The generalized kNN-LM of Xu, Alon & Neubig 2023 ("Why do Nearest Neighbor Language Models Work?"), Eq. 5::

    P_interp = (1 - lambda) * softmax(W_sm . h_sm) + lambda * M softmax(mask-to-k(W_ds (x) h_ds) / tau)

``W_sm . h_sm`` are the LM's own logits. ``W_ds`` is an ``[N_ds, D]`` matrix: a datastore of keys (the kNN-LM) or a
learned matrix (Sec. 4.1 / 4.2). ``(x)`` is a similarity, inner product ("ip") or negative squared L2 distance
("l2"); scores are "larger = closer" as everywhere in memlm. ``mask-to-k`` keeps the ``k`` largest scores per query
and sets the rest to ``-inf``; with ``k = N_ds`` Eq. 5 is Eq. 4 (a softmax over the whole datastore). ``M``
(``V x N_ds``) sums the probabilities of the entries that share a value (vocabulary item).

Everything is computed in log space (log-softmax, per-value logsumexp, mixing: :mod:`memlm.core.distribution`, the
one place memlm turns scores and values into distributions), so a value whose entries all have tiny
probabilities gets a finite log-probability rather than ``log 0``.

The dense functions here (:func:`similarity`, :func:`eq5_logprobs`, ...) score every row of ``W_ds``: they are meant
for small datastores, subsampled ones, exact-vs-approximate ablations and learned matrices, not for a 100M-entry
datastore (use :mod:`memlm.storage.index` and :mod:`memlm.core.distribution` for that; both paths give the same numbers,
see the tests).

:class:`LearnedWds` and :func:`train_learned_wds` implement Sec. 4.1 ("replacing the datastore with trainable
embeddings", ``N_ds = V``) and Sec. 4.2 / App. B ("increasing the softmax capacity", ``N_ds = n V``): a trainable
``[n V, D]`` matrix, trained with cross-entropy of ``M softmax(W_ds . h_ds)`` against the next token while the LM
stays frozen, so training only needs a datastore's ``(keys, values)`` = ``(h_ds, next token)`` pairs.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from memlm.core.distribution import (
    METRICS,
    check_metric,
    check_temperature,
    knn_distribution,
    knn_target_logprob,
    mask_to_k,
    mix,
    similarity,
)
from memlm.errors import MemlmError
from memlm.io.fileio import atomic_write_bytes

__all__ = [
    "METRICS",
    "LearnedWds",
    "datastore_logprobs",
    "datastore_target_logprob",
    "eq5_logprobs",
    "eq5_target_logprob",
    "load_learned_wds",
    "mask_to_k",
    "save_learned_wds",
    "similarity",
    "train_learned_wds",
]

_FORMAT = "memlm.LearnedWds"
_FORMAT_VERSION = 1
_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


# --------------------------------------------------------------------------------------------- Eq. 5 pieces


def _check_values(values: torch.Tensor, n: int, vocab_size: int | None) -> torch.Tensor:
    """Validate ``values`` (``[n]`` token ids, below ``vocab_size`` when given); returns them as int64."""
    if values.dim() != 1 or values.shape[0] != n:
        raise MemlmError(f"values must be a [N] vector with N = {n} rows of W_ds, got shape {tuple(values.shape)}")
    if values.dtype.is_floating_point or values.dtype == torch.bool:
        raise MemlmError(f"values must be integer token ids, got dtype {values.dtype}")
    if n and int(values.min()) < 0:
        raise MemlmError(f"values must be token ids >= 0, got {int(values.min())}")
    if n and vocab_size is not None and int(values.max()) >= vocab_size:
        raise MemlmError(
            f"values must be token ids in [0, {vocab_size}), got range [{int(values.min())}, {int(values.max())}]: "
            "the datastore was built with a different tokenizer; rebuild it with this model's tokenizer"
        )
    return values.long()


def _masked_scores(h_ds: torch.Tensor, W_ds: torch.Tensor, k: int, metric: str) -> torch.Tensor:
    """``mask-to-k(W_ds (x) h_ds)``: ``[..., N]``, the k best scores of each query and ``-inf`` elsewhere."""
    if W_ds.shape[0] == 0:
        raise MemlmError("W_ds is empty (0 rows); build the datastore first")
    return mask_to_k(similarity(h_ds, W_ds, metric), k)


def datastore_logprobs(
    h_ds: torch.Tensor,
    W_ds: torch.Tensor,
    values: torch.Tensor,
    vocab_size: int,
    k: int,
    temperature: float = 1.0,
    metric: str = "l2",
) -> torch.Tensor:
    """The non-parametric component of Eq. 5 (Xu et al. 2023): ``log M softmax(mask-to-k(W_ds (x) h_ds) / tau)``.

    ``h_ds`` ``[..., D]``, ``W_ds`` ``[N, D]``, ``values`` ``[N]`` token ids in ``[0, vocab_size)``. Returns float32
    log-probabilities ``[..., vocab_size]`` (``-inf`` for values with no entry among the top ``k``).
    """
    values = _check_values(values, W_ds.shape[0], vocab_size)
    scores = _masked_scores(h_ds, W_ds, k, metric)
    return knn_distribution(scores, values.to(scores.device).expand_as(scores), vocab_size, temperature)


def datastore_target_logprob(
    h_ds: torch.Tensor,
    W_ds: torch.Tensor,
    values: torch.Tensor,
    targets: torch.Tensor,
    k: int,
    temperature: float = 1.0,
    metric: str = "l2",
) -> torch.Tensor:
    """``log p_kNN(target)`` of Eq. 5 (Xu et al. 2023) for each query, without the ``[..., V]`` distribution.

    ``log sum_{i: v_i = target} softmax(mask-to-k(W_ds (x) h_ds) / tau)_i``; ``targets`` has ``h_ds``'s leading
    shape ``[...]``; returns float32 ``[...]``.
    """
    values = _check_values(values, W_ds.shape[0], None)
    if targets.shape != h_ds.shape[:-1]:
        raise MemlmError(f"targets {tuple(targets.shape)} must have h_ds's leading shape {tuple(h_ds.shape[:-1])}")
    scores = _masked_scores(h_ds, W_ds, k, metric)
    return knn_target_logprob(scores, values.to(scores.device).expand_as(scores), targets.to(scores.device).long(),
                              temperature)  # fmt: skip


def eq5_logprobs(
    lm_logits: torch.Tensor,
    h_ds: torch.Tensor,
    W_ds: torch.Tensor,
    values: torch.Tensor,
    lam: float,
    k: int,
    temperature: float = 1.0,
    metric: str = "l2",
) -> torch.Tensor:
    """``log P_interp`` of Eq. 5 (Xu et al. 2023), in log space::

        P_interp = (1 - lambda) softmax(lm_logits) + lambda M softmax(mask-to-k(W_ds (x) h_ds) / tau)

    ``lm_logits`` ``[..., V]`` (``W_sm . h_sm``), ``h_ds`` ``[..., D]``, ``W_ds`` ``[N, D]``, ``values`` ``[N]`` token
    ids in ``[0, V)``. ``k >= N`` gives Eq. 4 (the whole datastore). Returns float32 ``[..., V]``.
    """
    if lm_logits.shape[:-1] != h_ds.shape[:-1]:
        raise MemlmError(
            f"lm_logits {tuple(lm_logits.shape)} and h_ds {tuple(h_ds.shape)} must have the same leading shape"
        )
    vocab = lm_logits.shape[-1]
    mem = datastore_logprobs(h_ds, W_ds, values, vocab, k, temperature, metric)
    lm = torch.log_softmax(lm_logits.float(), dim=-1)
    return mix([lm, mem.to(lm.device)], weights=[1.0 - lam, lam])


def eq5_target_logprob(
    lm_logits: torch.Tensor,
    h_ds: torch.Tensor,
    W_ds: torch.Tensor,
    values: torch.Tensor,
    targets: torch.Tensor,
    lam: float,
    k: int,
    temperature: float = 1.0,
    metric: str = "l2",
) -> torch.Tensor:
    """``log P_interp(target)`` of Eq. 5 (Xu et al. 2023) for each query; ``targets`` ``[...]`` -> float32 ``[...]``.

    Same arguments as :func:`eq5_logprobs`; only the target's probability is mixed, so this is the per-token loss.
    """
    if lm_logits.shape[:-1] != h_ds.shape[:-1] or targets.shape != lm_logits.shape[:-1]:
        raise MemlmError(
            f"lm_logits {tuple(lm_logits.shape)}, h_ds {tuple(h_ds.shape)} and targets {tuple(targets.shape)} "
            "must have the same leading shape"
        )
    vocab = lm_logits.shape[-1]
    _check_values(values, W_ds.shape[0], vocab)
    t = targets.long()
    lm = torch.log_softmax(lm_logits.float(), dim=-1).gather(-1, t.unsqueeze(-1)).squeeze(-1)
    mem = datastore_target_logprob(h_ds, W_ds, values, t, k, temperature, metric)
    return mix([lm, mem.to(lm.device)], weights=[1.0 - lam, lam])


# ------------------------------------------------------------------------------------- learned W_ds (Sec. 4)


class LearnedWds(torch.nn.Module):
    """A trainable ``W_ds`` of ``n V`` rows (Xu et al. 2023, Sec. 4.1 with ``n = 1``, Sec. 4.2 / App. B with ``n > 1``).

    ``P(w | h) = M softmax(W_ds (x) h / tau)``: row ``r`` of ``weight`` (``[n V, D]``) is an embedding of word
    ``r % V`` (``n`` stacked ``V x D`` blocks), and ``M`` sums the ``n`` copies of each word. The paper uses the inner
    product and ``tau = 1``; ``metric="l2"`` is also available.

    Initialisation: ``init`` is copied when given, either ``[n V, D]`` or ``[V, D]`` (e.g. the LM's output embedding;
    with ``n = 1`` and ``h`` the LM's final hidden state, this reproduces the LM). A ``[V, D]`` init is copied into
    every block, and blocks ``1 .. n-1`` get ``N(0, init_noise^2)`` noise added: identical copies would get identical
    gradients and never separate. Without ``init``, entries are ``N(0, 0.02^2)`` (GPT-2's embedding init), drawn
    from a generator seeded with ``seed``.
    """

    def __init__(
        self,
        vocab_size: int,
        dim: int,
        n: int = 1,
        metric: str = "ip",
        init: torch.Tensor | None = None,
        seed: int = 0,
        init_noise: float = 0.02,
    ) -> None:
        super().__init__()
        check_metric(metric)
        for name, val in (("vocab_size", vocab_size), ("dim", dim), ("n", n)):
            if isinstance(val, bool) or not isinstance(val, int | np.integer) or val < 1:
                raise MemlmError(f"{name} must be a positive integer, got {val!r}")
        self.vocab_size, self.dim, self.n, self.metric = int(vocab_size), int(dim), int(n), metric
        gen = torch.Generator().manual_seed(int(seed))
        rows = self.n * self.vocab_size
        if init is None:
            weight = torch.randn(rows, self.dim, generator=gen) * 0.02
        else:
            init = init.detach().float().cpu()
            if init.dim() != 2 or init.shape[1] != self.dim or init.shape[0] not in (self.vocab_size, rows):
                raise MemlmError(
                    f"init has shape {tuple(init.shape)} but a W_ds of vocab_size={self.vocab_size}, n={self.n}, "
                    f"dim={self.dim} needs [{self.vocab_size}, {self.dim}] or [{rows}, {self.dim}]: pass the output "
                    "embedding of the model whose hidden states you use (same vocabulary and width)"
                )
            if init.shape[0] == rows:
                weight = init.clone()
            else:
                weight = init.repeat(self.n, 1)
                if self.n > 1:
                    noise = torch.randn(rows - self.vocab_size, self.dim, generator=gen) * init_noise
                    weight[self.vocab_size :] += noise
        self.weight = torch.nn.Parameter(weight)

    @property
    def config(self) -> dict[str, Any]:
        """The JSON-able shape of this matrix: ``vocab_size``, ``dim``, ``n``, ``metric``."""
        return {"vocab_size": self.vocab_size, "dim": self.dim, "n": self.n, "metric": self.metric}

    @property
    def values(self) -> torch.Tensor:
        """The value (word) of each row, ``r % V``: ``[n V]`` int64 (the ``M`` of Eq. 5)."""
        return torch.arange(self.n * self.vocab_size, device=self.weight.device) % self.vocab_size

    def extra_repr(self) -> str:
        return f"vocab_size={self.vocab_size}, dim={self.dim}, n={self.n}, metric={self.metric!r}"

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """``W_ds (x) h`` (Eq. 5, Xu et al. 2023) for every row: ``[..., D] -> [..., n V]`` float32."""
        return similarity(h, self.weight, self.metric)

    def _grouped(self, h: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Scaled logits ``[..., n, V]`` and their logsumexp over all ``n V`` rows ``[...]``."""
        check_temperature(temperature)
        z = self.logits(h).float() / temperature
        return z.unflatten(-1, (self.n, self.vocab_size)), torch.logsumexp(z, dim=-1)

    def log_probs(self, h: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        """``log M softmax(W_ds (x) h / tau)`` (Eq. 5 with ``k = n V``; Xu et al. 2023 Sec. 4): ``[..., V]``.

        The ``n`` copies of each word are summed with a logsumexp.
        """
        z, lse = self._grouped(h, temperature)
        return torch.logsumexp(z, dim=-2) - lse.unsqueeze(-1)

    def target_logprob(self, h: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        """``log P(target | h)`` of :meth:`log_probs` for each query: ``h`` ``[..., D]``, ``targets`` ``[...]``.

        Its negative mean is the training loss of Xu et al. 2023 Sec. 4.1 (cross-entropy against the next token).
        """
        z, lse = self._grouped(h, temperature)
        idx = targets.to(z.device).long()[..., None, None].expand(*z.shape[:-1], 1)
        return torch.logsumexp(z.gather(-1, idx).squeeze(-1), dim=-1) - lse

    @torch.inference_mode()
    def score(self, queries: Any, targets: Any, chunk: int = 2048) -> torch.Tensor:
        """:meth:`target_logprob` of ``queries`` ``[N, D]`` (any array, e.g. float16 dumps) and ``targets`` ``[N]``,
        in chunks of ``chunk`` rows converted to float32: the memory's log-probabilities of a held-out text."""
        parts = []
        for s in range(0, len(targets), chunk):
            h = torch.from_numpy(np.array(queries[s : s + chunk], dtype=np.float32))
            y = torch.from_numpy(np.asarray(targets[s : s + chunk]).astype(np.int64))
            parts.append(self.target_logprob(h, y).float())
        return torch.cat(parts) if parts else torch.zeros(0)

    def forward(self, h: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        """Same as :meth:`log_probs`."""
        return self.log_probs(h, temperature)


# ------------------------------------------------------------------------------------------------ training


def _check_pairs(keys: Any, values: Any, vocab_size: int, what: str) -> tuple[int, int]:
    """Validate a ``(keys [N, D], values [N])`` pair; returns ``(N, D)``."""
    if getattr(keys, "ndim", None) != 2:
        raise MemlmError(f"{what} keys must be a [N, D] array, got shape {getattr(keys, 'shape', None)}")
    if getattr(values, "ndim", None) != 1:
        raise MemlmError(f"{what} values must be a [N] array, got shape {getattr(values, 'shape', None)}")
    n, d = int(keys.shape[0]), int(keys.shape[1])
    if n != int(values.shape[0]):
        raise MemlmError(
            f"{what} keys and values have different lengths ({n:,} vs {int(values.shape[0]):,}): "
            "they must be the two halves of one datastore"
        )
    if n == 0:
        raise MemlmError(f"{what} keys are empty (0 rows): nothing to train on; build the datastore first")
    vals = np.asarray(values)
    if not np.issubdtype(vals.dtype, np.integer):
        raise MemlmError(f"{what} values must be integer token ids, got dtype {vals.dtype}")
    lo, hi = int(vals.min()), int(vals.max())
    if lo < 0 or hi >= vocab_size:
        raise MemlmError(
            f"{what} values must be token ids in [0, {vocab_size}), got range [{lo}, {hi}]: "
            "vocab_size must be the vocabulary of the model that built the datastore"
        )
    return n, d


def _batches(
    keys: Any, values: Any, order: np.ndarray, batch_size: int, device: torch.device
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """``(float32 keys, int64 values)`` batches in ``order``; rows are read sorted (fast on a memmap)."""
    for s in range(0, len(order), batch_size):
        idx = np.sort(order[s : s + batch_size])
        k = torch.from_numpy(np.asarray(keys[idx], dtype=np.float32)).to(device)
        v = torch.from_numpy(np.asarray(values[idx]).astype(np.int64)).to(device)
        yield k, v


@torch.no_grad()
def _evaluate(
    model: LearnedWds, keys: Any, values: Any, batch_size: int, device: torch.device, dtype: torch.dtype
) -> float:
    """Mean ``-log P(value | key)`` over all pairs (nats)."""
    total, count = 0.0, 0
    order = np.arange(int(keys.shape[0]))
    for k, v in _batches(keys, values, order, batch_size, device):
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            lp = model.target_logprob(k, v)
        total += float(-lp.double().sum())
        count += int(v.numel())
    return total / count


def train_learned_wds(
    keys: Any,
    values: Any,
    vocab_size: int,
    n: int = 1,
    metric: str = "ip",
    epochs: int = 1,
    batch_size: int = 512,
    lr: float = 1e-3,
    max_steps: int | None = None,
    dtype: str = "bfloat16",
    seed: int = 0,
    valid: tuple[Any, Any] | None = None,
    progress: bool = True,
    init: torch.Tensor | None = None,
    device: str | torch.device | None = None,
    log_every: int = 100,
    patience: int | None = None,
    min_delta: float = 1e-3,
    on_log: Callable[[list[dict[str, Any]]], None] | None = None,
) -> tuple[LearnedWds, list[dict[str, Any]]]:
    """Train a :class:`LearnedWds` on a datastore's ``(h_ds, next token)`` pairs (Xu et al. 2023, Sec. 4.1 / 4.2).

    Loss: ``-log M softmax(W_ds (x) k_i)[v_i]`` (cross-entropy of Eq. 5's non-parametric part with ``k = n V``,
    ``tau = 1``), minimised over ``W_ds`` only with AdamW (no weight decay); the LM is not involved: ``keys``
    (``[N, D]``, e.g. a float16 ``np.memmap`` such as ``Datastore.keys``) are its ``h_ds`` vectors and ``values``
    (``[N]`` ints) the next tokens. Batches of ``batch_size`` rows are streamed in a shuffled order (a fresh
    permutation per epoch from ``seed``) and converted to float32; ``dtype="bfloat16"`` runs the matmul under
    ``torch.autocast`` (weights and optimizer state stay float32). Training stops after ``epochs`` epochs or
    ``max_steps`` steps, whichever comes first.

    ``device`` defaults to CUDA when available. ``init``, ``n``, ``metric``, ``seed``: see :class:`LearnedWds`.
    ``valid``: optional ``(keys, values)`` evaluated at every log point.

    ``patience`` (needs ``valid``): train until the validation loss plateaus instead of for a fixed budget: stop
    once ``patience`` consecutive log points have not lowered the best validation loss by more than ``min_delta``
    nats, and return the weights of the best log point (early stopping; ``epochs`` / ``max_steps`` stay upper
    bounds). The log then ends with the point that triggered the stop; ``best_step`` in each entry names the step
    whose weights are kept so far.

    Returns the trained model (on ``device``, in eval mode) and a log: one dict every ``log_every`` steps, plus one
    before the first update (step 0) and one at the end, with ``step``, ``epoch``, ``loss`` (mean training loss per
    token since the previous entry; at step 0 the loss of the first batch) and, with ``valid``, ``valid_loss`` and
    ``valid_ppl``.

    ``on_log`` (optional) is called with the log so far after every entry, e.g. to write the curve of a long run
    to disk as it grows (a run stopped early still leaves its curve).
    """
    if dtype not in _DTYPES:
        raise MemlmError(f"unknown dtype {dtype!r}; use one of {', '.join(_DTYPES)}")
    for name, val in (("epochs", epochs), ("batch_size", batch_size), ("log_every", log_every)):
        if isinstance(val, bool) or not isinstance(val, int | np.integer) or val < 1:
            raise MemlmError(f"{name} must be a positive integer, got {val!r}")
    if max_steps is not None and max_steps < 1:
        raise MemlmError(f"max_steps must be a positive integer or None, got {max_steps!r}")
    if not lr > 0:
        raise MemlmError(f"lr must be > 0, got {lr}")
    check_metric(metric)
    if patience is not None:
        if isinstance(patience, bool) or not isinstance(patience, int | np.integer) or patience < 1:
            raise MemlmError(f"patience must be a positive integer or None, got {patience!r}")
        if valid is None:
            raise MemlmError("patience (stop when the validation loss plateaus) needs valid=(keys, values)")
    num, dim = _check_pairs(keys, values, vocab_size, "training")
    if valid is not None:
        if not isinstance(valid, tuple | list) or len(valid) != 2:
            raise MemlmError("valid must be a (keys, values) pair")
        _, vdim = _check_pairs(valid[0], valid[1], vocab_size, "validation")
        if vdim != dim:
            raise MemlmError(f"validation keys have dimension {vdim} but training keys have {dim}")
    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    amp = _DTYPES[dtype]

    model = LearnedWds(vocab_size, dim, n=n, metric=metric, init=init, seed=seed).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    steps_per_epoch = math.ceil(num / batch_size)
    total = epochs * steps_per_epoch if max_steps is None else min(max_steps, epochs * steps_per_epoch)
    rng = np.random.default_rng(seed)
    log: list[dict[str, Any]] = []

    best: dict[str, Any] = {"loss": math.inf, "step": 0, "state": None, "stale": 0}

    def record(step: int, epoch: int, loss: float) -> bool:
        """Append a log entry; True when early stopping says stop."""
        entry: dict[str, Any] = {"step": step, "epoch": epoch, "loss": loss}
        stop = False
        if valid is not None:
            model.eval()
            vloss = _evaluate(model, valid[0], valid[1], batch_size * 4, dev, amp)
            model.train()
            entry.update(valid_loss=vloss, valid_ppl=math.exp(min(vloss, 700.0)))
            if patience is not None:
                if vloss < best["loss"] - min_delta:
                    best.update(loss=vloss, step=step, stale=0,
                                state={k: v.detach().clone() for k, v in model.state_dict().items()})  # fmt: skip
                else:
                    best["stale"] += 1
                    stop = best["stale"] >= patience
                entry["best_step"] = best["step"]
        log.append(entry)
        if on_log is not None:
            on_log(log)
        return stop

    step, run_loss, run_n = 0, 0.0, 0
    model.train()
    with tqdm(total=total, desc="learned W_ds", unit="step", disable=not progress) as bar:
        for epoch in range(epochs):
            if step >= total:
                break
            order = rng.permutation(num)
            for k, v in _batches(keys, values, order, batch_size, dev):
                if step >= total:
                    break
                with torch.autocast(dev.type, dtype=amp, enabled=amp != torch.float32):
                    loss = -model.target_logprob(k, v).mean()
                if not torch.isfinite(loss):
                    raise MemlmError(
                        f"training loss became {float(loss.detach())} at step {step}: "
                        f"lower the learning rate (lr={lr}) or use dtype='float32'"
                    )
                loss_value = float(loss.detach())
                if step == 0:
                    record(0, epoch, loss_value)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                step += 1
                run_loss += loss_value * int(v.numel())
                run_n += int(v.numel())
                bar.update(1)
                bar.set_postfix(loss=f"{loss_value:.3f}")
                if step % log_every == 0 or step == total:
                    stopped = record(step, epoch, run_loss / run_n)
                    run_loss, run_n = 0.0, 0
                    if stopped:
                        total = step  # ends both loops
    if patience is not None and best["state"] is not None:
        model.load_state_dict(best["state"])
    model.eval()
    return model, log


# ------------------------------------------------------------------------------------------------ save / load


def save_learned_wds(model: LearnedWds, path: str | Path) -> Path:
    """Save a :class:`LearnedWds` (Xu et al. 2023, Sec. 4) as one safetensors file, written atomically.

    The file holds the float32 ``weight`` and, in its metadata, the config (``vocab_size``, ``dim``, ``n``,
    ``metric``) as JSON. Returns the path.
    """
    from safetensors.torch import save

    path = Path(path)
    meta = {"format": _FORMAT, "version": str(_FORMAT_VERSION), "config": json.dumps(model.config, sort_keys=True)}
    data = save({"weight": model.weight.detach().float().cpu().contiguous()}, metadata=meta)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, data)
    return path


def load_learned_wds(path: str | Path, device: str | torch.device = "cpu") -> LearnedWds:
    """Load a :class:`LearnedWds` (Xu et al. 2023, Sec. 4) saved by :func:`save_learned_wds`; eval mode."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise MemlmError(f"no learned W_ds file at {path}; train one with train_learned_wds and save_learned_wds")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            weight = f.get_tensor("weight")
        if meta.get("format") != _FORMAT:
            raise ValueError(f"format is {meta.get('format')!r}, not {_FORMAT!r}")
        if int(meta.get("version", "0")) > _FORMAT_VERSION:
            raise ValueError(f"version {meta.get('version')} is newer than this memlm supports ({_FORMAT_VERSION})")
        cfg = json.loads(meta["config"])
        model = LearnedWds(int(cfg["vocab_size"]), int(cfg["dim"]), n=int(cfg["n"]), metric=str(cfg["metric"]))
    except MemlmError:
        raise
    except Exception as err:  # corrupt file, missing tensor or metadata
        raise MemlmError(f"{path} is not a learned W_ds file saved by memlm ({err}); re-save it") from None
    if tuple(weight.shape) != tuple(model.weight.shape):
        raise MemlmError(
            f"{path}: weight has shape {tuple(weight.shape)} but its config says {tuple(model.weight.shape)}; "
            "the file is corrupt, re-save it"
        )
    with torch.no_grad():
        model.weight.copy_(weight)
    return model.to(device).eval()
