"""What the training section quotes, as tables: every number its text, captions and claims
state is a cell of one of these (`attnid.paper.document.untabled` checks it), written whole to
``tables/training_*.csv`` (also ``.json``, ``.md``).

One table per thing measured: the runs' settings, per run and side the second-order numbers
(beta, bounds, the tau balance, the largest jump), the same-point steps, the fits (slopes), the
gradient-flow runs, the SGD sweep, AdamW's update anatomy, the rebalancing comparison, the
bias gradients and, per attention variant, the tangent shares and the float32 rounding floor.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from attnid.monitor import parse_correction
from attnid.paper import second_order as so
from attnid.paper.document import Table
from attnid.paper.experiment import PAPER_CASES, VARIANTS, ExperimentData, RunData, title
from attnid.stats import log_slope, median
from attnid.theory import count
from attnid.weights import SIDES, Side

Row = dict[str, Any]


# ---- measurements shared by the tables, the captions and the claims ------------------------------
def tangent_share(spec, side: Side = "qk") -> float:
    """Orbit dimension over the parameter count of one side (what an isotropic update's rho
    averages): QK gauge and key-bias translation; VO gauge and value-bias translation."""
    comps = count(spec).components
    keys = ("qk_gauge", "key_bias_translation") if side == "qk" else ("vo_gauge", "value_bias_translation")
    parts = [comps[k] for k in keys if k in comps]
    return sum(p.unidentified for p in parts) / sum(p.params for p in parts)


def qk_share(spec) -> float:
    """Tangent share of the QK side's parameters (:func:`tangent_share` of the QK side)."""
    return tangent_share(spec, "qk")


def sweep_lr(name: str) -> float:
    return float(name.removeprefix("sweep_lr"))


def drift_fit(data: ExperimentData, sweep: list[str], side: Side, *, first: bool = False
              ) -> tuple[np.ndarray, np.ndarray, float]:
    """Log-log fit of drift against lr: over the whole run, or at step 1 (``first``), where
    every run of the sweep starts from the same weights and batch."""
    lrs = np.array([sweep_lr(c) for c in sweep])
    pick = (lambda d: d[0].mean()) if first else (lambda d: d[1:].mean())
    drift = np.array([pick(data.runs[c].side(side).drift) for c in sweep])
    return lrs, drift, log_slope(lrs, drift)


def loss_gap(adam: RunData, reb: RunData) -> tuple[float, float, float]:
    """Rebalancing against plain AdamW, same seed and batches, so each logged step is a paired
    comparison: (largest train-loss difference over the logged steps, final validation-loss
    difference, AdamW's loss drop from its step-1 train loss to its final validation loss)."""
    drop = float(adam.loss[0] - (adam.val_loss[-1] if adam.val_loss.size else adam.loss[-1]))
    train = float(np.max(np.abs(reb.loss - adam.loss)))
    both = adam.val_loss.size and reb.val_loss.size
    return train, float(abs(reb.val_loss[-1] - adam.val_loss[-1])) if both else 0.0, drop


def sawtooth(reb: RunData, adam: RunData, correct: str) -> tuple[int, int, float | None, float | None]:
    """(rebalancing period, logged rebalancing steps, the largest rebalanced mean beta_qk over
    AdamW's at them, the largest mean beta_qk between them over the largest at them); None
    where no such step is logged."""
    every = parse_correction(correct)[1]
    bm, ba = reb.qk.beta.mean(1), adam.qk.beta.mean(1)  # [S]
    at = (reb.step % every == 0) & (reb.step > 0)
    between = ~at & (reb.step > every)
    reset = float(np.max(bm[at] / ba[at])) if at.any() else None
    grown = (float(np.max(bm[between])) / max(float(np.max(bm[at])), 1e-300)
             if at.any() and between.any() else None)
    return every, int(at.sum()), reset, grown


def bias_grads(data: ExperimentData, cases: list[str]) -> tuple[float, float]:
    """(max |grad b_K|, median |grad b_Q|) over every logged step and head of ``cases``."""
    runs = [data.runs[c] for c in cases if data.runs[c].grad_norm_bk is not None]
    return (float(max(np.max(np.abs(r.grad_norm_bk)) for r in runs)),
            median([np.abs(r.grad_norm_bq) for r in runs]))


def variant_of(name: str) -> str:
    """The run-name prefix of a run's attention variant (``""`` for the plain MHA runs)."""
    return next((p for p in VARIANTS if p and name.startswith(p)), "")


def tau_of(data: ExperimentData, name: str) -> so.TauBalance:
    """The run's tau_vo balance, with SGD's coupled weight-decay term where it has one."""
    cfg = data.configs[name]
    wd = cfg.weight_decay if cfg.optimizer == "sgd" else 0.0
    return so.tau_balance(data.runs[name], "vo", cfg.lr, wd)


# ---- the tables -------------------------------------------------------------------------------
def settings_rows(data: ExperimentData) -> list[Row]:
    out = []
    for name, cfg in data.configs.items():
        m = cfg.model
        every = parse_correction(cfg.correct)[1] if cfg.correct.startswith("rebalance") else None
        out.append({"run": name, "title": title(name), "variant": VARIANTS[variant_of(name)],
                    "optimizer": cfg.optimizer, "lr": cfg.lr, "weight_decay": cfg.weight_decay,
                    "correct": cfg.correct, "rebalance_every": every, "steps": cfg.steps,
                    "batch_size": cfg.batch_size, "log_every": cfg.log_every, "eval_every": cfg.eval_every,
                    "seed": cfg.seed, "n_layers": m.n_layers, "n_heads": m.n_heads,
                    "n_kv_heads": m.n_kv_heads, "d_model": m.d_model})
    return out


def _side_row(data: ExperimentData, name: str, side: Side) -> Row:
    run = data.runs[name]
    s = run.side(side)
    b0, b1, rel = so.change(run, side)
    bound = float(s.update_sq[1:].sum(0).mean())  # per layer
    eps = so.rounding_allowance(data, variant_of(name), side)
    moved, worst, ratio = so.second_order_ratio(run, side, eps)
    j = so.biggest_jump(run, side)
    row: Row = {"run": name, "side": side, "median_rho": median(s.rho[1:]),
                "max_rho": float(np.max(s.rho[1:])),
                "beta_first": b0, "beta_last": b1, "beta_change": b1 - b0, "beta_change_rel": rel,
                "update_sq_per_layer": bound, "update_sq_over_beta": bound / b0,
                "update_sq_total": float(s.update_sq[1:].sum()), "rounding": eps, "worst_moved": moved,
                "worst_bound": worst, "worst_ratio": ratio, "jump_start": j.start, "jump_end": j.end,
                "jump_share": j.share, "jump_update_norm": j.update_norm, "jump_typical": j.typical,
                "jump_factor": j.update_norm / j.typical if j.typical else None}
    if side == "vo":
        t = tau_of(data, name)
        i = int(np.argmax(np.abs(t.second_order)))
        up = s.update_tau[1:].mean(1)  # [S-1]
        row |= {"tau_change": float(t.measured.mean()), "tau_second_order": float(t.second_order.mean()),
                "tau_decay": float(t.decay.mean()), "tau_mismatch": t.mismatch,
                "tau_decay_error": t.decay_error if t.decay.any() else None,
                "tau_largest_head_change": float(t.measured[i]),
                "tau_largest_head_second_order": float(t.second_order[i]),
                "intervals": int(up.size),
                "intervals_with_total_sign": int((np.sign(up) == np.sign(up.sum())).sum())}
    return row


def second_order_rows(data: ExperimentData) -> list[Row]:
    """Per run and side: beta, the bound, the largest jump; on VO the tau balance."""
    return [_side_row(data, name, side) for name in data.runs for side in SIDES]


def variant_rows(data: ExperimentData) -> list[Row]:
    """Per attention variant: tangent shares, float32 rounding floor, SGD's squared VO steps
    over AdamW's, AdamW's rho over its tangent share."""
    out = []
    for prefix, label in VARIANTS.items():
        if prefix + "adamw" not in data.runs:
            continue
        spec = data.configs[prefix + "adamw"].model.attention_spec()
        share = {side: tangent_share(spec, side) for side in SIDES}
        row: Row = {"variant": label, **{f"tangent_share_{s}": share[s] for s in SIDES},
                    "adamw_rho_qk_over_share": median(data.runs[prefix + "adamw"].qk.rho[1:]) / share["qk"]}
        sgd = data.runs.get(prefix + "sgd")
        if sgd is not None:
            adam = data.runs[prefix + "adamw"]
            row["sgd_over_adamw_update_sq_vo"] = float(sgd.vo.update_sq[1:].sum()
                                                       / adam.vo.update_sq[1:].sum())
        sp = data.same_point.get(prefix)
        if sp is not None:
            row |= {f"{k}_{s}": getattr(sp, k)[s] for k in ("floor_eps", "floor32", "tiny64") for s in SIDES}
        out.append(row)
    return out


def same_point_rows(data: ExperimentData) -> list[Row]:
    """One float64 SGD step of each lr from each variant's trained weights."""
    out = []
    for prefix, sp in data.same_point.items():
        for i, lr in enumerate(sp.lr):
            out.append({"variant": VARIANTS[prefix], "lr": lr,
                        **{f"drift_{s}": sp.drift[s][i] for s in SIDES},
                        **{f"bound_{s}": sp.step_sq[s][i] for s in SIDES},
                        **{f"drift_over_bound_{s}": sp.drift[s][i] / sp.step_sq[s][i] for s in SIDES},
                        "drift_qk_unprojected": sp.drift_qk_naive[i]})
    return out


def fit_rows(data: ExperimentData) -> list[Row]:
    """Log-log slopes of drift against lr: one step (per variant), fixed time, whole runs."""
    out: list[Row] = []
    for prefix, sp in data.same_point.items():
        out.append({"fit": "one float64 step from the trained weights", "variant": VARIANTS[prefix],
                    **{f"slope_{s}": log_slope(sp.lr, sp.drift[s]) for s in SIDES},
                    "slope_qk_unprojected": log_slope(sp.lr, sp.drift_qk_naive),
                    "lr_from": sp.lr[0], "lr_to": sp.lr[-1]})
    f = data.same_point[""].flow if "" in data.same_point else None
    if f is not None:
        local = {s: float(np.log(f.drift[s][-2] / f.drift[s][-1]) / np.log(f.lr[-2] / f.lr[-1]))
                 for s in SIDES}
        out.append({"fit": "gradient descent for a fixed time lr*steps", "variant": "MHA",
                    **{f"slope_{s}": log_slope(f.lr, f.drift[s]) for s in SIDES},
                    **{f"slope_{s}_last_pair": local[s] for s in SIDES},
                    "lr_from": f.lr[0], "lr_to": f.lr[-1]})
    sweep = sorted((n for n in data.runs if n.startswith("sweep_lr")), key=sweep_lr, reverse=True)
    if sweep:
        for first, what in ((False, "whole SGD runs, mean drift"), (True, "SGD runs at step 1, float32")):
            out.append({"fit": what, "variant": "MHA",
                        **{f"slope_{s}": drift_fit(data, sweep, s, first=first)[2] for s in SIDES},
                        "lr_from": sweep_lr(sweep[0]), "lr_to": sweep_lr(sweep[-1])})
    return out


def flow_rows(data: ExperimentData) -> list[Row]:
    """Gradient descent for the same time lr*steps at each lr; ratio_*: drift over the next
    (half) lr's."""
    f = data.same_point[""].flow if "" in data.same_point else None
    if f is None:
        return []
    out = []
    for i, (lr, steps) in enumerate(zip(f.lr, f.steps, strict=True)):
        row: Row = {"lr": lr, "steps": steps, "time": f.time}
        for s in SIDES:
            row |= {f"drift_{s}": f.drift[s][i], f"per_time_{s}": f.per_time(s)[i],
                    f"ratio_to_next_{s}": f.drift[s][i] / f.drift[s][i + 1] if i + 1 < len(f.lr) else None}
        out.append(row)
    return out


def sweep_rows(data: ExperimentData) -> list[Row]:
    """The SGD learning-rate sweep: drift over the run and at step 1, beta_vo's change."""
    sweep = sorted((n for n in data.runs if n.startswith("sweep_lr")), key=sweep_lr, reverse=True)
    _, per_time = so.sweep_per_time(data, "vo")
    out = []
    for name, pt in zip(sweep, per_time, strict=True):
        row: Row = {"run": name, "lr": sweep_lr(name)}
        for s in SIDES:
            row |= {f"mean_drift_{s}": float(data.runs[name].side(s).drift[1:].mean()),
                    f"step1_drift_{s}": float(data.runs[name].side(s).drift[0].mean())}
        out.append(row | {"beta_vo_change_rel": so.change(data.runs[name], "vo")[2], "beta_vo_per_time": pt})
    return out


def anatomy_rows(data: ExperimentData) -> list[Row]:
    a = data.anatomy
    return [] if a is None else [{"direction": k, **{f"median_rho_{s}": v[s] for s in SIDES}}
                                 for k, v in a.rho.items()]


def rebalancing_rows(data: ExperimentData, loss_share: float) -> list[Row]:
    """Per variant, AdamW with and without rebalancing on the same batches; the margin is
    ``loss_share`` of AdamW's loss drop."""
    out = []
    for prefix, label in VARIANTS.items():
        names = (prefix + "adamw", prefix + "adamw_rebalance")
        if not all(n in data.runs for n in names):
            continue
        adam, reb = (data.runs[n] for n in names)
        train, val, drop = loss_gap(adam, reb)
        every, n_at, reset, grown = sawtooth(reb, adam, data.configs[names[1]].correct)
        out.append({"variant": label, "largest_train_loss_gap": train, "final_val_loss_gap": val,
                    "largest_gap": max(train, val), "adamw_loss_drop": drop,
                    "margin": loss_share * drop, "every": every,
                    "logged_rebalancing_steps": n_at, "reset_over_adamw": reset, "regrowth": grown})
    return out


def bias_rows(data: ExperimentData) -> list[Row]:
    """max |grad b_K| and median |grad b_Q| per AdamW run, and over the paper's four cases."""
    groups = {title(n): [n] for n in data.runs
              if n.endswith("adamw") and data.runs[n].grad_norm_bk is not None}
    if all(c in data.runs for c in PAPER_CASES):
        groups["MHA: the paper's four cases"] = list(PAPER_CASES)
    out = []
    for what, cases in groups.items():
        bk, bq = bias_grads(data, cases)
        out.append({"runs": what, "max_grad_bk": bk, "median_grad_bq": bq,
                    "orders_apart": float(np.log10(bq / bk))})
    return out


def tables(data: ExperimentData, loss_share: float) -> tuple[Table, ...]:
    """Every measurement table of the training section (the summary and limits aside);
    ``loss_share``: the rebalancing claim's margin as a share of AdamW's loss drop."""
    sides = {"run": "run", "side": "side", "beta_first": "beta first", "beta_change_rel": "Δbeta rel",
             "worst_ratio": "moved / bound", "tau_change": "Δtau_vo", "tau_second_order": "Σ trace C_VO",
             "tau_mismatch": "mismatch"}
    found = (
        Table("training_settings", settings_rows(data),
              {k: k for k in ("run", "optimizer", "lr", "weight_decay", "correct", "steps", "batch_size",
                              "seed")}),
        Table("training_second_order", second_order_rows(data), sides, max_rows=12,
              notes=("Per run and side: mean beta after step 1 and at the end, the bound Σ‖Δw‖² and the "
                     "worst head against it (a bound for SGD without weight decay only), the largest jump of "
                     "the mean; on VO the tau balance.",)),
        Table("training_same_point", same_point_rows(data)),
        Table("training_fits", fit_rows(data)),
        Table("training_flow", flow_rows(data)),
        Table("training_sweep", sweep_rows(data)),
        Table("training_anatomy", anatomy_rows(data)),
        Table("training_rebalancing", rebalancing_rows(data, loss_share)),
        Table("training_bias_gradients", bias_rows(data)),
        Table("training_variants", variant_rows(data)),
    )
    return tuple(t for t in found if t.rows)
