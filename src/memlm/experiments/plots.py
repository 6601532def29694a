"""Plot helpers shared by the reports (``memlm analyze``, ``memlm demo``, the benchmark reports): headless matplotlib
and atomic PNG writes, so a half-written figure never replaces a good one."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from memlm.io.fileio import unique_tmp

__all__ = ["pyplot", "finish_figure"]


def pyplot():
    """``matplotlib.pyplot`` on the headless ``Agg`` backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def finish_figure(
    fig: Any,
    path: str | os.PathLike,
    axes: Any = None,
    *,
    xlabel: str | None = None,
    ylabel: str | None = None,
    title: str | None = None,
    legend_fontsize: float | None = 8,
    dpi: int = 120,
) -> Path:
    """Label ``axes`` (given: x/y label, title, a legend unless ``legend_fontsize`` is ``None``), lay ``fig`` out,
    write it to ``path`` atomically (a temporary PNG beside it, then a rename) and close it. Returns ``path``."""
    if axes is not None:
        if xlabel is not None:
            axes.set_xlabel(xlabel)
        if ylabel is not None:
            axes.set_ylabel(ylabel)
        if title is not None:
            axes.set_title(title)
        if legend_fontsize is not None:
            axes.legend(fontsize=legend_fontsize)
    fig.tight_layout()
    path = Path(path)
    tmp = unique_tmp(path, ".tmp.png")
    fig.savefig(tmp, dpi=dpi)
    pyplot().close(fig)
    os.replace(tmp, path)
    return path
