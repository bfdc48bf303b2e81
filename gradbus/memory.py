"""Server processes keep the memory they free instead of handing it back to the kernel.

ZeroMQ allocates one buffer per large message it receives (in its I/O thread) and the loop frees
it once the message is handled. With glibc's defaults the top of a heap is returned to the kernel
(``madvise``/``brk``) as soon as more than a few hundred KiB of it is free, so the next message's
buffer is mapped anew and every page of it faults on first touch. At 64 KiB pushes that was 12,000
page faults a second in the broker and 22,000 in a shard, about 5 us each on a virtual machine:
a tenth of the cluster's CPU, spent zeroing pages it had just given away.

:func:`keep_freed_memory` raises glibc's trim threshold (freed memory kept for reuse, per heap)
and fixes its mmap threshold (allocations below it come from a heap, so they can be reused), the
same tuning ``MALLOC_TRIM_THRESHOLD_`` and ``MALLOC_MMAP_THRESHOLD_`` give. The broker and shard
commands call it at start; an operator who set either variable keeps their own values. It does
nothing off glibc (musl, macOS). The SDK never calls it: a worker's process belongs to its user.
"""
from __future__ import annotations

import ctypes
import os
import sys
from typing import Mapping

M_TRIM_THRESHOLD = -1     # mallopt parameter numbers (malloc.h)
M_MMAP_THRESHOLD = -3

TRIM_THRESHOLD = 256 << 20   # freed memory a heap keeps before it is returned to the kernel
MMAP_THRESHOLD = 32 << 20    # allocations from this size up get their own mapping (glibc's max)
ENV_VARS = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_")


def keep_freed_memory(trim_threshold: int = TRIM_THRESHOLD,
                      mmap_threshold: int = MMAP_THRESHOLD,
                      environ: Mapping[str, str] | None = None) -> bool:
    """Set glibc's trim and mmap thresholds for this process; True when both were set.

    False (and nothing changed) off Linux, without glibc's ``mallopt``, or when the
    environment already tunes either threshold."""
    environ = os.environ if environ is None else environ
    if not sys.platform.startswith("linux") or any(environ.get(v) for v in ENV_VARS):
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    # mallopt returns 1 on success; the mmap threshold first, so a refused one (above glibc's
    # maximum) leaves the dynamic defaults alone.
    return bool(mallopt(M_MMAP_THRESHOLD, mmap_threshold)) and bool(
        mallopt(M_TRIM_THRESHOLD, trim_threshold))


__all__ = ["keep_freed_memory", "TRIM_THRESHOLD", "MMAP_THRESHOLD"]
