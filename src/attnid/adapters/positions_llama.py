"""A Llama whose positions are learned or absent: the transformers classes behind
``model_type="attnid_llama"`` (`attnid.adapters.families.llama_positions`).

Hugging Face has Llama-style models (RMSNorm, SwiGLU, GQA) only with RoPE. To compare
positional encodings on one architecture (`benchmarks/merge_positions.py`), attnid's own
trained models are exported without RoPE as this class:

- ``position_embedding="learned"``: a table ``model.embed_positions`` ``[max_positions, d]``
  added to the token embeddings, as GPT-2's ``wpe``;
- ``position_embedding="none"`` (NoPE): nothing; a causal model still knows the order.

Either way the attention applies no rotation (the rotary table is ``cos = 1``, ``sin = 0``),
so each layer is Llama's own code. The classes register with transformers' Auto classes when
this module is imported (`attnid.adapters.base.hf_config` and ``hf_model_class`` import it for
this ``model_type``); a checkpoint of this class loads wherever attnid is imported.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, LlamaConfig
from transformers.models.llama.modeling_llama import LlamaForCausalLM, LlamaModel

from attnid.adapters.own import MODEL_TYPE, POSITIONS


class PositionsLlamaConfig(LlamaConfig):
    model_type = MODEL_TYPE

    def __init__(self, position_embedding: str = "learned", **kwargs: Any) -> None:
        if position_embedding not in POSITIONS:
            raise ValueError(f"position_embedding must be one of {POSITIONS}, got {position_embedding!r}")
        self.position_embedding = position_embedding
        super().__init__(**kwargs)


class NoRotaryEmbedding(nn.Module):
    """The rotary table of no rotation: ``cos = 1``, ``sin = 0`` ``[B, T, head_dim]``."""

    def __init__(self, config: PositionsLlamaConfig) -> None:
        super().__init__()
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (*position_ids.shape, self.head_dim)
        return x.new_ones(shape), x.new_zeros(shape)


class PositionsLlamaModel(LlamaModel):
    config_class = PositionsLlamaConfig

    def __init__(self, config: PositionsLlamaConfig) -> None:
        super().__init__(config)
        self.rotary_emb = NoRotaryEmbedding(config)
        self.embed_positions = (nn.Embedding(config.max_position_embeddings, config.hidden_size)
                                if config.position_embedding == "learned" else None)
        self.post_init()

    def forward(self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.LongTensor | None = None, cache: Any = None,
                inputs_embeds: torch.Tensor | None = None, use_cache: bool | None = None,
                **kwargs: Any) -> Any:
        if self.embed_positions is not None:
            if inputs_embeds is None:
                if input_ids is None:
                    raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
                inputs_embeds = self.embed_tokens(input_ids)  # (B, T, d)
            if position_ids is None:
                past = cache.get_seq_length() if cache is not None else 0
                T = inputs_embeds.shape[1]
                position_ids = (torch.arange(T, device=inputs_embeds.device) + past)[None]  # (1, T)
            inputs_embeds = inputs_embeds + self.embed_positions(position_ids)
            input_ids = None
        return super().forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                               cache=cache, inputs_embeds=inputs_embeds, use_cache=use_cache, **kwargs)


class PositionsLlamaForCausalLM(LlamaForCausalLM):
    config_class = PositionsLlamaConfig

    def __init__(self, config: PositionsLlamaConfig) -> None:
        super().__init__(config)
        self.model = PositionsLlamaModel(config)
        self.post_init()


CLASSES = {"PositionsLlamaForCausalLM": PositionsLlamaForCausalLM, "PositionsLlamaModel": PositionsLlamaModel}

AutoConfig.register(MODEL_TYPE, PositionsLlamaConfig, exist_ok=True)
AutoModel.register(PositionsLlamaConfig, PositionsLlamaModel, exist_ok=True)
AutoModelForCausalLM.register(PositionsLlamaConfig, PositionsLlamaForCausalLM, exist_ok=True)
