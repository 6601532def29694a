"""memlm inside EleutherAI's lm-evaluation-harness (``pip install memlm[lmeval]``).

- :class:`memlm.lmeval.model.MemlmLM` (registered with lm_eval as ``memlm``): any memlm model + kNN-LM datastore +
  continuous cache as an lm_eval ``LM``.
- ``TASKS_DIR``: offline task YAMLs that read memlm's named corpora (no dataset hub): ``memlm_wikitext2`` (word
  perplexity exactly as lm_eval's ``wikitext`` task defines it), ``memlm_imdb`` (sentiment) and ``memlm_bbc_topic``
  (5 topics), both loglikelihood multiple choice. Pass ``task_manager()`` to ``lm_eval.simple_evaluate`` or
  ``--include_path TASKS_DIR`` to the ``lm_eval`` command.

Example::

    import lm_eval
    from memlm.lmeval import task_manager
    from memlm.lmeval.model import MemlmLM

    lm = MemlmLM(model="smollm2-135m", datastore="ds/", lam=0.25)
    lm_eval.simple_evaluate(model=lm, tasks=["memlm_wikitext2"], task_manager=task_manager())
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["TASKS_DIR", "TASKS", "task_manager"]

TASKS_DIR = Path(__file__).resolve().parent / "tasks"
TASKS = ("memlm_wikitext2", "memlm_imdb", "memlm_bbc_topic")


def task_manager(include_defaults: bool = True, **kwargs):
    """An ``lm_eval.tasks.TaskManager`` that knows memlm's offline tasks (and lm_eval's own unless
    ``include_defaults=False``, which is much faster to index: lm_eval ships thousands of task files)."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(TASKS_DIR), include_defaults=include_defaults, **kwargs)
