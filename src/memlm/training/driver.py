"""One training driver for every objective: ``memlm train`` (the objectives by name: :mod:`memlm.registry`).

An :class:`Objective` holds what is particular to one way of training: its model builder (:meth:`Objective.build`),
its batches (:meth:`Objective.batches`), its loss (``loss_fn(model, batch) -> scalar``, plus an optional
``warmup_loss`` for the first ``TrainConfig.warmup_loss_steps`` updates) and its validation metric (``validation``:
``"loop"``, the loop's next-token cross-entropy / perplexity of :meth:`Objective.valid_batches` every ``eval_every``
updates; ``"end"``, :meth:`Objective.final_valid_loss` once the run is complete; ``None``, no validation).
:func:`train_objective` does the rest once, for all of them, in this order:

1. the objective checks its settings and fixes what depends on the config (:meth:`Objective.prepare`);
2. the run folder is locked (one writer, :mod:`memlm.io.locking`) and the training corpora are read
   (split ``train``, :func:`memlm.data.corpora.load_corpora`) and fingerprinted;
3. resuming: the identity known so far (``corpus``, ``corpus_fingerprint`` and :meth:`Objective.identity`) is compared
   with the folder's ``run.json`` before anything is written or trained
   (:func:`memlm.training.loop.check_run_identity`); starting over (``resume=False``): a tokenizer trained for the old
   run (``out/tokenizer``) goes;
4. the objective builds the model and tokenizer, then its training batches (a tokenizer trained here is saved in
   ``out/tokenizer`` by :func:`run_tokenizer` and reused on resume);
5. validation data: ``valid_corpus`` (default: the training corpora) at split ``valid``, the first ``valid_tokens``
   tokens (``0``: none; ``None``: all);
6. :func:`memlm.training.loop.train` runs the loop: checkpoints and exact resume, ``run.json`` (the identity plus the
   tokenizer fingerprint and the losses), ``log.json``, the progress bar;
7. ``"end"`` validation once the run is complete, written into the last entry of ``log.json``.

A new loss is one :class:`Objective` subclass plus one line in :data:`memlm.registry.OBJECTIVES`
(``tests/test_train_driver.py`` trains a toy one through this driver).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from memlm.data.corpora import Document, corpus_fingerprint, load_corpora
from memlm.errors import MemlmError
from memlm.io.locking import folder_lock
from memlm.training.loop import LossFn, TrainConfig, TrainResult, check_run_identity, train, write_log

__all__ = ["Objective", "ObjectiveResult", "TrainSetup", "run_tokenizer", "train_objective"]


@dataclass
class TrainSetup:
    """What every objective is trained on and where: the settings :func:`train_objective` shares.

    ``scratch``: a size (``<layers>x<dim>`` or a preset, :func:`memlm.training.loop.parse_arch`) for a new random model;
    ``model``: a pretrained model to continue (an encoder objective also takes its tokenizer from it when training
    from scratch). ``tokenizer``: the tokenizer spec of a causal LM from scratch (``bpe:<vocab>``, ``gpt2`` or a
    folder). ``n_positions`` (``None``: the objective's default) and ``dropout`` shape a model from scratch.
    ``corpus`` is read at split ``train``, ``valid_corpus`` (default: the same) at split ``valid``.
    """

    out: str | os.PathLike
    corpus: str | Sequence[str]
    config: TrainConfig
    scratch: str | None = None
    model: str | None = None
    tokenizer: str | None = None
    valid_corpus: str | Sequence[str] | None = None
    valid_tokens: int | None = 200_000
    n_positions: int | None = None
    dropout: float = 0.1
    resume: bool = True
    stop_after: int | None = None
    progress: bool = True

    @property
    def folder(self) -> Path:
        return Path(self.out)


@dataclass
class ObjectiveResult(TrainResult):
    """:class:`memlm.training.loop.TrainResult` plus the validation loss of the last update of a complete run (``None``
    when the run stopped early or nothing was validated)."""

    valid_loss: float | None = None


class Objective(ABC):
    """One way of training (module docstring): subclass it, set ``name`` and ``loss_fn``, give ``build`` and
    ``batches``; override the other members where the defaults (no warm-up loss, no validation) do not fit."""

    name: ClassVar[str] = "objective"
    validation: ClassVar[str | None] = None  # "loop" (valid_batches), "end" (final_valid_loss) or None
    loss_fn: LossFn  # a class attribute, or set by prepare / batches (a loss may need the tokenizer)
    warmup_loss: LossFn | None = None

    def prepare(self, setup: TrainSetup) -> None:
        """Refuse settings this objective cannot train with, before anything is read or written (default: none)."""
        return None

    def identity(self, setup: TrainSetup) -> dict[str, Any]:
        """What the run is trained on beyond the corpus, known before the model is built (``run.json``; a resume with
        other values is refused). The tokenizer fingerprint and the losses are added by the driver."""
        return {}

    @abstractmethod
    def build(self, setup: TrainSetup, docs: list[Document]) -> tuple[Any, Any]:
        """``(model, tokenizer)`` to train, the model in training mode (``docs``: the training documents)."""

    @abstractmethod
    def batches(self, docs: list[Document], tokenizer, config: TrainConfig) -> Any:
        """The loop's ``train_batches``: a callable ``epoch -> batches`` (or a list), a function of the seed."""

    def valid_batches(self, docs: list[Document], tokenizer, setup: TrainSetup) -> Any:
        """``validation = "loop"``: batches whose next-token cross-entropy the loop scores (``docs``: split valid)."""
        return None

    def final_valid_loss(self, model, docs: list[Document], tokenizer, setup: TrainSetup) -> float | None:
        """``validation = "end"``: the validation loss of the trained model (``docs``: split valid)."""
        return None


def run_tokenizer(out: Path, spec: str, texts: list[str]):
    """The run's tokenizer: the one saved in ``out/tokenizer`` when resuming, else made from ``spec``
    (:func:`memlm.models.tokenizer.make_tokenizer`; a BPE is trained on ``texts``) and saved there atomically."""
    from transformers import AutoTokenizer

    from memlm.models.tokenizer import make_tokenizer

    folder = out / "tokenizer"
    if folder.is_dir():
        return AutoTokenizer.from_pretrained(folder)
    tok = make_tokenizer(spec, texts)
    tmp = out / f".tokenizer.tmp-{os.getpid()}-{os.urandom(4).hex()}"
    tok.save_pretrained(tmp)
    os.replace(tmp, folder)
    return tok


def train_objective(objective: Objective, setup: TrainSetup) -> ObjectiveResult:
    """Train ``objective`` on ``setup`` (module docstring); rerunning the same call resumes."""
    if setup.valid_tokens is not None and setup.valid_tokens < 0:
        raise MemlmError(f"valid_tokens must be >= 0 or None, got {setup.valid_tokens}")
    objective.prepare(setup)
    with folder_lock(setup.folder, "train"):
        return _train_locked(objective, setup)


def _start(objective: Objective, setup: TrainSetup, docs: list[Document]) -> dict[str, Any]:
    """Steps 2-3: the identity known before the model is built, checked against ``run.json`` (or the old run's
    tokenizer removed when starting over); leftovers of a killed run go (the lock is held)."""
    out, corpus = setup.folder, setup.corpus
    identity = {
        "corpus": corpus if isinstance(corpus, str) else ",".join(corpus),
        "corpus_fingerprint": corpus_fingerprint(docs),
        **objective.identity(setup),
    }
    if setup.resume:
        check_run_identity(out, identity)  # before a tokenizer is trained or reused in out/tokenizer
    else:
        shutil.rmtree(out / "tokenizer", ignore_errors=True)  # starting over: the old run's tokenizer goes too
    for stale in out.glob(".tokenizer.tmp*"):
        shutil.rmtree(stale, ignore_errors=True)
    return identity


def _valid_docs(setup: TrainSetup) -> list[Document] | None:
    if setup.valid_tokens == 0:
        return None
    return load_corpora(setup.valid_corpus or setup.corpus, "valid")


def _train_locked(objective: Objective, setup: TrainSetup) -> ObjectiveResult:
    from memlm.models.resources import tokenizer_fingerprint

    config, out = setup.config, setup.folder
    docs = load_corpora(setup.corpus, "train")
    identity = _start(objective, setup, docs)
    model, tok = objective.build(setup, docs)
    train_batches = objective.batches(docs, tok, config)
    valid = None
    if objective.validation == "loop" and (vdocs := _valid_docs(setup)) is not None:
        valid = objective.valid_batches(vdocs, tok, setup)
    res = train(model, config, train_batches, valid, loss_fn=objective.loss_fn, out_dir=out, resume=setup.resume,
                warmup_loss=objective.warmup_loss, stop_after=setup.stop_after, progress=setup.progress,
                tokenizer=tok, identity={**identity, "tokenizer": tokenizer_fingerprint(tok)})  # fmt: skip
    result = ObjectiveResult(**{f.name: getattr(res, f.name) for f in dataclasses.fields(TrainResult)})
    if result.final_dir is None:
        return result
    if objective.validation == "end" and (vdocs := _valid_docs(setup)) is not None:
        loss = objective.final_valid_loss(model, vdocs, tok, setup)
        if loss is not None and result.log:
            result.log[-1]["valid_loss"] = loss
            write_log(out, config, result.log)
    result.valid_loss = result.log[-1].get("valid_loss") if result.log else None
    return result
