"""``torch.compile`` as memlm uses it on CPU: one graph for every length, and no FX graph cache (see
:func:`compile_dynamic`). Used by ``--compile inductor`` (:mod:`memlm.models.compute`) and by ``--quantize int8``'s
element-wise ops (:class:`memlm.models.int8.FusedOps`)."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["compile_dynamic"]


def compile_dynamic(fn: Any) -> Any:
    """``torch.compile(fn, dynamic=True)`` (inductor; one graph for every length) without inductor's FX graph cache:
    its key leaves out ``ATEN_CPU_CAPABILITY``, so a graph compiled under one vector ISA was served to a process on
    another (torch 2.13: wrong int8 values, NaN perplexity, a heap corruption;
    ``docs/results/speed/int8_fx_cache_across_isas_nan.log``). The graphs are generated again in each process;
    inductor's cache of compiled C++ is still used."""
    return torch.compile(fn, dynamic=True, options={"fx_graph_cache": False})
