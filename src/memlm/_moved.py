"""Old import paths of modules that moved into packages (issue 25's layout), kept for one release.

``import memlm.datastore`` (and ``from memlm.datastore import Datastore``) still works: a finder on ``sys.meta_path``
answers the old name with the module at its new path (the same module object, so patches and ``isinstance`` agree)
and a :class:`DeprecationWarning` naming the new path. :func:`legacy_name` maps a new module name back to the old one
where a name is persisted (``run.json`` records a loss function by module and name: runs started before the move
resume)."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from types import ModuleType

MOVED = {
    "memlm.fileio": "memlm.io.fileio",
    "memlm.locking": "memlm.io.locking",
    "memlm.schema": "memlm.io.schema",
    "memlm.folder": "memlm.storage.folder",
    "memlm.datastore": "memlm.storage.datastore",
    "memlm.sharded": "memlm.storage.sharded",
    "memlm.index": "memlm.storage.index",
    "memlm.sharded_index": "memlm.storage.sharded_index",
    "memlm.searcher": "memlm.storage.searcher",
    "memlm.ray_backend": "memlm.storage.ray_backend",
    "memlm.resources": "memlm.models.resources",
    "memlm.keys": "memlm.models.keys",
    "memlm.forward": "memlm.models.forward",
    "memlm.tokenizer": "memlm.models.tokenizer",
    "memlm.corpora": "memlm.data.corpora",
    "memlm.windows": "memlm.data.windows",
    "memlm.train": "memlm.training.loop",
    "memlm.train_lm": "memlm.training.lm",
    "memlm.train_driver": "memlm.training.driver",
    "memlm.objectives": "memlm.registry",
    "memlm.plots": "memlm.experiments.plots",
    "memlm.demo": "memlm.experiments.demo",
    "memlm.xu2023.analysis": "memlm.experiments.xu2023_analysis",
    "memlm.npm.tasks": "memlm.experiments.npm_tasks",
}
_LEGACY = {new: old for old, new in MOVED.items()}


def legacy_name(module: str) -> str:
    """The name ``module`` had before the move (itself when it did not move)."""
    return _LEGACY.get(module, module)


class _MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers an old module name with the module at its new path (see the module docstring)."""

    def find_spec(self, name: str, path, target=None):  # noqa: ANN001 - the finder protocol
        return importlib.util.spec_from_loader(name, self) if name in MOVED else None

    def create_module(self, spec) -> ModuleType:  # noqa: ANN001
        warnings.warn(
            f"{spec.name} moved to {MOVED[spec.name]}; the old import path goes in the next release",
            DeprecationWarning,
            stacklevel=2,
        )
        return importlib.import_module(MOVED[spec.name])

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run: the new module ran when it was imported."""


def install() -> None:
    """Put the finder on ``sys.meta_path`` once."""
    if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _MovedFinder())
