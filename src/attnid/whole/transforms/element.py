"""One element of the whole-model symmetry group, as a typed record, and the pure function
that applies it (to a checkpoint's tensors or a module): what `attnid diff` fits and what
`attnid rewrite` draws.

The record holds norm gain transfers, the residual-stream rotation, and per layer a
`LayerElement`: the layer's attention gauge (`attnid.symmetry.Gauge`: per-kv-group Q/K and V/O
transforms, and where given the key-bias and value-bias shifts and QK-norm scales), a head
permutation, a neuron permutation and per-neuron MLP scales (docs/theory.md §13). The rest of
the additive part (LayerNorm bias moves, centring, all-ones shifts, translations, logit shifts,
parallel-bias transfer) has transforms of its own; `attnid diff` removes all of it by gauge
fixing, the shifts a LayerElement may carry included.

Order of :func:`apply_element`: gain transfers and the (gain-keeping) rotation act on the
residual side and commute with each other; the per-layer parts act on the head and neuron
side; a permutation comes before the transform indexed by the new order, and the shifts and
QK-norm scales come last (`attention_gauge`, which checks them).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch

from attnid.symmetry.gauge import Gauge
from attnid.whole.transforms.heads import (
    attention_gauge,
    head_permutation,
    query_key_transform,
    value_transform,
)
from attnid.whole.transforms.mlp import mlp_scaling, neuron_permutation
from attnid.whole.transforms.norms import norm_gain_transfer
from attnid.whole.transforms.residual import residual_rotation
from attnid.whole.transforms.state import ModelTensors, on_modules


@dataclass(frozen=True, kw_only=True)
class LayerElement(Gauge):
    """One layer's part (None: identity): the attention gauge (`attnid.symmetry.Gauge`: ``qk``,
    ``vo``, and where the layer has them the key-bias shift and QK-norm scales) with the head
    and neuron permutations and the MLP scales."""

    heads: torch.Tensor | None = None  # [H] long: new query head h is old head heads[h]
    neurons: torch.Tensor | None = None  # [f] long: new neuron j is old neuron neurons[j]
    mlp: torch.Tensor | None = None  # [f] per-neuron scales of the up side

    def rest(self) -> Gauge:
        """The attention part beyond Q/K and V/O (key-bias and value-bias shifts, QK-norm gain
        transfer and scales), as a Gauge (the identity when the layer has none)."""
        return Gauge(**{f.name: getattr(self, f.name) for f in fields(Gauge) if f.name not in ("qk", "vo")})


@dataclass(frozen=True)
class GroupElement:
    """A whole-model group element (None and empty parts: identity)."""

    rotation: torch.Tensor | None = None  # [d, d] orthogonal Q: the stream x -> x Q
    gains: dict[str, torch.Tensor] = field(default_factory=dict)  # norm path -> s: gain * s
    layers: tuple[LayerElement, ...] = ()


@on_modules
def apply_element(m: ModelTensors, g: GroupElement) -> ModelTensors:
    """``g`` applied to ``m`` (the parts whose tensors ``m`` holds: a checkpoint is rewritten one
    unit at a time)."""
    for path, s in g.gains.items():
        if f"{path}.weight" in m:
            m = norm_gain_transfer(m, path, s)
    if g.rotation is not None:
        m = residual_rotation(m, g.rotation)
    for i, le in enumerate(g.layers):
        rest = le.rest()
        heads = le.heads is not None or le.qk is not None or le.vo is not None or not rest.is_identity()
        if heads and m.complete(m.attention_names(i), f"layer {i}'s attention"):
            if le.heads is not None:
                m = head_permutation(m, i, le.heads)
            if le.qk is not None:
                m = query_key_transform(m, i, le.qk)
            if le.vo is not None:
                m = value_transform(m, i, le.vo)
            if not rest.is_identity():
                m = attention_gauge(m, i, rest)
        if (le.neurons is not None or le.mlp is not None) and m.has(m.layout.mlps[i][1]):
            if le.neurons is not None:
                m = neuron_permutation(m, i, le.neurons)
            if le.mlp is not None:
                m = mlp_scaling(m, i, le.mlp)
    return m
