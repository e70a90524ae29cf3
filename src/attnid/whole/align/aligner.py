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

`subgroup` selects the variant (a subgroup of the whole-model group) of docs/theory.md §13.20:
``none`` (B as it is), ``permutations`` (stream, heads, neurons), ``orthogonal`` (and
per-kv-group orthogonal Q/K and V/O maps, Zhang et al. style), ``rotation`` (the stream rotated
instead of permuted), ``full`` (the whole group).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import torch
from torch import nn

import attnid.whole.fit.canonical as C
from attnid.errors import AttnidError, renamed_keyword
from attnid.whole.align.activations import (
    check_memory,
    collect,
    head_matching,
    neuron_matching,
)
from attnid.whole.align.additive import fit_additive
from attnid.whole.align.gauges import Kind, pair_fit, scalar_fit
from attnid.whole.align.stream import Pair, fit_stream, gains_to, permuted, refine_stream
from attnid.whole.fit.frame import Frame
from attnid.whole.fit.match import match_heads, match_neurons
from attnid.whole.fit.source import assign_units
from attnid.whole.transforms.element import GroupElement, LayerElement
from attnid.whole.transforms.heads import head_permutation, query_key_transform, value_transform
from attnid.whole.transforms.mlp import mlp_scaling, neuron_permutation
from attnid.whole.transforms.norms import foldable, norm_gain_transfer
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
    """B aligned onto A (``model``: B's function, A's coordinates as far as ``subgroup``
    allows), the element's parts, and per unit the stored distance to A after each part."""

    model: ModelTensors
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


def unit_distances(a: ModelTensors, b: ModelTensors, unit_of: dict[str, int], count: int) -> list[float]:
    """Per unit ``||B - A||`` over the stored floating tensors (a tied table once)."""
    sq = [0.0] * count
    seen: set[tuple[int, tuple[int, ...]]] = set()
    for n, t in a.tensors.items():
        key = (t.data_ptr(), tuple(t.shape))
        if not t.is_floating_point() or key in seen or n not in unit_of:
            continue
        seen.add(key)
        sq[unit_of[n]] += float(((t - b.tensors[n]) ** 2).sum())
    return [x**0.5 for x in sq]


# ---- 2. heads and neurons --------------------------------------------------------------------------
def _sections(m: ModelTensors, i: int) -> tuple[C.Attention, C.MLP]:
    secs = C.layer_unit(m, i, Frame(None, None, torch.float64), {}).sections
    att = next(s for s in secs if isinstance(s, C.Attention))
    mlp = next(s for s in secs if isinstance(s, C.MLP))
    return att, mlp


def fit_permutations(a: ModelTensors, b: ModelTensors, i: int, acts: Pair | None = None,
                     Q: torch.Tensor | None = None, perm: torch.Tensor | None = None
                     ) -> tuple[ModelTensors, torch.Tensor, torch.Tensor]:
    """Layer ``i``'s heads and neurons matched (on gauge-invariant weight features, or on the
    activations ``acts`` of A and of B before its stream moved by ``Q`` or ``perm``)."""
    if acts is None:
        (att_a, mlp_a), (att_b, mlp_b) = _sections(a, i), _sections(b, i)
        heads, neurons = match_heads(att_a.w, att_b.w), match_neurons(mlp_a, mlp_b)
    else:
        heads = head_matching(*acts, i, b.spec(i).n_kv_heads, Q, perm)
        neurons = neuron_matching(*acts, i, signed=b.layout.mlp != "gated")
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


def fit_attention(a: ModelTensors, b: ModelTensors, i: int, kind: Kind
                  ) -> tuple[ModelTensors, torch.Tensor | None, torch.Tensor]:
    """B after layer ``i``'s Q/K and V/O gauges, and the gauges ``(M, C)``."""
    spec = b.spec(i)
    M = None
    if spec.qk_norm == "none":
        (XA, YA), (XB, YB) = _qk_pairs(a, i), _qk_pairs(b, i)
        M = pair_fit(XB, XA, YB, YA, kind, spec)
        b = query_key_transform(b, i, M)
    (XA, YA), (XB, YB) = _vo_pairs(a, i), _vo_pairs(b, i)
    Cv = pair_fit(XB, XA, YB, YA, kind)
    return value_transform(b, i, Cv), M, Cv


# ---- 4. MLP scales and norm gains ------------------------------------------------------------------
def _up(m: ModelTensors, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's scaled side per neuron ``[f, n]`` (up rows, bias) and its down columns ``[f, d]``."""
    up, down = m.layout.mlps[i]
    W = m.weight(up)
    c = m.bias(up)
    if up.rows is not None:
        W, c = W[up.rows[0]:up.rows[1]], None if c is None else c[up.rows[0]:up.rows[1]]
    X = W if c is None else torch.cat([W, c[:, None]], 1)
    return X, m.weight(down).T


def fit_mlp(a: ModelTensors, b: ModelTensors, i: int) -> tuple[ModelTensors, torch.Tensor]:
    (XA, YA), (XB, YB) = _up(a, i), _up(b, i)
    c = scalar_fit((XB**2).sum(1), (XB * XA).sum(1), (YB**2).sum(1), (YB * YA).sum(1),
                   positive=b.layout.mlp == "relu")
    return mlp_scaling(b, i, c), c


def fit_norms(a: ModelTensors, b: ModelTensors) -> tuple[ModelTensors, dict[str, torch.Tensor]]:
    """Each absorbable norm's gain per coordinate: ``(s g, s b)`` against the readers' columns ``/ s``."""
    out = {}
    for nm in b.layout.norms:
        if not foldable(nm) or f"{nm.path}.weight" not in b:
            continue
        readers = {r.path: r for r in nm.readers if b.has(r)}.values()

        def sides(m: ModelTensors, nm=nm, readers=readers) -> tuple[torch.Tensor, torch.Tensor]:
            x = [m.gain(nm)] + ([] if m.norm_bias(nm) is None else [m.norm_bias(nm)])
            return torch.stack(x, 1), torch.cat([m.weight(r).T for r in readers], 1)  # [d, 1|2], [d, n]

        (XA, YA), (XB, YB) = sides(a), sides(b)
        s = scalar_fit((XB**2).sum(1), (XB * XA).sum(1), (YB**2).sum(1), (YB * YA).sum(1))
        b = norm_gain_transfer(b, nm.path, s)
        out[nm.path] = s
    return b, out


# ---- the whole ---------------------------------------------------------------------------------------
def align(a: nn.Module | ModelTensors, b: nn.Module | ModelTensors, *, subgroup: Subgroup = "full",
          calibration: torch.Tensor | None = None, progress: Callable[[str], None] | None = None,
          group: Subgroup | None = None) -> Alignment:
    """B aligned onto A within ``subgroup`` (see the module); float64 throughout. With
    ``calibration`` (token ids ``[n, T]``) the stream, heads and neurons are matched on both
    models' activations (`attnid.whole.align.activations`) instead of on the weights.
    ``group``: the old name of ``subgroup`` (deprecated)."""
    subgroup = renamed_keyword("group", "subgroup", group, subgroup)
    if subgroup not in SUBGROUPS:
        raise AttnidError(f"unknown subgroup {subgroup!r}: one of {', '.join(SUBGROUPS)}")
    A, B = as_tensors(a), as_tensors(b)
    check_pair(A, B)
    say = progress or (lambda _: None)
    lay = A.layout
    L = len(lay.layers)
    unit_of = assign_units(lay, A.tensors)
    count = L + 2
    dist: dict[str, list[float]] = {"raw": unit_distances(A, B, unit_of, count)}

    def stage(name: str, m: ModelTensors) -> None:
        dist[name] = unit_distances(A, m, unit_of, count)

    gains: dict[str, torch.Tensor] = {}
    Q = perm = None
    how = "not aligned (subgroup none)"
    acts = None
    if subgroup != "none" and calibration is not None:
        check_memory(A, calibration.numel())
        acts = (collect(A, calibration), collect(B, calibration))
        say(f"activations collected on {calibration.numel()} calibration tokens")
    if subgroup != "none":
        before = B
        B, Q, perm, how = fit_stream(A, B, rotate=subgroup in ("rotation", "full"), acts=acts)
        moved = subgroup == "full" and Q is None  # a permuted stream: the gauges are fitted with A's gains

        def rest(m: ModelTensors, q: torch.Tensor | None, p: torch.Tensor | None) -> ModelTensors:
            return _fit_layers(A, gains_to(A, m) if moved else m, subgroup, acts, q, p)[0]

        if Q is not None or perm is not None:
            B, Q, perm, rounds = refine_stream(A, B, Q, perm, rest)
            how += f"; refined on every stream-side weight ({rounds} rounds)" if rounds else ""
        B = gains_to(A, B) if moved else B
        if subgroup == "full" or Q is not None:
            gains = {nm.path: A.gain(nm) / permuted(before.gain(nm), perm)
                     for nm in lay.norms if foldable(nm) and f"{nm.path}.weight" in B}
        say("stream fitted")  # how: in the result (`Alignment.stream`), said once by its reader
    stage("stream", B)
    B, layers, refined = _fit_layers(A, B, subgroup, acts, Q, perm, stage)
    gains = {p: gains.get(p, torch.ones_like(s)) * s for p, s in refined.items()} if refined else gains
    say("heads, neurons and gauges fitted")
    dist["aligned"] = dist["additive"]
    element = GroupElement(rotation=Q, gains=gains, layers=tuple(LayerElement(**x) for x in layers))
    per_unit = [{k: v[u] for k, v in dist.items()} for u in range(count)]
    return Alignment(B, subgroup, how, element, perm, per_unit)


def _fit_layers(A: ModelTensors, B: ModelTensors, subgroup: str, acts: Pair | None, Q: torch.Tensor | None,
                perm: torch.Tensor | None, stage: Callable[[str, ModelTensors], None] | None = None
                ) -> tuple[ModelTensors, list[dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """Stages 2-5 on B (its stream already aligned): ``(B, per-layer parts, refitted gains)``."""
    stage = stage or (lambda *_: None)
    L = len(A.layout.layers)
    layers = [dict[str, torch.Tensor]() for _ in range(L)]
    if subgroup != "none":
        for i in range(L):
            B, layers[i]["heads"], layers[i]["neurons"] = fit_permutations(A, B, i, acts, Q, perm)
    stage("permutations", B)
    if subgroup not in ("none", "permutations"):
        kind: Kind = "gl" if subgroup == "full" else "orthogonal"
        for i in range(L):
            B, M, Cv = fit_attention(A, B, i, kind)
            layers[i] |= {k: v for k, v in (("qk", M), ("vo", Cv)) if v is not None}
    stage("qk", _without_vo(B, layers))
    stage("vo", B)
    if subgroup == "full" and A.layout.mlp != "other":
        for i in range(L):
            B, layers[i]["mlp"] = fit_mlp(A, B, i)
    stage("mlp", B)
    refined: dict[str, torch.Tensor] = {}
    if subgroup == "full":
        B, refined = fit_norms(A, B)
    stage("norms", B)
    if subgroup == "full":
        B = fit_additive(A, B)
    stage("additive", B)
    return B, layers, refined


def _without_vo(after_vo: ModelTensors, layers: list[dict[str, torch.Tensor]]) -> ModelTensors:
    """The model with every layer's Q/K gauge but its V/O gauge undone (for the Q/K share)."""
    out = dict(after_vo.tensors)
    for i in range(len(layers)):
        if "vo" in layers[i]:
            back = value_transform(after_vo, i, torch.linalg.inv(layers[i]["vo"]))
            out.update({n: back.tensors[n] for n in after_vo.attention_names(i)})
    return ModelTensors(after_vo.layout, out, after_vo.config)
