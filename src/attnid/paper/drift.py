"""What an optimizer does to the conserved quantities near one trained point (docs/theory.md §9.3).

* :func:`same_point_drift`: one float64 SGD step of each lr from the trained weights (the drift
  is exactly second order: slope 2 in lr, at most ``||lr g_side||^2``); the float32 rounding
  floor that every float32 measurement of the drift sits on; and gradient descent for a fixed
  *time* ``lr * steps`` from the same weights, the gradient-flow limit: the drift then falls
  like lr (slope 1), so per unit of time it vanishes as lr -> 0.
* :func:`update_anatomy`: the tangent (orbit) share ``rho`` of AdamW's update and of each of
  its ingredients at the end of a run (gradient, momentum, preconditioned gradient, sign of
  the gradient, weight decay) beside an isotropic random update.

Both read a run's ``config.json`` and ``checkpoint.pt`` (model, and optimizer state for the
anatomy) and return plain records; `attnid.paper.training` turns them into figures and claims.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from attnid.stats import log_slope, median
from attnid.symmetry import AttentionWeights, metrics, project
from attnid.symmetry.conserved import flat_key
from attnid.symmetry.tangent import side_names
from attnid.train.data import shakespeare
from attnid.train.loop import TrainConfig, make_optimizer
from attnid.train.model import GPT
from attnid.weights import SIDES, Side, grams

DRAWS = 3  # isotropic random directions averaged by the update anatomy
TINY_LR = 1e-4  # a step whose true drift (~1e-8 of one at lr 1) is far below float32 rounding
FLOW_TIME = 0.25  # lr * steps of each gradient-descent run from the trained weights
FLOW_LRS = (0.0625, 0.03125, 0.015625, 0.0078125)  # 4 to 32 steps each
FLOW_BATCH = 8  # sequences of the one fixed batch those runs descend on
BATCH_SEED = 123


def _load(run_dir: Path, dtype: torch.dtype) -> tuple[TrainConfig, GPT, dict[str, Any]]:
    cfg = TrainConfig.from_dict(json.loads((run_dir / "config.json").read_text()))
    state = torch.load(run_dir / "checkpoint.pt", weights_only=False)
    model = GPT(cfg.model).to(dtype)
    model.load_state_dict(state["model"])
    return cfg, model, state


def _weights(model: GPT) -> AttentionWeights:
    """Every layer's attention weights, stacked ``[L, ...]`` (views, no copy)."""
    return AttentionWeights.stack([AttentionWeights.from_module(b.attn) for b in model.blocks])


def _stacked(model: GPT, fn: Callable[[str, torch.nn.Parameter], torch.Tensor]) -> AttentionWeights:
    """``fn(name, parameter)`` for every attention parameter, stacked ``[L, ...]``, float64."""
    spec = model.cfg.attention_spec()
    return AttentionWeights.stack([AttentionWeights.from_tensors(
        spec, {n: fn(n, p).detach().double() for n, p in b.attn.named_parameters()}) for b in model.blocks])


def _gradient(model: GPT, cfg: TrainConfig, batch_size: int | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """The loss gradient on the fixed batch (seed :data:`BATCH_SEED`) into ``.grad``; the batch."""
    x, y = shakespeare().batch("train", batch_size or cfg.batch_size, cfg.model.block_size,
                               torch.Generator().manual_seed(BATCH_SEED))
    model.zero_grad()
    model(x, y)[1].backward()
    return x, y


def _naive_qk(w: AttentionWeights) -> torch.Tensor:
    """The QK quantity one would conserve if RoPE and GQA were ignored: per query head,
    ``W~_Q^hT W~_Q^h - W~_K^gT W~_K^g`` (no commutant projection, no sum over the group):
    ``[..., H, dk, dk]``. A control: gradient flow does *not* conserve it under RoPE or GQA,
    so it drifts at first order in the step."""
    s = w.spec
    Q = w.W_Q if w.b_Q is None else torch.cat([w.W_Q, w.b_Q.unsqueeze(-2)], dim=-2)  # [..., H, d+1, dk]
    K = w.W_K if w.b_K is None else torch.cat([w.W_K, w.b_K.unsqueeze(-2)], dim=-2)  # [..., G, d+1, dk]
    K = K.repeat_interleave(s.kv_group_size, dim=-3)  # [..., H, d(+1), dk]
    return Q.transpose(-1, -2) @ Q - K.transpose(-1, -2) @ K


@dataclass(frozen=True)
class Flow:
    """Gradient descent on one fixed batch for the same time ``lr * steps`` at each lr, float64,
    from the trained weights: the drift ``||C(time) - C(0)||_F`` (largest over heads)."""

    time: float
    lr: list[float]
    steps: list[int]
    drift: dict[Side, list[float]]
    slope: dict[Side, float]  # log-log slope of drift against lr: 1 in the gradient-flow limit

    def per_time(self, side: Side) -> list[float]:
        """Drift per unit of time, ``drift / (lr * steps)``."""
        return [d / self.time for d in self.drift[side]]

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"time": self.time, "lr": self.lr, "steps": self.steps}
        for side in SIDES:
            out[flat_key("drift", side)] = self.drift[side]
            out[flat_key("slope", side)] = self.slope[side]
        return out


@dataclass(frozen=True)
class SamePoint:
    """One float64 SGD step of each lr from the same trained weights (``same_point_drift.json``
    is :meth:`to_dict`), the float32 rounding floor there, and the gradient-flow runs."""

    lr: list[float]
    step_sq: dict[Side, list[float]]  # ||lr g_side||^2 per lr: the bound on that side's drift
    drift: dict[Side, list[float]]  # per lr, the largest drift over heads
    slope: dict[Side, float]  # log-log slope of drift against lr
    drift_qk_naive: list[float]  # the same for the unprojected per-head QK quantity
    slope_qk_naive: float
    floor32: dict[Side, float]  # mean over heads: the drift a float32 step of TINY_LR reports
    floor_eps: dict[Side, float]  # largest over heads: eps32 * (||G_left||_F + ||G_right||_F)
    tiny64: dict[Side, float]  # the same TINY_LR step in float64 (mean over heads): its true drift
    flow: Flow | None = None

    @property
    def step_sq_qk(self) -> list[float]:
        return self.step_sq["qk"]

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"lr": self.lr}
        for side in SIDES:
            out[flat_key("step_sq", side)] = self.step_sq[side]
            out[flat_key("drift", side)] = self.drift[side]
            out[flat_key("slope", side)] = self.slope[side]
        out |= {"drift_qk_naive": self.drift_qk_naive, "slope_qk_naive": self.slope_qk_naive}
        for name in ("floor32", "floor_eps", "tiny64"):
            out |= {flat_key(name, side): getattr(self, name)[side] for side in SIDES}
        return out | {"flow": None if self.flow is None else self.flow.to_dict()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SamePoint:
        def per_side(name: str) -> dict[Side, Any]:
            return {side: d[flat_key(name, side)] for side in SIDES}

        f = d.get("flow")
        flow = None if f is None else Flow(f["time"], f["lr"], f["steps"],
                                           {s: f[flat_key("drift", s)] for s in SIDES},
                                           {s: f[flat_key("slope", s)] for s in SIDES})
        return cls(d["lr"], per_side("step_sq"), per_side("drift"), per_side("slope"), d["drift_qk_naive"],
                   d["slope_qk_naive"], per_side("floor32"), per_side("floor_eps"), per_side("tiny64"), flow)


def _floor(run_dir: Path) -> tuple[dict[Side, float], dict[Side, float]]:
    """(drift a float32 step of TINY_LR reports, mean over heads; eps32 * Gram norms, largest
    over heads: the rounding of one float32 evaluation of C)."""
    cfg, model, _ = _load(run_dir, torch.float32)
    _gradient(model, cfg)
    w = _weights(model)
    g = _stacked(model, lambda _, p: p.grad).to(torch.float32)
    m = metrics(w, w - g.scale(TINY_LR))  # Gram products in float32, as the Monitor does
    eps = torch.finfo(torch.float32).eps
    w64 = w.to(torch.float64)
    scale = {side: sum(G.flatten(-2).norm(dim=-1) for G in grams(w64, side)) for side in SIDES}
    return ({side: float(m.side(side).drift.mean()) for side in SIDES},
            {side: float(eps * scale[side].max()) for side in SIDES})


def gradient_flow(run_dir: Path, lrs: Sequence[float] = FLOW_LRS, time: float = FLOW_TIME) -> Flow:
    """Gradient descent (plain SGD steps on one fixed batch, every parameter, float64) from the
    trained weights for ``round(time / lr)`` steps at each lr; the drift of C over the run.

    Gradient flow conserves C; one step of lr changes it by ``lr^2 C(g)`` (§9.3), so over the
    ``time / lr`` steps of a fixed time the change is about ``lr * time * C(g)``: slope 1 in
    lr, and the drift per unit of time vanishes with lr."""
    drift: dict[Side, list[float]] = {side: [] for side in SIDES}
    steps = []
    for lr in lrs:
        cfg, model, _ = _load(run_dir, torch.float64)
        start = _weights(model).clone()
        x, y = _gradient(model, cfg, FLOW_BATCH)
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        n = max(1, round(time / lr))
        for i in range(n):
            if i:
                model.zero_grad()
                model(x, y)[1].backward()
            opt.step()
        m = metrics(start, _weights(model))
        steps.append(n)
        for side in SIDES:
            drift[side].append(float(m.side(side).drift.max()))
    return Flow(time, list(lrs), steps, drift, {side: log_slope(lrs, d) for side, d in drift.items()})


def same_point_drift(run_dir: Path, lrs: tuple[float, ...], *, flow: bool = True) -> SamePoint:
    """Drift of one SGD step of each lr from the *same* trained weights, in float64.

    The theory's statement (drift = O(lr^2) per step) isolated from trajectory effects and
    from float32 rounding: one gradient at the end of the run, ``w - lr g`` for every lr.
    Also the drift of :func:`_naive_qk` (first order when RoPE or GQA make it the wrong
    quantity), the step's squared norm per side (for the check ``drift <= ||lr g_side||^2``),
    the float32 rounding floor, and (``flow``) :func:`gradient_flow`.
    """
    cfg, model, _ = _load(run_dir, torch.float64)
    _gradient(model, cfg)
    spec = cfg.model.attention_spec()
    w, g = _weights(model), _stacked(model, lambda _, p: p.grad)
    g_sq = {side: float(sum(g[n].square().sum() for n in side_names(spec, side))) for side in SIDES}
    after = [metrics(w, w - g.scale(lr)) for lr in lrs]
    drift = {side: [float(m.side(side).drift.max()) for m in after] for side in SIDES}
    naive0 = _naive_qk(w)
    naive = [float((_naive_qk(w - g.scale(lr)) - naive0).flatten(-2).norm(dim=-1).max()) for lr in lrs]
    tiny = metrics(w, w - g.scale(TINY_LR))
    floor32, floor_eps = _floor(run_dir)
    return SamePoint(list(lrs), {side: [lr**2 * g_sq[side] for lr in lrs] for side in SIDES}, drift,
                     {side: log_slope(lrs, d) for side, d in drift.items()}, naive, log_slope(lrs, naive),
                     floor32, floor_eps, {side: float(tiny.side(side).drift.mean()) for side in SIDES},
                     gradient_flow(run_dir) if flow else None)


# ---- AdamW's update, ingredient by ingredient ------------------------------------------------
DIRECTIONS = ("gradient", "momentum", "preconditioned gradient", "sign of the gradient",
              "Adam direction", "weight decay", "AdamW update", "isotropic")


@dataclass(frozen=True)
class Anatomy:
    """Median tangent share ``rho`` (over every head and layer) of AdamW's next update and of
    its ingredients, at the end of an AdamW run, per side (``update_anatomy.json``)."""

    rho: dict[str, dict[Side, float]]  # a name of DIRECTIONS -> side -> median rho

    def to_dict(self) -> dict[str, Any]:
        return {name: {flat_key("rho", side): v[side] for side in SIDES} for name, v in self.rho.items()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Anatomy:
        return cls({name: {side: v[flat_key("rho", side)] for side in SIDES} for name, v in d.items()})


def update_anatomy(run_dir: Path, draws: int = DRAWS) -> Anatomy:
    """Where AdamW's orbit motion comes from, at the end of an AdamW run (needs its checkpoint
    with the optimizer state).

    The gradient ``g`` is orthogonal to the orbit (rho 0, §9.1). AdamW's next update is
    ``-lr (m_hat / (sqrt(v_hat) + eps) + wd w)`` with ``m, v`` the moment averages after
    ``g``. Measured: rho of ``g``; of the momentum ``m`` alone (past gradients, taken at past
    points); of ``g / sqrt(v_hat)`` (the per-coordinate preconditioner alone); of ``sign(g)``
    (Adam's first step); of the Adam direction; of the decay direction ``w``; of the update
    the optimizer really applies (one ``step()``); and the mean over ``draws`` isotropic
    Gaussian directions, whose expected share is the orbit dimension over the parameter count.
    """
    cfg, model, state = _load(run_dir, torch.float32)
    opt = make_optimizer(cfg, model)
    opt.load_state_dict(state["optimizer"])
    _gradient(model, cfg)
    param_group = opt.param_groups[0]
    beta1, beta2 = param_group["betas"]
    first = next(iter(opt.state.values()))
    t = float(first["step"]) + 1
    bc1, bc2 = 1 - beta1**t, 1 - beta2**t

    def moments(p: torch.nn.Parameter) -> tuple[torch.Tensor, torch.Tensor]:
        st = opt.state[p]
        m = beta1 * st["exp_avg"] + (1 - beta1) * p.grad  # m after this gradient
        v = beta2 * st["exp_avg_sq"] + (1 - beta2) * p.grad.square()
        return m / bc1, (v / bc2).sqrt() + param_group["eps"]

    gen = torch.Generator().manual_seed(0)
    ingredients: dict[str, Callable[[str, torch.nn.Parameter], torch.Tensor]] = {
        "gradient": lambda _, p: p.grad,
        "momentum": lambda _, p: moments(p)[0],
        "preconditioned gradient": lambda _, p: p.grad / moments(p)[1],
        "sign of the gradient": lambda _, p: p.grad.sign(),
        "Adam direction": lambda _, p: moments(p)[0] / moments(p)[1],
        "weight decay": lambda _, p: p,
    }
    w = _weights(model).to(torch.float64)
    dirs = {name: _stacked(model, fn) for name, fn in ingredients.items()}
    before = w.clone()
    opt.step()
    dirs["AdamW update"] = _weights(model).to(torch.float64) - before
    for i in range(draws):
        dirs[f"isotropic {i}"] = _stacked(model, lambda _, p: torch.randn(p.shape, generator=gen))

    def share(d: AttentionWeights) -> dict[Side, float]:
        return {side: median(project(w, d, side).rho.flatten()) for side in SIDES}

    rho = {name: share(d) for name, d in dirs.items() if not name.startswith("isotropic ")}
    iso = [share(d) for name, d in dirs.items() if name.startswith("isotropic ")]
    rho["isotropic"] = {side: float(np.mean([r[side] for r in iso])) for side in SIDES}
    return Anatomy(rho)
