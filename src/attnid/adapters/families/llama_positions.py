"""Llama without RoPE, positions learned or none (attnid's own class, `attnid.adapters.
positions_llama`): Llama's tensors, no rotation, and with learned positions a second table
``model.embed_positions`` summed into the residual stream."""

from dataclasses import replace

from torch import nn

from attnid.adapters.base import Adapter, Config, cfg, cfg_int
from attnid.adapters.layout import Layout, base_prefix, llama_layout
from attnid.adapters.own import MODEL_TYPE
from attnid.adapters.registry import register
from attnid.structure import Structure


def learned(c: Config) -> bool:
    return cfg(c, "position_embedding", default="learned") == "learned"


@register
class PositionsLlama(Adapter):
    architectures = ("PositionsLlamaForCausalLM", "PositionsLlamaModel")
    model_type = MODEL_TYPE
    family = "Llama (learned or no positions)"

    def rope(self, c: Config) -> float:
        return 0.0

    def whole(self, c: Config) -> Structure:
        return replace(super().whole(c),
                       positions=cfg_int(c, "max_position_embeddings") if learned(c) else 0)

    def layout(self, model: nn.Module) -> Layout:
        lay = llama_layout(model)
        if not learned(model.config.to_dict()):
            return lay
        return replace(lay, tables=(*lay.tables, f"{base_prefix(model, 'model')}embed_positions"))
