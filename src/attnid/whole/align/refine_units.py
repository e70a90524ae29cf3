"""The refinement of `attnid.whole.align.refine` with neither model held whole (docs/theory.md
§13.24): what `attnid align / merge / barrier --refine` run on checkpoints.

The objective and its gradient are the whole model's (`refine.PathLoss` through transformers'
own forward), computed one unit at a time over A's and B's units as they are read. Per step
and path point ``t`` (the weights ``(1 - t) A + t g(B)``, mixed in the compute dtype, float64
as `PathLoss` mixes them or float32 for bfloat16 and float16 checkpoints, then rounded to the
model's dtype):

1. **Forward**, without a graph: transformers' forward of the model built without its decoder
   layers (`attnid.whole.layerwise.LayerwiseLM`, its own tables and head freed: each forward
   is handed them), each slot running its layer there and then on that layer's weights at
   ``t``, every layer's input and output kept (``[b, T, d]`` each, as activation
   checkpointing keeps them).
2. **The head's part.** The forward again with the final norm and head as functions of ``g``,
   every slot handing back its kept output, the last one as a leaf: its backward gives the
   head's gradient and the last layer's output gradient.
3. **The layers**, last to first: each run again on its kept input with its weights now as
   functions of ``g``, its output's gradient pushed back to its input and to ``g``.
4. **The tables' part.** A forward with the tables as functions of ``g`` that stops at the
   first slot, whose input takes the first layer's input gradient.

The gradients reach ``g``'s tensors (the stream rotation, each layer's maps, the gains) held as
leaves, and from them the refinement's parameters in one more backward, so the element is made
once per step. Each step reads every layer unit twice per point (forward, backward) and the
tables and head twice (a tied table three times); what is held at once is B's unit being moved
and its graph (in the compute dtype), A read a tensor at a time, the tables and head at ``t``
(in the model's dtype, through the forward and the head's part), and the kept states.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from attnid.errors import AttnidError
from attnid.progress import Progress
from attnid.whole.align.refine import BATCH, Parameters, Refined, choose_parts, descend
from attnid.whole.fit.fitter import compute_dtype
from attnid.whole.layerwise import LayerwiseLM, inline
from attnid.whole.transforms.element import GroupElement, apply_element
from attnid.whole.transforms.state import ModelTensors

Tensors = dict[str, torch.Tensor]


def skeleton(src: Any) -> ModelTensors:
    """B's tensors as meta tensors of their shapes (what `Parameters` and `refinable_parts`
    read), the final norm's gain real (a tied head's rotation depends on its values)."""
    lay = src.layout
    out = {n: torch.empty(src.shape(n), dtype=torch.float64, device="meta") for n in src.unit_of}
    if lay.final is not None and (name := f"{lay.final.path}.weight") in out:
        out[name] = src.tensor(name).to(torch.float64)
    return ModelTensors(lay, out, src.config)


def _leaves(g: GroupElement) -> tuple[GroupElement, list[tuple[torch.Tensor, torch.Tensor]]]:
    """``g`` with each tensor a fresh leaf (its gradient kept; in its own dtype: the transforms
    check the maps in float64 and cast them to each weight's dtype), and the (tensor, leaf)
    pairs."""
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []

    def leaf(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None:
            return None
        x = t.detach().clone().requires_grad_()
        pairs.append((t, x))
        return x

    layers = tuple(replace(le, qk=leaf(le.qk), vo=leaf(le.vo), mlp=leaf(le.mlp)) for le in g.layers)
    gains = {p: leaf(s) for p, s in g.gains.items()}
    return GroupElement(rotation=leaf(g.rotation), gains=gains, layers=layers), pairs  # type: ignore[arg-type]


class _Stop(Exception):  # noqa: N818  (not an error: the forward's work is done at the first slot)
    """Ends a forward at the first slot, handing back that slot's input."""

    def __init__(self, x: torch.Tensor) -> None:
        self.x = x


def _hidden(args: tuple, kwargs: dict) -> torch.Tensor:
    return args[0] if args else kwargs["hidden_states"]


def _with_hidden(args: tuple, kwargs: dict, x: torch.Tensor) -> tuple[tuple, dict]:
    if args:
        return (x, *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": x}


def _first(out: Any) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out[0]


def _like(out: Any, x: torch.Tensor) -> Any:
    """``out`` (a layer's output: a tensor or a tuple starting with one) with ``x`` for its
    hidden states."""
    return x if isinstance(out, torch.Tensor) else (x, *out[1:])


class UnitPathLoss:
    """`refine.PathLoss` over sources read a unit at a time (`attnid.checkpoint.units.Units`, or
    `attnid.whole.fit.source.SplitSource` for a model in memory): A's, and B's moved by ``g``."""

    def __init__(self, lm: LayerwiseLM, a: Any, b: Any, alphas: Sequence[float],
                 dtype: torch.dtype = torch.float64) -> None:
        self.lm, self.a, self.b, self.alphas, self.dtype = lm, a, b, tuple(alphas), dtype
        self.L = lm.L

    def _mixed(self, unit: int, g: GroupElement, t: float, names: Sequence[str]) -> Tensors:
        """The weights ``names`` at point ``t``, from ``unit`` of A and of B moved by ``g`` (in
        the compute dtype), in the model's dtype."""
        moved = dict(apply_element(self.b.load(unit, self.dtype), g).tensors)
        out = {}
        for n in names:  # A a tensor at a time, and each of B's let go once mixed
            out[n] = ((1 - t) * self.a.tensor(n).to(self.dtype) + t * moved.pop(n)).to(self.lm.dtype)
        return out

    def _at(self, names: Sequence[str], g: GroupElement, t: float) -> Tensors:
        """The weights ``names`` at ``t``, each from its own unit (a post-LN layer's output norm
        is in the next unit, with its first reader)."""
        out: Tensors = {}
        for unit in sorted({self.a.unit_of[n] for n in names}):
            out |= self._mixed(unit, g, t, [n for n in names if self.a.unit_of[n] == unit])
        return out

    def _rest(self, g: GroupElement, t: float, units: Sequence[int] | None = None) -> Tensors:
        """The tables, final norm and head at ``t`` (those of ``units``; None: all)."""
        return self._at([n for n in self.lm.rest if units is None or self.a.unit_of[n] in units], g, t)

    def _layer(self, i: int, g: GroupElement, t: float) -> Tensors:
        """Layer ``i``'s weights at ``t``, by their names in the layer."""
        prefix = self.lm.prefixes[i]
        names = [prefix + n for n, _ in self.lm.layers[i].named_parameters()]
        missing = [n for n in names if n not in self.a.unit_of]
        if missing:
            raise AttnidError(f"internal: no tensor {missing[0]} for layer {i}")
        return {n[len(prefix):]: w for n, w in self._at(names, g, t).items()}

    def _forward(self, rest: Tensors, ids: torch.Tensor, run: Callable[[int, tuple, dict], Any]
                 ) -> torch.Tensor:
        """The loss of transformers' forward with the tables and head ``rest`` and each slot's
        work ``run(layer, args, kwargs)``."""
        with inline(run):
            logits = torch.func.functional_call(self.lm.model, rest, (),
                                                {"input_ids": ids, "use_cache": False}).logits
        return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).double(),
                                           ids[:, 1:].reshape(-1)) / len(self.alphas)

    def _point(self, g: GroupElement, t: float, ids: torch.Tensor, grad: bool) -> torch.Tensor:
        """The loss at ``t`` on ``ids``; with ``grad``, its gradient pushed into ``g``'s leaves:
        the forward without a graph, keeping each layer's input and output; the head's part
        (its forward again, every slot handing back the kept output); each layer's, last to
        first; the tables', through a forward that stops at the first slot."""
        lm, L = self.lm, self.L
        kept: list[tuple[tuple, dict]] = []
        outs: list[Any] = []
        ran = [0]

        def run(i: int, args: tuple, kwargs: dict) -> Any:
            a, kw = _with_hidden(args, kwargs, _hidden(args, kwargs).detach())
            out = torch.func.functional_call(lm.layers[i], self._layer(i, g, t), a, kw)
            ran[0] += 1
            if grad:  # what the backward starts from (the output is the next layer's input)
                kept.append((a, kw))
                outs.append(out)
            return out

        with torch.no_grad():
            rest = self._rest(g, t)
            loss = self._forward(rest, ids, run)
        if ran[0] != L:
            raise AttnidError(f"internal: the forward ran {ran[0]} of {L} layers")
        if not grad:
            return loss
        units = {self.a.unit_of[n] for n in rest}
        tail = sorted(units - {0} if not self.a.layout.tied else units)  # the head reads a tied table
        top = _first(outs[-1]).detach().requires_grad_()
        with torch.enable_grad():
            rest |= self._rest(g, t, tail)  # the final norm and head, now as functions of g
            head = self._forward(rest, ids, lambda i, _a, _kw: outs[i] if i < L - 1 else _like(outs[i], top))
            head.backward()
        up = top.grad
        rest.clear()
        outs.clear()
        for i in reversed(range(L)):
            a, kw = kept[i]
            x = _hidden(a, kw).requires_grad_()
            a, kw = _with_hidden(a, kw, x)
            with torch.enable_grad():
                out = torch.func.functional_call(lm.layers[i], self._layer(i, g, t), a, kw)
                torch.autograd.backward(_first(out), up)
            up = x.grad
            kept[i] = ((), {})

        def stop(i: int, args: tuple, kwargs: dict) -> Any:
            raise _Stop(_hidden(args, kwargs))

        with torch.enable_grad():
            try:
                self._forward(self._rest(g, t, sorted(units - {L + 1})), ids, stop)
            except _Stop as s:
                if s.x.requires_grad:  # g moves the tables: their part
                    s.x.backward(up)
            else:
                raise AttnidError("internal: the forward did not reach the first layer")
        return loss

    def value(self, g: GroupElement, ids: torch.Tensor) -> torch.Tensor:
        """The objective on ``ids`` (no gradient)."""
        with torch.no_grad():
            return torch.stack([self._point(g, t, ids, grad=False) for t in self.alphas]).sum()

    def backward(self, g: GroupElement, ids: torch.Tensor) -> float:
        """The objective on ``ids``, its gradient added to the parameters ``g`` was made from."""
        leafy, pairs = _leaves(g)
        total = sum(float(self._point(leafy, t, ids, grad=True)) for t in self.alphas)
        made = [(t, x.grad) for t, x in pairs if x.grad is not None and t.requires_grad]
        if made:
            torch.autograd.backward([t for t, _ in made], [d for _, d in made])
        return total

    def full(self, g: GroupElement, ids: torch.Tensor, batch: int = BATCH) -> float:
        """The objective over every chunk of ``ids``, weighted by chunk (as `PathLoss.full`)."""
        parts = [float(self.value(g, ids[i:i + batch])) * len(ids[i:i + batch])
                 for i in range(0, len(ids), batch)]
        return sum(parts) / len(ids)


def refine_units(a: Any, b: Any, lm: LayerwiseLM, calibration: torch.Tensor, steps: int, *,
                 subgroup: str = "full", permuted_stream: bool = False, parts: Sequence[str] | None = None,
                 alphas: Sequence[float] = (0.5,), lr: float = 1e-2, batch: int = BATCH, seed: int = 0,
                 progress: Progress | None = None) -> Refined:
    """`refine.refine` of the aligned B (``b``'s units) against A (``a``'s), through ``lm`` (A's
    model run a layer at a time; its own tables and head are freed), with neither held whole:
    the same steps, objective and element (``Refined.model`` is None: write B moved by
    ``Refined.element`` a unit at a time). Each unit is moved in float64, or in float32 for
    bfloat16 and float16 checkpoints (`attnid.whole.fit.fitter.compute_dtype`), the gradient's
    graph with it."""
    shape = skeleton(b)
    chosen = choose_parts(shape, subgroup, permuted_stream, parts, steps)
    theta = Parameters(shape, chosen, gl=subgroup == "full")
    lm.drop_rest()  # every forward is handed its tables and head
    loss = UnitPathLoss(lm, a, b, alphas, compute_dtype(b.dtype()))
    return descend(theta, chosen, steps, calibration, alphas=alphas, lr=lr, batch=batch, seed=seed,
                   progress=progress, step=loss.backward,
                   full=lambda g: loss.full(GroupElement() if g is None else g, calibration, batch),
                   moved=lambda g: None)
