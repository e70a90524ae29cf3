"""Two-process launches for the distributed tests: ``torchrun --standalone`` (a free port each
time), retried once when a rank dies by a native signal.

Gloo's TCP transport can abort a rank while it sets up its connections (``std::terminate`` in
``gloo::transport::tcp``, pytorch/pytorch#188266): the rank ends with SIGABRT and no Python
traceback. That is a race in the transport, not in the code under test, and it is rare (once in
one CI run; 0 in 16 launches here, 10 of them under full CPU load). A rank that fails in Python
exits with code 1 and is never retried; a native crash twice in a row fails the test. A retry is
reported as a warning, with what the first launch printed."""

from __future__ import annotations

import re
import subprocess
import sys
import warnings
from pathlib import Path

NATIVE_DEATH = re.compile(r"exitcode\s*:\s*-(6|11)\b")  # SIGABRT, SIGSEGV: died in C++


TWO = ["--standalone", "--nproc-per-node", "2"]  # two processes on a free port


def torchrun(args: list[str], *, env: dict[str, str], timeout: float,
             cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m torch.distributed.run *args`` (``args`` starts with ``--standalone``: a fixed
    port collides with a launch still closing)."""
    assert "--standalone" in args, f"torchrun {args}: --standalone picks a free port"
    cmd = [sys.executable, "-m", "torch.distributed.run", *args]
    done = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0 and NATIVE_DEATH.search(done.stderr) and "Traceback" not in _rank_output(done):
        warnings.warn(f"a rank died by a native signal; launched again. The first launch printed:\n"
                      f"{done.stderr[-3000:]}", stacklevel=2)
        done = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    return done


def _rank_output(done: subprocess.CompletedProcess[str]) -> str:
    """What the ranks printed, without torchrun's own report (whose traceback is the agent's)."""
    head = re.split(r"\] failed \(exitcode", done.stderr)[0]
    return done.stdout + head
