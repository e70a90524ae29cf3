"""Registers, in `attnid.layers`, a finder for the attention layers of a transformers model."""

from __future__ import annotations

import torch
from torch import nn

from attnid.adapters.registry import adapter_for
from attnid.errors import AttnidError
from attnid.layers import LayerAccessor, register_layer_finder


@register_layer_finder
def hf_layers(model: nn.Module) -> list[LayerAccessor]:
    """One accessor per attention layer of a Hugging Face model (empty for anything else)."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        return []
    try:
        adapter = adapter_for(config.to_dict())
    except AttnidError:
        return []
    params = dict(model.named_parameters())
    specs = adapter.specs(config.to_dict())
    first = adapter.names(0, specs[0])[0]
    prefix = next((n[: -len(first)] for n in params if n.endswith(first)), None)
    if prefix is None:
        return []
    out = []
    for i, spec in enumerate(specs):
        names = adapter.names(i, spec)
        mine = {n: params[prefix + n] for n in names}

        def get(i=i, spec=spec, mine=mine):
            return adapter.read({n: p.detach() for n, p in mine.items()}, i, spec)

        def set_(w, i=i, mine=mine):
            with torch.no_grad():
                for n, t in adapter.write(w, i).items():
                    mine[n].copy_(t)

        def grads(i=i, spec=spec, mine=mine):
            if any(p.grad is None for p in mine.values()):
                return {}
            return dict(adapter.read({n: p.grad for n, p in mine.items()}, i, spec).items())

        out.append(LayerAccessor(name=f"{prefix}{adapter.layer_prefix.format(i=i)}", spec=spec,
                                 get=get, set=set_, grads=grads))
    return out
