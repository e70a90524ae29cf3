"""Registers, in `attnid.layers`, a finder for the attention layers of a transformers model."""

from __future__ import annotations

from torch import nn

from attnid.adapters.base import stored_shapes
from attnid.adapters.registry import adapter_for
from attnid.errors import AttnidError
from attnid.layers import LayerAccessor, register_layer_finder
from attnid.sharding import clean_name


@register_layer_finder
def hf_layers(model: nn.Module) -> list[LayerAccessor]:
    """One accessor per attention layer of a Hugging Face model (empty for anything else).

    Tensors are named as the model names them without wrapper parts (FSDP1's
    ``_fsdp_wrapped_module``, ``torch.compile``'s ``_orig_mod``), so the accessors find them
    again however the model is wrapped or sharded later."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        return []
    try:
        adapter = adapter_for(config.to_dict())
    except AttnidError:
        return []
    names = [clean_name(n) for n, _ in model.named_parameters()]
    specs = adapter.specs(config.to_dict())
    first = adapter.names(0, specs[0])[0]
    prefix = next((n[: -len(first)] for n in names if n.endswith(first)), None)
    if prefix is None:
        return []
    return [LayerAccessor(
        name=f"{prefix}{adapter.layer_prefix.format(i=i)}", spec=spec, root=model,
        paths={n: prefix + n for n in adapter.names(i, spec)}, shapes=stored_shapes(adapter, spec, i),
        read=lambda t, i=i, spec=spec: adapter.read(t, i, spec), write=lambda w, i=i: adapter.write(w, i),
    ) for i, spec in enumerate(specs)]
