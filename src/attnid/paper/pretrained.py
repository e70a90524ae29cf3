"""The paper's claims measured on a pretrained model: all-MiniLM-L6-v2, fine-tuned offline.

The fine-tune and its measurements are `attnid.paper.finetune`: AdamW, AdamW with
projection (the orbit part of every update removed), AdamW with rebalancing and SGD, the
same batches per seed, only the attention weights trained. This section asks, with paired
95% intervals over seeds and held-out lines (`attnid.stats.paired_interval`):

* does the fine-tune move the task (AdamW's held-out retrieval gain excludes 0)?
* do projection and rebalancing keep that gain (their difference from AdamW lies within
  :data:`ACCURACY_MARGIN`)?
* is AdamW's orbit share of the order of an isotropic update's, SGD's at rounding level?

and audits the pretrained checkpoint itself. Every number its text, claims and captions
quote is a cell of one of its tables (``tests/paper/test_numbers.py`` checks).

    section = pretrained_section(ctx)   # `attnid reproduce` calls it; the size from ctx
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from attnid.checkpoint.audit import Audit, audit
from attnid.errors import require
from attnid.layers import find_layers
from attnid.paper.document import Claim, Context, Figure, Section, Table
from attnid.paper.finetune import (
    RUNS,
    VARIANTS,
    Budget,
    Difference,
    FineTune,
    difference,
    endpoint_distance,
    fine_tune,
    minilm_path,
    split,
    stacked,
)
from attnid.progress import Progress
from attnid.stats import median
from attnid.symmetry.conserved import flat_key
from attnid.weights import SIDES, Side

__all__ = ["ACCURACY_MARGIN", "DEFAULT", "FULL", "QUICK", "Budget", "minilm_path", "pretrained_section",
           "run_section"]

TITLE = "The claims on a pretrained model (all-MiniLM-L6-v2, fine-tuned on CPU)"
# sizes: `reproduce --scale quick | default | full`; the default fits ~200 CPU-s
QUICK = Budget(steps=3, batch_size=8, n_eval=32, rebalance_every=2, sgd_seeds=1)
DEFAULT = Budget(steps=30, batch_size=16, n_eval=512, seeds=2, monitor_every=5, rebalance_every=10,
                 sgd_seeds=1)
FULL = Budget(steps=60, batch_size=16, n_eval=1024, seeds=4, monitor_every=5, rebalance_every=10, sgd_seeds=2)
ACCURACY_MARGIN = 0.02  # "keeps the gain": the paired difference's 95% interval inside ±this (absolute)
RHO_ADAMW_MIN = 0.1  # AdamW's median rho at least this fraction of an isotropic update's (the tangent share)
RHO_SGD_MAX = 1e-4  # SGD's median rho below this fraction of it: orbit-free up to float32 rounding


def budget_for(ctx: Context) -> Budget:
    """The fine-tune's size for ``ctx``: ``ctx.scale`` when given, else ``ctx.quick``."""
    scale = ctx.scale or ("quick" if ctx.quick else "default")
    return {"quick": QUICK, "full": FULL, "paper": FULL}.get(scale, DEFAULT)


def pretrained_section(ctx: Context) -> Section:
    """The section for `attnid reproduce` (quick: a few steps, one seed)."""
    return run_section(budget_for(ctx), ctx.figures, ctx.progress)


@dataclass(frozen=True)
class Outcome:
    """What one setting's runs (every seed) come to: a row of ``pretrained_finetune``."""

    name: str
    seeds: int
    steps: int
    final_loss: float  # training loss at the last step, mean over seeds
    held_out_loss: float  # mean held-out loss at the end, mean over seeds
    rho_median: dict[Side, float]  # median over seeds and monitored steps of the median over heads
    drift_median: dict[Side, float]  # median over seeds of the median over heads of the final drift
    removed_median: float | None  # projection: median share of the squared update removed
    weight_change: float  # raw distance start -> end, attention only, mean over seeds
    gauge_share: float
    accuracy: float  # held-out retrieval at the end, mean over seeds
    spread: float  # mean cosine between different held-out lines at the end, mean over seeds
    seconds: float  # CPU seconds per run, mean over seeds

    @classmethod
    def of(cls, runs: list[FineTune]) -> Outcome:
        change = np.mean([r.change for r in runs], axis=0)
        proj = runs[0].name == "adamw_project"
        return cls(runs[0].name, len(runs), len(runs[0].loss), float(np.mean([r.loss[-1] for r in runs])),
                   float(np.mean([float(r.held_loss.mean()) for r in runs])),
                   {s: median([r.rho[s] for r in runs]) for s in SIDES},
                   {s: median([median(r.final_drift[s]) for r in runs]) for s in SIDES},
                   median([r.removed for r in runs]) if proj else None, float(change[0]), float(change[2]),
                   float(np.mean([r.accuracy[-1] for r in runs])),
                   float(np.mean([r.spread[-1] for r in runs])),
                   float(np.mean([r.seconds for r in runs])))

    @property
    def label(self) -> str:
        return RUNS[self.name].label

    @property
    def rho(self) -> float:
        """The larger of the two sides' median rho."""
        return max(self.rho_median.values())

    def row(self, distance: float | None = None) -> dict[str, Any]:
        """The table row; ``distance``: end point's distance from AdamW's, over AdamW's travel."""
        out: dict[str, Any] = {"optimizer": self.label, "seeds": self.seeds, "steps": self.steps,
                               "final_loss": self.final_loss, "held_out_loss": self.held_out_loss,
                               "retrieval_accuracy": self.accuracy, "embedding_cosine": self.spread}
        for side in SIDES:
            out[flat_key("rho", side) + "_median"] = self.rho_median[side]
        out["rho_max_side"] = self.rho
        for side in SIDES:
            out[flat_key("drift", side) + "_median"] = self.drift_median[side]
        return {**out, "removed_share_median": self.removed_median, "weight_change": self.weight_change,
                "gauge_share": self.gauge_share, "end_distance_from_adamw": distance,
                "cpu_seconds": self.seconds}


FINETUNE_COLUMNS = {"optimizer": "optimizer", "held_out_loss": "held-out loss",
                    "retrieval_accuracy": "retrieval", "rho_qk_median": "median rho_qk",
                    "rho_vo_median": "median rho_vo", "drift_qk_median": "drift QK",
                    "drift_vo_median": "drift VO",
                    "removed_share_median": "removed", "gauge_share": "gauge share",
                    "end_distance_from_adamw": "end vs AdamW", "embedding_cosine": "mean cosine"}
COMPARISON_COLUMNS = {"comparison": "comparison", "lines_differing": "hits differ",
                      "retrieval_diff": "retrieval", "retrieval_low": "95% low",
                      "retrieval_high": "95% high", "loss_diff": "held-out loss", "loss_low": "95% low",
                      "loss_high": "95% high"}


@dataclass(frozen=True)
class Results:
    """Everything the section states, from the runs and the pretrained model."""

    budget: Budget
    audit: Audit
    pretrained: Any  # `attnid.paper.contrastive.Retrieval` of the pretrained model
    runs: dict[str, list[FineTune]]
    outcomes: dict[str, Outcome]
    gain: dict[str, Difference]  # per setting: minus the pretrained model
    versus: dict[str, Difference]  # per correction: minus AdamW
    distance: dict[str, float]  # per correction: end point's distance from AdamW's, over AdamW's travel
    spec: Any  # MiniLM's `AttentionSpec`

    @property
    def share(self) -> dict[Side, float]:
        """The tangent share of MiniLM's attention, per side (an isotropic update's rho)."""
        from attnid.paper.training import tangent_share

        return {s: tangent_share(self.spec, s) for s in SIDES}

    @classmethod
    def of(cls, budget: Budget, rep: Audit, base: Any, runs: dict[str, list[FineTune]], spec: Any) -> Results:
        hits0, loss0 = base.hits.double(), base.loss.double()  # [N]
        data = {n: stacked(rs) for n, rs in runs.items()}
        gain = {n: difference(RUNS[n].label, "pretrained", *data[n], hits0, loss0) for n in runs}
        versus = {n: difference(RUNS[n].label, RUNS["adamw"].label, *data[n], *data["adamw"])
                  for n in VARIANTS}
        distance = {n: endpoint_distance(runs[n], runs["adamw"]) for n in VARIANTS}
        return cls(budget, rep, base, runs, {n: Outcome.of(rs) for n, rs in runs.items()}, gain, versus,
                   distance, spec)

    def tables(self) -> tuple[Table, ...]:
        base = {"optimizer": "pretrained (no fine-tune)", "seeds": 0, "steps": 0,
                "held_out_loss": float(self.pretrained.loss.double().mean()),
                "retrieval_accuracy": self.pretrained.accuracy,
                "embedding_cosine": self.pretrained.mean_cosine}
        rows = [base] + [o.row(self.distance.get(n)) for n, o in self.outcomes.items()]
        b = self.budget
        return (
            Table("pretrained_settings", [{**b.settings(), "layers": len(self.audit.layers),
                                           "d_model": self.spec.d_model, "heads": self.spec.n_heads,
                                           "head_dim": self.spec.head_dim,
                                           "tangent_share_qk": self.share["qk"],
                                           "tangent_share_vo": self.share["vo"],
                                           "accuracy_margin": ACCURACY_MARGIN, "rho_adamw_min": RHO_ADAMW_MIN,
                                           "rho_sgd_max": RHO_SGD_MAX}]),
            Table("pretrained_finetune", rows, columns=FINETUNE_COLUMNS,
                  notes=(f"Means over seeds; retrieval and held-out loss at the end over {b.n_eval} "
                         "held-out lines. Removed: median share of AdamW's squared update that projection "
                         "removed. End vs AdamW: distance of the final attention weights from AdamW's (same "
                         "seed), over AdamW's distance from the pretrained weights, both after the best "
                         "gauge alignment.",)),
            Table("pretrained_comparisons", [d.row() for d in (*self.gain.values(), *self.versus.values())],
                  columns=COMPARISON_COLUMNS,
                  notes=("Paired differences (per held-out line: hit 1, miss 0; and held-out loss), mean "
                         "over seeds and lines, 95% interval from a crossed bootstrap over seeds and "
                         "lines.",)),
            Table("pretrained_seeds", [{"optimizer": RUNS[r.name].label, "seed": r.seed,
                                        "final_loss": r.loss[-1], "held_out_loss": float(r.held_loss.mean()),
                                        "retrieval_accuracy": r.accuracy[-1],
                                        "embedding_cosine": r.spread[-1], "cpu_seconds": r.seconds}
                                       for rs in self.runs.values() for r in rs]),
            Table("pretrained_audit", audit_rows(self.audit)),
            Table("pretrained_audit_summary", [{"layers": len(self.audit.layers),
                                                **vars(self.audit.summary)}]),
        )


def run_section(budget: Budget | None = None, figures: Path = Path("figures"),
                progress: Progress | None = None, **sizes: int) -> Section:
    """`pretrained_section` at any size: ``budget``, or its fields as keywords
    (``run_section(steps=3, batch_size=8, n_eval=32, figures=...)``); figures are written
    under ``figures``."""
    budget = budget if budget is not None else Budget(**sizes)
    require("transformers", "hf")
    from attnid.paper.contrastive import load_encoder, retrieval

    progress = progress or Progress(enabled=False)
    path = minilm_path()
    progress.stage("pretrained MiniLM: audit")
    rep = audit(path)
    held_out = split(budget.n_eval).held_out
    model, tok = load_encoder(path)
    base = retrieval(model, tok, held_out)
    spec = find_layers(model)[0].spec
    runs: dict[str, list[FineTune]] = {name: [] for name in RUNS}
    todo = [(seed, name) for seed in range(max(budget.seeds, budget.sgd_seeds)) for name in RUNS
            if seed < budget.seeds_of(name)]
    for i, (seed, name) in enumerate(todo, start=1):
        progress.run(i, len(todo),
                     f"pretrained MiniLM: {RUNS[name].label}, seed {seed} ({budget.steps} steps)")
        r = fine_tune(name, seed, budget, held_out, (model, tok), progress)
        progress.line(f"  {RUNS[name].label}, seed {seed}: {budget.steps} steps in {r.seconds:.0f} CPU-s, "
                      f"held-out retrieval {r.accuracy[-1]:.3f}")
        runs[name].append(r)
    progress.stage("pretrained MiniLM: gauge shares, intervals, figures")
    res = Results.of(budget, rep, base, runs, spec)
    return Section(TITLE, markdown(res), tables=res.tables(), figures=tuple(_figures(res, figures)),
                   claims=tuple(claims(res)))


def audit_rows(rep: Audit) -> list[dict[str, Any]]:
    """The ``pretrained_audit`` table: per layer, the median and max imbalance over heads (the
    same numbers as ``attnid audit``'s table) and the removable share."""
    keys = ("layer", "imbalance_qk_median", "imbalance_qk_max", "imbalance_vo_median", "imbalance_vo_max",
            "removable_share")
    return [{k: r[k] for k in keys} for r in (layer.row() for layer in rep.layers)]


def audit_claim(rep: Audit) -> Claim:
    s = rep.summary
    return Claim(TITLE, "The pretrained all-MiniLM-L6-v2 (trained with AdamW) sits far from its balanced "
                        "point",
                 s.imbalance_qk_median > 0.05 and s.imbalance_vo_median > 0.05,
                 f"imbalance_qk median {s.imbalance_qk_median:.3f} (max {s.imbalance_qk_max:.3f}), "
                 f"imbalance_vo median {s.imbalance_vo_median:.3f} (max {s.imbalance_vo_max:.3f}); "
                 f"rebalancing would remove {s.removable_share_mean:.1%} of the attention weight norm")


def claims(res: Results) -> list[Claim]:
    o = res.outcomes
    adamw, sgd, proj = o["adamw"], o["sgd"], o["adamw_project"]
    share = max(res.share.values())

    def drift(x: Outcome) -> str:
        return f"{x.drift_median['qk']:.2e}/{x.drift_median['vo']:.2e}"

    out = [
        audit_claim(res.audit),
        Claim(TITLE, "AdamW's updates on the pretrained model have an orbit share of the order of an "
                     f"isotropic update's (median rho at least {RHO_ADAMW_MIN:g} of the tangent share); "
                     f"SGD's have none beyond float32 rounding (below {RHO_SGD_MAX:g} of it)",
              adamw.rho >= RHO_ADAMW_MIN * share and sgd.rho < RHO_SGD_MAX * share,
              f"median rho (larger side): AdamW {adamw.rho:.3g}, SGD {sgd.rho:.2g}; tangent share QK "
              f"{res.share['qk']:.4f}, VO {res.share['vo']:.4f}"),
        Claim(TITLE, "AdamW moves the conserved quantities of the pretrained point more than SGD",
              all(adamw.drift_median[side] > sgd.drift_median[side] for side in SIDES),
              f"median relative drift QK/VO: AdamW {drift(adamw)}, SGD {drift(sgd)}, "
              f"AdamW + projection {drift(proj)}"),
        Claim(TITLE, "Projection removes the orbit motion of AdamW on the pretrained model", proj.rho < 1e-6,
              f"median rho with projection {proj.rho:.1e}; it removed a median {proj.removed_median:.4f} of "
              f"AdamW's squared update"),
    ]
    return out + (accuracy_claims(res) if res.budget.compares else [])


def accuracy_claims(res: Results) -> list[Claim]:
    """The fine-tune moves the task, and each correction keeps what it reaches (paired 95%
    intervals over seeds and held-out lines)."""
    g = res.gain["adamw"]
    b = res.budget
    out = [Claim(TITLE, "The fine-tune moves the task: AdamW raises held-out retrieval (the 95% interval of "
                        "the paired gain over the pretrained model excludes 0)",
                 g.accuracy.low > 0,
                 f"retrieval {res.pretrained.accuracy:.4f} -> {res.outcomes['adamw'].accuracy:.4f}, gain "
                 f"{g.accuracy}; held-out loss change {g.loss}; {b.seeds} seeds x {b.n_eval} held-out lines")]
    for name in VARIANTS:
        d, own = res.versus[name], res.gain[name]
        out.append(Claim(
            TITLE, f"{RUNS[name].label} keeps AdamW's gain: the 95% interval of the paired difference in "
                   f"held-out retrieval, {RUNS[name].label} minus AdamW, lies inside ±{ACCURACY_MARGIN:g}",
            d.accuracy.within(ACCURACY_MARGIN),
            f"difference {d.accuracy}, the hit differs on {d.differing} of {d.pairs} (seed, line) pairs "
            f"(held-out loss {d.loss}); its own gain over the pretrained model "
            f"{own.accuracy}, AdamW's {g.accuracy.mean:+.3f}; end point {res.distance[name]:.3g} of AdamW's "
            f"travel away from AdamW's"))
    return out


def markdown(res: Results) -> str:
    b, o = res.budget, res.outcomes
    lines = [
        f"all-MiniLM-L6-v2 ({res.audit.spec}, {len(res.audit.layers)} layers): only its attention weights "
        f"fine-tuned, {b.steps} steps of {b.batch_size} pairs from the shipped Shakespeare corpus, each pair "
        "two word-dropout views of one line (each keeps every word with probability 0.5; in-batch negatives, "
        f"temperature {b.settings()['temperature']:g}); {b.seeds} seed(s) per AdamW setting, "
        f"{b.sgd_seeds} for SGD (a seed fixes the batch order; the settings of one seed see the same "
        "batches). Projection removes the orbit part of every update; rebalancing moves every head to its "
        f"balanced point every {b.rebalance_every} steps. Held-out retrieval: the share of {b.n_eval} "
        "held-out views whose nearest neighbour among all held-out other views is their own line's (chance "
        f"{1 / b.n_eval:.4f}; "
        f"pretrained {res.pretrained.accuracy:.4f}). Intervals are 95%, from a bootstrap over seeds and "
        "held-out lines of the paired differences (`tables/pretrained_comparisons.csv`).",
        "",
        audit_text(res.audit),
        "",
        "**Accuracy.** Gain over the pretrained model: "
        + "; ".join(f"{RUNS[n].label} {d.accuracy}" for n, d in res.gain.items())
        + ". Against AdamW: "
        + "; ".join(f"{RUNS[n].label} {res.versus[n].accuracy}" for n in VARIANTS) + ".",
    ]
    if not b.compares:
        lines += ["", f"At this size ({b.seeds} seed, {b.steps} steps) the accuracies are not compared: the "
                  "claims on accuracy need the default size's seeds and steps."]
    proj, proj_vs = o["adamw_project"], res.versus["adamw_project"]
    lines += ["", "**Why projection changes so little.** The orbit part of an update is what no input can "
              f"see at first order: projection removed a median {proj.removed_median:.4f} of AdamW's squared "
              f"update, and the end points differ by {res.distance['adamw_project']:.3g} of AdamW's travel "
              "(after gauge alignment), but the function only at second order in the step: the hit differs "
              f"on {proj_vs.differing} of {proj_vs.pairs} (seed, line) pairs, the held-out loss by "
              f"{proj_vs.loss}. Rebalancing is a jump along the orbit that leaves AdamW's moments where "
              "they were, so the steps after it differ at first order (end points "
              f"{res.distance['adamw_rebalance']:.3g} of AdamW's travel apart after gauge alignment)."]
    lines += ["", "Drift: median over heads of ||C_end - C_pretrained|| / ||C_pretrained||. Gauge share: "
              "the share of the squared weight change (start to end, attention only) that `attnid diff` "
              "attributes to the symmetry group."]
    return "\n".join(lines)


def audit_text(rep: Audit) -> str:
    s = rep.summary
    return (f"**Audit of the pretrained checkpoint.** imbalance_qk median {s.imbalance_qk_median:.3f}, max "
            f"{s.imbalance_qk_max:.3f}; imbalance_vo median {s.imbalance_vo_median:.3f}, max "
            f"{s.imbalance_vo_max:.3f} (the imbalance is beta = ||C||_F over the Gram scale ||G_left|| + "
            f"||G_right||: 0 = balanced, 1 = most unbalanced). Rebalancing would remove "
            f"{s.removable_share_mean:.1%} of the attention weight norm without changing the function.")


# ---- figures ------------------------------------------------------------------------------------
def _smooth(x: list[float], window: int) -> np.ndarray:
    """Trailing moving average (the first points average what there is)."""
    c = np.cumsum(np.insert(np.asarray(x, dtype=float), 0, 0.0))
    n = np.minimum(np.arange(1, len(x) + 1), window)
    return (c[1:] - c[np.arange(1, len(x) + 1) - n]) / n


MARKERS = dict(zip(RUNS, "osD^", strict=True))
# a broad pale line under a thin one: where two runs coincide, both stay visible
LINES: dict[str, dict[str, Any]] = {"adamw": {"lw": 3.2, "alpha": 0.45}, "adamw_project": {"lw": 1.2},
                                    "adamw_rebalance": {"lw": 1.2}, "sgd": {"lw": 1.4}}
COLORS = dict(zip(RUNS, ("tab:blue", "tab:green", "tab:purple", "tab:orange"), strict=True))


def _intervals(ax: Any, res: Results) -> None:
    """Paired differences with their 95% intervals: gains over the pretrained model (top) and
    each correction minus AdamW (bottom), the margin shaded."""
    rows = [(f"{RUNS[n].label}\nminus pretrained", d.accuracy, COLORS[n]) for n, d in res.gain.items()]
    rows += [(f"{RUNS[n].label}\nminus AdamW", res.versus[n].accuracy, COLORS[n]) for n in VARIANTS]
    for y, (_, iv, color) in enumerate(rows):
        ax.errorbar([iv.mean], [y], xerr=[[iv.mean - iv.low], [iv.high - iv.mean]], fmt="o", color=color,
                    capsize=4, mfc="none")
    ax.axvline(0, color="k", lw=0.8)
    first = len(res.gain)
    ax.axhspan(first - 0.5, len(rows) - 0.5, color="grey", alpha=0.08, lw=0)
    ax.fill_betweenx([first - 0.5, len(rows) - 0.5], -ACCURACY_MARGIN, ACCURACY_MARGIN, color="tab:green",
                     alpha=0.15, lw=0, label=f"margin ±{ACCURACY_MARGIN:g}")
    ax.set_yticks(range(len(rows)), [r[0] for r in rows], fontsize=7)
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_xlabel("held-out retrieval difference (95% interval)")
    ax.legend(fontsize=7, loc="lower right")


def _figures(res: Results, where: Path) -> list[Figure]:
    """Two PNGs under ``where`` (matplotlib's object API: the user's backend is left alone)."""
    where.mkdir(parents=True, exist_ok=True)
    require("matplotlib", "report")
    from matplotlib.figure import Figure as MplFigure
    from matplotlib.lines import Line2D
    from matplotlib.ticker import MaxNLocator

    fig = MplFigure(figsize=(13, 7.6))
    (ax_loss, ax_acc), (ax_rho, ax_drift) = fig.subplots(2, 2)
    steps = res.budget.steps
    window = max(1, steps // 4)
    for k, (name, rs) in enumerate(res.runs.items()):  # one colour and marker per setting
        c, m = COLORS[name], MARKERS[name]
        loss = np.mean([_smooth(r.loss, window) for r in rs], axis=0)
        ax_loss.plot(np.arange(1, steps + 1), loss, color=c, marker=m, mfc="none",
                     markevery=(k, max(1, steps // 8)), **LINES[name])
        mon = rs[0].monitored
        for side, ls in zip(SIDES, ("-", "--"), strict=True):
            rho = np.median([r.rho[side] for r in rs], axis=0)
            drift = np.median([r.drift[side] for r in rs], axis=0)
            ax_rho.plot(mon, np.maximum(rho, 1e-16), ls=ls, color=c, marker=m, mfc="none", ms=4, lw=1.2)
            ax_drift.plot(mon, np.maximum(drift, 1e-16), ls=ls, color=c, marker=m, mfc="none", ms=4, lw=1.2)
    _intervals(ax_acc, res)
    ax_rho.axhline(max(res.share.values()), color="grey", ls=":", lw=1)
    ax_loss.set_ylabel(f"contrastive loss (moving average, {window} step{'s' if window > 1 else ''})")
    ax_rho.set_ylabel("median rho (orbit share of the update)")
    ax_rho.set_yscale("log")
    ax_drift.set_ylabel("median ||C_t - C_0|| / ||C_0||")
    ax_drift.set_yscale("log")
    for ax in (ax_loss, ax_rho, ax_drift):
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    handles = [Line2D([], [], color=COLORS[n], marker=MARKERS[n], mfc="none", label=RUNS[n].label, **LINES[n])
               for n in RUNS]
    handles += [Line2D([], [], color="grey", ls=ls, label=side) for side, ls in (("QK", "-"), ("VO", "--"))]
    handles.append(Line2D([], [], color="grey", ls=":", label="tangent share (isotropic update)"))
    fig.legend(handles=handles, loc="lower center", ncol=4, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    heat = MplFigure(figsize=(9, 3.2))
    hax = heat.subplots(1, 2)
    for ax, side in zip(hax, SIDES, strict=True):
        im = ax.imshow([layer.imbalance(side).reshape(-1).tolist() for layer in res.audit.layers],
                       aspect="auto", cmap="magma", vmin=0)
        ax.set_title(flat_key("imbalance", side))
        ax.set_xlabel("head")
        ax.set_ylabel("layer")
        heat.colorbar(im, ax=ax)
    heat.tight_layout()
    fig.savefig(where / "pretrained_finetune.png", dpi=100)
    heat.savefig(where / "pretrained_audit.png", dpi=120)
    return [Figure(where / "pretrained_finetune.png", finetune_caption(res),
                   "Four panels: smoothed loss over fine-tuning steps, one colour and marker per setting; "
                   "held-out retrieval differences with 95% intervals as horizontal bars; median rho (log) "
                   "and median relative drift of the conserved quantities (log) over steps, QK solid and VO "
                   "dashed."),
            Figure(where / "pretrained_audit.png",
                   "Audit of the pretrained all-MiniLM-L6-v2: the imbalance ||C|| / (||G_left|| + "
                   "||G_right||) per layer and head, QK left, VO right (0 = balanced, 1 = most "
                   "unbalanced).",
                   "Two heat maps, layers by heads, of the QK and VO imbalance of the pretrained "
                   "checkpoint.")]


def finetune_caption(res: Results) -> str:
    """The fine-tune figure's caption, every number from the tables."""
    o = res.outcomes
    return ("Fine-tuning the attention of the pretrained all-MiniLM-L6-v2, "
            f"{res.budget.seeds} seed(s) per AdamW setting (one colour and marker each; QK solid, VO "
            "dashed). Top left: loss (moving average, mean over seeds). Top right: held-out retrieval gains "
            "over the pretrained "
            f"{res.pretrained.accuracy:.4f} (AdamW {res.gain['adamw'].accuracy}) and each correction minus "
            f"AdamW, the shaded band the margin ±{ACCURACY_MARGIN:g}. Bottom: the orbit share rho of the "
            f"updates (median: AdamW {o['adamw'].rho:.3g}, SGD {o['sgd'].rho:.2g}, projection "
            f"{o['adamw_project'].rho:.1e}; dotted: the tangent share {max(res.share.values()):.4f} of an "
            "isotropic update; the rebalancing run's peaks are its rebalancing steps, mostly orbit) and the "
            "drift of the conserved quantities from the pretrained point (rebalancing: C reset to 0, drift "
            "1).")
