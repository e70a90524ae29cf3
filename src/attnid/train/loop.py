"""`attnid train`: the training loop with orbit metrics, corrections, resume, Ctrl-C and DDP.

Writes ``OUT/config.json`` (everything needed to rerun), ``OUT/metrics.jsonl`` (one JSON
object per logged step), ``OUT/checkpoint.pt`` (for ``--resume``) and ``OUT/summary.json``.
Under ``torchrun`` (``WORLD_SIZE > 1``) it trains with DistributedDataParallel (gloo on the
CPU); every rank computes the same metrics and corrections, rank 0 writes.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from attnid.errors import AttnidError
from attnid.monitor import Corrector, Monitor, parse_mode
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
        parse_mode(self.correct)

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


def train(cfg: TrainConfig, out: Path, *, resume: bool = False, progress: bool = True) -> dict[str, Any]:
    """Run one training; return the summary. ``KeyboardInterrupt`` leaves a valid log and checkpoint."""
    rank, world = _ddp()
    data = shakespeare()
    cfg = replace(cfg, model=replace(cfg.model, vocab_size=data.vocab_size))
    out = Path(out)
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
    eval_gen = torch.Generator().manual_seed(7)
    start = 0
    if resume:
        state = torch.load(ckpt_path, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        gen.set_state(state["gen"])
        start = state["step"]
    wrapped: torch.nn.Module = model
    if world > 1:
        wrapped = torch.nn.parallel.DistributedDataParallel(model)
    monitor = Monitor(model)
    corrector = Corrector(model, cfg.correct)

    writer = rank == 0
    metrics_path = out / "metrics.jsonl"
    if writer:
        out.mkdir(parents=True, exist_ok=True)
        _atomic_write(out / "config.json", json.dumps(cfg.to_dict(), indent=2))
        if resume and metrics_path.exists():  # drop records logged after the checkpoint
            kept = [ln for ln in metrics_path.read_text().splitlines()
                    if ln.strip() and json.loads(ln)["step"] <= start]
            _atomic_write(metrics_path, "".join(k + "\n" for k in kept))
        elif metrics_path.exists():
            metrics_path.unlink()
    log = metrics_path.open("a") if writer else None

    def save(step: int) -> None:
        if writer:
            tmp = ckpt_path.with_suffix(".tmp")
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                        "gen": gen.get_state(), "step": step}, tmp)
            tmp.replace(ckpt_path)

    bar = _progress(progress and writer, cfg.steps, start)
    step = start
    t0 = time.perf_counter()
    last_loss = float("nan")
    try:
        for step in range(start + 1, cfg.steps + 1):
            x, y = data.batch("train", cfg.batch_size, cfg.model.block_size, gen)
            _, loss = wrapped(x.to(cfg.device), y.to(cfg.device))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            logging = step == 1 or step % cfg.log_every == 0 or step == cfg.steps
            if logging:
                with monitor.step(), corrector.step():
                    opt.step()
            else:
                with corrector.step():
                    opt.step()
            last_loss = float(loss.detach())
            if not math.isfinite(last_loss):
                raise AttnidError(f"the loss diverged at step {step} (lr {cfg.lr} too large?)")
            if logging:
                record: dict[str, Any] = {"step": step, "loss": last_loss, **monitor.last}
                if step % cfg.eval_every == 0 or step == cfg.steps:
                    record["val_loss"] = evaluate(model, cfg, eval_gen)
                if log is not None:
                    log.write(json.dumps(record) + "\n")
                    log.flush()
            if step % cfg.eval_every == 0:
                save(step)
            bar(step, last_loss)
    except KeyboardInterrupt:
        save(step - 1 if step > start else start)
        raise
    finally:
        bar(None, last_loss)
        if log is not None:
            log.close()
    save(cfg.steps)
    summary: dict[str, Any] = {"steps": cfg.steps, "final_loss": last_loss, "world_size": world, "rank": rank,
                               "seconds": time.perf_counter() - t0}
    if world > 1:
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        allf = [torch.zeros_like(flat) for _ in range(world)]
        dist.all_gather(allf, flat)
        summary["ranks_in_sync"] = all(torch.equal(allf[0], f) for f in allf)
        summary["max_rank_diff"] = max(float((allf[0] - f).abs().max()) for f in allf)
    if writer:
        _atomic_write(out / "summary.json", json.dumps(summary, indent=2))
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()
    return summary


def _progress(enabled: bool, total: int, start: int):
    """A rich progress bar with the running loss; a no-op when disabled."""
    if not enabled:
        return lambda step, loss: None
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    prog = Progress(TextColumn("train"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                    TextColumn("loss {task.fields[loss]}"), TimeRemainingColumn(), transient=True)
    task = prog.add_task("train", total=total, completed=start, loss="-")
    prog.start()

    def update(step: int | None, loss: float) -> None:
        if step is None:
            prog.stop()
        else:
            prog.update(task, completed=step, loss=f"{loss:.3f}")

    return update
