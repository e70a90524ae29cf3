"""Where attention layers are found in a model: a registry of *layer finders*.

A finder takes a model and returns one :class:`LayerAccessor` per attention layer it
recognises (read and write the layer in canonical form, read its gradients). attnid's own
`Attention` is found by the finder below; `attnid.adapters` registers one for Hugging Face
models when it is imported. Consumers (`attnid.monitor`) only call :func:`find_layers`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from attnid.attention import Attention
from attnid.errors import AttnidError
from attnid.spec import AttentionSpec
from attnid.weights import AttentionWeights


@dataclass(frozen=True)
class LayerAccessor:
    """How to read and write one attention layer in canonical form."""

    name: str
    spec: AttentionSpec
    get: Callable[[], AttentionWeights]
    set: Callable[[AttentionWeights], None]
    grads: Callable[[], dict[str, torch.Tensor | None]]


LayerFinder = Callable[[nn.Module], list[LayerAccessor]]
_FINDERS: list[LayerFinder] = []


def register_layer_finder(finder: LayerFinder) -> LayerFinder:
    """Teach `find_layers` another kind of attention layer (adapters do this)."""
    _FINDERS.append(finder)
    return finder


@register_layer_finder
def attnid_layers(model: nn.Module) -> list[LayerAccessor]:
    """Every `attnid.Attention` inside ``model``."""
    out = []
    for name, mod in model.named_modules():
        if isinstance(mod, Attention):
            out.append(LayerAccessor(
                name=name, spec=mod.spec,
                get=lambda mod=mod: AttentionWeights.from_module(mod),
                set=lambda w, mod=mod: w.load_into_(mod),
                grads=lambda mod=mod: {n: p.grad for n, p in mod.named_parameters()},
            ))
    return out


def find_layers(model: nn.Module) -> list[LayerAccessor]:
    """Accessors for every attention layer any registered finder recognises."""
    layers = [acc for finder in _FINDERS for acc in finder(model)]
    if not layers:
        raise AttnidError("no attention layer found in the model (no registered adapter matched)")
    return layers
