"""`attnid.allocator.keep_freed_memory`: on Linux with glibc, freed large blocks are reused, so
a loop that allocates and frees the same 64 MiB tensor faults far fewer fresh pages in: all 20
blocks by default, 2 to 8 of them with it in runs on the 2-core machine (beside other work the
kernel's memory reclaimer pages some freed heap blocks out again, so the count varies).
`attnid.allocator.huge_pages`: the same loop faults each block in 2 MiB pages (512 times fewer
faults) where the kernel offers transparent huge pages; it is refused once torch is imported.
`attnid.allocator.return_freed_memory`: freed blocks of 2 MiB or more go back to the kernel."""

import os
import subprocess
import sys

import pytest

LOOP = """
import resource, sys
if sys.argv[1] == "huge":
    from attnid.allocator import huge_pages
    assert huge_pages()
import torch
torch.set_num_threads(1)
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
    assert faults["keep"] < pages // 2, faults  # under a half: at most 8 of the 20 blocks seen


def _thp() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return "never"


@pytest.mark.skipif(_thp() == "never", reason="the kernel offers no transparent huge pages")
def test_huge_pages_fault_fewer_pages():
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    faults = {how: int(subprocess.run([sys.executable, "-c", LOOP, how], capture_output=True, text=True,
                                      check=True, env=env).stdout) for how in ("default", "huge")}
    pages = 20 * 2**26 // 4096
    assert faults["default"] > pages // 2, faults
    assert faults["huge"] < pages // 8, faults  # 2 MiB pages: 32 faults a block where they are given


def test_huge_pages_is_refused_once_torch_is_imported():
    code = "import torch; from attnid.allocator import huge_pages; print(huge_pages())"
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert out.stdout.strip() == "False", out.stdout


HELD = """
import sys
import torch
if sys.argv[1] == "return":
    from attnid.allocator import return_freed_memory
    assert return_freed_memory()
page = 4096
rss = lambda: int(open("/proc/self/statm").read().split()[1]) * page
torch.ones(3 * 2**21).sum()  # 24 MiB mapped and freed: glibc's threshold rises to it
blocks, pins = [], []
for _ in range(20):
    blocks.append(torch.ones(2**21))  # 8 MiB each
    pins.append(torch.ones(2**10))  # a small block after each: the heap cannot shrink past it
before = rss()
blocks.clear()
print((before - rss()) // 2**20)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_return_freed_memory_hands_freed_blocks_back():
    """20 blocks of 8 MiB, each followed by a small one, freed together: glibc's default keeps
    them resident (they sit in its heap below live blocks once its threshold has risen to a
    24 MiB block's size); with `return_freed_memory` each was mapped on its own and the
    whole 160 MiB goes back to the kernel."""
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    back = {how: int(subprocess.run([sys.executable, "-c", HELD, how], capture_output=True, text=True,
                                    check=True, env=env).stdout) for how in ("default", "return")}
    assert back["default"] < 40 and back["return"] >= 150, f"MiB handed back when freed: {back}"


AT_IMPORT = """
import importlib.abc, os, sys
seen = []
class Watch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "torch" and not seen:
            seen.append(os.environ.get("THP_MEM_ALLOC_ENABLE"))
        return None
sys.meta_path.insert(0, Watch())
from attnid.cli import main
code = main(sys.argv[1:])
print(code, seen)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="torch's THP_MEM_ALLOC_ENABLE is Linux's")
@pytest.mark.parametrize("argv", [["diff", "A", "B"], ["rewrite", "A", "OUT", "--fold-norms"],
                                  ["canonicalize", "A", "OUT"], ["align", "A", "B", "OUT"],
                                  ["merge", "A", "B", "OUT"], ["barrier", "A", "B", "--calibration", "T"]],
                         ids=lambda a: a[0])
def test_streamed_commands_take_huge_pages_before_torch(argv, tmp_path):
    """Each streamed command asks for huge pages while torch is not yet imported (torch reads
    the setting once, at its first allocation): the environment as torch's import begins."""
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    out = subprocess.run([sys.executable, "-c", AT_IMPORT, *argv], capture_output=True, text=True,
                         env=env, cwd=tmp_path, timeout=300)
    assert out.stdout.strip().endswith("['1']"), (out.stdout, out.stderr[-2000:])
