"""`attnid train`: the training loop with orbit metrics, corrections, resume, Ctrl-C and DDP.

Writes ``OUT/config.json`` (everything needed to rerun), ``OUT/metrics.jsonl`` (one JSON
object per logged step), ``OUT/checkpoint.pt`` (for ``--resume``; optional) and
``OUT/summary.json`` (final loss, median rho and first/last beta per side).
Under ``torchrun`` (``WORLD_SIZE > 1``) it trains with DistributedDataParallel (gloo on the
CPU); every rank computes the same metrics and corrections, rank 0 writes.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from attnid.errors import AttnidError
from attnid.monitor import Corrector, Monitor, parse_correction
from attnid.progress import Progress
from attnid.train.data import shakespeare
from attnid.train.model import GPT, GPTConfig

PRESETS: dict[str, dict[str, Any]] = {
    # CPU-sized: the effects are visible in a few hundred steps on two cores
    "tiny": dict(n_layers=2, n_heads=4, d_model=64, block_size=64),
    "small": dict(n_layers=4, n_heads=6, d_model=192, block_size=128),
    # nanoGPT's Shakespeare-char model (the paper's setting): head dim 64
    "paper": dict(n_layers=6, n_heads=6, d_model=384, block_size=256, dropout=0.2),
}


@dataclass(frozen=True)
class TrainConfig:
    model: GPTConfig = field(default_factory=GPTConfig)
    optimizer: str = "adamw"  # sgd | adam | adamw
    lr: float = 1e-3
    weight_decay: float = 0.0
    steps: int = 200
    batch_size: int = 16
    seed: int = 0
    log_every: int = 10
    eval_every: int = 50
    eval_batches: int = 4
    correct: str = "off"  # off | project | rebalance:N
    device: str = "cpu"

    def __post_init__(self) -> None:
        if self.optimizer not in ("sgd", "adam", "adamw"):
            raise AttnidError(f"unknown optimizer {self.optimizer!r}: use sgd, adam or adamw")
        for name in ("steps", "batch_size", "log_every", "eval_every", "eval_batches"):
            if getattr(self, name) <= 0:
                raise AttnidError(f"{name} must be positive")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise AttnidError("lr must be a positive number")
        if self.weight_decay < 0:
            raise AttnidError("weight_decay must be >= 0")
        parse_correction(self.correct)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainConfig:
        return cls(**{**d, "model": GPTConfig(**d["model"])})


def make_optimizer(cfg: TrainConfig, model: torch.nn.Module) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    if cfg.optimizer == "adam":
        return torch.optim.Adam(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def _ddp() -> tuple[int, int]:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("gloo")
    return (dist.get_rank(), world) if world > 1 else (0, 1)


@torch.no_grad()
def evaluate(model: GPT, cfg: TrainConfig, gen: torch.Generator) -> float:
    data = shakespeare()
    was = model.training
    model.eval()
    losses = []
    for _ in range(cfg.eval_batches):
        x, y = data.batch("val", cfg.batch_size, cfg.model.block_size, gen)
        losses.append(float(model(x.to(cfg.device), y.to(cfg.device))[1]))
    model.train(was)
    return sum(losses) / len(losses)


@dataclass
class _Run:
    """The live objects of one training run."""

    cfg: TrainConfig
    model: GPT
    wrapped: torch.nn.Module
    opt: torch.optim.Optimizer
    gen: torch.Generator
    start: int
    rank: int
    world: int


def _setup(cfg: TrainConfig, out: Path, resume: bool) -> _Run:
    """Model, optimizer and data generator, fresh or restored from ``out/checkpoint.pt``."""
    rank, world = _ddp()
    cfg = replace(cfg, model=replace(cfg.model, vocab_size=shakespeare().vocab_size))
    ckpt_path = out / "checkpoint.pt"
    if resume and not ckpt_path.exists():
        raise AttnidError(f"nothing to resume: {ckpt_path} does not exist")
    if resume:
        saved = TrainConfig.from_dict(json.loads((out / "config.json").read_text()))
        cfg = replace(saved, steps=max(saved.steps, cfg.steps))
    torch.manual_seed(cfg.seed)
    model = GPT(cfg.model).to(cfg.device)
    opt = make_optimizer(cfg, model)
    gen = torch.Generator().manual_seed(1000 * cfg.seed + rank)
    start = 0
    if resume:
        state = torch.load(ckpt_path, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        gen.set_state(state["gen"])
        start = state["step"]
    wrapped = torch.nn.parallel.DistributedDataParallel(model) if world > 1 else model
    return _Run(cfg, model, wrapped, opt, gen, start, rank, world)


def _open_log(run: _Run, out: Path, resume: bool):
    """Rank 0 writes ``config.json`` and opens ``metrics.jsonl`` (records after the checkpoint
    dropped on resume); other ranks write nothing."""
    if run.rank != 0:
        return None
    metrics_path = out / "metrics.jsonl"
    out.mkdir(parents=True, exist_ok=True)
    _atomic_write(out / "config.json", json.dumps(run.cfg.to_dict(), indent=2))
    if resume and metrics_path.exists():
        kept = [ln for ln in metrics_path.read_text().splitlines()
                if ln.strip() and json.loads(ln)["step"] <= run.start]
        _atomic_write(metrics_path, "".join(k + "\n" for k in kept))
    elif metrics_path.exists():
        metrics_path.unlink()
    return metrics_path.open("a")


def _save(run: _Run, out: Path, step: int) -> None:
    """Model, optimizer and generator state for ``--resume`` (rank 0, atomically)."""
    if run.rank == 0:
        path = out / "checkpoint.pt"
        tmp = path.with_suffix(".tmp")
        torch.save({"model": run.model.state_dict(), "optimizer": run.opt.state_dict(),
                    "gen": run.gen.get_state(), "step": step}, tmp)
        tmp.replace(path)


class _UpdateSizes:
    """Squared norm of every step's attention update, per layer and side, summed between logs.

    Plain SGD changes the conserved quantities only at second order: per step
    ``||C_QK(w + d) - C_QK(w)||_F <= ||d_QK||^2`` (``d_QK``: the update of W_Q, b_Q, W_K,
    b_K). Logging ``sum ||d_QK||^2`` between records (and the largest single ``||d||``) makes
    that bound checkable over the whole run, not only at the logged steps. Cheap: one copy
    of the attention weights per step.
    """

    SIDES: ClassVar[dict[str, tuple[str, ...]]] = {"qk": ("W_Q", "b_Q", "W_K", "b_K", "g_Q", "g_K"),
                                                   "vo": ("W_V", "b_V", "W_O", "b_O")}

    def __init__(self, model: GPT) -> None:
        self.params = {side: [[p for n, p in b.attn.named_parameters() if n in names] for b in model.blocks]
                       for side, names in self.SIDES.items()}
        self._before: dict[str, list[torch.Tensor]] = {}
        self._reset()

    def _reset(self) -> None:
        n = len(self.params["qk"])
        self.sums: dict[str, list[float]] = {"update_sq_qk": [0.0] * n, "update_sq_vo": [0.0] * n,
                                             "update_norm_max": [0.0] * n}

    def _flat(self) -> dict[str, list[torch.Tensor]]:
        return {side: [torch.cat([p.detach().reshape(-1) for p in ps]).double() for ps in layers]
                for side, layers in self.params.items()}

    def before(self) -> None:
        self._before = self._flat()

    def after(self) -> None:
        now = self._flat()
        for i in range(len(self.params["qk"])):
            total = 0.0
            for side in ("qk", "vo"):
                sq = float((now[side][i] - self._before[side][i]).square().sum())
                self.sums[f"update_sq_{side}"][i] += sq
                total += sq
            self.sums["update_norm_max"][i] = max(self.sums["update_norm_max"][i], math.sqrt(total))

    def take(self) -> dict[str, list[float]]:
        """The sums since the last record, then reset."""
        out = self.sums
        self._reset()
        return out


def _orbit_summary(records: list[dict[str, Any]]) -> dict[str, float]:
    """Median rho (tangent share of the update) and first/last mean beta (norm of the conserved
    quantity) over the logged records, for the end-of-run summary."""
    out: dict[str, float] = {}
    if not records:
        return out
    for side in ("qk", "vo"):
        rhos = sorted(float(v) for r in records[1:] or records for v in _flatten(r[f"rho_{side}"]))
        out[f"median_rho_{side}"] = rhos[len(rhos) // 2]
        for tag, rec in (("first", records[0]), ("last", records[-1])):
            betas = _flatten(rec[f"beta_{side}"])
            out[f"beta_{side}_{tag}"] = sum(betas) / len(betas)
    return out


def _flatten(v: Any) -> list[float]:
    return [x for item in v for x in _flatten(item)] if isinstance(v, list) else [float(v)]


def train(cfg: TrainConfig, out: Path, *, resume: bool = False, progress: bool | Progress = True,
          checkpoint: bool = True) -> dict[str, Any]:
    """Run one training; return the summary. ``KeyboardInterrupt`` leaves a valid log (and,
    with ``checkpoint``, a checkpoint to resume from).

    ``progress``: a :class:`attnid.progress.Progress` to report steps to, ``True`` for a new
    one on stderr, ``False`` for silence. ``checkpoint=False`` writes no ``checkpoint.pt``.
    """
    out = Path(out)
    run = _setup(cfg, out, resume)
    cfg = run.cfg
    data = shakespeare()
    monitor = Monitor(run.model)
    corrector = Corrector(run.model, cfg.correct)
    sizes = _UpdateSizes(run.model)
    eval_gen = torch.Generator().manual_seed(7)
    log = _open_log(run, out, resume)
    records: list[dict[str, Any]] = []
    shown = progress if isinstance(progress, Progress) else Progress(enabled=bool(progress))
    bar = shown.steps(cfg.steps, "train", run.start) if run.rank == 0 else Progress(enabled=False).steps(1)
    step, last_loss, t0 = run.start, float("nan"), time.perf_counter()
    try:
        for step in range(run.start + 1, cfg.steps + 1):
            x, y = data.batch("train", cfg.batch_size, cfg.model.block_size, run.gen)
            _, loss = run.wrapped(x.to(cfg.device), y.to(cfg.device))
            run.opt.zero_grad(set_to_none=True)
            loss.backward()
            logging = step == 1 or step % cfg.log_every == 0 or step == cfg.steps
            sizes.before()
            with monitor.step() if logging else contextlib.nullcontext(), corrector.step():
                run.opt.step()
            sizes.after()
            last_loss = float(loss.detach())
            if not math.isfinite(last_loss):
                raise AttnidError(f"the loss diverged at step {step} (lr {cfg.lr} too large?)")
            if logging:
                record: dict[str, Any] = {"step": step, "loss": last_loss, **monitor.last, **sizes.take()}
                if step % cfg.eval_every == 0 or step == cfg.steps:
                    record["val_loss"] = evaluate(run.model, cfg, eval_gen)
                records.append(record)
                if log is not None:
                    log.write(json.dumps(record) + "\n")
                    log.flush()
            if checkpoint and step % cfg.eval_every == 0:
                _save(run, out, step)
            bar(step, last_loss)
    except KeyboardInterrupt:
        if checkpoint:
            _save(run, out, step - 1 if step > run.start else run.start)
        raise
    finally:
        bar.close()
        if log is not None:
            log.close()
    if checkpoint:
        _save(run, out, cfg.steps)
    return _finish(run, out, last_loss, time.perf_counter() - t0, _orbit_summary(records))


def _finish(run: _Run, out: Path, last_loss: float, seconds: float, orbit: dict[str, float]
            ) -> dict[str, Any]:
    """The summary (written by rank 0); under DDP, checks that the ranks ended in sync."""
    summary: dict[str, Any] = {"steps": run.cfg.steps, "final_loss": last_loss, "world_size": run.world,
                               "rank": run.rank, "seconds": seconds, **orbit}
    ckpt = out / "checkpoint.pt"
    if ckpt.exists():
        summary["checkpoint_bytes"] = ckpt.stat().st_size
    if run.world > 1:
        flat = torch.cat([p.detach().reshape(-1) for p in run.model.parameters()])
        allf = [torch.zeros_like(flat) for _ in range(run.world)]
        dist.all_gather(allf, flat)
        summary["ranks_in_sync"] = all(torch.equal(allf[0], f) for f in allf)
        summary["max_rank_diff"] = max(float((allf[0] - f).abs().max()) for f in allf)
    if run.rank == 0:
        _atomic_write(out / "summary.json", json.dumps(summary, indent=2))
    if run.world > 1:
        dist.barrier()
        dist.destroy_process_group()
    return summary
