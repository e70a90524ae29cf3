"""`attnid experiment paper`: the paper's four cases, the SGD learning-rate sweep, and more.

Cases (Section 5 of arXiv:2609.01231), defined once in :data:`PAPER_CASES`: (1) SGD lr
0.25; (2) SGD lr 0.25 + weight decay 4e-4; (3) AdamW lr 1e-3 + weight decay 0.1; (4) case
3 + rebalancing; plus the SGD sweep lr 0.5, 0.25, 0.125, 0.0625. Beyond the paper: the four
cases on a RoPE and on a GQA variant, and AdamW with the ``project`` correction.

This module trains and measures; it returns data (:class:`ExperimentData`) and draws
nothing. `attnid.paper.training` turns the data into figures, tables and claims.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields, replace
from pathlib import Path

import numpy as np

from attnid.errors import AttnidError
from attnid.paper.drift import Anatomy, SamePoint
from attnid.paper.runs import Job, Measure, Precision, launch, run_job
from attnid.progress import Progress
from attnid.symmetry.conserved import flat_key
from attnid.train.loop import PRESETS, TrainConfig
from attnid.train.model import GPTConfig
from attnid.weights import Side


@dataclass(frozen=True)
class Scale:
    preset: str
    steps: int
    batch_size: int
    log_every: int
    eval_every: int
    rebalance_every: int


SCALES = {
    # a smoke test of the whole pipeline (tests only): effects are not expected to show
    "smoke": Scale("tiny", steps=20, batch_size=4, log_every=5, eval_every=10, rebalance_every=10),
    # reproduce --scale quick: under a minute of training on two cores
    "quick": Scale("tiny", steps=100, batch_size=16, log_every=10, eval_every=50, rebalance_every=50),
    # reproduce's default: effects visible in about a minute of training on two cores
    "default": Scale("tiny", steps=250, batch_size=32, log_every=10, eval_every=50, rebalance_every=50),
    # reproduce --scale full (the default until this release): effects clearly visible
    "full": Scale("tiny", steps=400, batch_size=32, log_every=10, eval_every=100, rebalance_every=100),
    # the paper's settings (nanoGPT Shakespeare-char), for a GPU
    "paper": Scale("paper", steps=5000, batch_size=64, log_every=10, eval_every=250, rebalance_every=200),
}


@dataclass(frozen=True)
class Case:
    """One optimizer setting of the paper's Section 5."""

    title: str
    optimizer: str
    lr: float
    weight_decay: float = 0.0
    rebalance: bool = False


PAPER_CASES: dict[str, Case] = {
    "sgd": Case("SGD lr 0.25", "sgd", 0.25),
    "sgd_wd": Case("SGD lr 0.25, wd 4e-4", "sgd", 0.25, 4e-4),
    "adamw": Case("AdamW lr 1e-3, wd 0.1", "adamw", 1e-3, 0.1),
    "adamw_rebalance": Case("AdamW + rebalancing", "adamw", 1e-3, 0.1, rebalance=True),
}
SWEEP_LRS = (0.5, 0.25, 0.125, 0.0625)
# run-name prefix -> label of the attention variant the four cases are repeated on
VARIANTS = {"": "MHA", "rope_": "RoPE", "gqa_": "GQA"}


def title(name: str) -> str:
    """A run's human name: ``rope_adamw`` -> ``RoPE: AdamW lr 1e-3, wd 0.1``."""
    if name.startswith("sweep_lr"):
        return f"SGD lr {name.removeprefix('sweep_lr')}"
    if name == "adamw_project":
        return "AdamW + projection"
    for prefix, label in VARIANTS.items():
        if prefix and name.startswith(prefix):
            return f"{label}: {title(name.removeprefix(prefix))}"
    return PAPER_CASES[name].title if name in PAPER_CASES else name


def variant_model(base: GPTConfig, prefix: str) -> GPTConfig:
    if prefix == "rope_":
        return replace(base, rope=1.0)
    if prefix == "gqa_":
        return replace(base, n_kv_heads=max(1, base.n_heads // 2))
    return base


def case_configs(scale: str, *, beyond: bool = True, seed: int = 0, device: str = "cpu",
                 cuda_graph: bool = True) -> dict[str, TrainConfig]:
    """Every run of the experiment, by name (on CUDA, with ``cuda_graph``, each replays its
    forward and backward pass as a graph: `attnid.train.cuda.GraphedLoss`)."""
    if scale not in SCALES:
        raise AttnidError(f"unknown scale {scale!r}: use one of {', '.join(SCALES)}")
    sc = SCALES[scale]
    base_model = GPTConfig(**PRESETS[sc.preset], attn_bias="qk")
    base = TrainConfig(model=base_model, steps=sc.steps, batch_size=sc.batch_size, seed=seed,
                       log_every=sc.log_every, eval_every=sc.eval_every, device=device,
                       cuda_graph=cuda_graph and device.startswith("cuda"))

    def four(prefix: str) -> dict[str, TrainConfig]:
        b = replace(base, model=variant_model(base_model, prefix))
        return {prefix + name: replace(b, optimizer=c.optimizer, lr=c.lr, weight_decay=c.weight_decay,
                                       correct=f"rebalance:{sc.rebalance_every}" if c.rebalance else "off")
                for name, c in PAPER_CASES.items()}

    runs = four("")
    for lr in SWEEP_LRS:
        runs[f"sweep_lr{lr:g}"] = replace(base, optimizer="sgd", lr=lr)
    if beyond:
        runs.update(four("rope_"))
        runs.update(four("gqa_"))
        runs["adamw_project"] = replace(runs["adamw"], correct="project")
    return runs


@dataclass(frozen=True)
class SideSeries:
    """One side's metrics over a run (``S`` logged steps): per head ``[S, L*G]`` (QK-norm's QK
    side: per layer ``[S, L]``)."""

    rho: np.ndarray  # tangent share of each logged update
    beta: np.ndarray  # ||C||_F after it
    tau: np.ndarray  # trace C
    mu: np.ndarray  # smallest Gram eigenvalues, summed
    drift: np.ndarray  # ||C_after - C_before||_F of the logged update
    update_sq: np.ndarray  # [S, L]: sum of the squared updates of this side since the last log
    update_tau: np.ndarray  # [S, L*G]: sum of trace C(Δw) over the updates since the last log


@dataclass(frozen=True)
class RunData:
    """One run's ``metrics.jsonl`` as arrays (``S`` logged steps, ``L`` layers)."""

    step: np.ndarray  # [S]
    loss: np.ndarray  # [S]
    val_step: np.ndarray  # [V]: the steps that were evaluated
    val_loss: np.ndarray  # [V]
    update_norm: np.ndarray  # [S]: norm of the whole attention update
    update_norm_layers: np.ndarray  # [S, L]
    update_norm_max: np.ndarray  # [S, L]: the largest single update since the last log
    qk: SideSeries
    vo: SideSeries
    grad_norm_bq: np.ndarray | None  # [S, L*H]: query-bias gradient norm per head
    grad_norm_bk: np.ndarray | None  # [S, L*G]

    def side(self, side: Side) -> SideSeries:
        return self.qk if side == "qk" else self.vo


def load_run(run_dir: Path) -> RunData:
    """``metrics.jsonl`` -> :class:`RunData` (the names are those the training loop writes)."""
    recs = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if ln.strip()]

    def col(key: str) -> np.ndarray:
        vals = [r[key] for r in recs]
        if isinstance(vals[0], list):
            return np.array([np.ravel(np.array(v, dtype=float)) for v in vals])
        return np.array(vals, dtype=float)

    def series(side: Side) -> SideSeries:
        return SideSeries(*(col(flat_key(f.name, side)) for f in fields(SideSeries)))

    vl = [(r["step"], r["val_loss"]) for r in recs if "val_loss" in r]
    layers = col("update_norm")  # [S, L]
    return RunData(col("step"), col("loss"), np.array([s for s, _ in vl], dtype=float),
                   np.array([v for _, v in vl], dtype=float), np.sqrt((layers**2).sum(1)), layers,
                   col("update_norm_max"), series("qk"), series("vo"),
                   col("grad_norm_bq") if "grad_norm_bq" in recs[0] else None,
                   col("grad_norm_bk") if "grad_norm_bk" in recs[0] else None)


@dataclass(frozen=True)
class ExperimentData:
    """What the experiment measured: every run's metrics and config, the same-point drift of
    one float64 SGD step from each variant's trained SGD weights (keyed by the variant's
    run-name prefix: ``""``, ``"rope_"``, ``"gqa_"``; the gradient-flow runs on the plain
    variant only) and the anatomy of AdamW's update at the end of the plain AdamW run."""

    out: Path
    configs: dict[str, TrainConfig]
    runs: dict[str, RunData]
    same_point: dict[str, SamePoint]
    anatomy: Anatomy | None = None  # of the plain AdamW run's last update

    @property
    def n_heads(self) -> int:
        return self.configs["sgd"].model.n_heads


def _measure(name: str) -> Measure:
    """What run ``name`` measures at its end: the same-point drift after each variant's SGD run
    (with the gradient flow on the plain variant), the anatomy of AdamW's update after the plain
    AdamW run."""
    prefix = name.removesuffix("sgd")
    if name.endswith("sgd") and prefix in VARIANTS:
        return "same_point" if prefix else "same_point_flow"
    return "anatomy" if name == "adamw" else "none"


def run_experiment(out: Path, *, scale: str = "default", beyond: bool = True, seed: int = 0,
                   device: str = "cpu", jobs: int = 1, precision: Precision = "fp32",
                   cuda_graph: bool = True, progress: Progress | None = None) -> ExperimentData:
    """Train every case (reusing identical runs) under ``out/runs``; return the measurements.

    ``jobs > 1``: each distinct run trains in its own process, ``jobs`` at a time
    (`attnid.paper.runs.launch`); otherwise one after the other in this process."""
    out = Path(out)
    shown = progress if progress is not None else Progress(enabled=False)
    runs = case_configs(scale, beyond=beyond, seed=seed, device=device, cuda_graph=cuda_graph)
    first: dict[str, str] = {}  # the config's key -> the first run with it
    for name, cfg in runs.items():  # e.g. the sweep's lr 0.25 is case 1
        first.setdefault(json.dumps(cfg.to_dict(), sort_keys=True), name)
    distinct = list(first.values())
    for name in distinct:
        (out / "runs" / name).mkdir(parents=True, exist_ok=True)
        job = Job(runs[name], _measure(name), precision, SWEEP_LRS)
        (out / "runs" / name / "job.json").write_text(json.dumps(job.to_dict(), indent=2))
    if jobs > 1:
        shown.line(f"training {len(distinct)} runs, {jobs} at a time, each its own process")
        wall = launch([out / "runs" / n for n in distinct], jobs, shown)
        (out / "timing.json").write_text(json.dumps({"jobs": jobs, "precision": precision, "wall_s": wall},
                                                    indent=2))
    else:
        for i, name in enumerate(distinct, start=1):
            shown.run(i, len(distinct), f"training {name} ({title(name)})")
            job = Job.from_dict(json.loads((out / "runs" / name / "job.json").read_text()))
            run_job(out / "runs" / name, job, progress=shown if shown.rich else False)
    for name, cfg in runs.items():
        src = first[json.dumps(cfg.to_dict(), sort_keys=True)]
        if src != name:
            (out / "runs" / name).mkdir(parents=True, exist_ok=True)
            for f in ("config.json", "metrics.jsonl", "summary.json"):
                (out / "runs" / name / f).write_text((out / "runs" / src / f).read_text())
    data = load_experiment(out, list(runs))
    same = {k: v.to_dict() for k, v in data.same_point.items()}
    (out / "same_point_drift.json").write_text(json.dumps(same, indent=2))
    if data.anatomy is not None:
        (out / "update_anatomy.json").write_text(json.dumps(data.anatomy.to_dict(), indent=2))
    return data


def load_experiment(out: Path, names: list[str] | None = None) -> ExperimentData:
    """An experiment's measurements read back from its folder (``names``: every run under
    ``out/runs`` with metrics, in the experiment's order)."""
    out = Path(out)
    if names is None:
        found = {p.parent.name for p in (out / "runs").glob("*/metrics.jsonl")}
        order = list(case_configs("smoke"))
        names = [n for n in order if n in found] + sorted(found - set(order))
    missing = [n for n in PAPER_CASES if n not in names]
    if missing:
        raise AttnidError(f"{out / 'runs'} has no run {', '.join(missing)}: not an experiment folder "
                          "(attnid experiment paper OUT, or OUT/experiment of attnid reproduce)")
    configs = {n: TrainConfig.from_dict(json.loads((out / "runs" / n / "config.json").read_text()))
               for n in names}
    same_point = {prefix: SamePoint.from_dict(json.loads(p.read_text())) for prefix in VARIANTS
                  if (p := out / "runs" / f"{prefix}sgd" / "same_point.json").exists()}
    anatomy_file = out / "runs" / "adamw" / "anatomy.json"
    anatomy = Anatomy.from_dict(json.loads(anatomy_file.read_text())) if anatomy_file.exists() else None
    return ExperimentData(out, configs, {n: load_run(out / "runs" / n) for n in names}, same_point, anatomy)
