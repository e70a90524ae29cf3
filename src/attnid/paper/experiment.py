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
from attnid.paper.drift import Anatomy, SamePoint, same_point_drift, update_anatomy
from attnid.progress import Progress
from attnid.symmetry.conserved import flat_key
from attnid.train.loop import PRESETS, TrainConfig, train
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
    # reproduce --quick: a couple of minutes for everything on two cores
    "quick": Scale("tiny", steps=150, batch_size=16, log_every=10, eval_every=50, rebalance_every=50),
    # the CPU default: at most ~10 minutes on two cores, effects clearly visible
    "cpu": Scale("tiny", steps=400, batch_size=32, log_every=10, eval_every=100, rebalance_every=100),
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


def case_configs(scale: str, *, beyond: bool = True, seed: int = 0, device: str = "cpu"
                 ) -> dict[str, TrainConfig]:
    """Every run of the experiment, by name."""
    if scale not in SCALES:
        raise AttnidError(f"unknown scale {scale!r}: use one of {', '.join(SCALES)}")
    sc = SCALES[scale]
    base_model = GPTConfig(**PRESETS[sc.preset], attn_bias="qk")
    base = TrainConfig(model=base_model, steps=sc.steps, batch_size=sc.batch_size, seed=seed,
                       log_every=sc.log_every, eval_every=sc.eval_every, device=device)

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


def run_experiment(out: Path, *, scale: str = "cpu", beyond: bool = True, seed: int = 0,
                   device: str = "cpu", progress: Progress | None = None) -> ExperimentData:
    """Train every case (reusing identical runs) under ``out/runs``; return the measurements."""
    out = Path(out)
    shown = progress if progress is not None else Progress(enabled=False)
    runs = case_configs(scale, beyond=beyond, seed=seed, device=device)
    done: dict[str, str] = {}
    same_point: dict[str, SamePoint] = {}
    anatomy: Anatomy | None = None
    for i, (name, cfg) in enumerate(runs.items(), start=1):
        key = json.dumps(cfg.to_dict(), sort_keys=True)
        shown.run(i, len(runs), f"training {name} ({title(name)})")
        if key in done:  # e.g. the sweep's lr 0.25 is case 1
            (out / "runs" / name).mkdir(parents=True, exist_ok=True)
            for f in ("config.json", "metrics.jsonl", "summary.json"):
                (out / "runs" / name / f).write_text((out / "runs" / done[key] / f).read_text())
            continue
        prefix = name.removesuffix("sgd")
        same = name.endswith("sgd") and prefix in VARIANTS  # the same-point analysis needs weights
        keep = same or name == "adamw"  # ... and the anatomy AdamW's optimizer state
        train(cfg, out / "runs" / name, progress=shown if shown.rich else False, checkpoint=keep)
        if same:
            shown.line(f"  {name}: one float64 step of each lr from the trained weights"
                       + ("; gradient descent for a fixed time lr*steps" if not prefix else ""))
            same_point[prefix] = same_point_drift(out / "runs" / name, SWEEP_LRS, flow=not prefix)
        elif keep:
            shown.line(f"  {name}: the tangent share of each ingredient of its last update")
            anatomy = update_anatomy(out / "runs" / name)
        (out / "runs" / name / "checkpoint.pt").unlink(missing_ok=True)
        done[key] = name
    (out / "same_point_drift.json").write_text(json.dumps({k: v.to_dict() for k, v in same_point.items()},
                                                          indent=2))
    if anatomy is not None:
        (out / "update_anatomy.json").write_text(json.dumps(anatomy.to_dict(), indent=2))
    return ExperimentData(out, runs, {n: load_run(out / "runs" / n) for n in runs}, same_point, anatomy)
