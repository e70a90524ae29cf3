"""The C allocator tuned for streamed passes over large checkpoints.

A streamed command allocates and frees the same few hundred megabytes for every unit (a 7B
layer's tensors, converted, probed, compared). glibc hands each block of 128 KiB or more back
to the kernel when it is freed and takes fresh pages for the next, so every unit pays the
kernel for zeroing and mapping them again: on the 7B-shaped 8-layer `attnid diff` of
`benchmarks/diff.py`, 21 of its 35 seconds were system time. `keep_freed_memory` has glibc
keep freed blocks for reuse instead (``mallopt``: large blocks from the heap, no trimming, a
1 GiB pad), which brought that run to 23 s with 7 s of system time; its peak resident memory
rose from 3.0 to 3.4 GB (reused blocks stay resident). Elsewhere (macOS, musl) it does nothing.
"""

from __future__ import annotations

import ctypes
import sys

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3  # glibc's malloc.h
_SETTINGS = ((M_MMAP_THRESHOLD, 2**31 - 1), (M_TRIM_THRESHOLD, 2**31 - 1), (M_TOP_PAD, 2**30))


def keep_freed_memory() -> bool:
    """Have glibc keep freed memory for reuse for the rest of the process (see the module);
    whether it took effect. Process-wide: `attnid diff` calls it, the library never does
    (`attnid align` holds more at once: on its 7B-shaped 2-layer benchmark the peak rose from
    4.0 to 7.0 GB with these settings, so align and merge keep glibc's default)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    return all(mallopt(ctypes.c_int(k), ctypes.c_int(v)) == 1 for k, v in _SETTINGS)
