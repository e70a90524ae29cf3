"""The paper's training experiment at smoke scale: every figure and claim, the same-point
drift at second order, and tau's balance under SGD (not AdamW)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from attnid.train.loop import TrainConfig, train
from attnid.train.model import GPTConfig

TINY = GPTConfig(n_layers=1, n_heads=4, d_model=32, block_size=16)


def _records(out: Path) -> list[dict]:
    return [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]


def test_experiment_smoke_writes_every_figure_and_claim(smoke, training):
    data, section = smoke, training
    figs = {p.name for p in section.figures[0].path.parent.iterdir()}
    assert {"fig2_qk.png", "fig2_vo.png", "fig3_bias_grads.png", "fig4_drift_qk.png", "fig4_drift_vo.png",
            "fig2_qk_rope.png", "fig2_qk_gqa.png", "fig_project.png", "fig5_second_order.png",
            "fig6_vo_drift.png"} <= figs
    assert all(f.caption and f.alt and f.path.exists() for f in section.figures)
    assert len(section.tables[0].rows) == 17 and len(section.claims) >= 40
    assert "beta_vo_change" in section.tables[0].columns  # shown in the report, not only in the CSV
    for prefix in ("", "rope_", "gqa_"):  # one float64 step: second order in lr for every variant
        sp = data.same_point[prefix]
        assert abs(sp.slope["qk"] - 2) < 0.05 and abs(sp.slope["vo"] - 2) < 0.05, (prefix, sp)
        assert all(d <= b for s in ("qk", "vo") for d, b in zip(sp.drift[s], sp.step_sq[s], strict=True)), sp
    for prefix in ("rope_", "gqa_"):  # the quantity that ignores RoPE/GQA drifts at first order
        assert data.same_point[prefix].slope_qk_naive < 1.3, data.same_point[prefix]
    flow = data.same_point[""].flow  # a fixed time lr*steps: first order in lr
    assert flow is not None and flow.steps == [4, 8, 16, 32]
    assert all(0.8 < flow.slope[s] < 1.4 for s in ("qk", "vo")), flow
    assert data.same_point["rope_"].flow is None  # measured on the plain variant only
    out = data.out
    assert not any((out / "runs").glob("*/checkpoint.pt"))  # the weights were only needed on the way
    # the files keep their names: same_point_drift.json, and metrics.jsonl read back as typed arrays
    saved = json.loads((out / "same_point_drift.json").read_text())
    assert list(saved[""]) == ["lr", "step_sq_qk", "drift_qk", "slope_qk", "step_sq_vo", "drift_vo",
                               "slope_vo", "drift_qk_naive", "slope_qk_naive", "floor32_qk", "floor32_vo",
                               "floor_eps_qk", "floor_eps_vo", "tiny64_qk", "tiny64_vo", "flow"]
    assert saved["rope_"]["slope_vo"] == data.same_point["rope_"].slope["vo"]
    from attnid.paper.drift import Anatomy, SamePoint

    assert SamePoint.from_dict(saved[""]) == data.same_point[""]  # the file round-trips
    assert Anatomy.from_dict(json.loads((out / "update_anatomy.json").read_text())) == data.anatomy
    run, recs = data.runs["gqa_adamw"], _records(out / "runs" / "gqa_adamw")
    assert run.qk.beta.shape == (len(recs), 2 * 2)  # 2 layers x 2 key/value groups
    assert run.vo.update_sq.shape == (len(recs), 2) and run.vo.update_tau.shape == (len(recs), 2 * 2)
    assert run.vo.drift[-1].tolist() == [x for row in recs[-1]["drift_vo"] for x in row]
    assert run.grad_norm_bq.shape == (len(recs), 2 * 4) and run.update_norm_max.shape == (len(recs), 2)


def test_matplotlib_backend_is_not_changed_by_the_report_modules():
    code = ("import matplotlib; matplotlib.use('svg'); import attnid.paper.reproduce, "
            "attnid.paper.training; print(matplotlib.get_backend())")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": "src"})
    assert proc.stdout.strip() == "svg", proc.stderr[-500:]


@pytest.mark.parametrize("variant", [{}, {"rope": 1.0}, {"n_kv_heads": 2}, {"n_kv_heads": 2, "rope": 0.5}],
                         ids=["mha", "rope", "gqa", "gqa+partial-rope"])
def test_one_sgd_step_moves_c_only_at_second_order(tmp_path, variant):
    """beta's C is the right conserved quantity: one float64 SGD step changes it by at most
    ||lr g_QK||^2 (slope 2 in lr); the per-head unprojected quantity moves at first order
    whenever RoPE or GQA make it the wrong one."""
    from attnid.paper.drift import same_point_drift

    model = GPTConfig(**{**TINY.to_dict(), **variant, "attn_bias": "qk"})
    cfg = TrainConfig(model=model, optimizer="sgd", lr=0.1, steps=4, log_every=2, eval_every=4)
    train(cfg, tmp_path / "r", progress=False)
    lrs = (1e-3, 1e-2, 1e-1)
    sp = same_point_drift(tmp_path / "r", lrs)
    for lr, d, bound in zip(lrs, sp.drift["qk"], sp.step_sq_qk, strict=True):
        assert d <= bound, f"lr {lr}: drift {d:.3e} above ||lr g_QK||^2 = {bound:.3e}"
    assert abs(sp.slope["qk"] - 2) < 0.02 and abs(sp.slope["vo"] - 2) < 0.02, sp
    if variant:
        assert abs(sp.slope_qk_naive - 1) < 0.2, sp.slope_qk_naive
        assert sp.drift_qk_naive[0] > 10 * sp.step_sq_qk[0], sp


@pytest.mark.parametrize("variant", [{}, {"rope": 1.0}, {"n_kv_heads": 2}, {"attn_bias": "qkvo"},
                                     {"qk_norm": "head", "attn_bias": "qkvo"}],
                         ids=["mha", "rope", "gqa", "all-biases", "qk-norm"])
def test_tau_moves_by_exactly_the_logged_trace_of_the_steps_own_c_under_sgd_not_adamw(tmp_path, variant):
    """docs/theory.md §9.5: a gradient step changes tau by exactly trace C(Δw) (the step's own
    conserved quantity), so over a run Δtau = Σ update_tau per head; an AdamW step is not a
    gradient step and breaks it at first order (the control). VO only: in 12 small steps the QK
    side's change (about 1e-9) is below float32 rounding (about 1e-8)."""
    from attnid.paper.experiment import load_run
    from attnid.paper.second_order import tau_balance

    model = GPTConfig(**{**TINY.to_dict(), "attn_bias": "qk", **variant})
    for opt, lr in (("sgd", 0.3), ("adamw", 1e-3)):
        train(TrainConfig(model=model, optimizer=opt, lr=lr, steps=12, log_every=3, eval_every=12),
              tmp_path / opt, progress=False, checkpoint=False)
    sgd, adam = load_run(tmp_path / "sgd"), load_run(tmp_path / "adamw")
    t = tau_balance(sgd, "vo")
    assert np.abs(t.second_order).max() > 1e-4  # the steps did move tau_vo
    assert t.mismatch < 1e-4, (t.measured, t.second_order)
    assert tau_balance(adam, "vo").mismatch > 0.5
