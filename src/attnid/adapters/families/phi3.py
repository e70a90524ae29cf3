"""Phi-3: one fused ``qkv_proj`` ([q; k; v] stacked), partial RoPE, no biases."""

from collections.abc import Mapping

import torch
from torch import nn

from attnid.adapters.base import Adapter, merge_heads_in, merge_heads_out, split_heads_in, split_heads_out
from attnid.adapters.layout import Layout, Lin, Norm, base_prefix, final_norm, lm_head
from attnid.adapters.registry import register
from attnid.spec import AttentionSpec
from attnid.weights import AttentionWeights


@register
class Phi3(Adapter):
    architectures = ("Phi3ForCausalLM", "Phi3Model")
    model_type = "phi3"
    family = "Phi-3"

    def names(self, i: int, spec: AttentionSpec) -> list[str]:
        p = self.layer_prefix.format(i=i)
        return [f"{p}self_attn.qkv_proj.weight", f"{p}self_attn.o_proj.weight"]

    def read(self, t: Mapping[str, torch.Tensor], i: int, spec: AttentionSpec) -> AttentionWeights:
        p = self.layer_prefix.format(i=i)
        H, G, dk = spec.n_heads, spec.n_kv_heads, spec.head_dim
        q, k, v = t[f"{p}self_attn.qkv_proj.weight"].split([H * dk, G * dk, G * dk], dim=0)
        return AttentionWeights(spec, W_Q=split_heads_in(q, H), W_K=split_heads_in(k, G),
                                W_V=split_heads_in(v, G),
                                W_O=split_heads_out(t[f"{p}self_attn.o_proj.weight"], H))

    def write(self, w: AttentionWeights, i: int) -> dict[str, torch.Tensor]:
        p = self.layer_prefix.format(i=i)
        qkv = torch.cat([merge_heads_in(w.W_Q), merge_heads_in(w.W_K), merge_heads_in(w.W_V)], dim=0)
        return {f"{p}self_attn.qkv_proj.weight": qkv, f"{p}self_attn.o_proj.weight": merge_heads_out(w.W_O)}

    def layout(self, model: nn.Module) -> Layout:
        """Llama's layout with fused ``qkv_proj`` and ``gate_up_proj`` (gate rows first)."""
        b = base_prefix(model, "model")
        L = [f"{b}layers.{i}." for i in range(model.config.num_hidden_layers)]
        f = model.config.intermediate_size
        unembed, tied = lm_head(model, "lm_head", f"{b}embed_tokens")
        norms = [x for p in L for x in (Norm(f"{p}input_layernorm", (Lin(f"{p}self_attn.qkv_proj"),)),
                                        Norm(f"{p}post_attention_layernorm", (Lin(f"{p}mlp.gate_up_proj"),)))]
        if unembed is not None and not tied:
            norms.append(Norm(f"{b}norm", (unembed,)))
        return Layout("rms", tuple(norms),
                      tuple((Lin(f"{p}self_attn.o_proj"), Lin(f"{p}mlp.down_proj")) for p in L),
                      False, (f"{b}embed_tokens",),
                      tuple((Lin(f"{p}mlp.gate_up_proj", rows=(f, 2 * f)), Lin(f"{p}mlp.down_proj"))
                            for p in L),
                      "gated", unembed, tied, final=final_norm(f"{b}norm", unembed, tied),
                      gates=tuple(Lin(f"{p}mlp.gate_up_proj", rows=(0, f)) for p in L), layers=tuple(L))
