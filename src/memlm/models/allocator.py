"""The C allocator held on to the forward pass's buffers between layers (glibc's ``mallopt``).

A transformer layer on CPU allocates and frees the same few activation buffers every layer (SmolLM2-135M with a
``[4, 1024]`` batch: the FFN's ``[4, 1024, 1536]`` float32 tensors are 24 MiB each). With glibc's defaults those
buffers are either ``mmap``ed (above a threshold that starts at 128 KiB) or, once the threshold has adapted, taken from
the heap whose free top is handed back to the kernel as soon as it exceeds twice that threshold. Either way the next
layer touches fresh pages: on 2 idle cores (float32, SmolLM2-135M), 444-456k minor page faults and 0.74-0.81 s of
kernel time per ``[4, 1024]`` forward of 4.7-4.8 s; tuned, the body runs 1.095x as fast
(``docs/results/speed/allocator.json``; ``docs/results/performance.md``, "The C allocator").

:func:`tune_allocator` sets two of glibc's knobs once per process, the same ones the ``MALLOC_MMAP_THRESHOLD_`` and
``MALLOC_TRIM_THRESHOLD_`` environment variables set at start-up:

- ``M_MMAP_THRESHOLD`` = 32 MiB (glibc's largest on 64-bit): a block under it comes from the heap, so a freed
  activation is reused by the next layer instead of being unmapped. Larger blocks (the float32 logits of a whole
  batch) are still ``mmap``ed and returned when freed.
- ``M_TRIM_THRESHOLD`` = 512 MiB: the heap's free top is returned to the kernel only past 512 MiB, so a layer's
  working set stays mapped while a freed batch of keys or logits larger than that is still given back.

Numbers are unchanged (it only decides where a buffer's memory comes from). Nothing is done when the C library is
not glibc (musl, macOS: no ``mallopt`` of this meaning), when another allocator is preloaded (jemalloc, tcmalloc
through ``LD_PRELOAD``), when the user set either ``MALLOC_*_`` variable themselves, or when ``MEMLM_MALLOC=default``
asks memlm to leave the allocator alone. Model loading calls it (:func:`memlm.models.resources.load_causal_lm`, the
masked LM loader), so the CLI and the Python API both get it.
"""

from __future__ import annotations

import ctypes
import os
import platform
from typing import Any

__all__ = ["MMAP_THRESHOLD", "TRIM_THRESHOLD", "allocator_state", "tune_allocator"]

M_TRIM_THRESHOLD = -1  # glibc's malloc.h
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 512 << 20
USER_VARIABLES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_MAX_", "MALLOC_TOP_PAD_")

_state: dict[str, Any] | None = None


def _reason_to_leave_alone() -> str | None:
    if os.environ.get("MEMLM_MALLOC", "").lower() in ("default", "0", "off", "no"):
        return "MEMLM_MALLOC asks for the C library's defaults"
    user = [v for v in USER_VARIABLES if v in os.environ]
    if user:
        return f"the user set {', '.join(user)}"
    preload = os.environ.get("LD_PRELOAD", "")
    if any(name in preload for name in ("jemalloc", "tcmalloc", "mimalloc")):
        return f"another allocator is preloaded ({preload})"
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return f"the C library is not glibc ({platform.system()} {' '.join(platform.libc_ver()) or 'unknown'})"
    return None


def tune_allocator() -> dict[str, Any]:
    """Set glibc's mmap and trim thresholds for the forward pass, once per process (see the module docstring).

    Returns what was done: ``{"tuned": True, "mmap_threshold": ..., "trim_threshold": ...}``, or ``{"tuned":
    False, "reason": ...}`` when the allocator was left alone. Calling it again returns the first call's answer.
    """
    global _state
    if _state is not None:
        return _state
    reason = _reason_to_leave_alone()
    if reason is None:
        try:
            libc = ctypes.CDLL("libc.so.6")
            ok = (
                libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
                and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
            )
        except (OSError, AttributeError) as error:
            ok, reason = False, f"mallopt unavailable ({error})"
        if ok:
            _state = {"tuned": True, "mmap_threshold": MMAP_THRESHOLD, "trim_threshold": TRIM_THRESHOLD}
            return _state
        reason = reason or "mallopt refused the thresholds"
    _state = {"tuned": False, "reason": reason}
    return _state


def allocator_state() -> dict[str, Any]:
    """What :func:`tune_allocator` did in this process (``{"tuned": False, "reason": "not called"}`` before it ran)."""
    return _state if _state is not None else {"tuned": False, "reason": "not called"}
