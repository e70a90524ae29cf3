"""Hooks for any training loop: measure and correct what the optimizer does along the orbits.

    monitor = Monitor(model)                       # finds every attention layer
    corrector = Corrector(model, "project")        # or "rebalance:200"
    for batch in data:
        loss = model(batch).backward()
        with monitor.step(), corrector.step():     # corrector inside: the monitor sees
            optimizer.step()                       # the update that was applied
        log(monitor.last.to_dict())                # {"rho_qk": [layer][group], ...}

Layers are found through `attnid.layers` (accessors that get/set an `AttentionWeights`);
attnid's own `Attention` is found there, `attnid.adapters` registers Hugging Face models.
All layers of the same spec are stacked and processed in one batch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import operator
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

import attnid.adapters.hooks  # noqa: F401  (registers the Hugging Face layer finder)
from attnid.errors import AttnidError
from attnid.layers import find_layers
from attnid.spec import AttentionSpec
from attnid.symmetry.conserved import Metrics, metrics
from attnid.symmetry.projection import project, remove_tangent
from attnid.symmetry.rebalance import rebalance
from attnid.weights import SIDES, AttentionWeights, Side


class _Batches:
    """Layers grouped by spec, read and written as stacked containers."""

    def __init__(self, model: nn.Module) -> None:
        self.layers = find_layers(model)
        groups: dict[AttentionSpec, list[int]] = {}
        for i, acc in enumerate(self.layers):
            groups.setdefault(acc.spec, []).append(i)
        self.groups = list(groups.values())

    def snapshot(self, dtype: torch.dtype | None = None, *,
                 unless_equal: list[AttentionWeights] | None = None,
                 into: list[AttentionWeights] | None = None) -> list[AttentionWeights]:
        """One stacked copy per spec group: in the model's dtype (one copy, no conversion) or
        in ``dtype``. ``unless_equal``: an earlier snapshot returned as it is (with the Gram
        matrices it has cached) when the layers still hold exactly its values. ``into``: an
        earlier snapshot in the model's dtype, overwritten in place instead of new memory."""
        current = [[self.layers[i].get() for i in idx] for idx in self.groups]
        if unless_equal is not None and all(
                _equal(layer, old, j) for now, old in zip(current, unless_equal, strict=True)
                for j, layer in enumerate(now)):
            return unless_equal
        if into is not None and dtype is None and all(
                (layer[n].dtype, layer[n].device) == (buf[n].dtype, buf[n].device)
                for now, buf in zip(current, into, strict=True) for layer in now for n, _ in buf.items()):
            for layers, buf in zip(current, into, strict=True):
                for n, t in buf.items():
                    torch.stack([layer[n] for layer in layers], out=t)
            return into
        out = []
        for layers in current:
            w = AttentionWeights.stack(layers)
            out.append(w if dtype is None or w.W_Q.dtype == dtype else w.to(dtype))
        return out

    def write(self, stacks: list[AttentionWeights]) -> None:
        """Write stacked weights back, each layer in its own dtype."""
        for idx, w in zip(self.groups, stacks, strict=True):
            for i, layer_w in zip(idx, w.unstack(), strict=True):
                dtype = self.layers[i].get().W_Q.dtype
                self.layers[i].set(layer_w.to(dtype))


def _equal(layer: AttentionWeights, stacked: AttentionWeights, j: int) -> bool:
    """Whether ``layer`` holds exactly the values of entry ``j`` of ``stacked``."""
    return all(t.dtype == stacked[n].dtype and torch.equal(t, stacked[n][j]) for n, t in layer.items())


@dataclasses.dataclass(frozen=True)
class LayerStep:
    """What one update did to one attention layer, float64. Per key/value group ``[G]``
    unless said (QK-norm's QK-side metrics: one value per layer, ``[]``)."""

    rho_qk: torch.Tensor  # [G]: tangent (orbit) share of the applied update, QK side
    rho_vo: torch.Tensor  # [G]: the same, VO side
    update_norm: torch.Tensor  # []: ||Δw|| of the layer's update
    metrics: Metrics  # the conserved quantity after the update; drift: over the update
    grad_norm_bq: torch.Tensor | None = None  # [H]: ||grad b_Q|| per head, before the update
    grad_norm_bk: torch.Tensor | None = None  # [G]: ||grad b_K|| per group

    def rho(self, side: Side) -> torch.Tensor:
        return self.rho_qk if side == "qk" else self.rho_vo

    def flat(self) -> dict[str, torch.Tensor]:
        """Flat names (``beta_qk, ..., rho_qk, rho_vo, update_norm, grad_norm_bq, ...``):
        the metrics' own, then this record's fields by name; absent biases left out."""
        out = self.metrics.flat()
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name != "metrics" and v is not None:
                out[f.name] = v
        return out


@dataclasses.dataclass(frozen=True)
class StepMetrics:
    """What one update did to every attention layer of a model: ``layers[i]`` is layer ``i``
    (in the order of `Monitor.layer_names`)."""

    layers: tuple[LayerStep, ...]

    def rho(self, side: Side) -> torch.Tensor:
        """Every layer's tangent shares on one side, concatenated: ``[sum of G]``."""
        return torch.cat([layer.rho(side).reshape(-1) for layer in self.layers])

    def to_dict(self) -> dict[str, list[Any]]:
        """The JSON form, indexed ``[layer][group]`` (``update_norm``: ``[layer]``): the keys of
        `LayerStep.flat`; a bias-gradient key only when every layer has that bias."""
        rows = [layer.flat() for layer in self.layers]
        keys = [k for k in rows[0] if all(k in r for r in rows)] if rows else []
        return {k: [r[k].tolist() for r in rows] for k in keys}


class Monitor:
    """Records, around each optimizer step, the paper's metrics for every attention layer.

    Snapshots stay in the model's dtype; the big products (Gram matrices, ``W^T dW``) run in
    it and everything derived from them (generators, metrics) is float64.

    ``last`` is the latest `StepMetrics`: per layer (``last.layers[i]``, a `LayerStep`)
    ``rho_qk, rho_vo`` (tangent share of the applied update), ``metrics`` (``beta, tau, mu,
    drift`` of the conserved quantity after the step, per side), ``update_norm``, and
    ``grad_norm_bq, grad_norm_bk`` per head when those biases exist (read from ``.grad`` at
    the start of the step); ``last.to_dict()`` is the same as JSON-ready lists indexed
    ``[layer][group]`` under the flat names ``rho_qk, beta_qk, ...``.
    """

    def __init__(self, model: nn.Module, *, near: bool = False) -> None:
        self.batches = _Batches(model)
        self.near = near
        self.last: StepMetrics | None = None
        self._after: list[AttentionWeights] | None = None  # the last step's end point
        self._before: list[AttentionWeights] | None = None  # set by begin(), used by end()
        self._grads: list[tuple[torch.Tensor | None, torch.Tensor | None]] = []
        # two snapshots and one update, reused every step: no fresh memory (and its page
        # faults) for the model-sized copies after the first step
        self._buffers: list[list[AttentionWeights]] = []
        self._delta: list[AttentionWeights | None] = [None] * len(self.batches.groups)

    @property
    def after(self) -> list[AttentionWeights] | None:
        """The stacked weights (one container per spec group) after the last measured update.

        The monitor reuses this memory: it is valid until the next :meth:`end`; ``clone()`` it
        to keep it."""
        return self._after

    @property
    def layer_names(self) -> list[str]:
        return [acc.name for acc in self.batches.layers]

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Measure the update applied inside the block (``begin`` before, ``end`` after)."""
        self.begin()
        yield
        self.end()

    def begin(self) -> None:
        """Before an update: read the bias gradients and the current point. For loops whose
        hooks cannot wrap the update in one block (a `Trainer` callback)."""
        self._grads = self._bias_grads()
        # usually the last end point itself: no copy, its Gram matrices and spectra known
        spare = self._spare(self._after)
        self._before = self._keep(self.batches.snapshot(unless_equal=self._after, into=spare), spare)

    def end(self) -> StepMetrics:
        """After the update: measure what moved since :meth:`begin`; sets and returns ``last``."""
        if self._before is None:
            raise AttnidError("Monitor.end() needs a Monitor.begin() before the update")
        spare = self._spare(self._before)
        after = self._after = self._keep(self.batches.snapshot(into=spare), spare)
        step = self.measure(self._before, after)
        self.last = StepMetrics(tuple(dataclasses.replace(layer, grad_norm_bq=bq, grad_norm_bk=bk)
                                      for layer, (bq, bk) in zip(step.layers, self._grads, strict=True)))
        self._before = None
        return self.last

    def _spare(self, busy: list[AttentionWeights] | None) -> list[AttentionWeights] | None:
        """A snapshot buffer other than ``busy``, once there are two."""
        free = [b for b in self._buffers if b is not busy]
        return free[0] if len(self._buffers) == 2 and free else None

    def _keep(self, snap: list[AttentionWeights], spare: list[AttentionWeights] | None
              ) -> list[AttentionWeights]:
        """Keep a new snapshot as a buffer: the third one replaces the spare that did not fit
        (the model changed dtype or device)."""
        if all(b is not snap for b in self._buffers):
            if spare is not None:
                self._buffers = [snap if b is spare else b for b in self._buffers]
            elif len(self._buffers) < 2:
                self._buffers.append(snap)
        return snap

    def _bias_grads(self) -> list[tuple[torch.Tensor | None, torch.Tensor | None]]:
        """Per layer, ``||grad b_Q||`` and ``||grad b_K||`` per head (None without the bias or
        its gradient)."""
        def norm(g: torch.Tensor | None) -> torch.Tensor | None:
            return None if g is None else g.detach().double().norm(dim=-1)

        grads = [acc.grads() for acc in self.batches.layers]
        return [(norm(g.get("b_Q")), norm(g.get("b_K"))) for g in grads]

    def measure(self, before: list[AttentionWeights], after: list[AttentionWeights]) -> StepMetrics:
        """What the update from ``before`` to ``after`` (snapshots: one stacked container per
        spec group) did to every layer."""
        layers: list[LayerStep] = [None] * len(self.batches.layers)  # type: ignore[list-item]
        for k, (idx, w0, w1) in enumerate(zip(self.batches.groups, before, after, strict=True)):
            delta = self._difference(k, w1, w0)  # in the model's dtype; the small rest is float64
            m = metrics(w0, w1)
            p = {side: project(w0, delta, side, near=self.near) for side in SIDES}
            norm = (p["qk"].delta_sq + p["vo"].delta_sq).sqrt()  # [n]
            for j, i in enumerate(idx):
                layers[i] = LayerStep(p["qk"].rho[j], p["vo"].rho[j], norm[j], m.map(operator.itemgetter(j)))
        return StepMetrics(tuple(layers))

    def _difference(self, k: int, w1: AttentionWeights, w0: AttentionWeights) -> AttentionWeights:
        """``w1 - w0`` for spec group ``k``, written into the monitor's update buffer."""
        buf = self._delta[k]
        if buf is None or any(buf[n].shape != t.shape or buf[n].device != t.device
                              or buf[n].dtype != torch.result_type(t, w0[n]) for n, t in w1.items()):
            buf = self._delta[k] = w1 - w0
            return buf
        for n, t in w1.items():
            torch.sub(t, w0[n], out=buf[n])
        return buf


class Corrector:
    """Removes orbit motion from the optimizer: ``project`` every step, or ``rebalance`` every N.

    ``correction`` is ``"off"``, ``"project"``, ``"rebalance"`` (every step) or ``"rebalance:N"``.
    """

    def __init__(self, model: nn.Module, correction: str = "project", *, near: bool = False) -> None:
        self.kind, self.every = parse_correction(correction)
        self.batches = _Batches(model) if self.kind != "off" else None
        self.near = near
        self.steps = 0

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        before = self.batches.snapshot(torch.float64) if self.kind == "project" else None
        yield
        self.steps += 1
        if self.kind == "project":
            after = self.batches.snapshot(torch.float64)
            self.batches.write([w0 + remove_tangent(w0, w1 - w0, near=self.near)
                                for w0, w1 in zip(before, after, strict=True)])
        elif self.kind == "rebalance" and self.steps % self.every == 0:
            self.batches.write([rebalance(w, group="auto")
                                for w in self.batches.snapshot(torch.float64)])


def parse_correction(correction: str) -> tuple[str, int]:
    """``"off" | "project" | "rebalance" | "rebalance:N"`` -> (kind, every)."""
    if correction in ("off", "project", "rebalance"):
        return correction, 1
    if correction.startswith("rebalance:"):
        tail = correction.split(":", 1)[1]
        if tail.isdigit() and int(tail) > 0:
            return "rebalance", int(tail)
    raise AttnidError(f"unknown correction {correction!r}: use off, project or rebalance:N")

