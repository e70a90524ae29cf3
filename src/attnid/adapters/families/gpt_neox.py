"""GPT-NeoX / Pythia: fused ``query_key_value`` laid out per head ([H, 3, dk]), partial rotary."""

from collections.abc import Mapping
from dataclasses import replace

import torch
from torch import nn

from attnid.adapters.base import (
    Adapter,
    Config,
    cfg,
    cfg_bool,
    cfg_float,
    cfg_int,
    config_spec,
    fused_names,
    merge_heads_out,
    rope_float,
    rope_param,
    split_heads_out,
)
from attnid.adapters.config import source_of
from attnid.adapters.layout import Layout, Lin, Norm, activation, base_prefix, final_norm, lm_head
from attnid.adapters.registry import register
from attnid.errors import AttnidError
from attnid.spec import AttentionSpec
from attnid.structure import Structure
from attnid.weights import AttentionWeights


@register
class GPTNeoX(Adapter):
    architectures = ("GPTNeoXForCausalLM", "GPTNeoXModel")
    model_type = "gpt_neox"
    family = "GPT-NeoX"

    def bias(self, c: Config) -> str:
        return "qkvo" if cfg_bool(c, "attention_bias", default=True) else ""

    def rope(self, c: Config) -> float:
        frac = cfg_float(c, "rotary_pct", default=rope_float(c, "partial_rotary_factor", 1.0), minimum=0.0)
        dk = cfg_int(c, "hidden_size") // cfg_int(c, "num_attention_heads")
        if dk == 0:  # more heads than width: the spec refuses it, naming the fields
            return 0.0
        r = int(dk * frac)  # GPT-NeoX truncates
        if r % 2:  # Hugging Face then rotates an odd number of dims: no pairs to count
            raise AttnidError(f"{source_of(c)}: rotary_pct {frac:g} of head size {dk} rotates {r} dims, "
                              "an odd number; attnid counts rotations of whole (even) pairs only")
        return r / dk

    def spec(self, c: Config) -> AttentionSpec:
        s = super().spec(c)
        base = cfg_float(c, "rotary_emb_base", default=None)  # the older key for rope_theta
        if base is not None and rope_param(c, "rope_theta") is None:
            s = config_spec(c, **{**s.to_dict(), "rope_base": base})
        return s

    def reduce(self, c: Config) -> Config:
        small = super().reduce(c)
        small.pop("num_key_value_heads", None)
        small.pop("head_dim", None)
        return small

    def whole(self, c: Config) -> Structure:
        act = str(cfg(c, "hidden_act", default="gelu"))
        return replace(super().whole(c), norm="layer", norm_bias=True,
                       eps=cfg_float(c, "layer_norm_eps", default=1e-5, minimum=0.0),
                       layout="parallel" if cfg_bool(c, "use_parallel_residual", default=True) else "pre",
                       mlp="relu" if act == "relu" else "gelu", mlp_bias=True)

    def names(self, i: int, spec: AttentionSpec) -> list[str]:
        return fused_names(self.layer_prefix.format(i=i), "attention", bool(spec.bias))

    def read(self, t: Mapping[str, torch.Tensor], i: int, spec: AttentionSpec) -> AttentionWeights:
        p = self.layer_prefix.format(i=i)
        H, dk, d = spec.n_heads, spec.head_dim, spec.d_model
        W = t[f"{p}attention.query_key_value.weight"].reshape(H, 3, dk, d).transpose(-1, -2)
        w = dict(W_Q=W[:, 0], W_K=W[:, 1], W_V=W[:, 2],
                 W_O=split_heads_out(t[f"{p}attention.dense.weight"], H))
        if spec.bias:
            b = t[f"{p}attention.query_key_value.bias"].reshape(H, 3, dk)
            w.update(b_Q=b[:, 0], b_K=b[:, 1], b_V=b[:, 2], b_O=t[f"{p}attention.dense.bias"])
        return AttentionWeights(spec, **w)

    def write(self, w: AttentionWeights, i: int) -> dict[str, torch.Tensor]:
        p = self.layer_prefix.format(i=i)
        s = w.spec
        W = torch.stack([w.W_Q, w.W_K, w.W_V], dim=1).transpose(-1, -2)  # [H, 3, dk, d]
        out = {f"{p}attention.query_key_value.weight": W.reshape(3 * s.n_heads * s.head_dim, s.d_model),
               f"{p}attention.dense.weight": merge_heads_out(w.W_O)}
        if s.bias:
            out[f"{p}attention.query_key_value.bias"] = torch.stack([w.b_Q, w.b_K, w.b_V], 1).reshape(-1)
            out[f"{p}attention.dense.bias"] = w.b_O
        return out

    def layout(self, model: nn.Module) -> Layout:
        b = base_prefix(model, "gpt_neox")
        L = [f"{b}layers.{i}." for i in range(model.config.num_hidden_layers)]
        unembed, tied = lm_head(model, "lm_head" if hasattr(model, "lm_head") else "embed_out",
                                f"{b}embed_in")
        norms = [x for p in L for x in (
            Norm(f"{p}input_layernorm", (Lin(f"{p}attention.query_key_value"),)),
            Norm(f"{p}post_attention_layernorm", (Lin(f"{p}mlp.dense_h_to_4h"),)))]
        if unembed is not None and not tied:  # a tied head cannot absorb the final gain
            norms.append(Norm(f"{b}final_layer_norm", (unembed,)))
        return Layout("layer", tuple(norms),
                      tuple((Lin(f"{p}attention.dense"), Lin(f"{p}mlp.dense_4h_to_h")) for p in L),
                      bool(model.config.use_parallel_residual), (f"{b}embed_in",),
                      tuple((Lin(f"{p}mlp.dense_h_to_4h"), Lin(f"{p}mlp.dense_4h_to_h")) for p in L),
                      activation(model), unembed, tied,
                      final=final_norm(f"{b}final_layer_norm", unembed, tied), layers=tuple(L))
