"""Registers, in `attnid.layers`, the finder for the attention layers of a transformers model:
it picks the model's family by its config and asks that family (``Adapter.layers``)."""

from __future__ import annotations

from torch import nn

from attnid.adapters.registry import adapter_for
from attnid.errors import AttnidError
from attnid.layers import LayerAccessor, register_layer_finder


@register_layer_finder
def hf_layers(model: nn.Module) -> list[LayerAccessor]:
    """One accessor per attention layer of a Hugging Face model (empty for anything else):
    its family's layer finder (`attnid.adapters.base.Adapter.layers`)."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        return []
    try:
        adapter = adapter_for(config.to_dict())
    except AttnidError:
        return []
    return adapter.layers(model)
