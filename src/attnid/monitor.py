"""Hooks for any training loop: measure and correct what the optimizer does along the orbits.

    monitor = Monitor(model)                       # finds every attention layer
    corrector = Corrector(model, "project")        # or "rebalance:200"
    for batch in data:
        loss = model(batch).backward()
        with monitor.step(), corrector.step():     # corrector inside: the monitor sees
            optimizer.step()                       # the update that was applied
        log(monitor.last.to_dict())                # {"rho_qk": [layer][kv_group], ...}

Layers are found through `attnid.layers` (accessors that get/set an `AttentionWeights`);
attnid's own `Attention` is found there, `attnid.adapters` registers Hugging Face models.
All layers of the same spec are stacked and processed in one batch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import operator
import warnings
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

import attnid.adapters.hooks  # noqa: F401  (registers the Hugging Face layer finder)
from attnid.errors import AttnidError
from attnid.layers import LayerShards, find_layers
from attnid.spec import AttentionSpec
from attnid.symmetry.conserved import Metrics, metrics
from attnid.symmetry.projection import project, remove_tangent
from attnid.symmetry.rebalance import rebalance
from attnid.weights import SIDES, AttentionWeights, Side


class _Batches:
    """Layers of one spec stacked into one container (a stack), read and written stack by stack.

    When the model is sharded (FSDP2, FSDP1, DeepSpeed ZeRO-3; `attnid.sharding`) each layer is
    its own stack and a snapshot keeps only this process's pieces: a stack is gathered whole
    when it is read (:class:`_Gathered`), one layer at a time, never the whole model."""

    def __init__(self, model: nn.Module) -> None:
        self.layers = find_layers(model)
        by_spec: dict[AttentionSpec, list[int]] = {}
        for i, acc in enumerate(self.layers):
            by_spec.setdefault(acc.spec, []).append(i)
        self.by_spec = list(by_spec.values())
        self.stacks = self.by_spec  # the layer indices of each stack

    def snapshot(self, dtype: torch.dtype | None = None, *,
                 unless_equal: Sequence[AttentionWeights] | None = None,
                 into: Sequence[AttentionWeights] | None = None) -> Sequence[AttentionWeights]:
        """One stacked copy per stack: in the model's dtype (one copy, no conversion) or
        in ``dtype``. ``unless_equal``: an earlier snapshot returned as it is (with the Gram
        matrices it has cached) when the layers still hold exactly its values. ``into``: an
        earlier snapshot in the model's dtype, overwritten in place instead of new memory.
        Sharded: a :class:`_Gathered` (this process's pieces; read one stack at a time)."""
        shards = [acc.shards() for acc in self.layers]  # the parameters as they are now
        if any(s.sharded for s in shards):
            self.stacks = [[i] for i in range(len(self.layers))]
            if isinstance(unless_equal, _Gathered) and unless_equal.holds(shards, dtype):
                return unless_equal  # what this process holds is unchanged: keep its Gram matrices
            old = into.shards if isinstance(into, _Gathered) and dtype is None else [None] * len(shards)
            return _Gathered([s.copy(o) for s, o in zip(shards, old, strict=True)], dtype)
        self.stacks = self.by_spec
        if not isinstance(unless_equal, list):
            unless_equal = None
        if not isinstance(into, list):
            into = None
        current = [[shards[i].weights() for i in idx] for idx in self.stacks]
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

    def write(self, stacked: Iterable[AttentionWeights]) -> None:
        """Write stacked weights back (one stack at a time), each layer in its own dtype."""
        for k, w in enumerate(stacked):
            self.write_stack(k, w)

    def write_stack(self, k: int, w: AttentionWeights) -> None:
        """Write stack ``k``'s weights back; sharded, each process its own slices."""
        for i, layer_w in zip(self.stacks[k], w.unstack(), strict=True):
            self.layers[i].set(layer_w)


def _equal(layer: AttentionWeights, stacked: AttentionWeights, j: int) -> bool:
    """Whether ``layer`` holds exactly the values of entry ``j`` of ``stacked``."""
    return all(t.dtype == stacked[n].dtype and torch.equal(t, stacked[n][j]) for n, t in layer.items())


class _Gathered(Sequence[AttentionWeights]):
    """A snapshot of a sharded model: this process's pieces of every layer; entry ``k`` is
    layer ``k`` gathered whole (stacked, batch of one) when it is read. Reading is a
    collective: every process reads the same entries in the same order."""

    def __init__(self, shards: list[LayerShards], dtype: torch.dtype | None) -> None:
        self.shards, self.dtype = shards, dtype
        # what was computed from each gathered layer (Gram matrices, spectra: small), kept for
        # its next reading; the pieces are never changed in place while this snapshot lives
        self.memos: list[dict] = [{} for _ in shards]

    def __len__(self) -> int:
        return len(self.shards)

    def __getitem__(self, k):  # type: ignore[override]
        if isinstance(k, slice):
            return [self[j] for j in range(*k.indices(len(self)))]
        w = self.shards[k].weights().map(lambda t: t.unsqueeze(0))
        w = w if self.dtype is None or w.W_Q.dtype == self.dtype else w.to(self.dtype)
        w.__dict__["_memo"] = self.memos[k]  # fresh tensors, version 0 each reading: still valid
        return w

    def holds(self, shards: list[LayerShards], dtype: torch.dtype | None) -> bool:
        """Whether this snapshot holds exactly the pieces ``shards`` show now (a local check:
        reading either gathers the same way on every process)."""
        same = lambda a, b: a.dtype == b.dtype and torch.equal(a, b)  # noqa: E731
        return dtype == self.dtype and all(
            mine.pieces.keys() == now.pieces.keys()
            and all(same(t, now.pieces[n]) for n, t in mine.pieces.items())
            for mine, now in zip(self.shards, shards, strict=True))


@dataclasses.dataclass(frozen=True)
class LayerStep:
    """What one update did to one attention layer, float64. Per key/value group ``[G]``
    unless said (QK-norm's QK-side metrics: one value per layer, ``[]``)."""

    rho_qk: torch.Tensor  # [G]: tangent (orbit) share of the applied update, QK side
    rho_vo: torch.Tensor  # [G]: the same, VO side
    update_norm: torch.Tensor  # []: ||Δw|| of the layer's update
    metrics: Metrics  # the conserved quantity after the update; drift: over the update
    grad_norm_bq: torch.Tensor | None = None  # [H]: ||grad b_Q|| per head, before the update
    grad_norm_bk: torch.Tensor | None = None  # [G]: ||grad b_K|| per kv group

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
        """The JSON form, indexed ``[layer][kv_group]`` (``update_norm``: ``[layer]``): the keys of
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
    ``[layer][kv_group]`` under the flat names ``rho_qk, beta_qk, ...``.
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
        # one update buffer per spec (sharded, the layers of one spec take turns in it)
        self._delta: dict[AttentionSpec, AttentionWeights] = {}

    @property
    def after(self) -> list[AttentionWeights] | None:
        """The stacked weights (one container per stack) after the last measured update.

        The monitor reuses this memory: it is valid until the next :meth:`end`; ``clone()`` it
        to keep it."""
        return self._after

    @property
    def layer_names(self) -> list[str]:
        return [acc.name for acc in self.batches.layers]

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Measure the update applied inside the ``with`` statement (``begin`` before, ``end`` after)."""
        self.begin()
        yield
        self.end()

    def begin(self, *, grads: bool = True) -> None:
        """Before an update: read the bias gradients and the current point. For loops whose
        hooks cannot wrap the update in one ``with`` statement (a `Trainer` callback). ``grads=False``:
        called before the backward pass (there are no gradients yet): no gradient norms."""
        self._grads = self._bias_grads() if grads else [(None, None)] * len(self.batches.layers)
        # usually the last end point itself: no copy, its Gram matrices and spectra known
        spare = self._spare(self._after)
        self._before = self._keep(self.batches.snapshot(unless_equal=self._after, into=spare), spare)

    def end(self) -> StepMetrics:
        """After the update: measure what moved since :meth:`begin`; sets and returns ``last``."""
        if self._before is None:
            raise AttnidError("Monitor.end() needs a Monitor.begin() before the update")
        spare = self._spare(self._before)
        after = self._after = self._keep(self.batches.snapshot(into=spare), spare)
        if isinstance(self._before, _Gathered) != isinstance(after, _Gathered):
            self._before = None
            raise AttnidError("the model was sharded (or gathered) between Monitor.begin() and "
                              "Monitor.end(): measure a step before the change or after it")
        step = self.measure(self._before, after)
        self.last = StepMetrics(tuple(dataclasses.replace(layer, grad_norm_bq=bq, grad_norm_bk=bk)
                                      for layer, (bq, bk) in zip(step.layers, self._grads, strict=True)))
        self._before = None
        if not any(bool(layer.update_norm) for layer in self.last.layers):
            warnings.warn("attnid: no attention weight moved during the monitored step, so every rho "
                          "reads 0; the optimizer stepped outside the `with`, skipped the step, or "
                          "updates a copy of the weights attnid cannot see", stacklevel=2)
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
        stack) did to every layer."""
        layers: list[LayerStep] = [None] * len(self.batches.layers)  # type: ignore[list-item]
        for k, (idx, w0, w1) in enumerate(zip(self.batches.stacks, before, after, strict=True)):
            delta = self._difference(k, w1, w0)  # in the model's dtype; the small rest is float64
            m = metrics(w0, w1)
            p = {side: project(w0, delta, side, near=self.near) for side in SIDES}
            norm = (p["qk"].delta_sq + p["vo"].delta_sq).sqrt()  # [n]
            for j, i in enumerate(idx):
                layers[i] = LayerStep(p["qk"].rho[j], p["vo"].rho[j], norm[j], m.map(operator.itemgetter(j)))
        return StepMetrics(tuple(layers))

    def _difference(self, k: int, w1: AttentionWeights, w0: AttentionWeights) -> AttentionWeights:
        """``w1 - w0`` for stack ``k``, written into the monitor's update buffer for its spec."""
        buf = self._delta.get(w1.spec)
        if buf is None or any(buf[n].shape != t.shape or buf[n].device != t.device
                              or buf[n].dtype != torch.result_type(t, w0[n]) for n, t in w1.items()):
            buf = self._delta[w1.spec] = w1 - w0
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
            self.batches.write(w0 + remove_tangent(w0, w1 - w0, near=self.near)  # one stack at a time
                               for w0, w1 in zip(before, after, strict=True))
        elif self.kind == "rebalance" and self.steps % self.every == 0:
            self.batches.write(rebalance(w, subgroup="auto") for w in self.batches.snapshot(torch.float64))


def parse_correction(correction: str) -> tuple[str, int]:
    """``"off" | "project" | "rebalance" | "rebalance:N"`` -> (kind, every)."""
    if correction in ("off", "project", "rebalance"):
        return correction, 1
    if correction.startswith("rebalance:"):
        tail = correction.split(":", 1)[1]
        if tail.isdigit() and int(tail) > 0:
            return "rebalance", int(tail)
    raise AttnidError(f"unknown correction {correction!r}: use off, project or rebalance:N")

