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
from typing import Any

import torch
import torch.distributed as dist

from attnid.errors import AttnidError
from attnid.monitor import Corrector, Monitor, StepMetrics, parse_correction
from attnid.progress import Progress
from attnid.stats import median
from attnid.symmetry.conserved import flat_key
from attnid.train.cuda import GraphedLoss, HostMirror
from attnid.train.data import shakespeare
from attnid.train.export import Export, check_export, export_hf
from attnid.train.model import GPT, GPTConfig
from attnid.train.sizes import UpdateSizes
from attnid.weights import SIDES, Side

PRESETS: dict[str, dict[str, Any]] = {
    # CPU-sized: the effects are visible in a few hundred steps on two cores
    "tiny": dict(n_layers=2, n_heads=4, d_model=64, block_size=64),
    "small": dict(n_layers=4, n_heads=6, d_model=192, block_size=128),
    # nanoGPT's Shakespeare-char model (the paper's setting): head dim 64
    "paper": dict(n_layers=6, n_heads=6, d_model=384, block_size=256, dropout=0.2),
}
# architectures (GPTConfig fields); gpt2 and llama export to Hugging Face (attnid.train.export)
ARCHS: dict[str, dict[str, Any]] = {
    "nanogpt": dict(),  # the paper's: LayerNorm, GELU, learned positions, tied head, q and k biases
    "gpt2": dict(attn_bias="qkvo", mlp_bias=True),  # GPT2LMHeadModel: biases on q, k, v, o and the MLP
    "llama": dict(norm="rmsnorm", mlp="swiglu", rope=1.0, attn_bias="", mlp_bias=False,
                  tie_weights=False),  # LlamaForCausalLM: RMSNorm, SwiGLU, RoPE, untied, no biases
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
    schedule: str = "constant"  # constant | cosine (to lr / 10 at the last step)
    warmup: int = 0  # steps of linear warmup from lr / warmup
    cuda_graph: bool = False  # CUDA only: replay forward + backward as one graph (attnid.train.cuda)

    def __post_init__(self) -> None:
        if self.optimizer not in ("sgd", "adam", "adamw"):
            raise AttnidError(f"unknown optimizer {self.optimizer!r}: use sgd, adam or adamw")
        if self.schedule not in ("constant", "cosine"):
            raise AttnidError(f"unknown schedule {self.schedule!r}: use constant or cosine")
        if self.warmup < 0:
            raise AttnidError("warmup must be >= 0")
        for name in ("steps", "batch_size", "log_every", "eval_every", "eval_batches"):
            if getattr(self, name) <= 0:
                raise AttnidError(f"{name} must be positive")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise AttnidError("lr must be a positive number")
        if self.weight_decay < 0:
            raise AttnidError("weight_decay must be >= 0")
        parse_correction(self.correct)
        if self.cuda_graph and not self.device.startswith("cuda"):
            raise AttnidError(f"cuda_graph needs a CUDA device, not {self.device!r}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def lr_at(self, step: int) -> float:
        """The learning rate of step ``step`` (1-based): linear warmup over ``warmup`` steps,
        then constant or a cosine from ``lr`` down to ``lr / 10`` at step ``steps``."""
        if step <= self.warmup:
            return self.lr * step / self.warmup
        if self.schedule == "constant":
            return self.lr
        done = (step - self.warmup) / max(1, self.steps - self.warmup)
        return self.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * min(done, 1.0))))

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


@dataclass(frozen=True)
class OrbitSummary:
    """One side over a run: the median tangent share rho of the logged updates (after the
    first, unless it is the only one) and the mean beta (norm of the conserved quantity) over
    heads at the first and the last logged step."""

    median_rho: float
    beta_first: float
    beta_last: float

    @classmethod
    def of(cls, steps: list[StepMetrics], side: Side) -> OrbitSummary:
        def mean_beta(step: StepMetrics) -> float:
            betas = torch.cat([layer.metrics.side(side).beta.reshape(-1) for layer in step.layers])
            return float(betas.mean())

        rho = median([s.rho(side) for s in steps[1:] or steps])
        return cls(rho, mean_beta(steps[0]), mean_beta(steps[-1]))

    def flat(self, side: Side) -> dict[str, float]:
        """``median_rho_qk, beta_qk_first, beta_qk_last`` (the names in ``summary.json``)."""
        beta = flat_key("beta", side)
        return {flat_key("median_rho", side): self.median_rho, f"{beta}_first": self.beta_first,
                f"{beta}_last": self.beta_last}


@dataclass(frozen=True)
class TrainSummary:
    """The end of a run (``OUT/summary.json`` is :meth:`to_dict`)."""

    steps: int
    final_loss: float
    world_size: int
    rank: int
    seconds: float
    orbit: dict[Side, OrbitSummary]  # per side; empty when no step was logged
    checkpoint_bytes: int | None = None  # when OUT/checkpoint.pt exists
    ranks_in_sync: bool | None = None  # under DDP: the ranks ended with equal weights
    max_rank_diff: float | None = None  # under DDP
    hf: Export | None = None  # the Hugging Face export (``train(..., hf=True)``)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"steps": self.steps, "final_loss": self.final_loss,
                               "world_size": self.world_size, "rank": self.rank, "seconds": self.seconds}
        for side, o in self.orbit.items():
            out.update(o.flat(side))
        for k in ("checkpoint_bytes", "ranks_in_sync", "max_rank_diff"):
            if getattr(self, k) is not None:
                out[k] = getattr(self, k)
        if self.hf is not None:
            out |= {"hf_path": str(self.hf.path), "hf_architecture": self.hf.architecture,
                    "hf_error": self.hf.error}
        return out


def train(cfg: TrainConfig, out: Path, *, resume: bool = False, progress: bool | Progress = True,
          checkpoint: bool = True, hf: bool = False) -> TrainSummary:
    """Run one training; return the summary. ``KeyboardInterrupt`` leaves a valid log (and,
    with ``checkpoint``, a checkpoint to resume from).

    ``progress``: a :class:`attnid.progress.Progress` to report steps to, ``True`` for a new
    one on stderr, ``False`` for silence. ``checkpoint=False`` writes no ``checkpoint.pt``.
    ``hf=True`` also writes ``OUT/hf``, the trained model as a Hugging Face checkpoint
    (`attnid.train.export.export_hf`; a model it cannot represent is refused before training).
    """
    out = Path(out)
    run = _setup(cfg, out, resume)
    cfg = run.cfg
    if hf:  # before any training (under --resume, the saved model's config)
        check_export(cfg.model, out / "hf", force=True)
    data = shakespeare()
    on_gpu = torch.device(cfg.device).type == "cuda"
    mirror = HostMirror(run.model) if on_gpu else None  # the Monitor measures a CPU copy
    monitor = Monitor(run.model if mirror is None else mirror.layers)
    corrector = Corrector(run.model, cfg.correct)
    sizes = UpdateSizes(run.model)
    shown = progress if isinstance(progress, Progress) else Progress(enabled=bool(progress))
    graphed = _graphed(run, shown)
    eval_gen = torch.Generator().manual_seed(7)
    log = _open_log(run, out, resume)
    logged: list[StepMetrics] = []
    bar = shown.steps(cfg.steps, "train", run.start) if run.rank == 0 else Progress(enabled=False).steps(1)
    step, last_loss, t0 = run.start, float("nan"), time.perf_counter()
    try:
        for step in range(run.start + 1, cfg.steps + 1):
            if cfg.schedule != "constant" or cfg.warmup:
                for param_group in run.opt.param_groups:
                    param_group["lr"] = cfg.lr_at(step)
            x, y = data.batch("train", cfg.batch_size, cfg.model.block_size, run.gen)
            if graphed is not None:  # the gradients land in .grad, overwritten
                loss = graphed(x, y)
            else:  # non_blocking: the copy waits for nothing queued on the GPU
                x, y = x.to(cfg.device, non_blocking=True), y.to(cfg.device, non_blocking=True)
                _, loss = run.wrapped(x, y)
                run.opt.zero_grad(set_to_none=True)
                loss.backward()
            logging = step == 1 or step % cfg.log_every == 0 or step == cfg.steps
            if logging and mirror is not None:
                mirror.pull(grads=True)
            sizes.before()
            with monitor.step() if logging else contextlib.nullcontext():
                with corrector.step():
                    run.opt.step()
                if logging and mirror is not None:
                    mirror.pull()
            sizes.after()
            if logging or not on_gpu:  # on a GPU, reading the loss waits for it: at a record only
                last_loss = float(loss.detach())
                if not math.isfinite(last_loss):
                    raise AttnidError(f"the loss diverged by step {step} (lr {cfg.lr} too large?)")
            if logging:
                logged.append(monitor.last)
                record: dict[str, Any] = {"step": step, "loss": last_loss, **monitor.last.to_dict(),
                                          **sizes.take()}
                if step % cfg.eval_every == 0 or step == cfg.steps:
                    record["val_loss"] = evaluate(run.model, cfg, eval_gen)
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
    orbit = {side: OrbitSummary.of(logged, side) for side in SIDES} if logged else {}
    seconds = time.perf_counter() - t0
    exported = None
    if hf and run.rank == 0:
        exported = export_hf(run.model, out / "hf", data.chars, force=True)
    return _finish(run, out, last_loss, seconds, orbit, exported)


def _graphed(run: _Run, shown: Progress) -> GraphedLoss | None:
    """The run's forward and backward pass as a CUDA graph when its config asks for one (one
    process only); None, with a line saying why, when the capture fails."""
    cfg = run.cfg
    if not cfg.cuda_graph or run.world > 1:
        return None
    try:
        return GraphedLoss(run.wrapped, cfg.batch_size, cfg.model.block_size, cfg.device)
    except RuntimeError as e:  # an operation the capture does not take: train without the graph
        shown.line(f"CUDA graph capture failed ({str(e).splitlines()[0]}): training without it")
        run.model.zero_grad(set_to_none=True)
        return None


def _finish(run: _Run, out: Path, last_loss: float, seconds: float, orbit: dict[Side, OrbitSummary],
            exported: Export | None = None) -> TrainSummary:
    """The summary (written by rank 0); under DDP, checks that the ranks ended in sync."""
    ckpt = out / "checkpoint.pt"
    in_sync = rank_diff = None
    if run.world > 1:
        flat = torch.cat([p.detach().reshape(-1) for p in run.model.parameters()])
        allf = [torch.zeros_like(flat) for _ in range(run.world)]
        dist.all_gather(allf, flat)
        in_sync = all(torch.equal(allf[0], f) for f in allf)
        rank_diff = max(float((allf[0] - f).abs().max()) for f in allf)
    summary = TrainSummary(run.cfg.steps, last_loss, run.world, run.rank, seconds, orbit,
                           ckpt.stat().st_size if ckpt.exists() else None, in_sync, rank_diff, exported)
    if run.rank == 0:
        _atomic_write(out / "summary.json", json.dumps(summary.to_dict(), indent=2))
    if run.world > 1:
        dist.barrier()
        dist.destroy_process_group()
    return summary
