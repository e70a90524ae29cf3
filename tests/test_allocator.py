"""`attnid.allocator.keep_freed_memory`: on Linux with glibc, freed large blocks are reused, so
a loop that allocates and frees the same 64 MiB tensor stops faulting fresh pages in."""

import subprocess
import sys

import pytest

LOOP = """
import resource, sys, torch
if sys.argv[1] == "keep":
    from attnid.allocator import keep_freed_memory
    assert keep_freed_memory()
torch.ones(2**24).sum()  # warm up
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    torch.ones(2**24).sum()  # 64 MiB, allocated and freed
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_memory_is_reused():
    faults = {how: int(subprocess.run([sys.executable, "-c", LOOP, how], capture_output=True, text=True,
                                      check=True).stdout) for how in ("default", "keep")}
    pages = 20 * 2**26 // 4096  # what faulting every block in afresh costs
    assert faults["default"] > pages // 2, faults  # glibc's default: every block from the kernel
    assert faults["keep"] < pages // 5, faults  # measured: 2 of the 20 blocks
