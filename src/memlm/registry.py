"""The training objectives by name, above the packages that define them: what ``memlm train`` looks up (``--objective``,
and ``--loss`` for the TRIME ones).

=============  =====================================================  ===========================================
name           objective (model; loss)                                validation
=============  =====================================================  ===========================================
lm             :class:`memlm.training.lm.LmObjective` (a causal LM;       perplexity every ``eval_every`` updates
               next-token cross-entropy)
trime          :class:`memlm.trime.training.TrimeLmObjective`          perplexity (plain CE) every ``eval_every``
               (TRIME, local memory; Zhong et al. 2022)
trime-long     :class:`~memlm.trime.training.TrimeLongObjective`       as trime
               (+ long-term memory over consecutive segments)
trime-ext      :class:`~memlm.trime.training.TrimeExtObjective`        as trime
               (+ external memory over BM25-packed segments)
npm            :class:`memlm.npm.train_npm.NpmTrainObjective` (an      loss per masked span, at the end
               encoder; NPM's span contrastive loss, Min et al. 2023)
npm-single     :class:`~memlm.npm.train_npm.NpmSingleTrainObjective`   loss per masked token, at the end
               (single-token masking)
mlm            :class:`memlm.npm.mlm.MlmTrainObjective` (the encoder   cross-entropy per masked token, at the end
               with a masked-LM head; NPM's parametric baseline)
=============  =====================================================  ===========================================

Each is trained by the one driver, :func:`memlm.training.driver.train_objective`. A new objective is a subclass of
:class:`memlm.training.driver.Objective` and one line here (or ``OBJECTIVES["name"] = MyObjective`` at run time).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from memlm.errors import MemlmError
from memlm.npm.mlm import MlmTrainObjective
from memlm.npm.train_npm import NpmSingleTrainObjective, NpmTrainObjective
from memlm.training.driver import Objective
from memlm.training.lm import LmObjective
from memlm.trime.training import TrimeExtObjective, TrimeLmObjective, TrimeLongObjective

__all__ = ["OBJECTIVES", "make_objective"]

OBJECTIVES: dict[str, Callable[..., Objective]] = {
    "lm": LmObjective,
    "trime": TrimeLmObjective,
    "trime-long": TrimeLongObjective,
    "trime-ext": TrimeExtObjective,
    "npm": NpmTrainObjective,
    "npm-single": NpmSingleTrainObjective,
    "mlm": MlmTrainObjective,
}


def make_objective(name: str, **options: Any) -> Objective:
    """The objective ``name`` of :data:`OBJECTIVES` with its ``options`` (e.g. ``drop_local_p`` for trime-ext,
    ``budget`` for npm, ``prob`` for mlm); an unknown name is refused with the known ones."""
    if name not in OBJECTIVES:
        raise MemlmError(f"unknown training objective {name!r}: use one of {', '.join(OBJECTIVES)}")
    return OBJECTIVES[name](**options)
