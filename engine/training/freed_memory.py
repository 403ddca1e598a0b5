"""A training process keeps the memory it frees, to use again the next step.

Each step allocates and frees the same large arrays: a heads step's logits alone are
2,048 x 8,192 floats (64 MiB) a head. glibc's malloc serves blocks over its mmap
threshold (32 MiB at most) from fresh mappings and unmaps them when freed, and returns
freed memory at the top of its heap to the system: so every step the kernel mapped and
zeroed those pages again (~8% of a SmolLM2 heads step's CPU in `clear_page` and page
faults). Kept, a heads step took 1.69-1.75 s against 2.08-2.20 s (docs/performance.md).

Process-wide and for good: `mtplxd train` sets it for its own process, whose working set
is the same every step. The daemon does not (it would keep a prompt's peak for good).
"""

from __future__ import annotations

import ctypes
import sys

_M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD = 1 << 30  # blocks below 1 GiB come from the heap, and are reused there
_TRIM_THRESHOLD = (1 << 31) - 1  # never give the heap's top back


def keep_freed_memory() -> bool:
    """Ask glibc's malloc to keep freed memory for reuse; whether it agreed (False off
    glibc: macOS, musl)."""
    if not sys.platform.startswith("linux"):
        return False
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)  # the C library the process runs on
    if mallopt is None:
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD))
