"""Refine an alignment for the barrier (docs/theory.md §13.24): with B already aligned onto A
(the permutations matched, `attnid.whole.align.aligner`), choose the continuous part of one
more group element ``g`` to lower the loss of ``(1 - alpha) A + alpha g(B)`` on calibration
tokens, by gradient steps on parameters that keep every iterate in the group:

* ``rotation``: the residual stream ``x -> x Q``, ``Q = (I - S)^{-1} (I + S)`` (Cayley) of a
  skew ``S`` (under LayerNorm ``S = P S0 P`` with ``P`` the centring projector, so ``Q 1 = 1``);
* ``qk``: per key/value group ``M = exp(X)``, ``X`` projected onto the RoPE commutant (an
  algebra: its exponential stays in it and is invertible); skew first for the orthogonal
  variants;
* ``vo``: per key/value group ``C = exp(X)`` (skew ``X`` for the orthogonal variants);
* ``mlp``: per-neuron scales ``exp(x)`` (positive: ReLU's too);
* ``norms``: each absorbable norm's gain per coordinate, ``exp(x)``.

At zero every parameter is the identity. ``g`` is applied by `apply_element`, the group's own
function-preserving transforms, so ``g(B)`` computes B's function for every value of the
parameters; the loss runs through the Hugging Face model of A's class by
`torch.func.functional_call`. The refined element is kept only when it lowers the loss over
all the calibration tokens; else B stays as aligned.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from attnid.errors import AttnidError
from attnid.progress import Progress
from attnid.rope import project_commutant
from attnid.whole.transforms.element import GroupElement, LayerElement, apply_element
from attnid.whole.transforms.norms import foldable
from attnid.whole.transforms.orthogonal import cayley, skew
from attnid.whole.transforms.residual import rotation_refusal
from attnid.whole.transforms.state import ModelTensors

ADAM_EPS = 1e-8  # Adam's eps (torch's default), set in every group (`Parameters.groups`)
REFINABLE = ("rotation", "qk", "vo", "mlp", "norms")  # the continuous parts, in apply order
BATCH = 16  # calibration chunks per step (every chunk, once, when there are fewer)


@dataclass(frozen=True)
class Refined:
    """B moved by the refined element (float64), the element, and how the refinement went."""

    model: ModelTensors | None  # None when B is not held whole (`refine_units`)
    element: GroupElement
    parts: tuple[str, ...]
    steps: int
    alphas: tuple[float, ...]
    loss_before: float  # the objective over every calibration token, B as aligned
    loss_after: float  # the same with the refined element (kept only when lower)
    kept: bool
    seconds: float
    trace: list[float] = field(default_factory=list)  # the objective of each step's batch

    def to_dict(self) -> dict:
        return {"parts": list(self.parts), "steps": self.steps, "alphas": list(self.alphas),
                "loss_before": self.loss_before, "loss_after": self.loss_after, "kept": self.kept,
                "seconds": self.seconds}


def refinable_parts(B: ModelTensors, subgroup: str, permuted_stream: bool) -> tuple[str, ...]:
    """The continuous parts of ``subgroup`` that act on B (the stream rotates only where a
    rotation is a symmetry and the alignment rotated it)."""
    if subgroup in ("none", "permutations"):
        return ()
    lay = B.layout
    parts = []
    final = lay.final if lay.final is not None and f"{lay.final.path}.weight" in B else None
    if (subgroup in ("rotation", "full") and not permuted_stream
            and rotation_refusal(lay, None if final is None else B.gain(final)) is None):
        parts.append("rotation")
    if any(B.spec(i).qk_norm == "none" for i in range(len(lay.layers))):
        parts.append("qk")
    parts.append("vo")
    if subgroup == "full":
        if lay.mlp != "other":
            parts.append("mlp")
        if _norms(B):
            parts.append("norms")
    return tuple(parts)


def _norms(B: ModelTensors) -> list[str]:
    return [nm.path for nm in B.layout.norms if foldable(nm) and f"{nm.path}.weight" in B]


class Parameters(nn.Module):
    """The refinement's free parameters (all zero: the identity) and the element they give."""

    def __init__(self, B: ModelTensors, parts: Sequence[str], gl: bool) -> None:
        super().__init__()
        lay = B.layout
        self.parts, self.gl, self.layer_norm = tuple(parts), gl, lay.norm == "layer"
        self.specs = [B.spec(i) for i in range(len(lay.layers))]
        z = torch.float64
        d = B.tensors[f"{lay.tables[0]}.weight"].shape[-1]
        # the rotation's skew S held as its strict upper triangle (row by row): d (d - 1) / 2
        # numbers, not a [d, d] whose skew part is taken (Adam's two moments with it: at 7B
        # widths 201 MB held instead of 403)
        self.d = d
        self.rotation = nn.Parameter(torch.zeros(d * (d - 1) // 2, dtype=z)) if "rotation" in parts else None
        self.qk = nn.ParameterList(
            [nn.Parameter(torch.zeros(s.n_kv_heads, s.head_dim, s.head_dim, dtype=z))
             for s in self.specs if s.qk_norm == "none"] if "qk" in parts else [])
        self.vo = nn.ParameterList(
            [nn.Parameter(torch.zeros(s.n_kv_heads, s.v_head_dim, s.v_head_dim, dtype=z))
             for s in self.specs] if "vo" in parts else [])
        self.mlp = nn.ParameterList(
            [nn.Parameter(torch.zeros(B.weight(lay.mlps[i][1]).shape[1], dtype=z))
             for i in range(len(self.specs))] if "mlp" in parts else [])
        paths = _norms(B) if "norms" in parts else []
        self.norm_paths = paths
        self.norms = nn.ParameterList([nn.Parameter(torch.zeros(d, dtype=z)) for _ in paths])

    def groups(self) -> list[dict[str, Any]]:
        """Adam's parameter groups: the rotation's triangle with twice Adam's ``eps``. Its
        gradient is twice a full ``[d, d]`` parameter's (each entry of ``S`` is one number, not
        half the difference of two), so with ``2 eps`` Adam's steps are those of the full
        parameter exactly (tested), and the refinement's path is what it was."""
        rest = [p for n, p in self.named_parameters() if n != "rotation"]
        mine = [] if self.rotation is None else [{"params": [self.rotation], "eps": 2 * ADAM_EPS}]
        return mine + ([{"params": rest, "eps": ADAM_EPS}] if rest else [])

    def element(self) -> GroupElement:
        Q = None
        if self.rotation is not None:
            upper = torch.ones(self.d, self.d, dtype=torch.bool).triu_(1)
            U = self.rotation.new_zeros(self.d, self.d).masked_scatter(upper, self.rotation)
            S = U - U.T
            del U, upper
            if self.layer_norm:  # Q 1 = 1: S 1 = 0
                S = S - S.mean(0, keepdim=True) - S.mean(1, keepdim=True) + S.mean()
            Q = cayley(S)
        layers = []
        qk = iter(self.qk)
        for i, s in enumerate(self.specs):
            M = None
            if len(self.qk) and s.qk_norm == "none":
                X = next(qk)
                M = torch.linalg.matrix_exp(project_commutant(X if self.gl else skew(X), s))
            C = None
            if len(self.vo):
                C = torch.linalg.matrix_exp(self.vo[i] if self.gl else skew(self.vo[i]))
            c = torch.exp(self.mlp[i]) if len(self.mlp) else None
            layers.append(LayerElement(qk=M, vo=C, mlp=c))
        gains = {p: torch.exp(x) for p, x in zip(self.norm_paths, self.norms, strict=True)}
        return GroupElement(rotation=Q, gains=gains, layers=tuple(layers))


class PathLoss:
    """The mean next-token loss of ``(1 - alpha) A + alpha B`` over ``alphas``, differentiable
    in B's tensors, through ``model`` (A's Hugging Face class, float32)."""

    def __init__(self, model: nn.Module, A: ModelTensors, alphas: Sequence[float]) -> None:
        lay = A.layout
        tied = f"{lay.unembed.path}.weight" if lay.tied and lay.unembed is not None else None
        self.names = [n for n, t in A.tensors.items() if t.is_floating_point() and n != tied]
        self.model, self.A, self.alphas = model.eval().requires_grad_(False), A, tuple(alphas)
        self.dtype = next(model.parameters()).dtype

    def __call__(self, B: ModelTensors, ids: torch.Tensor) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float64)
        for t in self.alphas:
            params = {n: ((1 - t) * self.A.tensors[n] + t * B.tensors[n]).to(self.dtype) for n in self.names}
            logits = torch.func.functional_call(self.model, params, (), {"input_ids": ids}).logits
            total = total + nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]).double(), ids[:, 1:].reshape(-1))
        return total / len(self.alphas)

    def full(self, B: ModelTensors, ids: torch.Tensor, batch: int = BATCH) -> float:
        """The objective over every chunk of ``ids`` (no gradient), weighted by chunk."""
        with torch.no_grad():
            parts = [float(self(B, ids[i:i + batch])) * len(ids[i:i + batch])
                     for i in range(0, len(ids), batch)]
        return sum(parts) / len(ids)


def choose_parts(B: ModelTensors, subgroup: str, permuted_stream: bool, parts: Sequence[str] | None,
                 steps: int) -> tuple[str, ...]:
    """The parts a refinement of ``steps`` steps moves (``parts``, or every one ``subgroup``
    allows), refused in one line when there are none or one is not allowed."""
    if steps < 1:
        raise AttnidError(f"--refine {steps}: at least one step")
    allowed = refinable_parts(B, subgroup, permuted_stream)
    chosen = allowed if parts is None else tuple(p for p in REFINABLE if p in parts)
    if parts is not None and (bad := sorted(set(parts) - set(allowed))):
        raise AttnidError(f"cannot refine {', '.join(bad)} within subgroup {subgroup} (refinable: "
                          f"{', '.join(allowed) or 'nothing'})")
    if not chosen:
        raise AttnidError(f"--refine: subgroup {subgroup} has no continuous part to refine")
    return chosen


def refine(A: ModelTensors, B: ModelTensors, model: nn.Module, calibration: torch.Tensor, steps: int, *,
           subgroup: str = "full", permuted_stream: bool = False, parts: Sequence[str] | None = None,
           alphas: Sequence[float] = (0.5,), lr: float = 1e-2, batch: int = BATCH, seed: int = 0,
           progress: Progress | None = None) -> Refined:
    """``steps`` Adam steps on the continuous part of ``subgroup`` (or only ``parts``) acting on
    the aligned ``B`` (float64), lowering the mean loss of the path at ``alphas`` on
    ``calibration`` (token ids ``[n, T]``, ``batch`` chunks a step); see the module. Both
    models are held whole: `attnid.whole.align.refine_units` refines checkpoints a unit at a
    time."""
    chosen = choose_parts(B, subgroup, permuted_stream, parts, steps)
    theta = Parameters(B, chosen, gl=subgroup == "full")
    loss = PathLoss(model, A, alphas)

    def step(make: Callable[[], GroupElement], ids: torch.Tensor) -> float:
        g = make()
        value = loss(apply_element(B, g), ids)
        value.backward()
        return float(value)

    r = descend(theta, chosen, steps, calibration, alphas=alphas, lr=lr, batch=batch, seed=seed,
                progress=progress, step=step,
                full=lambda g: loss.full(B if g is None else apply_element(B, g), calibration, batch),
                moved=lambda g: apply_element(B, g))
    return r if r.kept else replace(r, model=B)


def descend(theta: Parameters, chosen: tuple[str, ...], steps: int, calibration: torch.Tensor, *,
            alphas: Sequence[float], lr: float, batch: int, seed: int, progress: Progress | None,
            step: Callable[[Callable[[], GroupElement], torch.Tensor], float],
            full: Callable[[GroupElement | None], float],
            moved: Callable[[GroupElement], ModelTensors | None]) -> Refined:
    """The refinement's steps: ``step(make, ids)`` adds the objective's gradient on ``ids`` to
    ``theta``'s parameters and gives its value (``make()`` makes the element from them, with a
    graph when gradients are on); ``full(g)`` is the
    objective over all of ``calibration`` (None: B as aligned); ``moved(g)`` is B moved by
    ``g``, kept only when that lowers the objective."""
    start = time.perf_counter()
    before = full(None)
    opt = torch.optim.Adam(theta.groups(), lr=lr)
    order = torch.randperm(len(calibration), generator=torch.Generator().manual_seed(seed))
    shown = progress if progress is not None else Progress(enabled=False)
    bar = shown.steps(steps, "refine")
    trace = []
    with warnings.catch_warnings():  # the group's checks read numbers off tensors with gradients
        warnings.filterwarnings("ignore", "Converting a tensor with requires_grad", UserWarning)
        try:
            for k in range(steps):
                n = min(batch, len(order))  # a chunk at most once a step (fewer than a batch: all)
                pick = order[(torch.arange(n) + k * n) % len(order)]
                opt.zero_grad()
                trace.append(step(theta.element, calibration[pick]))
                opt.step()
                bar(k + 1, trace[-1])
        finally:
            bar.close()  # type: ignore[attr-defined]
    opt.zero_grad(set_to_none=True)
    del opt  # its moments and the gradients (3 d (d - 1) / 2 float64 for a rotation) before the last pass
    with torch.no_grad():
        g = theta.element()
        after = full(g)
        kept = after < before
        model = moved(g) if kept else None
    shown.line(f"refined {', '.join(chosen)} in {steps} steps: calibration loss at alpha "
               f"{', '.join(f'{t:g}' for t in alphas)} {before:.4f} -> {after:.4f}"
               + ("" if kept else " (not lower: B kept as aligned)"))
    return Refined(model, g if kept else GroupElement(), chosen, steps, tuple(alphas), before,
                   after, kept, time.perf_counter() - start, trace)
