"""Keep the C allocator from handing freed memory back to the kernel after every pass.

PyTorch takes CPU tensors from the C library's ``malloc``. With glibc's defaults, once the free space at the top
of a heap passes the trim threshold, ``free`` gives it back to the kernel (``sbrk`` down, or ``madvise`` for a
thread's heap), and the next pass's tensors fault the same pages in again, each zeroed by the kernel. A log-prob
or update pass allocates and frees its activations micro-batch after micro-batch, so it pays that over and over.
Measured on the step benchmark's passes (tiny Qwen2.5-VL, 2 cores, one process each, the raw HF passes of
``benchmarks.step``): 1.5 to 2.2 million page faults and 3.4 to 5.2 s of kernel time for four rounds of the old,
reference and update passes with the defaults; 0.21 million and 0.8 to 0.9 s with the settings below.

``keep_freed_memory`` keeps up to ``TRIM_THRESHOLD`` bytes free at the top of each heap instead of trimming it.
Setting the trim threshold turns off glibc's sliding ``mmap`` threshold, which would otherwise have grown to
32 MiB, so the ``mmap`` threshold is set to that value by hand: a block under it comes from a heap, where a freed
one is reused; a larger one is still mapped on its own and unmapped when freed. Setting only the trim threshold
left the ``mmap`` threshold at 128 KiB and made every pass slower (14 million faults).

The cost is memory: a process keeps the pages of its largest pass (up to ``TRIM_THRESHOLD`` per heap) while it
lives, instead of returning them between passes. The run's Ray worker processes call it from the job's set-up.
"""

from __future__ import annotations

import ctypes
import platform
import sys

TRIM_THRESHOLD = 1 << 30
"""Free bytes a heap keeps at its top before ``free`` trims it (glibc's default: 128 KiB, sliding up to 64 MiB)."""

MMAP_THRESHOLD = 32 << 20
"""Blocks from this size up are mapped on their own: glibc's largest allowed value, and where its sliding
threshold ends up for a process that frees such blocks."""

# mallopt's parameter numbers, from glibc's malloc.h.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def keep_freed_memory() -> bool:
    """Set this process's glibc ``malloc`` to keep freed memory for reuse; False where the C library is not glibc
    (nothing is changed there)."""
    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        return False
    mallopt = ctypes.CDLL(None).mallopt
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # mallopt returns 1 on success; glibc refuses an mmap threshold above its maximum, which this one is not.
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
