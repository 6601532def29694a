"""memlm inside EleutherAI's lm-evaluation-harness (``pip install memlm[lmeval]``).

- :class:`memlm.lmeval.model.MemlmLM` (registered with lm_eval as ``memlm``): any memlm model + its memories
  (datastores, ∞-gram indexes, the continuous cache; one spec string or list, ``memories=``) as an lm_eval ``LM``,
  mixed by one :class:`memlm.core.mixture.Mixture` (``mixture=``): fixed weights, a fit of ``memlm tune --mixture
  gate``, or by default the memories' stored fits.
- ``TASKS_DIR``: offline task YAMLs that read memlm's named corpora (no dataset hub): ``memlm_wikitext2`` (word
  perplexity exactly as lm_eval's ``wikitext`` task defines it), ``memlm_imdb`` (sentiment) and ``memlm_bbc_topic``
  (5 topics), both loglikelihood multiple choice. Pass ``task_manager()`` to ``lm_eval.simple_evaluate`` or
  ``--include_path TASKS_DIR`` to the ``lm_eval`` command.

Example::

    import lm_eval
    from memlm.lmeval import MemlmLM, task_manager

    lm = MemlmLM(model="smollm2-135m", memories="ds/", mixture="knn=0.25")
    # or: MemlmLM(model="smollm2-135m", memories="knn:ds/?k=64;ngram:idx/;cache", mixture="fit.json")
    lm_eval.simple_evaluate(model=lm, tasks=["memlm_wikitext2"], task_manager=task_manager())
"""

from __future__ import annotations

import logging
import os
import subprocess
from pathlib import Path

__all__ = ["MemlmLM", "TASKS_DIR", "TASKS", "quiet_harness", "task_manager"]


def __getattr__(name: str):
    if name == "MemlmLM":  # imports lm_eval (an optional dependency) and torch: only when asked for
        from memlm.lmeval.model import MemlmLM

        return MemlmLM
    raise AttributeError(f"module 'memlm.lmeval' has no attribute {name!r}")


TASKS_DIR = Path(__file__).resolve().parent / "tasks"
TASKS = ("memlm_wikitext2", "memlm_imdb", "memlm_bbc_topic")
#: the named corpus and split each offline task evaluates (its YAML's test_split, read from memlm.data.corpora)
TASK_CORPORA = {
    "memlm_wikitext2": ("wikitext2", "test"),
    "memlm_imdb": ("imdb", "test"),
    "memlm_bbc_topic": ("bbc", "test"),
}


def task_manager(include_defaults: bool = True, **kwargs):
    """An ``lm_eval.tasks.TaskManager`` that knows memlm's offline tasks (and lm_eval's own unless
    ``include_defaults=False``, which is much faster to index: lm_eval ships thousands of task files)."""
    from lm_eval.tasks import TaskManager

    quiet_harness()
    return TaskManager(include_path=str(TASKS_DIR), include_defaults=include_defaults, **kwargs)


class _NoMetadataHint(logging.Filter):
    """Drops lm_eval's hint to pass ``--metadata`` (an ``lm_eval`` flag, not memlm's) for memlm's tasks, which take
    no task arguments: they read memlm's named corpora as they are."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not ("--metadata" in message and message.startswith(TASKS))


_METADATA_FILTER = _NoMetadataHint()


def _git_hash_quietly() -> str | None:
    """lm_eval's ``get_git_commit_hash`` (``git describe --always``, else the checkout in the working folder) with
    git's stderr discarded: outside a git checkout git prints ``fatal: not a git repository``, which is no error."""
    from lm_eval.loggers.utils import get_commit_from_path

    try:
        return subprocess.check_output(["git", "describe", "--always"], stderr=subprocess.DEVNULL).strip().decode()
    except (subprocess.CalledProcessError, FileNotFoundError, OSError):
        return get_commit_from_path(os.getcwd())


def quiet_harness() -> None:
    """Silence two lm_eval messages that do not apply to memlm runs (idempotent; :func:`task_manager` calls it): git's
    ``fatal: not a git repository`` when lm_eval records the git hash outside a checkout, and the ``--metadata``
    hint for memlm's own tasks."""
    import lm_eval.evaluator

    lm_eval.evaluator.get_git_commit_hash = _git_hash_quietly
    task_logger = logging.getLogger("lm_eval.api.task")
    if _METADATA_FILTER not in task_logger.filters:
        task_logger.addFilter(_METADATA_FILTER)
