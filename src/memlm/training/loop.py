"""One training loop for causal LMs, shared by plain LM training (Xu et al. 2023) and TRIME (a loss is swapped in).

:func:`train` runs AdamW (no weight decay on biases and norms, i.e. parameters with fewer than 2 dimensions) under a
linear warm-up then cosine decay to ``min_lr_ratio`` of the peak, with gradient accumulation, gradient clipping,
optional bfloat16 autocast, validation perplexity, atomic checkpoints and exact resume.

Data. ``train_batches`` is either a callable ``epoch -> iterable of batches`` (e.g. :func:`lm_batches`, whose order is
a function of its seed and the epoch) or a re-iterable collection of batches (a list), used as is every epoch. A batch
is a dict with ``input_ids`` [B, T] (int64) and optionally ``attention_mask`` [B, T] and any extra fields a custom loss
needs. The data position saved in a checkpoint is (epoch, batches consumed in that epoch); a resumed run asks for the
same epoch again and skips the consumed batches, so it sees exactly the batches an uninterrupted run would.

Loss. A loss is any callable ``loss_fn(model, batch) -> scalar tensor`` (:class:`LossFn`); the default
:func:`causal_lm_loss` is the mean cross-entropy of next tokens. ``warmup_loss`` (default :func:`causal_lm_loss`)
replaces ``loss_fn`` for the first ``TrainConfig.warmup_loss_steps`` updates (TRIME trains with plain CE for the
first ~5% of updates: ``warmup_loss_steps=0.05``).

Learning rate at update ``s`` (0-based, ``W`` warm-up updates, ``S = max_steps``, ``r = min_lr_ratio``)::

    s <  W:  lr * (s + 1) / W
    s >= W:  lr * (r + (1 - r) * 0.5 * (1 + cos(pi * (s - W) / max(1, S - W))))

Files under ``out_dir``::

    checkpoint-<step>/   model (save_pretrained) + training_state.pt (optimizer, scheduler, step, RNG states, data
                         position, log, config); written into a temporary folder renamed into place; the last
                         ``keep_checkpoints`` are kept
    final/               the final model (save_pretrained)
    log.json             {"config": ..., "log": [{step, loss, lr, tokens, tokens_per_s[, valid_ppl, valid_loss]}, ...]}
    run.json             what the run is trained on (corpus, tokenizer, model, loss: ``identity``); a rerun with other
                         values is refused with the differences named (:func:`check_run_identity`)

One writer per run folder: :func:`train` holds the folder's lock (:mod:`memlm.io.locking`). ``resume=False`` starts
over: the folder's checkpoints, ``final`` and ``run.json`` are deleted first, so a later resume never continues from
a checkpoint of the old run.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
import os
import random
import re
import shutil
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
import torch.nn.functional as F

from memlm.errors import MemlmError
from memlm.io import schema
from memlm.io.fileio import atomic_write_json, disk_full_error, is_disk_full
from memlm.io.locking import folder_lock

__all__ = [
    "GPT2_SIZES",
    "LMBatches",
    "LossFn",
    "TrainConfig",
    "TrainResult",
    "causal_lm_loss",
    "check_run_identity",
    "describe_callable",
    "lm_batches",
    "lr_at",
    "parse_arch",
    "train",
    "write_log",
]

_STATE_FILE = "training_state.pt"
_STATE_FORMAT = 1
RUN_FILE = "run.json"
# Config fields that may change between an interrupted run and its resumption without changing the result.
_RESUMABLE_CHANGES = {"eval_every", "save_every", "keep_checkpoints", "log_every", "device"}


@dataclass
class TrainConfig:
    """Settings of :func:`train`.

    ``warmup_steps`` and ``warmup_loss_steps`` are update counts, or fractions of ``max_steps`` when a float in (0, 1).
    ``batch_size`` and ``seq_len`` describe the batches (``lm_batches`` takes them; ``train`` checks ``seq_len``
    against the model's maximum positions). ``eval_every``/``save_every`` of 0 disable periodic evaluation/saving
    (the end of training always evaluates, when validation data is given, and saves ``final``).
    """

    lr: float = 3e-4
    weight_decay: float = 0.1
    warmup_steps: int | float = 0.05
    max_steps: int = 1000
    batch_size: int = 8
    grad_accum: int = 1
    seq_len: int = 256
    dtype: str = "float32"  # "float32" or "bfloat16" (autocast)
    eval_every: int = 0
    save_every: int = 0
    seed: int = 0
    max_grad_norm: float | None = 1.0
    min_lr_ratio: float = 0.1
    warmup_loss_steps: int | float = 0
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    keep_checkpoints: int = 2
    log_every: int = 1  # progress-bar refresh, in updates (every update is logged to log.json regardless)
    device: str = "auto"  # where to train: "auto" (CUDA when available, else CPU), "cpu", "cuda", "cuda:1", ...

    def resolved_warmup(self) -> int:
        return _steps(self.warmup_steps, self.max_steps, "warmup_steps")

    def resolved_warmup_loss(self) -> int:
        return _steps(self.warmup_loss_steps, self.max_steps, "warmup_loss_steps")

    def validate(self) -> None:
        if self.max_steps < 1:
            raise MemlmError(f"max_steps must be at least 1, got {self.max_steps}")
        for name in ("batch_size", "grad_accum", "seq_len", "keep_checkpoints", "log_every"):
            if getattr(self, name) < 1:
                raise MemlmError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.lr <= 0:
            raise MemlmError(f"lr must be positive, got {self.lr}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise MemlmError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.dtype not in ("float32", "bfloat16"):
            raise MemlmError(f"dtype must be 'float32' or 'bfloat16' (autocast), got {self.dtype!r}")
        self.resolved_warmup()
        self.resolved_warmup_loss()
        self.torch_device()

    def torch_device(self) -> torch.device:
        """The device of ``device``: ``auto`` is CUDA when ``torch.cuda.is_available()``, else CPU."""
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        try:
            dev = torch.device(self.device)
        except (RuntimeError, TypeError) as e:
            raise MemlmError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}") from e
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise MemlmError(f"device {self.device!r} was asked for, but torch sees no CUDA GPU: use device='cpu'")
        return dev


def _steps(value: int | float, max_steps: int, name: str) -> int:
    if isinstance(value, float) and 0 < value < 1:
        return int(round(value * max_steps))
    if value < 0 or value != int(value):
        raise MemlmError(f"{name} must be a count of updates or a fraction in (0, 1), got {value}")
    return int(value)


def lr_at(config: TrainConfig, step: int) -> float:
    """The learning rate of update ``step`` (0-based): linear warm-up, then cosine decay (module docstring)."""
    warm = config.resolved_warmup()
    if step < warm:
        return config.lr * (step + 1) / warm
    progress = min(1.0, (step - warm) / max(1, config.max_steps - warm))
    r = config.min_lr_ratio
    return config.lr * (r + (1 - r) * 0.5 * (1 + math.cos(math.pi * progress)))


class _Schedule:
    """Picklable LambdaLR factor (its state goes into the scheduler's state_dict)."""

    def __init__(self, config: TrainConfig):
        self.config = dataclasses.asdict(config)

    def __call__(self, step: int) -> float:
        cfg = TrainConfig(**self.config)
        return lr_at(cfg, step) / cfg.lr


# ---------------------------------------------------------------------------------------------------------------
# Losses


class LossFn(Protocol):
    def __call__(self, model: torch.nn.Module, batch: dict[str, Any]) -> torch.Tensor: ...


def _ce_sum(model: torch.nn.Module, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of next-token cross-entropies, number of scored targets) of a batch."""
    ids = batch["input_ids"]
    mask = batch.get("attention_mask")
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
    targets = ids[:, 1:]
    ce = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), reduction="none")
    if mask is not None:
        keep = mask[:, 1:].reshape(-1).to(ce.dtype)
        return (ce * keep).sum(), keep.sum()
    return ce.sum(), torch.tensor(float(ce.numel()))


def causal_lm_loss(model: torch.nn.Module, batch: dict[str, Any]) -> torch.Tensor:
    """Mean cross-entropy of each next token (positions with ``attention_mask`` 0 as targets are ignored)."""
    total, count = _ce_sum(model, batch)
    return total / count.clamp_min(1)


# ---------------------------------------------------------------------------------------------------------------
# Batches


class LMBatches:
    """Callable ``epoch -> iterator of batches`` over fixed ``seq_len`` chunks of a token stream.

    Each epoch visits every chunk once in an order drawn from ``seed`` and the epoch number (the last batch of an
    epoch may be smaller). ``len()`` is the number of batches per epoch.
    """

    def __init__(self, chunks: np.ndarray, batch_size: int, seed: int = 0, shuffle: bool = True):
        self.chunks = chunks  # [n, seq_len] int64
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle

    def __len__(self) -> int:
        return math.ceil(len(self.chunks) / self.batch_size)

    def __call__(self, epoch: int = 0) -> Iterator[dict[str, torch.Tensor]]:
        n = len(self.chunks)
        order = np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle else np.arange(n)
        for start in range(0, n, self.batch_size):
            idx = order[start : start + self.batch_size]
            yield {"input_ids": torch.from_numpy(self.chunks[idx].copy())}


def lm_batches(
    data: Sequence | np.ndarray,
    tokenizer=None,
    seq_len: int = 256,
    batch_size: int = 8,
    seed: int = 0,
    shuffle: bool = True,
) -> LMBatches:
    """Batches for LM training: documents' tokens (each followed by EOS) concatenated and cut into ``seq_len`` chunks.

    ``data`` is a sequence of documents (objects with ``.id`` and ``.text``, tokenized with ``tokenizer``) or an
    already concatenated 1-D token stream. The tail shorter than ``seq_len`` is dropped. Returns an
    :class:`LMBatches` (call it with an epoch number; pass it as ``train_batches``).
    """
    if seq_len < 2:
        raise MemlmError(f"seq_len must be at least 2 tokens, got {seq_len}")
    if batch_size < 1:
        raise MemlmError(f"batch_size must be at least 1, got {batch_size}")
    if isinstance(data, (np.ndarray, torch.Tensor)):
        stream = np.asarray(data, dtype=np.int64).reshape(-1)
    else:
        if tokenizer is None:
            raise MemlmError("lm_batches needs a tokenizer to tokenize documents (or pass a 1-D token array)")
        from memlm.data.windows import tokenize_documents

        docs = list(data)
        parts = [c.tokens for c in tokenize_documents(docs, tokenizer)] if docs else []
        stream = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    n = len(stream) // seq_len
    if n == 0:
        raise MemlmError(
            f"the training corpus has {len(stream)} tokens, fewer than one sequence of seq_len={seq_len}: "
            f"give more text or a smaller seq_len"
        )
    return LMBatches(stream[: n * seq_len].reshape(n, seq_len), batch_size, seed, shuffle)


def _as_epochs(batches) -> Callable[[int], Iterable[dict[str, Any]]]:
    if batches is None:
        return None
    if callable(batches):
        return batches
    if isinstance(batches, Iterator):
        raise MemlmError(
            "train batches must be a list (re-iterable) or a callable epoch -> batches, not a one-shot iterator: "
            "resuming needs to replay an epoch"
        )
    return lambda epoch: batches


def _to_device(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


# ---------------------------------------------------------------------------------------------------------------
# GPT-2 configs

# name -> (n_layer, n_embd, n_head); parameter counts for vocab 50,257 and 1,024 positions (tied embeddings):
GPT2_SIZES: dict[str, tuple[int, int, int]] = {
    "5m": (4, 96, 4),  # 5.37M
    "10m": (6, 160, 4),  # 10.06M
    "20m": (6, 288, 8),  # 20.76M
    "30m": (8, 352, 8),  # 29.98M
    "50m": (8, 512, 8),  # 51.48M
}


def parse_arch(size: str) -> tuple[int, int, int]:
    """``(n_layer, n_embd, n_head)`` of a preset (5m, 10m, 20m, 30m, 50m) or ``<layers>x<dim>`` (64-dim heads)."""
    key = size.strip().lower()
    if key in GPT2_SIZES:
        return GPT2_SIZES[key]
    m = re.fullmatch(r"(\d+)x(\d+)", key)
    if not m or int(m.group(1)) < 1 or int(m.group(2)) < 64 or int(m.group(2)) % 64:
        raise MemlmError(
            f"bad model size {size!r}: use a preset ({', '.join(GPT2_SIZES)}) or <layers>x<dim> with dim a multiple "
            f"of 64, e.g. 6x384"
        )
    n_layer, n_embd = int(m.group(1)), int(m.group(2))
    return n_layer, n_embd, n_embd // 64


def gpt2_shape_config(n_layer: int, n_embd: int, n_head: int, vocab_size: int, n_positions: int, dropout: float, **kw):
    """A ``GPT2Config`` of this shape with all three GPT-2 dropouts at ``dropout``; ``kw`` go to ``GPT2Config``."""
    from transformers import GPT2Config

    return GPT2Config(vocab_size=vocab_size, n_positions=n_positions, n_layer=n_layer, n_embd=n_embd, n_head=n_head,
                      resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout, **kw)  # fmt: skip


# ---------------------------------------------------------------------------------------------------------------
# The loop


def describe_callable(fn: Any) -> str | None:
    """A stable description of a loss or batch factory for ``run.json``: its qualified name and its scalar settings
    (attributes of a callable object, scalar variables a closure captured)."""
    if fn is None:
        return None
    target = fn if inspect.isfunction(fn) or inspect.ismethod(fn) else type(fn)
    name = f"{getattr(target, '__module__', '?')}.{getattr(target, '__qualname__', repr(target))}"
    scalars = (int, float, str, bool, type(None))
    params: dict[str, Any] = {}
    if inspect.isfunction(fn) and fn.__closure__:
        for var, cell in zip(fn.__code__.co_freevars, fn.__closure__, strict=True):
            try:
                value = cell.cell_contents
            except ValueError:
                continue
            if isinstance(value, scalars):
                params[var] = value
    elif not inspect.isfunction(fn) and hasattr(fn, "__dict__"):
        params = {k: v for k, v in vars(fn).items() if isinstance(v, scalars) and not k.startswith("_")}
    return name + (json.dumps(params, sort_keys=True) if params else "")


def _same_callable_elsewhere(old: Any, new: Any) -> bool:
    """Two :func:`describe_callable` records of one callable (same name and settings) under another module path."""
    if not (isinstance(old, str) and isinstance(new, str)) or old == new:
        return False
    (old_path, _, old_params), (new_path, _, new_params) = old.partition("{"), new.partition("{")
    return old_params == new_params and old_path.rsplit(".", 1)[-1] == new_path.rsplit(".", 1)[-1]


def _run_fix(out: Path) -> str:
    return f"rerun with the run's settings to resume, use a new --out, or --no-resume to start over in {out}"


def check_run_identity(out: str | os.PathLike, identity: dict[str, Any]) -> None:
    """Refuse to resume the run in ``out`` when its ``run.json`` records other values for keys of ``identity``.

    Only the keys present in both are compared, so callers can check what they know early (corpus, tokenizer spec,
    model) and the rest later. A malformed ``run.json`` is a :class:`MemlmError`. No ``run.json``: nothing to compare.
    A loss recorded under a module path that has since moved (same name and settings) is refused with its new name.
    """
    out = Path(out)
    path = out / RUN_FILE
    if not path.exists():
        return
    rec = schema.read_json(path, schema.TRAIN_RUN, "training-run record", _run_fix(out))
    old = rec["identity"]
    diff = [f"{k} {old[k]} -> {identity[k]}" for k in identity if k in old and old[k] != identity[k]]
    moved = [k for k in identity if k in old and _same_callable_elsewhere(old[k], identity[k])]
    if moved and len(moved) == len(diff):
        names = "; ".join(f"{k} {old[k]} is now {identity[k]}" for k in moved)
        raise MemlmError(
            f"{out} holds a training run that records its functions under module paths that moved ({names}): "
            f"write the new names in {path} to resume it, or use --no-resume to start over in {out}"
        )
    if diff:
        raise MemlmError(f"{out} holds a training run with other settings ({'; '.join(diff)}): {_run_fix(out)}")


def write_log(out: Path, config: TrainConfig, log: list[dict[str, Any]]) -> None:
    """``out/log.json``: ``{"config": ..., "log": [one entry per update]}`` (atomic)."""
    atomic_write_json(out / "log.json", {"config": dataclasses.asdict(config), "log": log})


def _start_over(out: Path) -> None:
    """``resume=False``: delete the folder's checkpoints, final model and run record (the lock is held)."""
    for _, ckpt in _checkpoints(out):
        shutil.rmtree(ckpt)
    shutil.rmtree(out / "final", ignore_errors=True)
    (out / RUN_FILE).unlink(missing_ok=True)


def _load_state(ckpt: Path) -> dict[str, Any]:
    fix = f"delete {ckpt} to resume from the checkpoint before it, or use --no-resume to start over"
    try:
        state = torch.load(ckpt / _STATE_FILE, map_location="cpu", weights_only=False)
    except Exception as e:  # a truncated or foreign file fails inside pickle/zipfile in many ways
        raise MemlmError(f"checkpoint state {ckpt / _STATE_FILE} is unreadable ({type(e).__name__}); {fix}") from None
    return schema.check(state, schema.TRAIN_STATE, ckpt / _STATE_FILE, "checkpoint state", fix)


@dataclass
class TrainResult:
    step: int
    out_dir: Path
    final_dir: Path | None  # None when the run stopped early (stop_after)
    log: list[dict[str, Any]] = field(default_factory=list)

    @property
    def losses(self) -> list[float]:
        return [e["loss"] for e in self.log]

    @property
    def valid_ppl(self) -> float | None:
        vals = [e["valid_ppl"] for e in self.log if "valid_ppl" in e]
        return vals[-1] if vals else None


def _max_positions(model) -> int | None:
    cfg = getattr(model, "config", None)
    for name in ("n_positions", "max_position_embeddings"):
        value = getattr(cfg, name, None)
        if isinstance(value, int):
            return value
    return None


def _signature(model: torch.nn.Module) -> dict[str, list[int]]:
    return {name: list(p.shape) for name, p in model.named_parameters()}


def _optimizer(model: torch.nn.Module, config: TrainConfig) -> torch.optim.AdamW:
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=config.lr, betas=config.betas, eps=config.eps)


def _rng_state() -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])


def _checkpoints(out_dir: Path) -> list[tuple[int, Path]]:
    found = []
    if out_dir.is_dir():
        for p in out_dir.iterdir():
            name = p.name
            if p.is_dir() and name.startswith("checkpoint-") and name[11:].isdigit() and (p / _STATE_FILE).is_file():
                found.append((int(name[11:]), p))
    return sorted(found)


def _save_model(model, tokenizer, out: Path, name: str, state: dict[str, Any] | None = None) -> Path:
    """``out/name``: the model, its tokenizer and the trainer ``state`` (a checkpoint's), written into a temporary
    folder (``.name.tmp-*``) renamed into place once complete."""
    tmp = out / f".{name}.tmp-{os.getpid()}-{os.urandom(4).hex()}"
    model.save_pretrained(tmp)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    if state is not None:
        with open(tmp / _STATE_FILE, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
    shutil.rmtree(out / name, ignore_errors=True)
    os.replace(tmp, out / name)
    return out / name


@torch.no_grad()
def _evaluate(model, epochs, autocast) -> tuple[float, float]:
    """(token-weighted mean CE, perplexity) over one pass of the validation batches."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0.0
    device = next(model.parameters()).device
    try:
        for batch in epochs(0):
            with autocast():
                s, c = _ce_sum(model, _to_device(batch, device))
            total += float(s)
            count += float(c)
    finally:
        model.train(was_training)
    if count == 0:
        raise MemlmError("the validation data has no tokens to score: give validation text or pass valid_batches=None")
    mean = total / count
    return mean, math.exp(min(mean, 700.0))


def train(
    model: torch.nn.Module,
    config: TrainConfig,
    train_batches,
    valid_batches=None,
    loss_fn: LossFn = causal_lm_loss,
    out_dir: str | os.PathLike = "memlm-train",
    resume: bool = True,
    warmup_loss: LossFn | None = causal_lm_loss,
    stop_after: int | None = None,
    progress: bool = True,
    tokenizer=None,
    identity: dict[str, Any] | None = None,
) -> TrainResult:
    """Train ``model`` in place for ``config.max_steps`` updates; see the module docstring.

    ``stop_after`` ends the run (after a checkpoint) once that many updates are done, without changing the schedule:
    a later call with ``resume=True`` continues to ``max_steps``. ``resume=False`` starts over (the folder's
    checkpoints and final model are deleted). A ``tokenizer`` is saved next to every checkpoint and the final model,
    so each folder loads on its own. ``identity`` (JSON values: corpus, tokenizer, model, loss, ...) is recorded in
    ``run.json``; resuming a run recorded with other values is refused (:func:`check_run_identity`). The loss
    functions are always part of it. The folder is locked for the whole call.
    """
    config.validate()
    out = Path(out_dir)
    identity = {
        **(identity or {}),
        "loss": describe_callable(loss_fn),
        "warmup_loss": describe_callable(warmup_loss) if config.resolved_warmup_loss() else None,
    }
    with folder_lock(out, "train"):
        if resume:
            check_run_identity(out, identity)
        else:
            _start_over(out)
        for stale in [*out.glob(".checkpoint-*.tmp*"), *out.glob(".final.tmp*")]:
            shutil.rmtree(stale, ignore_errors=True)  # left by a killed run (the lock is ours: none is in use)
        atomic_write_json(out / RUN_FILE, {"format": "memlm-train-run", "identity": identity})
        try:
            return _train_locked(model, config, train_batches, valid_batches, loss_fn, out, resume, warmup_loss,
                                 stop_after, progress, tokenizer)  # fmt: skip
        except OSError as e:
            if is_disk_full(e):
                raise disk_full_error(getattr(e, "filename", None) or out) from None
            raise


def _train_locked(
    model: torch.nn.Module,
    config: TrainConfig,
    train_batches,
    valid_batches,
    loss_fn: LossFn,
    out: Path,
    resume: bool,
    warmup_loss: LossFn | None,
    stop_after: int | None,
    progress: bool,
    tokenizer,
) -> TrainResult:
    limit = _max_positions(model)
    if limit is not None and config.seq_len > limit:
        raise MemlmError(
            f"seq_len={config.seq_len} is longer than the model's {limit} positions: use seq_len <= {limit}"
        )
    epochs = _as_epochs(train_batches)
    valid = _as_epochs(valid_batches)
    device = config.torch_device()
    model.to(device)
    warm_loss_n = config.resolved_warmup_loss()

    def autocast():
        return torch.autocast(device.type, dtype=torch.bfloat16, enabled=config.dtype == "bfloat16")

    torch.manual_seed(config.seed)
    np.random.seed(config.seed % 2**32)
    random.seed(config.seed)
    optimizer = _optimizer(model, config)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _Schedule(config))
    step, epoch, position = 0, 0, 0
    log: list[dict[str, Any]] = []

    existing = _checkpoints(out) if resume else []
    if existing:
        step, ckpt = existing[-1]
        state = _load_state(ckpt)
        if state.get("signature") != _signature(model):
            raise MemlmError(
                f"checkpoint {ckpt} was written for another model (parameter names or shapes differ): train with "
                f"the same architecture, pass another out_dir, or resume=False"
            )
        saved_cfg = {k: v for k, v in state["config"].items() if k not in _RESUMABLE_CHANGES}
        now_cfg = {k: v for k, v in json.loads(json.dumps(dataclasses.asdict(config))).items()}
        diff = sorted(k for k in saved_cfg if saved_cfg[k] != now_cfg.get(k))
        if diff:
            raise MemlmError(
                f"checkpoint {ckpt} was trained with other settings ({', '.join(diff)} differ): resume with the same "
                f"TrainConfig, pass another out_dir, or resume=False"
            )
        loaded = type(model).from_pretrained(ckpt)
        model.load_state_dict(loaded.state_dict())
        del loaded
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        epoch, position = state["epoch"], state["position"]
        log = state["log"]
        _set_rng_state(state["rng"])

    def save_checkpoint() -> None:
        state = {
            "format": _STATE_FORMAT,
            "step": step,
            "epoch": epoch,
            "position": position,
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "rng": _rng_state(),
            "log": log,
            "config": json.loads(json.dumps(dataclasses.asdict(config))),
            "signature": _signature(model),
        }
        _save_model(model, tokenizer, out, f"checkpoint-{step}", state)
        for _, old in _checkpoints(out)[: -config.keep_checkpoints]:
            shutil.rmtree(old, ignore_errors=True)
        write_log(out, config, log)

    # the data iterator, positioned at (epoch, position)
    def open_epoch(e: int, skip: int) -> Iterator[dict[str, Any]]:
        it = iter(epochs(e))
        for i in range(skip):
            if next(it, None) is None:
                raise MemlmError(f"epoch {e} of the training batches has only {i} batches, the checkpoint expects more")
        return it

    it = open_epoch(epoch, position)

    def next_batch() -> dict[str, Any]:
        nonlocal it, epoch, position
        batch = next(it, None)
        if batch is None:
            if position == 0:
                raise MemlmError("the training data yields no batches (empty corpus?): give training text")
            epoch, position = epoch + 1, 0
            it = open_epoch(epoch, 0)
            batch = next(it, None)
            if batch is None:
                raise MemlmError(f"epoch {epoch} of the training batches is empty: train_batches must repeat its data")
        position += 1
        ids = batch["input_ids"]
        if limit is not None and ids.shape[-1] > limit:
            raise MemlmError(
                f"a training batch has sequences of {ids.shape[-1]} tokens, more than the model's {limit} positions"
            )
        return batch

    end = config.max_steps if stop_after is None else min(config.max_steps, stop_after)
    bar = None
    if progress and step < end:
        from tqdm.auto import tqdm

        bar = tqdm(total=config.max_steps, initial=step, desc="train", unit="update", dynamic_ncols=True)
    model.train()
    try:
        while step < end:
            t0 = time.perf_counter()
            fn = warmup_loss if (warmup_loss is not None and step < warm_loss_n) else loss_fn
            lr = optimizer.param_groups[0]["lr"]
            total_loss, tokens = 0.0, 0
            for _ in range(config.grad_accum):
                batch = _to_device(next_batch(), device)
                with autocast():
                    loss = fn(model, batch)
                (loss / config.grad_accum).backward()
                total_loss += float(loss.detach()) / config.grad_accum
                mask = batch.get("attention_mask")
                tokens += int(mask.sum()) if mask is not None else batch["input_ids"].numel()
            if config.max_grad_norm:
                torch.nn.utils.clip_grad_norm_(model.parameters(), config.max_grad_norm)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            seconds = time.perf_counter() - t0
            entry = {"step": step, "loss": total_loss, "lr": lr, "tokens": tokens, "tokens_per_s": tokens / seconds}
            log.append(entry)
            if valid is not None and config.eval_every and step % config.eval_every == 0 and step < config.max_steps:
                entry["valid_loss"], entry["valid_ppl"] = _evaluate(model, valid, autocast)
            if bar is not None:
                bar.update(1)
                if step % config.log_every == 0:
                    bar.set_postfix(loss=f"{total_loss:.3f}", lr=f"{lr:.2e}")
            if not math.isfinite(total_loss):
                raise MemlmError(f"training loss is {total_loss} at update {step}: lower lr or use dtype='float32'")
            if (config.save_every and step % config.save_every == 0) or (stop_after is not None and step == end):
                save_checkpoint()
    finally:
        if bar is not None:
            bar.close()
    model.eval()
    final_dir = None
    if step >= config.max_steps:
        if valid is not None and log and "valid_ppl" not in log[-1]:
            log[-1]["valid_loss"], log[-1]["valid_ppl"] = _evaluate(model, valid, autocast)
        final_dir = _save_model(model, tokenizer, out, "final")
    write_log(out, config, log)
    return TrainResult(step=step, out_dir=out, final_dir=final_dir, log=log)
