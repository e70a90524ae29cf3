"""Align B onto A: the group element, applied to B, that brings B's stored tensors closest to
A's (docs/theory.md §13.20). Every step is a function-preserving transform of
`attnid.whole.transforms`, so the result computes B's function exactly; each step fits its
part of the group to A in A's own coordinates, in this order:

1. the residual stream: a rotation (`subgroup` ``rotation`` and ``full``, where it is a symmetry)
   fitted by Procrustes on the gauge-fixed embedding and unembedding rows after B's norm gains
   are moved to A's (a rotation commutes only with a uniform gain); else a permutation,
   matched by linear assignment on the same rows (gains move with it: a symmetry of every
   pre-LN model with a head);
2. heads (within and across key/value groups) and MLP neurons, matched by linear assignment on
   features no continuous gauge changes (`attnid.whole.fit.match`);
3. per key/value group the Q/K gauge (inside the RoPE commutant) and the V/O gauge: orthogonal
   (``orthogonal``, ``rotation``) or invertible (``full``), each fitted on both of its factors
   (`attnid.whole.align.gauges`);
4. ``full`` only: the MLP neuron scales, the norm gains per coordinate, the additive gauges
   (`attnid.whole.align.additive`).

Every part after the stream acts within a unit (the tables; a layer with the norms its readers
read; the head), so B is aligned a unit at a time (`align_sources`, reading both models from
`attnid.whole.fit.source.UnitSource` and handing each aligned unit to an `Output`): the
checkpoint commands stream (`attnid.checkpoint.align`), and `align` runs the same on models in
memory. Each refinement of the stream is one more pass over the units.

`subgroup` selects the variant (a subgroup of the whole-model group) of docs/theory.md §13.20:
``none`` (B as it is), ``permutations`` (stream, heads, neurons), ``orthogonal`` (and
per-kv-group orthogonal Q/K and V/O maps, Zhang et al. style), ``rotation`` (the stream rotated
instead of permuted), ``full`` (the whole group).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Protocol, get_args

import torch
from torch import nn

import attnid.whole.fit.canonical as C
from attnid.adapters.layout import Lin
from attnid.errors import AttnidError, renamed_keyword
from attnid.numerics import sq_distance, sums_of_products
from attnid.whole.align.activations import (
    check_disk,
    check_memory,
    collect_pair,
    head_matching,
    keep_dtype,
)
from attnid.whole.align.additive import fit_additive
from attnid.whole.align.gauges import Kind, pair_fit, scalar_fit
from attnid.whole.align.stream import ROUNDS, Pair, cross, fit_stream, gains_to, permuted, refit
from attnid.whole.fit.canonical import MLP
from attnid.whole.fit.frame import Frame, probes
from attnid.whole.fit.match import FEW, SKETCH, match_heads, match_neurons, nearest_neurons, neurons_within
from attnid.whole.fit.source import SplitSource, UnitSource, read_ahead
from attnid.whole.transforms.element import GroupElement, LayerElement
from attnid.whole.transforms.heads import head_permutation, query_key_transform, value_transform
from attnid.whole.transforms.mlp import mlp_scaling, neuron_permutation
from attnid.whole.transforms.norms import foldable, norm_gain_transfer
from attnid.whole.transforms.permutation import residual_permutation
from attnid.whole.transforms.residual import residual_rotation
from attnid.whole.transforms.state import ModelTensors

# the subgroups of the whole-model symmetry group that `align` may search
Subgroup = Literal["none", "permutations", "orthogonal", "rotation", "full"]
SUBGROUPS: tuple[str, ...] = get_args(Subgroup)
Group = Subgroup  # deprecated alias (one release): the old name of Subgroup
GROUPS = SUBGROUPS  # deprecated alias (one release): the old name of SUBGROUPS
# the parts of the group, in the order they are fitted (each a share in `Alignment.to_dict`)
PARTS = ("stream", "permutations", "qk", "vo", "mlp", "norms", "additive")


@dataclass(frozen=True)
class Alignment:
    """B aligned onto A (``model``: B's function, A's coordinates as far as ``subgroup`` allows),
    the element's parts, and per unit the stored distance to A after each part."""

    model: ModelTensors | None  # None: written unit by unit elsewhere (a checkpoint)
    subgroup: str
    stream: str  # how the residual stream was aligned (or why not)
    element: GroupElement  # rotation, gains, per layer heads/qk/vo/neurons/mlp
    stream_permutation: torch.Tensor | None  # [d]: the stream permuted instead of rotated
    distances: list[dict[str, float]] = field(default_factory=list)  # per unit: "raw", part -> distance

    @property
    def group(self) -> str:
        """The old name of ``subgroup`` (deprecated; goes in the next release)."""
        return self.subgroup

    @property
    def raw_distance(self) -> float:
        return sum(u["raw"] ** 2 for u in self.distances) ** 0.5

    @property
    def aligned_distance(self) -> float:
        return sum(u["aligned"] ** 2 for u in self.distances) ** 0.5

    def to_dict(self) -> dict[str, Any]:
        """The JSON of `attnid align` (without paths): totals, shares, per layer."""
        L = len(self.distances) - 2

        def row(parts: list[dict[str, float]]) -> dict[str, Any]:
            raw2 = sum(p["raw"] ** 2 for p in parts)
            out: dict[str, Any] = {"raw_distance": raw2**0.5,
                                   "aligned_distance": sum(p["aligned"] ** 2 for p in parts) ** 0.5}
            prev = raw2
            shares = {}
            for part in PARTS:
                now = sum(p[part] ** 2 for p in parts)
                shares[part] = 0.0 if raw2 == 0 else (prev - now) / raw2
                prev = now
            out["shares"] = shares
            return out

        layers = [{"layer": i, **row([self.distances[i + 1]])} for i in range(L)]
        return {"subgroup": self.subgroup, "group": self.subgroup,  # "group": deprecated alias key
                "stream": self.stream, **row(self.distances),
                "embeddings": row([self.distances[0]]), "head": row([self.distances[L + 1]]),
                "layers": layers}

    report = to_dict  # deprecated alias (one release): "report" is `attnid report` only


def as_tensors(x: nn.Module | ModelTensors) -> ModelTensors:
    """A model's tensors in float64 (a `ModelTensors` or a Hugging Face module); tensors that
    share storage (a tied table) stay one tensor, so that it is moved and counted once."""
    m = x if isinstance(x, ModelTensors) else ModelTensors.of(x)
    done: dict[tuple, torch.Tensor] = {}

    def f64(v: torch.Tensor) -> torch.Tensor:
        if not v.is_floating_point():
            return v
        key = (v.untyped_storage().data_ptr(), v.storage_offset(), tuple(v.shape), v.stride())
        return done.setdefault(key, v.to(torch.float64))

    return ModelTensors(m.layout, {k: f64(v) for k, v in m.tensors.items()}, m.config)


def check_pair(a: ModelTensors, b: ModelTensors) -> None:
    """Refuse two models that are not of one architecture (layout, tensor names and shapes)."""
    if a.layout != b.layout:
        raise AttnidError("the two models are not the same architecture (their layouts differ)")
    if set(a.tensors) != set(b.tensors):
        extra = sorted(set(a.tensors) ^ set(b.tensors))[:3]
        raise AttnidError(f"the two models hold different tensors (e.g. {', '.join(extra)})")
    for n, t in a.tensors.items():
        if tuple(t.shape) != tuple(b.tensors[n].shape):
            raise AttnidError(f"{n} has shape {list(t.shape)} in A but {list(b.tensors[n].shape)} in B")


def _floating(m: ModelTensors, own: list[str]) -> Iterator[str]:
    """A unit's own floating tensors, one storage once."""
    seen: set[tuple[int, tuple[int, ...]]] = set()
    for n in own:
        t = m.tensors[n]
        key = (t.data_ptr(), tuple(t.shape))
        if t.is_floating_point() and key not in seen:
            seen.add(key)
            yield n


def unit_distance(a: ModelTensors, b: ModelTensors, own: list[str],
                  memo: dict[str, tuple[weakref.ref, float]] | None = None) -> float:
    """``||B - A||`` over a unit's own floating tensors (one storage once), a chunk at a time
    (`attnid.numerics.sq_distance`: no full-size difference of a table is made). ``memo``: each
    tensor's last squared distance, reused while B's tensor is the same object (a transform
    returns the tensors it leaves as they were); held by a weak reference, so that a tensor a
    transform replaced is freed (a 7B layer's float32 copy is 0.8 GB)."""
    memo = {} if memo is None else memo
    total = 0.0
    for n in _floating(a, own):
        t = b.tensors[n]
        if n not in memo or memo[n][0]() is not t:
            memo[n] = (weakref.ref(t), sq_distance(a.tensors[n], t))
        total += memo[n][1]
    return total**0.5


def unit_norm(a: ModelTensors, own: list[str]) -> float:
    """``||A||`` over a unit's own floating tensors (one storage once), as a scale: each norm in
    float32 at least (about 1e-4 relative for a 7B table: a threshold needs no better)."""
    wide = (torch.float32, torch.float64)
    return sum(float(torch.linalg.vector_norm(t if t.dtype in wide else t.float())) ** 2
               for t in (a.tensors[n] for n in _floating(a, own))) ** 0.5


# ---- 2. heads and neurons --------------------------------------------------------------------------
def _frame(m: ModelTensors, i: int) -> Frame:
    """The frame heads and neurons are matched in, in the dtype the layer is held in (float32
    for a bfloat16 checkpoint): the stored one, or, for a stream wider than ``SKETCH``, one seen
    through ``SKETCH`` random directions (the same for both models, whose streams are already
    aligned), so that no gain-folded copy of a 7B layer's weights and no ``[H, d, SKETCH]``
    product is ever formed (`attnid.whole.fit.match`: the costs sketch those widths anyway)."""
    dtype = m.weight(m.layout.mlps[i][1]).dtype
    d = m.spec(i).d_model
    return Frame(probes(d, SKETCH, dtype) if d > SKETCH else None, None, dtype)


def _heads(a: ModelTensors, b: ModelTensors, i: int) -> torch.Tensor:
    """Layer ``i``'s heads matched on their gauge-fixed weights (the norm folded in)."""
    wa, wb = (C.attention(m, i, _frame(m, i), {})[0].w for m in (a, b))
    return match_heads(wa, wb)


def _own_rows(m: ModelTensors, lin: Lin) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A linear map's weight and bias as stored, a fused map's own rows only (a view)."""
    W, c = m.weight(lin), m.bias(lin)
    if lin.rows is None:
        return W, c
    r = slice(*lin.rows)
    return W[r], None if c is None else c[r]


def _stored_mlp(m: ModelTensors, i: int) -> MLP:
    """Layer ``i``'s MLP as stored, a row per neuron (no gain folded, no probes): what a
    checkpoint's rounding acts on."""
    lay = m.layout
    up, down = lay.mlps[i]
    (U, cu), (G, cg) = _own_rows(m, up), _own_rows(m, lay.gates[i]) if lay.gates else (None, None)
    return MLP(U, m.weight(down).T, G, cu, cg, lay.mlp, {})


def _neurons(a: ModelTensors, b: ModelTensors, i: int, tol: float = 0.0) -> tuple[torch.Tensor, ModelTensors]:
    """Layer ``i``'s MLP neurons matched (the attention's copies let go first: a 7B layer), and
    B with them permuted. With ``tol`` > 0, first each neuron's nearest in direction through a
    few probes (`match.nearest_neurons`), kept when B so permuted has every neuron within
    ``tol`` of A's as stored (`match.neurons_within`): a rewrite's matching, without the
    ``[f, f]`` costs of `match_neurons`."""
    if tol > 0:
        near = nearest_neurons(C.mlp(a, i, _frame(a, i), rows=FEW), C.mlp(b, i, _frame(b, i), rows=FEW))
        if near is not None:
            moved = neuron_permutation(b, i, near)
            if neurons_within(_stored_mlp(a, i), _stored_mlp(moved, i), tol):
                return near, moved
            del moved
    perm = match_neurons(C.mlp(a, i, _frame(a, i), rows=SKETCH), C.mlp(b, i, _frame(b, i), rows=SKETCH))
    return perm, neuron_permutation(b, i, perm)


def fit_permutations(a: ModelTensors, b: ModelTensors, i: int, acts: Pair | None = None, tol: float = 0.0
                     ) -> tuple[ModelTensors, torch.Tensor, torch.Tensor]:
    """Layer ``i``'s heads and neurons matched (on gauge-invariant weight features, or on the
    activations ``acts`` of A and of B, B's heads' writes made from its output projection as
    it is now: in A's stream coordinates), and B with both permuted; ``tol``: a storage
    rounding within which a rewrite's neurons are matched on a few probes (`_neurons`)."""
    if acts is None:
        heads = _heads(a, b, i)
        neurons, b = _neurons(a, head_permutation(b, i, heads), i, tol)  # (heads leave the MLP as it is)
        return b, heads, neurons
    heads = head_matching(acts, i, b.spec(i).n_kv_heads, a.attention(i).W_O, b.attention(i).W_O)
    neurons = acts.neurons[i]  # matched once, as the activations were collected (`collect_pair`)
    return neuron_permutation(head_permutation(b, i, heads), i, neurons), heads, neurons


# ---- 3. attention gauges ---------------------------------------------------------------------------
def _rows_with(W: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return W if bias is None else torch.cat([W, bias.unsqueeze(-2)], -2)


def _qk_pairs(m: ModelTensors, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    w = m.attention(i)
    s = w.spec
    G, mm = s.n_kv_heads, s.kv_group_size
    X = _rows_with(w.W_Q, w.b_Q).reshape(G, -1, s.head_dim)  # [G, m (d + 1), dk]: a kv group's queries
    Y = _rows_with(w.W_K, w.b_K)  # [G, d (+1), dk]
    assert X.shape[1] % mm == 0
    return X, Y


def _vo_pairs(m: ModelTensors, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    w = m.attention(i)
    s = w.spec
    X = _rows_with(w.W_V, w.b_V)  # [G, d (+1), dv]
    Y = w.W_O.reshape(s.n_kv_heads, s.kv_group_size, s.v_head_dim, -1).transpose(-1, -2).reshape(
        s.n_kv_heads, -1, s.v_head_dim)  # [G, m d, dv]: W_O^T, C^{-1} W_O = (W_O^T C^{-T})^T
    return X, Y


def fit_query_key(a: ModelTensors, b: ModelTensors, i: int, kind: Kind, rounding: float = 0.0
                  ) -> tuple[ModelTensors, torch.Tensor | None]:
    """B after layer ``i``'s Q/K gauge, and the gauge ``M`` (None under a Q/K norm, which
    leaves none); ``rounding``: `gauges.pair_fit`'s."""
    spec = b.spec(i)
    if spec.qk_norm != "none":
        return b, None
    (XA, YA), (XB, YB) = _qk_pairs(a, i), _qk_pairs(b, i)
    M = pair_fit(XB, XA, YB, YA, kind, spec, rounding=rounding)
    return (b if _identity(M) else query_key_transform(b, i, M)), M


def fit_value_output(a: ModelTensors, b: ModelTensors, i: int, kind: Kind, rounding: float = 0.0
                     ) -> tuple[ModelTensors, torch.Tensor]:
    """B after layer ``i``'s V/O gauge, and the gauge ``C``; ``rounding``: `gauges.pair_fit`'s."""
    (XA, YA), (XB, YB) = _vo_pairs(a, i), _vo_pairs(b, i)
    Cv = pair_fit(XB, XA, YB, YA, kind, rounding=rounding)
    return (b if _identity(Cv) else value_transform(b, i, Cv)), Cv


def _identity(M: torch.Tensor) -> bool:
    """Whether ``M [G, k, k]`` is the identity exactly (a transform by it would only copy)."""
    return torch.equal(M, torch.eye(M.shape[-1], dtype=M.dtype).expand_as(M))


# ---- 4. MLP scales and norm gains ------------------------------------------------------------------
def _up(m: ModelTensors, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's scaled side per neuron ``[f, n]`` (up rows, bias) and its down columns ``[f, d]``."""
    up, down = m.layout.mlps[i]
    W, c = _own_rows(m, up)
    X = W if c is None else torch.cat([W, c[:, None]], 1)
    return X, m.weight(down).T


def _sums(XA: torch.Tensor, XB: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(|x_B|^2, <x_B, x_A>)`` of ``X [n, p]`` over ``dim`` (0: per column ``[p]``, 1: per row
    ``[n]``), in blocks (`attnid.numerics.sums_of_products`: no full-size product of a 7B
    layer's weights; 2,048-row blocks took 3 to 4 times as long)."""
    return sums_of_products(XB, XB, dim), sums_of_products(XB, XA, dim)


def fit_mlp(a: ModelTensors, b: ModelTensors, i: int) -> tuple[ModelTensors, torch.Tensor]:
    """B after layer ``i``'s MLP neuron scales, and the scales ``c [f]``: all ones when every
    scale is 1 to the arithmetic's own rounding (as `fit_norms`: the transform would only copy
    the layer's MLP, 0.5 GB at 7B widths in float32)."""
    (XA, YA), (XB, YB) = _up(a, i), _up(b, i)
    c = scalar_fit(*_sums(XA, XB, 1), *_sums(YA, YB, 1), positive=b.layout.mlp == "relu")
    if _ones(c, XB.dtype):
        return b, torch.ones_like(c)
    return mlp_scaling(b, i, c), c


def _ones(s: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether every scale of ``s`` is 1 to the rounding of arithmetic in ``dtype`` (a transform
    by them would only copy what it scales)."""
    return bool(((s - 1).abs() <= torch.finfo(dtype).eps).all())


def fit_norms(a: ModelTensors, b: ModelTensors) -> tuple[ModelTensors, dict[str, torch.Tensor]]:
    """Each absorbable norm's gain per coordinate: ``(s g, s b)`` against the readers' columns ``/ s``."""
    out = {}
    for nm in b.layout.norms:
        if not foldable(nm) or f"{nm.path}.weight" not in b:
            continue
        readers = list({r.path: r for r in nm.readers if b.has(r)}.values())

        def gains(m: ModelTensors, nm=nm) -> torch.Tensor:
            return torch.stack([m.gain(nm)] + ([] if m.norm_bias(nm) is None else [m.norm_bias(nm)]), 1)

        col = [_sums(a.weight(r), b.weight(r), 0) for r in readers]  # per stream coordinate [d]
        s = scalar_fit(*_sums(gains(a), gains(b), 1), sum(x[0] for x in col), sum(x[1] for x in col))
        if _ones(s, b.gain(nm).dtype):  # the transfer would only copy the readers
            s = torch.ones_like(s)
        else:
            b = norm_gain_transfer(b, nm.path, s)
        out[nm.path] = s
    return b, out


# ---- one unit ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Plan:
    """How B's stream moves before the per-unit stages: a rotation ``Q`` (B's gains moved to A's
    first) or a permutation ``perm`` (B's gains moved to A's after it when ``moved``)."""

    subgroup: str
    Q: torch.Tensor | None = None
    perm: torch.Tensor | None = None
    moved: bool = False
    acts: Pair | None = None
    _rotates: dict[torch.dtype, bool] = field(default_factory=dict, compare=False, repr=False)

    def rotates(self, dtype: torch.dtype) -> bool:
        """`stream_rotated` for a unit held in ``dtype``, decided once (``||Q - I||`` of a
        ``[4096, 4096]`` rotation: 0.17 s a unit at 7B widths)."""
        if dtype not in self._rotates:
            self._rotates[dtype] = stream_rotated(self.Q, dtype)
        return self._rotates[dtype]


@dataclass(frozen=True)
class UnitAligned:
    """One unit of B aligned onto A's: the tensors (extras included), its layer's parts, the
    norm gains it moved, the distance to A after each part, and the stream cross product."""

    model: ModelTensors | None  # None: kept only as the report's numbers
    layer: dict[str, torch.Tensor]
    gains: dict[str, torch.Tensor]
    distances: dict[str, float]
    cross: torch.Tensor | None
    scale: float = 0.0  # ||A|| over the unit's own tensors


def align_unit(a: ModelTensors, b: ModelTensors | Callable[[], ModelTensors], unit: int,
               own: list[str], plan: Plan, with_cross: bool = False, rounding: float = 0.0
               ) -> UnitAligned:
    """Unit ``unit`` of B (its ``own`` tensors and the extras it reads) aligned onto A's by
    ``plan`` and then every later part of the group (each acts within a unit, so a whole model
    is aligned unit by unit; docs/theory.md §13.20). ``rounding``: B's storage rounding
    (``eps / 2``; 0: none), within which a gauge fit is not refined. ``with_cross``: also the
    stream cross product, unless the aligned unit is within ``rounding`` of ``||A||`` over it.
    ``b`` may be a function that loads the unit: then no caller holds B's tensors as they were,
    and each stage's input is freed once the next is made (a 7B layer's float32 copy is 0.8 GB)."""
    b = b() if callable(b) else b
    lay, subgroup = b.layout, plan.subgroup
    memo: dict[str, tuple[weakref.ref, float]] = {}
    dist: dict[str, float] = {"raw": unit_distance(a, b, own, memo)}

    def stage(name: str, m: ModelTensors) -> None:
        dist[name] = unit_distance(a, m, own, memo)

    mine = set(own)
    gains: dict[str, torch.Tensor] = {}
    if subgroup == "full" or plan.Q is not None:  # B's gains as they were (B itself is let go below)
        gains = {nm.path: a.gain(nm) / permuted(b.gain(nm), plan.perm)
                 for nm in lay.norms if foldable(nm) and f"{nm.path}.weight" in mine}
    if subgroup != "none":
        if plan.Q is not None:
            b = gains_to(a, b)
            b = residual_rotation(b, plan.Q) if plan.rotates(_dtype(b)) else b
        else:
            b = b if plan.perm is None else residual_permutation(b, plan.perm)
            b = gains_to(a, b) if plan.moved else b
    stage("stream", b)
    i = unit - 1
    layer: dict[str, torch.Tensor] = {}
    in_layer = 0 <= i < len(lay.layers) and subgroup != "none"
    if in_layer:
        b, layer["heads"], layer["neurons"] = fit_permutations(a, b, i, plan.acts, 2 * rounding)
    stage("permutations", b)
    if in_layer and subgroup != "permutations":
        kind: Kind = "gl" if subgroup == "full" else "orthogonal"
        b, M = fit_query_key(a, b, i, kind, rounding)
        stage("qk", b)
        b, Cv = fit_value_output(a, b, i, kind, rounding)
        layer |= {k: v for k, v in (("qk", M), ("vo", Cv)) if v is not None}
    else:
        stage("qk", b)
    stage("vo", b)
    if in_layer and subgroup == "full" and lay.mlp != "other":
        b, layer["mlp"] = fit_mlp(a, b, i)
    stage("mlp", b)
    if subgroup == "full":
        b, refined = fit_norms(a, b)
        refined = {p: s for p, s in refined.items() if f"{p}.weight" in mine}
        gains = {p: gains.get(p, torch.ones_like(s)) * s for p, s in refined.items()} if refined else gains
    stage("norms", b)
    if subgroup == "full":
        b = fit_additive(a, b, with_tables=unit == 0)
    stage("additive", b)
    dist["aligned"] = dist["additive"]
    scale = unit_norm(a, own)
    M = None
    if with_cross and dist["aligned"] > rounding * scale:
        M = cross(_own(a, mine), _own(b, mine))
    return UnitAligned(b, layer, gains, dist, M, scale)


def check_rounds(rounds: int) -> None:
    """Refuse a number of refinement rounds that is not a whole number >= 0."""
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 0:
        raise AttnidError(f"--rounds {rounds}: a whole number of refinement rounds, 0 or more")


def _within(Q: torch.Tensor, eps: float) -> bool:
    """``||Q - I||_F <= eps``: then ``x Q`` is ``x`` to ``eps ||x||`` for every row ``x`` (the
    rotation is skipped: it would move nothing beyond that rounding)."""
    return float(torch.linalg.matrix_norm(Q - torch.eye(Q.shape[0], dtype=Q.dtype))) <= eps


def _dtype(m: ModelTensors) -> torch.dtype:
    """The widest floating dtype ``m`` is held in."""
    held = (t.dtype for t in m.tensors.values() if t.is_floating_point())
    return min(held, key=lambda t: torch.finfo(t).eps, default=torch.float64)


def stream_rotated(Q: torch.Tensor | None, dtype: torch.dtype) -> bool:
    """Whether a unit held in ``dtype`` is rotated by the stream rotation ``Q``: not when
    ``||Q - I||_F <= eps`` (`_within`: it would move no number by more than ``dtype``'s own
    rounding)."""
    return Q is not None and not _within(Q, torch.finfo(dtype).eps)


def _own(m: ModelTensors, names: set[str]) -> ModelTensors:
    return ModelTensors(m.layout, {n: t for n, t in m.tensors.items() if n in names}, m.config)


# ---- the whole, unit by unit ----------------------------------------------------------------------------
class Output(Protocol):
    """Where a pass puts B's aligned units: ``run(compute)`` asks ``compute(u)`` for each unit
    (in any order, each once) and returns a handle on what it kept; ``drop`` lets one go."""

    def run(self, compute: Callable[[int], UnitAligned]) -> Any: ...

    def drop(self, handle: Any) -> None: ...


class Kept:
    """The in-memory `Output`: every unit's aligned tensors, by unit."""

    def __init__(self, count: int) -> None:
        self.count = count

    def run(self, compute: Callable[[int], UnitAligned]) -> dict[int, ModelTensors]:
        return {u: compute(u).model for u in range(self.count)}  # type: ignore[misc]

    def drop(self, handle: Any) -> None:
        pass


@dataclass(frozen=True)
class _Pass:
    plan: Plan
    handle: Any
    units: dict[int, UnitAligned]
    cross: torch.Tensor | None  # [d, d]: X_B^T X_A over every unit's stream-side pieces
    uncrossed: tuple[int, ...] = ()  # units left out of cross (within rounding of A's)

    @property
    def total(self) -> float:
        return sum(r.distances["aligned"] ** 2 for r in self.units.values())

    def full_cross(self, a: UnitSource, dtype: torch.dtype | None) -> torch.Tensor:
        """The stream cross product over every unit: a unit already within ``eps / 2`` of A's
        (`align_unit`'s ``rounding``: its stored numbers are A's up to rounding) was given
        none, and adds A's own ``X_A^T X_A``, its cross product up to that rounding, made now
        that a round is tried (A's unit read again) and never in a pass that ends at rounding."""
        M = self.cross
        for u in self.uncrossed:
            m = _own(a.load(u, dtype), set(a.names(u)))
            c = cross(m, m)
            if c is not None:
                M = c if M is None else M + c
        return M  # type: ignore[return-value]

    def at_rounding(self, eps: float) -> bool:
        """The total distance at most ``eps / 2`` of ``||A||`` (``eps`` of B's storage dtype):
        about what rounding both models to that dtype leaves of one model (a round-to-nearest
        error is uniform within half a unit in the last place, which is between ``eps / 2`` and
        ``eps`` of the number: RMS between ``0.14 eps`` and ``0.29 eps`` a side, up to ``0.41
        eps`` for two). Below it no refinement can show in what is written."""
        return self.total <= (eps / 2) ** 2 * sum(r.scale**2 for r in self.units.values())


def align_sources(a: UnitSource, b: UnitSource, out: Output, *, subgroup: Subgroup = "full",
                  acts: Pair | None = None, dtype: torch.dtype | None = None,
                  progress: Callable[[str], None] | None = None, rounds: int = ROUNDS
                  ) -> tuple[Alignment, Any]:
    """B aligned onto A within ``subgroup``, reading both one unit at a time (floating tensors in
    ``dtype``; None: as held): the stream fitted on the tables' rows (or ``acts``), then passes
    over every unit, each writing B's aligned units to ``out``, while refining the stream lowers
    the total distance, for at most ``rounds`` rounds (each one more pass; 0: none).
    ``(alignment, out's handle on the kept pass)``."""
    check_rounds(rounds)
    say = progress or (lambda _: None)
    lay = b.layout
    L = len(lay.layers)
    plan, how = Plan(subgroup, acts=acts), "not aligned (subgroup none)"
    if subgroup != "none":
        Q, perm, how = fit_stream(a, b, rotate=subgroup in ("rotation", "full"), acts=acts)
        plan = Plan(subgroup, Q, perm, subgroup == "full" and Q is None, acts)
        say("stream fitted")  # how: in the result (`Alignment.stream`), said once by its reader
    moves = plan.Q is not None or plan.perm is not None
    eps = torch.finfo(b.dtype()).eps  # B's storage rounding

    def run(p: Plan) -> _Pass:
        done: dict[int, UnitAligned] = {}
        summed: list[torch.Tensor] = []  # the stream cross product, summed as units come
        uncrossed: list[int] = []

        def compute(u: int) -> UnitAligned:
            read_ahead((a,), u + 1, u + 2)  # A's next units, read while this one computes (B's: the output)
            r = align_unit(a.load(u, dtype), lambda: b.load(u, dtype), u, b.names(u), p, with_cross=moves,
                           rounding=eps / 2)
            if r.cross is not None:  # summed in place (the first unit's own, which nothing else reads)
                summed[:] = [r.cross if not summed else summed[0].add_(r.cross)]
            elif moves:
                uncrossed.append(u)
            done[u] = replace(r, model=None, cross=None)  # the tensors go to the output only
            say(f"unit {u} of {L + 1} aligned")
            return r

        handle = out.run(compute)
        for u in range(b.count):  # a unit the output never asked for (it holds nothing)
            if u not in done:
                compute(u)
        return _Pass(p, handle, done, summed[0] if summed else None, tuple(uncrossed))

    best = run(plan)
    kept = 0  # rounds that lowered the distance
    for _ in range(rounds if moves else 0):
        if best.at_rounding(eps):
            break
        r = refit(best.full_cross(a, dtype), best.plan.Q is not None, lay.norm == "layer")
        best = replace(best, cross=None)  # [d, d] float64: not held through the next pass
        if best.plan.Q is not None:
            if _within(r, 0.5 * eps):  # it moves no stored number by a rounding
                break
            cand = replace(best.plan, Q=best.plan.Q @ r)
        elif torch.equal(r, torch.arange(r.numel())):
            break
        else:
            cand = replace(best.plan, perm=best.plan.perm[r])
        del r  # nor the refit (at 7B widths the two were 256 MB of a pass's 3.8 GiB peak)
        nxt = run(cand)
        say(f"stream refinement round {kept + 1}: distance {nxt.total**0.5:.6g} "
            f"(was {best.total**0.5:.6g})")
        if not nxt.total < best.total * (1 - 1e-9):
            out.drop(nxt.handle)
            break
        out.drop(best.handle)
        best, kept = nxt, kept + 1
    how += f"; refined on every stream-side weight ({kept} rounds)" if kept else ""
    say("heads, neurons and gauges fitted")
    units = [best.units[u] for u in range(b.count)]
    gains = {p: g for r in units for p, g in r.gains.items()}
    element = GroupElement(rotation=best.plan.Q, gains=gains,
                           layers=tuple(LayerElement(**units[i + 1].layer) for i in range(L)))
    al = Alignment(None, subgroup, how, element, best.plan.perm, [r.distances for r in units])
    return al, best.handle


def align(a: nn.Module | ModelTensors, b: nn.Module | ModelTensors, *, subgroup: Subgroup = "full",
          calibration: torch.Tensor | None = None, progress: Callable[[str], None] | None = None,
          group: Subgroup | None = None, rounds: int = ROUNDS) -> Alignment:
    """B aligned onto A within ``subgroup`` (see the module); float64 throughout. With
    ``calibration`` (token ids ``[n, T]``) the stream, heads and neurons are matched on both
    models' activations (`attnid.whole.align.activations`) instead of on the weights.
    ``rounds``: at most this many refinements of the stream (each one more pass over the units).
    ``group``: the old name of ``subgroup`` (deprecated)."""
    check_rounds(rounds)
    subgroup = renamed_keyword("group", "subgroup", group, subgroup)
    if subgroup not in SUBGROUPS:
        raise AttnidError(f"unknown subgroup {subgroup!r}: one of {', '.join(SUBGROUPS)}")
    A, B = as_tensors(a), as_tensors(b)
    check_pair(A, B)
    acts = activations(A, B, subgroup, calibration, progress)
    sb = SplitSource(B)
    al, kept = align_sources(SplitSource(A), sb, Kept(sb.count), subgroup=subgroup, acts=acts,
                             progress=progress, rounds=rounds)
    out = dict(B.tensors)
    for u, m in kept.items():
        out.update({n: m.tensors[n] for n in sb.names(u)})
    lay = B.layout
    if lay.tied and lay.unembed is not None and f"{lay.unembed.path}.weight" in out:
        out[f"{lay.unembed.path}.weight"] = out[f"{lay.tables[0]}.weight"]  # the tied head is its table
    return replace(al, model=ModelTensors(B.layout, out, B.config))


def activations(A: Any, B: Any, subgroup: str, calibration: torch.Tensor | None,
                progress: Callable[[str], None] | None = None) -> Pair | None:
    """Both models' activations on the calibration tokens (None without them, or for ``none``);
    each model a `ModelTensors` or a checkpoint's units, run a layer at a time either way."""
    if subgroup == "none" or calibration is None:
        return None
    spill = not isinstance(B, ModelTensors)  # a checkpoint's: each layer's head sums kept in a file
    check_memory(B, calibration, spill)  # in B's compute dtype, as it is collected
    if spill:
        check_disk(B, calibration)
    acts = collect_pair(A, B, calibration, dtype=keep_dtype(B), signed=B.layout.mlp != "gated", spill=spill)
    (progress or (lambda _: None))(f"activations collected on {calibration.numel()} calibration tokens, "
                                   "neurons matched")
    return acts
