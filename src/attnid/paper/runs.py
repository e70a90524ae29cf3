"""The experiment's training runs: one in this process, or many, each its own process.

A run's folder holds ``job.json`` (its :class:`Job`); :func:`run_job` trains it, then takes the
measurement that needs its final weights (`attnid.paper.drift`: the same-point drift after
an SGD run, the anatomy of AdamW's update after the AdamW run), writes it beside the metrics
(``same_point.json`` or ``anatomy.json``) and deletes the checkpoint. :func:`launch` starts
``python -m attnid.paper.runs RUN_DIR`` for each folder, at most ``jobs`` at a time (on one GPU
they share it), each writing its progress to ``RUN_DIR/log.txt``.

Needs only torch and numpy: the runs of ``reproduce --scale paper`` can train on a machine
without the ``[hf]`` and ``[report]`` extras, and the report be built elsewhere from their files.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from attnid.errors import AttnidError
from attnid.progress import Progress
from attnid.train.loop import TrainConfig, train

Measure = Literal["none", "same_point", "same_point_flow", "anatomy"]
Precision = Literal["fp32", "tf32"]


@dataclass(frozen=True)
class Job:
    """One training run and what to measure at its end."""

    config: TrainConfig
    measure: Measure = "none"
    precision: Precision = "fp32"  # tf32: float32 matmuls on tensor cores (CUDA only)
    lrs: tuple[float, ...] = ()  # the learning rates of the same-point steps

    def to_dict(self) -> dict[str, Any]:
        return {"config": self.config.to_dict(), "measure": self.measure, "precision": self.precision,
                "lrs": list(self.lrs)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Job:
        return cls(TrainConfig.from_dict(d["config"]), d["measure"], d["precision"], tuple(d["lrs"]))


def precision_for(scale: str, device: str) -> Precision:
    """TF32 for the paper's model on CUDA (in float32 it would not fit a GPU's 10 minutes);
    full float32 everywhere else."""
    return "tf32" if scale == "paper" and device.startswith("cuda") else "fp32"


@contextlib.contextmanager
def precision(kind: Precision) -> Iterator[None]:
    """Float32 matmuls in full precision (``fp32``) or on TF32 tensor cores (``tf32``, about 10
    bits of mantissa in the products); restored on exit. The Monitor's metrics are float64 and
    unaffected either way."""
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = kind == "tf32"
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def run_job(run_dir: Path, job: Job, progress: Progress | bool = False) -> None:
    """Train ``job`` into ``run_dir``, take its measurement, delete its checkpoint."""
    from attnid.paper.drift import same_point_drift, update_anatomy

    with precision(job.precision):
        train(job.config, run_dir, progress=progress, checkpoint=job.measure != "none")
    if job.config.device.startswith("cuda"):  # the measurements run on the CPU, now idle: every core
        torch.set_num_threads(os.cpu_count() or 1)
    if job.measure.startswith("same_point"):
        found = same_point_drift(run_dir, job.lrs, flow=job.measure == "same_point_flow")
        (run_dir / "same_point.json").write_text(json.dumps(found.to_dict(), indent=2))
    elif job.measure == "anatomy":
        (run_dir / "anatomy.json").write_text(json.dumps(update_anatomy(run_dir).to_dict(), indent=2))
    (run_dir / "checkpoint.pt").unlink(missing_ok=True)


def _env(jobs: int) -> dict[str, str]:
    """The children's environment: this attnid importable; the cores shared between them."""
    import attnid

    src = str(Path(attnid.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p)}
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // jobs)))
    return env


def launch(run_dirs: list[Path], jobs: int, progress: Progress | None = None) -> dict[str, float]:
    """Run the job in each folder, ``jobs`` processes at a time; return each run's wall seconds.
    A failed run stops the others and raises with the end of its log."""
    shown = progress if progress is not None else Progress(enabled=False)
    env, pending = _env(jobs), list(run_dirs)
    running: dict[Path, tuple[subprocess.Popen, float]] = {}
    seconds: dict[str, float] = {}
    try:
        while pending or running:
            while pending and len(running) < jobs:
                d = pending.pop(0)
                with (d / "log.txt").open("w") as log:
                    cmd = [sys.executable, "-m", "attnid.paper.runs", str(d)]
                    running[d] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env),
                                  time.perf_counter())
                shown.line(f"  {d.name}: started ({len(running)} running, {len(pending)} waiting)")
            time.sleep(0.2)
            for d, (proc, t0) in list(running.items()):
                if proc.poll() is None:
                    continue
                del running[d]
                if proc.returncode != 0:
                    tail = (d / "log.txt").read_text().strip().splitlines()[-1:] or ["(empty log)"]
                    raise AttnidError(f"the run {d.name} failed (exit {proc.returncode}): {tail[0]} "
                                      f"(its log: {d / 'log.txt'})")
                seconds[d.name] = time.perf_counter() - t0
                shown.line(f"  {d.name}: done in {seconds[d.name]:.0f} s")
    finally:
        for proc, _ in running.values():
            proc.terminate()
        for proc, _ in running.values():
            proc.wait()
    return seconds


def main(argv: list[str]) -> int:
    """``python -m attnid.paper.runs RUN_DIR``: the job in ``RUN_DIR/job.json``."""
    run_dir = Path(argv[0])
    job = Job.from_dict(json.loads((run_dir / "job.json").read_text()))
    run_job(run_dir, job, progress=Progress(rich=False))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
