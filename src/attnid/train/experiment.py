"""`attnid experiment paper`: the paper's four cases, the SGD learning-rate sweep, and more.

Cases (Section 5 of arXiv:2609.01231): (1) SGD lr 0.25; (2) SGD lr 0.25 + weight decay
4e-4; (3) AdamW lr 1e-3 + weight decay 0.1; (4) case 3 + rebalancing; plus the SGD sweep
lr 0.5, 0.25, 0.125, 0.0625. Beyond the paper: the four cases on a RoPE and on a GQA
variant, and AdamW with the ``project`` correction.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from attnid.errors import AttnidError
from attnid.train.loop import PRESETS, TrainConfig, train
from attnid.train.model import GPTConfig


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

PAPER_CASES = ("sgd", "sgd_wd", "adamw", "adamw_rebalance")
SWEEP_LRS = (0.5, 0.25, 0.125, 0.0625)


def case_configs(scale: str, *, beyond: bool = True, seed: int = 0, device: str = "cpu"
                 ) -> dict[str, TrainConfig]:
    """Every run of the experiment, by name."""
    if scale not in SCALES:
        raise AttnidError(f"unknown scale {scale!r}: use one of {', '.join(SCALES)}")
    sc = SCALES[scale]
    base_model = GPTConfig(**PRESETS[sc.preset], attn_bias="qk")
    base = TrainConfig(model=base_model, steps=sc.steps, batch_size=sc.batch_size, seed=seed,
                       log_every=sc.log_every, eval_every=sc.eval_every, device=device)

    def four(prefix: str, model: GPTConfig) -> dict[str, TrainConfig]:
        b = replace(base, model=model)
        return {
            f"{prefix}sgd": replace(b, optimizer="sgd", lr=0.25),
            f"{prefix}sgd_wd": replace(b, optimizer="sgd", lr=0.25, weight_decay=4e-4),
            f"{prefix}adamw": replace(b, optimizer="adamw", lr=1e-3, weight_decay=0.1),
            f"{prefix}adamw_rebalance": replace(b, optimizer="adamw", lr=1e-3, weight_decay=0.1,
                                                correct=f"rebalance:{sc.rebalance_every}"),
        }

    runs = four("", base_model)
    for lr in SWEEP_LRS:
        runs[f"sweep_lr{lr:g}"] = replace(base, optimizer="sgd", lr=lr)
    if beyond:
        heads = base_model.n_heads
        runs.update(four("rope_", replace(base_model, rope=1.0)))
        runs.update(four("gqa_", replace(base_model, n_kv_heads=max(1, heads // 2))))
        runs["adamw_project"] = replace(runs["adamw"], correct="project")
    return runs


def same_point_drift(run_dir: Path, lrs: tuple[float, ...]) -> dict[str, Any]:
    """Drift of one SGD step of each lr from the *same* trained weights, in float64.

    The theory's statement (drift = O(lr^2) per step) isolated from trajectory effects and
    from float32 rounding: one gradient at the end of the run, ``w - lr g`` for every lr.
    """
    import numpy as np
    import torch

    from attnid.symmetry import AttentionWeights, metrics
    from attnid.train.data import shakespeare
    from attnid.train.model import GPT

    cfg = TrainConfig.from_dict(json.loads((run_dir / "config.json").read_text()))
    model = GPT(cfg.model).double()
    model.load_state_dict(torch.load(run_dir / "checkpoint.pt", weights_only=False)["model"])
    x, y = shakespeare().batch("train", cfg.batch_size, cfg.model.block_size,
                               torch.Generator().manual_seed(123))
    model.zero_grad()
    model(x, y)[1].backward()
    spec = cfg.model.attention_spec()
    ws = [AttentionWeights.from_module(b.attn) for b in model.blocks]
    gs = [AttentionWeights.from_tensors(spec, {n: p.grad for n, p in b.attn.named_parameters()})
          for b in model.blocks]
    w, g = AttentionWeights.stack(ws), AttentionWeights.stack(gs)
    out: dict[str, Any] = {"lr": list(lrs)}
    for side in ("qk", "vo"):
        d = [float(metrics(w, w - g.scale(lr))[f"drift_{side}"].mean()) for lr in lrs]
        out[f"drift_{side}"] = d
        out[f"slope_{side}"] = float(np.polyfit(np.log(lrs), np.log(d), 1)[0])
    return out


def run_experiment(out: Path, *, scale: str = "cpu", beyond: bool = True, seed: int = 0,
                   device: str = "cpu", progress=None) -> dict[str, Any]:
    """Train every case (reusing identical runs), then write figures and tables under ``out``."""
    from attnid.report.training import write_training_report

    out = Path(out)
    runs = case_configs(scale, beyond=beyond, seed=seed, device=device)
    done: dict[str, str] = {}
    for i, (name, cfg) in enumerate(runs.items()):
        key = json.dumps(cfg.to_dict(), sort_keys=True)
        if progress is not None:
            progress(f"training {name} ({i + 1}/{len(runs)})")
        if key in done:  # e.g. the sweep's lr 0.25 is case 1
            (out / "runs" / name).mkdir(parents=True, exist_ok=True)
            for f in ("config.json", "metrics.jsonl", "summary.json"):
                src = out / "runs" / done[key] / f
                (out / "runs" / name / f).write_text(src.read_text())
            continue
        train(cfg, out / "runs" / name, progress=False)
        if name == "sgd":
            drift = same_point_drift(out / "runs" / name, SWEEP_LRS)
            (out / "same_point_drift.json").write_text(json.dumps(drift, indent=2))
        (out / "runs" / name / "checkpoint.pt").unlink(missing_ok=True)
        done[key] = name
    if progress is not None:
        progress("drawing training figures")
    return write_training_report(out, list(runs), runs["sgd"].model.n_heads)
