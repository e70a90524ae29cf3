"""The training experiment as a report section: figures (PNG), the summary table and the
checked claims, drawn from :class:`attnid.paper.experiment.ExperimentData`.

Figures use matplotlib's object-oriented API (``Figure`` + the Agg canvas): the user's
plotting backend is never changed.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure as MplFigure
from matplotlib.ticker import NullFormatter

from attnid.paper import measures, second_order
from attnid.paper.document import Claim, Figure, Section, Table
from attnid.paper.drift import DRAWS, TINY_LR
from attnid.paper.experiment import PAPER_CASES, VARIANTS, ExperimentData, RunData, title
from attnid.paper.measures import bias_grads, drift_fit, loss_gap, qk_share, sawtooth, sweep_lr, tangent_share
from attnid.paper.second_order import lr_axis
from attnid.stats import median, medians
from attnid.symmetry.conserved import flat_key
from attnid.weights import SIDES, Side

SECTION = "Training"
BAND = "shaded: min to max over all heads and layers"


def _save(fig: MplFigure, path: Path) -> Path:
    fig.savefig(path, dpi=90)
    return path


# ---- figures ----------------------------------------------------------------------------------
RHO_FLOOR = 1e-14  # rho is drawn on a log axis; exact zeros sit on this floor
def fig2(data: ExperimentData, cases: list[str], side: Side, path: Path, heading: str) -> Path:
    """Rows: cases. Columns: loss, update norm, rho, beta, tau, mu (per head: median or mean
    line, min-max band). Dashed on rho: each case's own tangent share (:func:`tangent_share`
    of its spec, the rho of an isotropic update; 1/(2H) only for plain MHA)."""
    cols = ["loss", "update norm ||Δw||", f"{flat_key('rho', side)} (tangent share)",
            f"{flat_key('beta', side)} = ||C||_F", f"{flat_key('tau', side)} = trace C", flat_key("mu", side)]
    fig = MplFigure(figsize=(19, 2.7 * len(cases) + 0.8))
    axes = fig.subplots(len(cases), len(cols), squeeze=False)
    for row, case in zip(axes, cases, strict=True):
        r = data.runs[case]
        s = r.step
        share = tangent_share(data.configs[case].model.attention_spec(), side)
        row[0].plot(s, r.loss, lw=1, label="train")
        if r.val_loss.size:
            row[0].plot(r.val_step, r.val_loss, "o-", ms=3, label="val")
        row[0].legend(fontsize=7)
        row[0].set_ylabel(title(case), fontsize=9)
        row[1].plot(s, r.update_norm, color="tab:red", lw=0.8)
        row[1].set_ylim(0, 1.05 * float(np.max(r.update_norm)))
        rho = np.maximum(r.side(side).rho, RHO_FLOOR)  # log axis: SGD's numerical zero stays visible
        row[2].fill_between(s, rho.min(1), rho.max(1), alpha=0.25, color="tab:blue", lw=0)
        row[2].plot(s, medians(rho), lw=1.2, color="tab:blue", label="median")
        row[2].axhline(share, color="k", ls="--", lw=0.8, label=f"tangent share {share:.2g}")
        row[2].set_yscale("log")
        row[2].set_ylim(RHO_FLOOR, 2.0)  # a share: rebalancing steps show as 1 (the move is all orbit)
        row[2].legend(fontsize=6, loc="lower right")
        for ax, name in zip(row[3:], ("beta", "tau", "mu"), strict=True):
            v = getattr(r.side(side), name)
            ax.fill_between(s, v.min(1), v.max(1), alpha=0.25, lw=0)
            ax.plot(s, v.mean(1), lw=1.2)
    for ax, name in zip(axes[0], cols, strict=True):
        ax.set_title(name, fontsize=10)
    for ax in axes[-1]:
        ax.set_xlabel("step")
    fig.suptitle(f"{heading}. Lines: mean (rho: median) over heads; {BAND}.", fontsize=11)
    fig.tight_layout()
    return _save(fig, path)


def fig3(data: ExperimentData, cases: list[str], path: Path) -> Path:
    fig = MplFigure(figsize=(10, 2.6 * len(cases)))
    axes = fig.subplots(len(cases), 2, squeeze=False, sharey="row")  # b_Q and b_K on one scale
    for row, case in zip(axes, cases, strict=True):
        r = data.runs[case]
        for ax, key, name in zip(row, ("grad_norm_bq", "grad_norm_bk"), ("b_Q", "b_K"), strict=True):
            v = np.abs(getattr(r, key)) + 1e-30  # [S, H]
            for stat, line in (("min", v.min(1)), ("median", medians(v)), ("max", v.max(1))):
                ax.plot(r.step, line, lw=1, label=f"{stat} over heads")
            ax.set_yscale("log")
            ax.yaxis.set_minor_formatter(NullFormatter())
            ax.set_title(f"{title(case)}: gradient of {name}", fontsize=9)
        row[0].set_ylabel("||gradient|| per head")
    axes[0][0].legend(fontsize=7)
    for ax in axes[-1]:
        ax.set_xlabel("step")
    fig.tight_layout()
    return _save(fig, path)


def fig4(data: ExperimentData, sweep: list[str], side: Side, path: Path) -> float:
    fig = MplFigure(figsize=(11, 4.6))
    a, b = fig.subplots(1, 2)
    for c in sweep:
        a.plot(data.runs[c].step, data.runs[c].side(side).drift.mean(1), lw=1, label=title(c))
    floor = second_order.floor_line(data, side)
    for ax in (a, b):
        if floor is not None:
            ax.axhline(floor, color="grey", ls=":", lw=1.2, label="float32 rounding floor ε32·(‖G_L‖+‖G_R‖)")
    a.set_yscale("log")
    a.set_xlabel("step")
    a.set_ylabel(f"{flat_key('drift', side)} of one step (mean over heads)")
    fig.legend(*a.get_legend_handles_labels(), loc="lower left", fontsize=8, ncols=2,
               bbox_to_anchor=(0.06, 0.0))
    lrs, md, slope = drift_fit(data, sweep, side)
    _, d1, slope1 = drift_fit(data, sweep, side, first=True)
    b.plot(lrs, md, "o-", label=f"mean over the run: slope {slope:.2f}")
    b.plot(lrs, d1, "s--", label=f"step 1, float32: slope {slope1:.2f}")
    sp = data.same_point.get("")
    if sp is not None:
        b.plot(sp.lr, sp.drift[side], "^-",
               label=f"one float64 step from the same weights: slope {sp.slope[side]:.3f}")
    b.set_yscale("log")
    lr_axis(b, lrs)
    b.set_ylabel(flat_key("drift", side))
    b.set_title("drift against lr (theory: slope 2)", fontsize=10)
    handles, labels = b.get_legend_handles_labels()
    fig.legend(handles[1:], labels[1:], loc="lower right", fontsize=8, bbox_to_anchor=(0.99, 0.0))
    fig.tight_layout(rect=(0, 0.14, 1, 1))
    _save(fig, path)
    return slope


# ---- claims -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Thresholds:
    """Where each training claim draws its line (named, so that a reader can judge them)."""

    sgd_rho_vs_adam: float = 1e-3  # SGD's median rho below this fraction of AdamW's
    share_factor: float = 10.0  # AdamW's median rho within this factor of the tangent share
    loss_share: float = 0.05  # rebalancing: loss differences below this share of AdamW's loss drop
    reset_level: float = 1e-4  # at a rebalancing step: beta below this fraction of AdamW's (rounding: 1e-7)
    regrowth: float = 100.0  # between rebalancings: beta back above this many times its reset level
    key_bias_zero: float = 1e-4  # float32: "numerically zero" relative to the query-bias gradient
    key_bias_alive: float = 1e-2  # under full RoPE: clearly not zero
    projection_rho: float = 1e-6  # rho left by the project correction
    isotropic: float = 0.1  # an isotropic update's rho within this fraction of the tangent share
    gradient_rho: float = 1e-8  # the gradient's own rho: zero up to the solver's tolerance
    momentum_share: float = 0.5  # momentum alone: below this fraction of the update's rho
    preconditioner_factor: float = 2.0  # g / sqrt(v) alone: within this factor of the update's rho


LIMITS = Thresholds()
THEORY = {"theory: slope of one step's drift against lr": 2.0,
          "theory: slope of a fixed time's drift against lr": 1.0}


def limit_rows() -> list[dict]:
    """Every named line the claims draw, the theory's slopes and the fixed sizes of the probes."""
    named = {**{f"training: {k}": v for k, v in vars(LIMITS).items()},
             **{f"second order: {k}": v for k, v in vars(second_order.LIMITS).items()},
             "second order: spike share": second_order.SPIKE_SHARE,
             "second order: spike update norm factor": second_order.SPIKE_NORM,
             "second order: moved (not described below)": second_order.MOVED,
             "probe: tiny lr of the rounding floor": TINY_LR, "probe: isotropic draws of the anatomy": DRAWS,
             **THEORY}
    rows = []
    for name, v in named.items():
        lo, hi = v if isinstance(v, tuple) else (v, None)
        rows.append({"limit": name, "value": lo} if hi is None else {"limit": name, "low": lo, "high": hi})
    return rows


def claims(data: ExperimentData, prefix: str = "", share: float | None = None,
           key_bias_free: bool = True) -> list[Claim]:
    """The paper's qualitative training claims on one variant, each checked against the runs,
    and the second-order claims (`attnid.paper.second_order`) on both sides."""
    runs = data.runs
    sgd, wd = runs[prefix + "sgd"], runs[prefix + "sgd_wd"]
    adam, reb = runs[prefix + "adamw"], runs[prefix + "adamw_rebalance"]
    tag = f"[{VARIANTS[prefix]}] " if prefix else ""
    out: list[Claim] = []

    def add(claim: str, holds: bool, evidence: str) -> None:
        out.append(Claim(SECTION, tag + claim, bool(holds), evidence))

    rho_sgd, rho_adam = median(sgd.qk.rho[1:]), median(adam.qk.rho[1:])
    add("SGD without weight decay moves (numerically) nothing along the QK orbit",
        rho_sgd < LIMITS.sgd_rho_vs_adam * rho_adam,
        f"median rho_qk: SGD {rho_sgd:.2e}, AdamW {rho_adam:.2e}")
    second_order.claims(data, prefix, add)
    b1, bw = sgd.qk.beta[-1].mean(), wd.qk.beta[-1].mean()
    add("weight decay makes beta_qk shrink", bw < b1, f"final mean beta_qk: SGD {b1:.4g}, SGD+wd {bw:.4g}")
    target = tangent_share(data.configs[prefix + "adamw"].model.attention_spec()) if share is None else share
    add("AdamW's rho_qk is of the order of the tangent share (orbit dimension over QK parameters; 1/(2H) "
        "for plain MHA without biases)",
        target / LIMITS.share_factor <= rho_adam <= LIMITS.share_factor * target,
        f"median rho_qk {rho_adam:.3g} vs tangent share {target:.3g}")
    b0 = sgd.qk.beta[0].mean()
    ba0, ba1 = adam.qk.beta[0].mean(), adam.qk.beta[-1].mean()
    add("AdamW makes beta_qk drift (more than SGD)", abs(ba1 - ba0) > abs(b1 - b0),
        f"AdamW beta_qk {ba0:.4g} -> {ba1:.4g}; SGD {b0:.4g} -> {b1:.4g}")
    add(*rebalance_loss_claim(adam, reb))
    add(*sawtooth_claim(adam, reb, data.configs[prefix + "adamw_rebalance"].correct))
    if adam.grad_norm_bk is not None:
        bk, bq = bias_grads(data, [prefix + c for c in ("adamw",)])
        if key_bias_free:  # float32 training: "numerically zero" is ~1e-7 relative
            add("the key-bias gradient is numerically zero, the query-bias gradient is not",
                bk < LIMITS.key_bias_zero * bq, f"max |grad b_K| {bk:.2e}, median |grad b_Q| {bq:.2e}")
        else:
            add("under full RoPE the key bias is identified: its gradient is not zero",
                bk > LIMITS.key_bias_alive * bq, f"max |grad b_K| {bk:.2e}, median |grad b_Q| {bq:.2e}")
    return out


def rebalance_loss_claim(adam: RunData, reb: RunData) -> tuple[str, bool, str]:
    """The loss differences of :func:`loss_gap` against a share of AdamW's loss drop."""
    train, val, drop = loss_gap(adam, reb)
    margin = LIMITS.loss_share * drop  # measures.rebalancing_rows tables it
    return (f"rebalancing leaves AdamW's loss curve unchanged: on the same batches, every logged loss "
            f"differs by less than {LIMITS.loss_share:.0%} of AdamW's loss drop",
            drop > 0 and max(train, val) < margin,
            f"largest train-loss difference {train:.2g}, final validation-loss difference {val:.2g}; AdamW's "
            f"loss drop {drop:.3g} (step-1 train loss to final validation loss), margin {margin:.2g}")


def sawtooth_claim(adam: RunData, reb: RunData, correct: str) -> tuple[str, bool, str]:
    """At the logged rebalancing steps the mean beta_qk is reset to rounding level; at the logged
    steps between them AdamW regrows it (a sawtooth), when any are logged."""
    every, n_at, reset, grown = sawtooth(reb, adam, correct)
    if reset is None:
        return ("rebalancing resets beta_qk to ~0", False,
                f"no logged step is a rebalancing step (every {every})")
    text = (f"at the {n_at} logged rebalancing steps (every {every}) the rebalanced mean beta_qk is "
            f"at most {reset:.2g} of AdamW's (margin {LIMITS.reset_level:g})")
    if grown is None:
        return ("rebalancing resets beta_qk to ~0 at each rebalancing step (no step between them is logged: "
                "the regrowth is not observed)", reset < LIMITS.reset_level, text)
    return ("rebalancing makes beta_qk a sawtooth: reset to ~0 at each rebalancing step, regrown by AdamW "
            "between them",
            reset < LIMITS.reset_level and grown > LIMITS.regrowth,
            f"{text}; between them it regrows to {grown:.3g}× its largest reset value (margin "
            f"{LIMITS.regrowth:g}×)")


def anatomy_claims(data: ExperimentData) -> list[Claim]:
    """Where AdamW's orbit motion comes from (`attnid.paper.drift.update_anatomy`)."""
    a = data.anatomy
    if a is None:
        return []
    spec = data.configs["adamw"].model.attention_spec()
    share = {side: tangent_share(spec, side) for side in SIDES}
    iso, upd = a.rho["isotropic"], a.rho["AdamW update"]
    pre, mom, grad = a.rho["preconditioned gradient"], a.rho["momentum"], a.rho["gradient"]
    f = LIMITS.preconditioner_factor
    return [
        Claim(SECTION, "an isotropic random update's tangent share rho is the orbit dimension over the "
                       "parameter count of its side",
              all(abs(iso[s] - share[s]) <= LIMITS.isotropic * share[s] for s in SIDES),
              "; ".join(f"{s.upper()}: median rho {iso[s]:.4f} (mean of 3 draws), orbit dim / params "
                        f"{share[s]:.4f}" for s in SIDES)),
        Claim(SECTION, "AdamW's orbit motion comes from its per-coordinate preconditioner: the gradient "
                       "is orbit-free, the momentum alone carries less than half of AdamW's rho, g / "
                       "sqrt(v) alone "
                       "about all of it",
              all(grad[s] < LIMITS.gradient_rho and mom[s] < LIMITS.momentum_share * upd[s]
                  and upd[s] / f <= pre[s] <= f * upd[s] for s in SIDES),
              "; ".join(f"{s.upper()} median rho: update {upd[s]:.3g}, g/sqrt(v) {pre[s]:.3g}, momentum "
                        f"{mom[s]:.2g}, gradient {grad[s]:.1g}" for s in SIDES)),
    ]


def sweep_claim(data: ExperimentData, sweep: list[str]) -> Claim:
    ordered = sorted(sweep, key=sweep_lr, reverse=True)
    mono = all(all(a > b for a, b in itertools.pairwise(drift_fit(data, ordered, side)[1].tolist()))
               for side in SIDES)
    s = {side: drift_fit(data, sweep, side)[2] for side in SIDES}
    s1 = {side: drift_fit(data, sweep, side, first=True)[2] for side in SIDES}
    return Claim(SECTION, "over whole SGD runs, drift falls with the learning rate (the paper's Fig. 4)",
                 mono and s["qk"] > 0 and s["vo"] > 0,
                 f"mean drift decreases monotonically from lr {sweep_lr(ordered[0]):g} to "
                 f"{sweep_lr(ordered[-1]):g}: {mono}; whole-run log-log "
                 f"slope QK {s['qk']:.2f}, VO {s['vo']:.2f} (not 2: each lr follows its own trajectory); "
                 f"at step 1 in float32 QK {s1['qk']:.2f}, VO {s1['vo']:.2f}")


def summary_rows(data: ExperimentData) -> list[dict]:
    rows = []
    for c, r in data.runs.items():
        rows.append({
            "case": c,
            "final_train_loss": round(float(r.loss[-1]), 4),
            "final_val_loss": round(float(r.val_loss[-1]), 4) if r.val_loss.size else None,
            "median_rho_qk": median(r.qk.rho[1:]),
            "median_rho_vo": median(r.vo.rho[1:]),
            "beta_qk_first": float(r.qk.beta[0].mean()),
            "beta_qk_last": float(r.qk.beta[-1].mean()),
            "beta_vo_first": float(r.vo.beta[0].mean()),
            "beta_vo_last": float(r.vo.beta[-1].mean()),
            "beta_vo_change": float(r.vo.beta[-1].mean() - r.vo.beta[0].mean()),
            "final_tau_qk": float(r.qk.tau[-1].mean()),
            "sum_update_sq_qk": float(r.qk.update_sq[1:].sum()),
            "sum_update_sq_vo": float(r.vo.update_sq[1:].sum()),
        })
    return rows


SUMMARY_COLUMNS = {"case": "run", "final_train_loss": "train loss", "final_val_loss": "val loss",
                   "median_rho_qk": "rho_qk", "median_rho_vo": "rho_vo", "beta_qk_first": "beta_qk first",
                   "beta_qk_last": "beta_qk last", "beta_vo_change": "Δbeta_vo",
                   "sum_update_sq_qk": "Σ‖Δw_QK‖²", "sum_update_sq_vo": "Σ‖Δw_VO‖²"}


# ---- captions (every number in them computed from the data) --------------------------------------
def caption_fig2_qk(data: ExperimentData) -> str:
    sgd, adam = data.runs["sgd"], data.runs["adamw"]
    spec = data.configs["adamw"].model.attention_spec()
    share = tangent_share(spec, "qk")
    rho_sgd, rho_adam = median(sgd.qk.rho[1:]), median(adam.qk.rho[1:])
    _, _, rel = second_order.change(sgd, "qk")
    _, _, rel_adam = second_order.change(adam, "qk")
    text = (f"The paper's Fig. 2. SGD's rho_qk stays at numerical zero (median {rho_sgd:.1g}) and its mean "
            f"beta_qk moves {100 * rel:+.1f}%; AdamW's median rho_qk is {rho_adam:.3g}, "
            f"{rho_adam / share:.2f} of the share an isotropic update would have (orbit dimension over QK "
            f"parameters, {share:.3g}, dashed)")
    a = data.anatomy
    if a is not None:
        text += (f": AdamW's update is the gradient (rho {a.rho['gradient']['qk']:.0e}) rescaled coordinate "
                 f"by coordinate by 1/sqrt(v), and that rescaling alone gives rho "
                 f"{a.rho['preconditioned gradient']['qk']:.3g} (momentum alone "
                 f"{a.rho['momentum']['qk']:.2g}, an isotropic direction {a.rho['isotropic']['qk']:.3g})")
    adam, reb = data.runs["adamw"], data.runs["adamw_rebalance"]
    saw = sawtooth_claim(adam, reb, data.configs["adamw_rebalance"].correct)
    loss = rebalance_loss_claim(adam, reb)
    text += f"; AdamW's beta_qk drifts {100 * rel_adam:+.0f}%; rebalancing "
    text += "resets beta_qk to ~0 at each rebalancing step" if saw[1] else "does not reset beta_qk to ~0"
    gap = max(loss_gap(adam, reb)[:2])
    text += f" and changes the loss by at most {gap:.2g} ({'within' if loss[1] else 'beyond'} its margin"
    return text + (f"; its rebalancing steps are pure orbit moves: rho = 1 and a spike in the update norm). "
                   f"Lines are means (rho: median) over heads; {BAND}.")


def caption_fig2_vo(data: ExperimentData) -> str:
    sgd, wd, adam = data.runs["sgd"], data.runs["sgd_wd"], data.runs["adamw"]
    b0, b1, rel = second_order.change(sgd, "vo")
    rel_qk = second_order.change(sgd, "qk")[2]
    _, _, rel_wd = second_order.change(wd, "vo")
    _, _, rel_adam = second_order.change(adam, "vo")
    t = second_order.tau_balance(sgd, "vo")
    flat = abs(rel) < second_order.MOVED
    head = ("The value/output side. SGD's beta_vo stays flat" if flat else
            "The value/output side. " + ("Unlike QK (" + f"{100 * rel_qk:+.2f}%), " if abs(rel_qk) < abs(rel)
                                         else "") + "SGD's beta_vo is not flat")
    return (f"{head}: its mean goes from {b0:.3g} to {b1:.3g} ({100 * rel:+.1f}%; with weight decay "
            f"{100 * rel_wd:+.1f}%, AdamW {100 * rel_adam:+.1f}%) while rho_vo stays at numerical zero "
            f"(median {median(sgd.vo.rho[1:]):.1g}). What moves it is SGD's second-order term: tau_vo moves "
            f"by "
            f"{t.measured.mean():+.3g} per head, and the accumulated Σ trace C_VO(Δw) over the steps is "
            f"{t.second_order.mean():+.3g} (the claims and the last figures of this section measure it). "
            f"AdamW's rho_vo (median {median(adam.vo.rho[1:]):.3g}) and rebalancing's sawtooth are as on QK.")


def caption_fig3(data: ExperimentData) -> str:
    bk, bq = bias_grads(data, list(PAPER_CASES))
    return (f"The paper's Fig. 3: the key-bias gradient (right) stays at float32 rounding level in every "
            f"case (largest {bk:.1e}), {np.log10(bq / bk):.0f} orders below the query-bias gradient "
            f"(left, median {bq:.1e}), on the same scale.")


def caption_fig4(data: ExperimentData, sweep: list[str], side: Side, slope: float) -> str:
    text = (f"The paper's Fig. 4 ({side.upper()}). Left: drift of one step along the run for each SGD lr. "
            f"Right: against lr; whole runs give slope {slope:.2f} because each lr follows its own "
            "trajectory; one float64 step from the same weights gives slope "
            f"{data.same_point[''].slope[side]:.3f}." if "" in data.same_point else ".")
    floor = second_order.floor_line(data, side)
    if floor is None:
        return text
    at_floor = [c for c in sweep if median(data.runs[c].side(side).drift[1:].mean(1))
                <= second_order.LIMITS.floor_factor * floor]
    lrs, d1, _ = drift_fit(data, sweep, side, first=True)
    near = second_order.LIMITS.floor_factor * floor
    first = [f"{lr:g}" for lr, d in zip(lrs, d1, strict=True) if d <= near]
    dotted = f" Dotted: float32 rounding floor ε32·(‖G_L‖+‖G_R‖) = {floor:.2g}"
    if not at_floor and not first:
        return text + dotted + ": every series stays above it."
    parts = []
    if first:
        parts.append(f"the float32 step-1 values at lr {', '.join(first)}")
    if at_floor:
        parts.append("the whole " + ", ".join(title(c) for c in at_floor) + (" curves" if len(at_floor) > 1
                                                                               else " curve"))
    return (text + dotted + f"; {' and '.join(parts)} sit within {second_order.LIMITS.floor_factor:g}× of "
                            f"it: "
            "rounding noise, not drift (a float32 step too small to drift reports "
            f"{data.same_point[''].floor32[side]:.2g} there, the same step in float64 "
            f"{data.same_point[''].tiny64[side]:.1g}).")


def caption_fig5(data: ExperimentData) -> str:
    worst = {side: max(second_order.second_order_ratio(data.runs[p + "sgd"], side,
                                                       second_order.rounding_allowance(data, p, side))[2]
                       for p in VARIANTS if p + "sgd" in data.runs) for side in SIDES}
    slopes = {side: [sp.slope[side] for sp in data.same_point.values()] for side in SIDES}
    naive = [sp.slope_qk_naive for p, sp in data.same_point.items() if p]
    text = ("Second order, both sides (top QK, bottom VO). Left: one float64 step from the trained weights "
            f"drifts C like lr² (slopes {min(slopes['qk'] + slopes['vo']):.3f} to "
            f"{max(slopes['qk'] + slopes['vo']):.3f}), below its bound ||lr g||² (dotted)")
    if naive:
        text += (f"; the unprojected per-head QK quantity, which ignores RoPE/GQA, drifts like lr (slopes "
                 f"{min(naive):.2f} to {max(naive):.2f}), so beta is the right conserved quantity")
    return text + (". Middle: every logged SGD step's drift against that step's squared update, below "
                   "drift = ||Δw||² (dotted: the float32 rounding floor). Right: what the bound claim "
                   "checks, "
                   "per head against its own layer's Σ||Δw_side||² since step 1 plus the float32 rounding of "
                   f"beta, the largest over heads: it stays below 1 (largest at the end: QK "
                   f"{worst['qk']:.2g}, VO {worst['vo']:.2g}).")


def caption_fig6(data: ExperimentData) -> str:
    t = {p: second_order.tau_balance(data.runs[p + "sgd"], "vo") for p in VARIANTS if p + "sgd" in data.runs}
    adam = second_order.tau_balance(data.runs["adamw"], "vo")
    text = ("beta_vo under SGD. Left: Δtau_vo (lines) and the accumulated Σ trace C_VO(Δw) of the steps "
            f"(circles) coincide for every SGD run (largest mismatch "
            f"{max(x.mismatch for x in t.values()):.0e} "
            f"of the change); for AdamW (red) they do not (mismatch {adam.mismatch:.2g}): its steps are "
            "not gradient steps.")
    sp = data.same_point.get("")
    if sp is not None and sp.flow is not None:
        text += (f" Middle: gradient descent from the trained weights for the same time lr·steps = "
                 f"{sp.flow.time:g}: the drift per unit of time falls like lr (slopes QK "
                 f"{sp.flow.slope['qk']:.2f}, VO {sp.flow.slope['vo']:.2f}; dotted: slope 1), to 0 in the "
                 "gradient-flow limit.")
    lrs, per_time = second_order.sweep_per_time(data, "vo")
    if lrs:
        text += (" Right: beta_vo along the whole sweep runs against time lr·step; per unit of time it "
                 f"moves {per_time[0]:+.2g} at lr {lrs[0]:g} and {per_time[-1]:+.2g} at lr {lrs[-1]:g}.")
    return text


def caption_variant(data: ExperimentData, prefix: str) -> str:
    sgd = data.runs[prefix + "sgd"]
    _, _, rel = second_order.change(sgd, "qk")
    _, _, rel_vo = second_order.change(sgd, "vo")
    j = second_order.biggest_jump(sgd, "qk")
    text = (f"Fig. 2 repeated on the {VARIANTS[prefix]} variant (QK side). SGD's mean beta_qk moves "
            f"{100 * rel:+.1f}% (beta_vo {100 * rel_vo:+.1f}%)")
    if second_order.is_spike(j):
        text += (f", most of it between steps {j.start} and {j.end}, where one update had norm "
                 f"{j.update_norm:.2g} ({j.update_norm / j.typical:.0f}× the median): a loss spike")
    return text + ("; all of it second order (the bound, the tau identity and the one-step slope are "
                   "claims of this section; the last figures show them).")


def caption_project(data: ExperimentData) -> str:
    proj, adam = data.runs["adamw_project"], data.runs["adamw"]
    rp = float(np.max(proj.qk.rho[1:]))
    return (f"The project correction (bottom) removes the orbit part of every AdamW update: rho_qk drops "
            f"to at most {rp:.0e} and the mean beta_qk moves "
            f"{100 * second_order.change(proj, 'qk')[2]:+.1f}% "
            f"(AdamW without it: {100 * second_order.change(adam, 'qk')[2]:+.0f}%); what moves is "
            "second order in the step, as under SGD.")


# ---- the section ------------------------------------------------------------------------------
def _paper_figures(data: ExperimentData, figures: Path) -> list[Figure]:
    """Figs. 2-4 of the paper, on the plain (MHA) runs."""
    paper = list(PAPER_CASES)
    sweep = [n for n in data.runs if n.startswith("sweep_")]
    figs = [
        Figure(fig2(data, paper, "qk", figures / "fig2_qk.png", "Fig. 2 (QK side): the paper's four cases"),
               caption_fig2_qk(data),
               "Grid of the four training cases (rows) against loss, update norm, rho_qk, beta_qk, tau_qk "
               "and mu_qk (columns) over steps."),
        Figure(fig2(data, paper, "vo", figures / "fig2_vo.png", "Fig. 2 (VO side): the paper's four cases"),
               caption_fig2_vo(data),
               "Grid of the four training cases against loss, update norm, rho_vo, beta_vo, tau_vo and "
               "mu_vo over steps."),
        Figure(fig3(data, paper, figures / "fig3_bias_grads.png"), caption_fig3(data),
               "Per-head query-bias (left) and key-bias (right) gradient norms over steps, log scale, "
               "one row per training case."),
    ]
    for side in SIDES:
        path = figures / f"fig4_drift_{side}.png"
        slope = fig4(data, sweep, side, path)
        figs.append(Figure(path, caption_fig4(data, sweep, side, slope),
                           f"Left: drift_{side} per step along each SGD sweep run; right: drift_{side} "
                           "against learning rate on log axes, with the float32 rounding floor dotted."))
    return figs


def _variant_parts(data: ExperimentData, figures: Path) -> tuple[list[Figure], list[Claim]]:
    """Fig. 2 and the claims on the RoPE and GQA variants."""
    figs: list[Figure] = []
    found: list[Claim] = []
    for prefix in (p for p in VARIANTS if p):
        cases = [prefix + c for c in PAPER_CASES]
        if not all(c in data.runs for c in cases):
            continue
        figs.append(Figure(fig2(data, cases, "qk", figures / f"fig2_qk_{prefix[:-1]}.png",
                                f"The four cases on the {VARIANTS[prefix]} variant (QK side)"),
                           caption_variant(data, prefix),
                           f"Grid of the four training cases on the {VARIANTS[prefix]} variant against loss, "
                           "update norm and the QK metrics over steps."))
        spec = data.configs[prefix + "adamw"].model.attention_spec()
        free = spec.pass_dims > 0 and spec.qk_norm == "none"
        found += claims(data, prefix, share=qk_share(spec), key_bias_free=free)
    return figs, found


def _projection_parts(data: ExperimentData, figures: Path) -> tuple[list[Figure], list[Claim]]:
    if "adamw_project" not in data.runs:
        return [], []
    fig = Figure(fig2(data, ["adamw", "adamw_project"], "qk", figures / "fig_project.png",
                      "AdamW with and without the project correction"),
                 caption_project(data),
                 "Two rows, AdamW without and with the project correction, against loss, update norm and "
                 "the QK metrics over steps.")
    rp = float(np.max(data.runs["adamw_project"].qk.rho[1:]))
    return [fig], [Claim(SECTION, "the project correction removes all orbit motion (rho_qk = 0)",
                         rp < LIMITS.projection_rho, f"max rho_qk with projection {rp:.2e}")]


def training_section(data: ExperimentData, figures: Path) -> Section:
    """Figures under ``figures``, the summary table and every claim of the training runs."""
    figures.mkdir(parents=True, exist_ok=True)
    figs = _paper_figures(data, figures)
    found = claims(data, share=qk_share(data.configs["adamw"].model.attention_spec()))
    found += anatomy_claims(data)
    found.append(sweep_claim(data, [n for n in data.runs if n.startswith("sweep_")]))
    more_figs, more_claims = _variant_parts(data, figures)
    figs += more_figs
    found += more_claims
    figs.append(Figure(second_order.fig5(data, figures / "fig5_second_order.png"), caption_fig5(data),
                       "Two rows (QK, VO) of three panels: one-step drift against learning rate and "
                       "per-step drift against squared update (both log-log), and the moved-over-bound ratio "
                       "(log) against the step (linear)."))
    figs.append(Figure(second_order.fig6_vo(data, figures / "fig6_vo_drift.png"), caption_fig6(data),
                       "Three panels: tau_vo change against the accumulated second-order term over steps; "
                       "drift per unit time against learning rate; beta_vo change against time lr·step."))
    proj_figs, proj_claims = _projection_parts(data, figures)
    figs += proj_figs
    found += proj_claims
    text = ("The paper's Section 5 on the small GPT (character-level Shakespeare), and beyond it: "
            "the four cases on a RoPE and a GQA variant, and AdamW with the project correction. "
            "rho: tangent (orbit) share of an update; beta = ||C||_F of the conserved quantity C; "
            "tau = trace C; mu: smallest Gram eigenvalues; drift: ||C_after - C_before||_F of one step.\n\n"
            + second_order.text(data))
    table = Table("training_summary", summary_rows(data), SUMMARY_COLUMNS,
                  notes=("rho: median over logged steps after the first; beta: mean over heads; Δbeta_vo: "
                         "last minus first; Σ‖Δw_QK‖², Σ‖Δw_VO‖²: sum over all steps after the first of the "
                         "squared update of each side of each layer, summed over layers.",))
    tables = (table, *measures.tables(data, LIMITS.loss_share), Table("training_limits", limit_rows()))
    return Section("Training: the paper's Section 5 and beyond", text, tables, tuple(figs), tuple(found))
