"""Figures (PNG), the summary table (CSV + Markdown) and the checked claims of the training experiment."""

from __future__ import annotations

import csv
import itertools
import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

PAPER = ("sgd", "sgd_wd", "adamw", "adamw_rebalance")
TITLES = {"sgd": "SGD lr 0.25", "sgd_wd": "SGD lr 0.25, wd 4e-4", "adamw": "AdamW lr 1e-3, wd 0.1",
          "adamw_rebalance": "AdamW + rebalancing", "adamw_project": "AdamW + projection"}


def load_run(run_dir: Path) -> dict[str, np.ndarray]:
    """metrics.jsonl -> arrays: ``step [S]``, scalars ``[S]``, per-head metrics ``[S, L*G]``."""
    recs = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    out: dict[str, Any] = {"step": np.array([r["step"] for r in recs], dtype=float)}
    for key in recs[0]:
        if key == "step":
            continue
        vals = [r.get(key) for r in recs]
        if isinstance(vals[0], list):
            out[key] = np.array([np.ravel(np.array(v, dtype=float)) for v in vals])
        elif key != "val_loss":
            out[key] = np.array(vals, dtype=float)
    vl = [(r["step"], r["val_loss"]) for r in recs if "val_loss" in r]
    out["val_step"] = np.array([s for s, _ in vl], dtype=float)
    out["val_loss"] = np.array([v for _, v in vl], dtype=float)
    out["update_norm"] = np.ravel(out["update_norm"]) if out["update_norm"].ndim == 1 else \
        np.sqrt((out["update_norm"] ** 2).sum(1))
    return out


def _panel_row(axes, run: dict, side: str, n_heads: int) -> None:
    s = run["step"]
    ax = axes[0]
    ax.plot(s, run["loss"], lw=1, label="train")
    if run["val_loss"].size:
        ax.plot(run["val_step"], run["val_loss"], "o-", ms=3, label="val")
    ax.set_ylabel("loss")
    ax.legend(fontsize=7)
    ax = axes[1]
    rho = run[f"rho_{side}"]
    ax.plot(s, np.median(rho, 1), lw=1, label=f"median rho_{side}")
    ax.fill_between(s, rho.min(1), rho.max(1), alpha=0.2)
    ax.axhline(1 / (2 * n_heads), color="k", ls="--", lw=0.8, label="1/(2H)")
    ax.set_yscale("symlog", linthresh=1e-6)
    ax.set_ylim(0, 1.05)  # a share: rebalancing steps show as 1 (the move is all orbit)
    ax2 = ax.twinx()
    ax2.plot(s, run["update_norm"], color="tab:red", lw=0.7, alpha=0.6)
    ax2.set_ylabel("update norm", color="tab:red", fontsize=7)
    ax.legend(fontsize=6, loc="lower right")
    for j, name in enumerate(("beta", "tau", "mu"), start=2):
        v = run[f"{name}_{side}"]
        axes[j].plot(s, v.mean(1), lw=1)
        axes[j].fill_between(s, v.min(1), v.max(1), alpha=0.2)
        axes[j].set_ylabel(f"{name}_{side}")


def fig2(runs: dict[str, dict], cases: list[str], side: str, n_heads: int, path: Path, title: str) -> None:
    fig, axes = plt.subplots(len(cases), 5, figsize=(20, 3.2 * len(cases)), squeeze=False)
    for row, case in zip(axes, cases, strict=True):
        _panel_row(row, runs[case], side, n_heads)
        row[0].set_title(TITLES.get(case.split("_", 1)[-1] if case.startswith(("rope_", "gqa_"))
                                    else case, case), fontsize=9, loc="left")
    for ax in axes[-1]:
        ax.set_xlabel("step")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def fig3(runs: dict[str, dict], cases: list[str], path: Path) -> None:
    fig, axes = plt.subplots(len(cases), 2, figsize=(10, 3 * len(cases)), squeeze=False)
    for row, case in zip(axes, cases, strict=True):
        r = runs[case]
        for ax, key in zip(row, ("grad_norm_bq", "grad_norm_bk"), strict=True):
            v = np.abs(r[key]) + 1e-30
            for stat, fn in (("min", np.min), ("median", np.median), ("mean", np.mean), ("max", np.max)):
                ax.plot(r["step"], fn(v, 1), lw=1, label=stat)
            ax.set_yscale("log")
            ax.set_title(f"{TITLES.get(case, case)}: |grad {key[-2:]}|", fontsize=9)
            ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def drift_fit(runs: dict[str, dict], sweep: list[str], side: str, *, first: bool = False
              ) -> tuple[np.ndarray, np.ndarray, float]:
    """Log-log fit of drift against lr: over the whole run, or at step 1 (``first``), where
    every run of the sweep starts from the same weights and batch."""
    lrs = np.array([float(c.removeprefix("sweep_lr")) for c in sweep])
    pick = (lambda d: d[0].mean()) if first else (lambda d: d[1:].mean())
    drift = np.array([pick(runs[c][f"drift_{side}"]) for c in sweep])
    slope = float(np.polyfit(np.log(lrs), np.log(drift), 1)[0])
    return lrs, drift, slope


def fig4(runs: dict[str, dict], sweep: list[str], side: str, path: Path,
         same_point: dict | None = None) -> float:
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for c in sweep:
        a.plot(runs[c]["step"], runs[c][f"drift_{side}"].mean(1), lw=1, label=c.removeprefix("sweep_"))
    a.set_yscale("log")
    a.set_xlabel("step")
    a.set_ylabel(f"drift_{side} per logged step")
    a.legend(fontsize=7)
    lrs, md, slope = drift_fit(runs, sweep, side)
    _, d1, slope1 = drift_fit(runs, sweep, side, first=True)
    b.loglog(lrs, md, "o-", label=f"mean over the run: slope {slope:.2f}")
    b.loglog(lrs, d1, "s--", label=f"step 1, float32 training: slope {slope1:.2f}")
    if same_point is not None:
        b.loglog(same_point["lr"], same_point[f"drift_{side}"], "^-",
                 label=f"one step from the same trained weights, float64: slope "
                       f"{same_point[f'slope_{side}']:.3f}")
    b.set_xlabel("learning rate")
    b.set_ylabel(f"drift_{side}")
    b.set_title("drift against lr (theory: slope 2)")
    b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return slope


def _tail(x: np.ndarray, frac: float = 0.2) -> float:
    n = max(1, int(len(x) * frac))
    return float(np.mean(x[-n:]))


def summary_rows(runs: dict[str, dict], cases: list[str], slopes: dict[str, float]) -> list[dict]:
    rows = []
    for c in cases:
        r = runs[c]
        rows.append({
            "case": c,
            "final_train_loss": round(float(r["loss"][-1]), 4),
            "final_val_loss": round(float(r["val_loss"][-1]), 4) if r["val_loss"].size else None,
            "median_rho_qk": float(np.median(r["rho_qk"][1:])),
            "median_rho_vo": float(np.median(r["rho_vo"][1:])),
            "beta_qk_change": float(r["beta_qk"][-1].mean() - r["beta_qk"][0].mean()),
            "beta_vo_change": float(r["beta_vo"][-1].mean() - r["beta_vo"][0].mean()),
            "final_tau_qk": float(r["tau_qk"][-1].mean()),
            "drift_slope_qk": slopes["qk"] if c.startswith("sweep") else None,
            "drift_slope_vo": slopes["vo"] if c.startswith("sweep") else None,
        })
    return rows


def _keys(rows: list[dict]) -> list[str]:
    """Every column, in first-seen order (rows may differ in optional columns)."""
    return list(dict.fromkeys(k for r in rows for k in r))


def write_table(rows: list[dict], stem: Path) -> None:
    keys = _keys(rows)
    with stem.with_suffix(".csv").open("w", newline="") as f:
        w = csv.DictWriter(f, keys, restval="")
        w.writeheader()
        w.writerows(rows)
    stem.with_suffix(".json").write_text(json.dumps(rows, indent=2))
    stem.with_suffix(".md").write_text(markdown_table(rows))


def markdown_table(rows: list[dict]) -> str:
    keys = _keys(rows)
    fmt = lambda v: "" if v is None else (f"{v:.4g}" if isinstance(v, float) else str(v))  # noqa: E731
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(fmt(r.get(k)) for k in keys) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def claims(runs: dict[str, dict], n_heads: int, slopes: dict[str, float], prefix: str = "",
           share: float | None = None, key_bias_free: bool = True) -> list[dict]:
    """The paper's qualitative training claims, each checked against the measured runs."""
    sgd, wd = runs[prefix + "sgd"], runs[prefix + "sgd_wd"]
    adam, reb = runs[prefix + "adamw"], runs[prefix + "adamw_rebalance"]
    out = []

    def add(claim: str, holds: bool, evidence: str) -> None:
        out.append({"claim": claim, "holds": bool(holds), "evidence": evidence})

    rho_sgd, rho_adam = float(np.median(sgd["rho_qk"][1:])), float(np.median(adam["rho_qk"][1:]))
    add("SGD without weight decay moves (numerically) nothing along the QK orbit",
        rho_sgd < 1e-3 * rho_adam, f"median rho_qk: SGD {rho_sgd:.2e}, AdamW {rho_adam:.2e}")
    b0, b1 = sgd["beta_qk"][0].mean(), sgd["beta_qk"][-1].mean()
    bw = wd["beta_qk"][-1].mean()
    add("SGD keeps beta_qk nearly constant", abs(b1 - b0) <= 0.05 * b0,
        f"mean beta_qk {b0:.4g} -> {b1:.4g} ({100 * (b1 - b0) / b0:+.2f}%)")
    add("weight decay makes beta_qk shrink", bw < b1, f"final mean beta_qk: SGD {b1:.4g}, SGD+wd {bw:.4g}")
    target = 1 / (2 * n_heads) if share is None else share
    add("AdamW's rho_qk is of the order of the tangent share (1/(2H) for plain MHA)",
        0.1 * target <= rho_adam <= 10 * target,
        f"median rho_qk {rho_adam:.3g} vs tangent share {target:.3g} (1/(2H) = {1 / (2 * n_heads):.3g})")
    ba0, ba1 = adam["beta_qk"][0].mean(), adam["beta_qk"][-1].mean()
    add("AdamW makes beta_qk drift", abs(ba1 - ba0) > abs(b1 - b0),
        f"AdamW beta_qk {ba0:.4g} -> {ba1:.4g}; SGD {b0:.4g} -> {b1:.4g}")
    la, lr_ = _tail(adam["loss"]), _tail(reb["loss"])
    noise = max(float(np.std(adam["loss"][-max(3, len(adam["loss"]) // 5):])), 1e-3)
    add("rebalancing leaves AdamW's loss curve unchanged (within run-to-run noise)",
        abs(la - lr_) <= 3 * noise + 0.02 * la,
        f"mean loss over the last 20%: AdamW {la:.4f}, rebalanced {lr_:.4f}, noise {noise:.4f}")
    bm = reb["beta_qk"].mean(1)
    add("rebalancing makes beta_qk a sawtooth (back to ~0 at each rebalance)",
        bm.min() < 0.05 * bm.max() and bm[-1] > bm.min(),
        f"rebalanced mean beta_qk: min {bm.min():.3g}, max {bm.max():.3g}")
    if "grad_norm_bk" in adam:
        bk = float(np.max(np.abs(adam["grad_norm_bk"])))
        bq = float(np.median(np.abs(adam["grad_norm_bq"])))
        if key_bias_free:  # float32 training: "numerically zero" is ~1e-7 relative
            add("the key-bias gradient is numerically zero, the query-bias gradient is not",
                bk < 1e-4 * bq, f"max |grad b_K| {bk:.2e}, median |grad b_Q| {bq:.2e}")
        else:
            add("under full RoPE the key bias is identified: its gradient is not zero",
                bk > 1e-2 * bq, f"max |grad b_K| {bk:.2e}, median |grad b_Q| {bq:.2e}")
    if "same_qk" in slopes:
        add("one SGD step's drift grows like lr^2 (slope near 2, same trained weights, float64)",
            1.8 <= slopes["same_qk"] <= 2.2 and 1.8 <= slopes["same_vo"] <= 2.2,
            f"same-point slope QK {slopes['same_qk']:.3f}, VO {slopes['same_vo']:.3f}")
    if "qk" in slopes:
        mono = slopes.get("monotone", False)
        add("over whole SGD runs, drift falls with the learning rate (the paper's Fig. 4)",
            mono and slopes["qk"] > 0 and slopes["vo"] > 0,
            f"mean drift decreases monotonically from lr 0.5 to 0.0625: {mono}; whole-run log-log "
            f"slope QK {slopes['qk']:.2f}, VO {slopes['vo']:.2f} (not 2: each lr follows its own "
            f"trajectory); at step 1 in float32 QK {slopes['qk_step1']:.2f}, VO {slopes['vo_step1']:.2f}")
    return out


def qk_share(spec) -> float:
    """Tangent share of the QK side's parameters (what an isotropic update's rho averages)."""
    from attnid.theory import count

    comps = count(spec).components
    params = comps["qk_gauge"].params + (comps["key_bias_translation"].params
                                         if "key_bias_translation" in comps else 0)
    null = comps["qk_gauge"].unidentified + (comps["key_bias_translation"].unidentified
                                             if "key_bias_translation" in comps else 0)
    return null / params


def write_training_report(out: Path, names: list[str], n_heads: int) -> dict[str, Any]:
    from attnid.train.loop import TrainConfig

    out = Path(out)
    spec_of = {n: TrainConfig.from_dict(json.loads((out / "runs" / n / "config.json").read_text()))
               .model.attention_spec() for n in names}
    runs = {n: load_run(out / "runs" / n) for n in names}
    figs = out / "figures"
    figs.mkdir(parents=True, exist_ok=True)
    sweep = [n for n in names if n.startswith("sweep_")]
    same = out / "same_point_drift.json"
    sp = json.loads(same.read_text()) if same.exists() else None
    slopes = {side: fig4(runs, sweep, side, figs / f"fig4_drift_{side}.png", sp) for side in ("qk", "vo")}
    for side in ("qk", "vo"):
        slopes[f"{side}_step1"] = drift_fit(runs, sweep, side, first=True)[2]
    ordered = sorted(sweep, key=lambda c: -float(c.removeprefix("sweep_lr")))
    slopes["monotone"] = all(  # type: ignore[assignment]
        all(a > b for a, b in itertools.pairwise(d))
        for d in ([drift_fit(runs, ordered, side)[1].tolist() for side in ("qk", "vo")]))
    if sp is not None:
        slopes["same_qk"], slopes["same_vo"] = sp["slope_qk"], sp["slope_vo"]
    for side in ("qk", "vo"):
        fig2(runs, list(PAPER), side, n_heads, figs / f"fig2_{side}.png",
             f"Fig. 2 ({side.upper()} side): the paper's four cases")
    fig3(runs, list(PAPER), figs / "fig3_bias_grads.png")
    result_claims = claims(runs, n_heads, slopes, share=qk_share(spec_of["adamw"]))
    for variant in ("rope", "gqa"):
        cases = [f"{variant}_{c}" for c in PAPER]
        if all(c in runs for c in cases):
            fig2(runs, cases, "qk", n_heads, figs / f"fig2_qk_{variant}.png",
                 f"The four cases on the {variant.upper()} variant (QK side)")
            spec = spec_of[f"{variant}_adamw"]
            free = spec.pass_dims > 0 and spec.qk_norm == "none"
            for c in claims(runs, n_heads, {}, prefix=f"{variant}_", share=qk_share(spec),
                            key_bias_free=free):
                c["claim"] = f"[{variant.upper()}] " + c["claim"]
                result_claims.append(c)
    if "adamw_project" in runs:
        fig2(runs, ["adamw", "adamw_project"], "qk", n_heads, figs / "fig_project.png",
             "AdamW with and without the project correction")
        rp = float(np.max(runs["adamw_project"]["rho_qk"][1:]))
        result_claims.append({"claim": "the project correction removes all orbit motion (rho_qk = 0)",
                              "holds": rp < 1e-6, "evidence": f"max rho_qk with projection {rp:.2e}"})
    rows = summary_rows(runs, names, slopes)
    tables = out / "tables"
    tables.mkdir(parents=True, exist_ok=True)
    write_table(rows, tables / "training_summary")
    (out / "training_claims.json").write_text(json.dumps(result_claims, indent=2))
    return {"rows": rows, "claims": result_claims, "slopes": slopes}
