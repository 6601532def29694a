"""What this machine's CPU computes natively, and a warning where a dtype is only emulated.

A dtype the CPU only emulates (bf16 without AVX512-BF16 or AMX-BF16: every product converted to float32 and back)
is never run silently: :func:`warn_if_emulated` says once what it costs and which choice is faster."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

__all__ = ["CPU_FEATURES", "EMULATION_COST", "NATIVE_FEATURES", "cpu_flags", "emulated_dtype_cost", "warn_if_emulated"]

log = logging.getLogger(__name__)

#: CPU features that decide which path is fast (x86 names as /proc/cpuinfo spells them; Arm's bf16 / i8mm too)
CPU_FEATURES = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_int8",
                "amx_tile", "bf16", "i8mm")  # fmt: skip


def cpu_flags() -> list[str]:
    """The :data:`CPU_FEATURES` this machine's CPU reports (``/proc/cpuinfo``; empty where it cannot be read)."""
    try:
        have = set(Path("/proc/cpuinfo").read_text(errors="ignore").lower().split())
    except OSError:
        return []
    return [f for f in CPU_FEATURES if f in have]


#: the CPU features that compute a dtype's matrix products natively (x86 as /proc/cpuinfo names them; Arm's ``bf16``)
NATIVE_FEATURES = {"bfloat16": ("avx512_bf16", "amx_bf16", "bf16")}

#: what a dtype costs where the CPU only emulates it (converting to float32 around every product)
EMULATION_COST = {
    "bfloat16": "about 7x slower than float32 (SmolLM2-135M, one 512-token forward on a 2-core AVX2 EPYC: 67 "
    "against 466 tokens/s, docs/results/speed/bf16_emulated_avx2.json)",
}

_warned: set[str] = set()


def emulated_dtype_cost(dtype: torch.dtype | str, device: torch.device | str = "cpu") -> str | None:
    """What computing in ``dtype`` costs on ``device`` when its CPU has none of :data:`NATIVE_FEATURES` for it (the
    dtype is then emulated: every product converts to float32 and back), else None. None also where the CPU's
    features cannot be read (no ``/proc/cpuinfo``): no claim is made there."""
    name = str(dtype).removeprefix("torch.")
    if torch.device(device).type != "cpu" or name not in NATIVE_FEATURES:
        return None
    flags = cpu_flags()
    if not flags or any(f in flags for f in NATIVE_FEATURES[name]):
        return None
    return EMULATION_COST[name]


def warn_if_emulated(dtype: torch.dtype | str, device: torch.device | str = "cpu") -> bool:
    """Warn once per process and dtype (one line on stderr, through :mod:`logging`) when ``dtype`` is emulated on
    ``device`` (:func:`emulated_dtype_cost`), naming the cost and the faster choice; returns whether it warned."""
    cost = emulated_dtype_cost(dtype, device)
    name = str(dtype).removeprefix("torch.")
    if cost is None or name in _warned:
        return False
    _warned.add(name)
    have = ", ".join(f for f in CPU_FEATURES if f in cpu_flags())
    log.warning(
        f"{name} is emulated on this CPU (no {' / '.join(NATIVE_FEATURES[name])}; it has {have or 'none of them'}): "
        f"{cost}; pass --dtype float32 or --dtype auto (dtype='float32' in Python) for the faster path"
    )
    return True
