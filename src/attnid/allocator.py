"""The C allocator tuned for streamed passes over large checkpoints.

A streamed command allocates and frees the same few hundred megabytes for every unit (a 7B
layer's tensors, converted, probed, compared). glibc hands each block of 128 KiB or more back
to the kernel when it is freed and takes fresh pages for the next, so every unit pays the
kernel for zeroing and mapping them again: on the 7B-shaped 8-layer `attnid diff` of
`benchmarks/diff.py`, 21 of its 35 seconds were system time. `keep_freed_memory` has glibc
keep freed blocks for reuse instead (``mallopt``: large blocks from the heap, no trimming, a
1 GiB pad), which brought that run to 23 s with 7 s of system time; its peak resident memory
rose from 3.0 to 3.4 GB (reused blocks stay resident). Elsewhere (macOS, musl) it does nothing.

`huge_pages` is the other way to the same end: torch's own allocator asks the kernel for
transparent huge pages (2 MiB) for every tensor of 2 MiB or more (``THP_MEM_ALLOC_ENABLE``), so
a fresh block costs one fault per 2 MiB instead of one per 4 KiB where the kernel has them to
give. Every streamed command takes it. `attnid align`, `merge` and `barrier` take it instead of
keeping freed blocks, which fragments the heap of commands that hold more at once (the
7B-shaped 2-layer align peaked at 4.5-6.2 GB): on that align, two runs each, 30.4-31.8 s with
11.6-12.7 s of system time, against 36.7-42.6 s with 26-31 s, peak 3.26 GB either way. `attnid
diff` takes both: its heap still grows to the first units' size, and those blocks fault in huge
pages (the 8-layer diff, three runs each, alternating: 19.2-20.8 s against 21.4-22.5 s).
`rewrite` and `canonicalize` take huge pages alone (8 layers, two runs each, alternating:
`rewrite --fold-norms --rotate-residual hadamard --rotate-values hadamard` 36.7-39.5 s against
60.3-60.7 s, peak 3.18 GB either way; `canonicalize` 35.0-36.4 s against 52.0-52.3 s, peak
2.78-2.79 against 3.01-3.03 GB).

`return_freed_memory` is the third setting, for `align`, `merge` and `barrier` only: glibc's
heap kept the blocks a unit had freed resident into the next unit (see its docstring).
`streamed` is what a command calls: huge pages, and for those three freed blocks handed back.
"""

from __future__ import annotations

import ctypes
import os
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


def huge_pages() -> bool:
    """Have torch's CPU allocator use transparent huge pages for its large blocks (see the
    module); whether it took effect: only before torch is imported (torch reads the setting
    once), on Linux, and unless ``THP_MEM_ALLOC_ENABLE`` is already set (the user's choice
    stands). The kernel decides in the end: with transparent huge pages ``never`` nothing
    changes."""
    if not sys.platform.startswith("linux") or "torch" in sys.modules or "THP_MEM_ALLOC_ENABLE" in os.environ:
        return False
    os.environ["THP_MEM_ALLOC_ENABLE"] = "1"
    return True


RETURN_ABOVE = 2**21  # bytes: blocks at least this large are mapped fresh and handed back when freed


def return_freed_memory() -> bool:
    """Have glibc map every block of ``RETURN_ABOVE`` (2 MiB, a huge page) or more on its own
    and hand it back to the kernel when it is freed, for the rest of the process; whether it
    took effect. glibc's default starts at 128 KiB but raises the threshold to the size of each
    mapped block freed, up to 32 MiB, and keeps the smaller blocks in its heap, where they
    fragment: the 7B-shaped unrelated `attnid align` (2 layers) carried 1.4-1.6 GiB of freed
    heap from one unit to the next (what ``malloc_trim`` gave back at a unit's start), and
    peaked at 4.4-4.5 GB. A fixed threshold keeps what is freed from staying resident; with
    `huge_pages` each fresh block costs a fault per 2 MiB. Process-wide: `attnid align`,
    `merge` and `barrier` call it, the library never does. Elsewhere (macOS, musl) it does
    nothing."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    return mallopt(ctypes.c_int(M_MMAP_THRESHOLD), ctypes.c_int(RETURN_ABOVE)) == 1


def streamed(return_freed: bool = False) -> None:
    """A streamed command's settings, called before torch is imported: `huge_pages`, and with
    ``return_freed`` (`attnid align`, `merge`, `barrier`) `return_freed_memory`."""
    huge_pages()
    if return_freed:
        return_freed_memory()
