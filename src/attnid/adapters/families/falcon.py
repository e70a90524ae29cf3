"""Falcon: fused ``query_key_value``: multi-query (7B) or the grouped "new decoder" layout."""

from collections.abc import Mapping
from dataclasses import replace

import torch
from torch import nn

from attnid.adapters.base import (
    Adapter,
    Config,
    cfg_bool,
    cfg_float,
    cfg_int,
    cfg_layers,
    config_spec,
    fused_names,
    merge_heads_out,
    rope_float,
    split_heads_out,
)
from attnid.adapters.layout import Layout, Lin, Norm, activation, base_prefix, final_norm, lm_head
from attnid.adapters.registry import register
from attnid.spec import AttentionSpec
from attnid.structure import Structure
from attnid.weights import AttentionWeights


@register
class Falcon(Adapter):
    architectures = ("FalconForCausalLM", "FalconModel", "RWForCausalLM")
    model_type = "falcon"
    family = "Falcon"
    layer_prefix = "h.{i}."
    tie_default = True

    def n_layers(self, c: Config) -> int:
        return cfg_layers(c, "num_hidden_layers", "n_layer")

    def spec(self, c: Config) -> AttentionSpec:
        d = cfg_int(c, "hidden_size")
        H = cfg_int(c, "num_attention_heads", "n_head")
        if cfg_bool(c, "new_decoder_architecture"):
            G = cfg_int(c, "num_kv_heads", default=H)
        else:
            G = 1 if cfg_bool(c, "multi_query", default=True) else H
        return config_spec(c, d_model=d, n_heads=H, n_kv_heads=G,
                           bias="qkvo" if cfg_bool(c, "bias") else "",
                           rope=0.0 if cfg_bool(c, "alibi") else 1.0,
                           rope_base=rope_float(c, "rope_theta", 10000.0))

    def unsupported(self, c: Config) -> str | None:
        if cfg_bool(c, "alibi"):
            return "Falcon with ALiBi positions is not supported (only rotary Falcon models)"
        return None

    def reduce(self, c: Config) -> Config:
        s = self.spec(c)
        G = 1 if s.n_kv_heads == 1 else 2
        H = 4 if s.n_kv_heads == 1 else 2 * G if s.kv_group_size > 1 else 2
        small = dict(c, hidden_size=4 * H, num_attention_heads=H, num_hidden_layers=1, vocab_size=32,
                     bos_token_id=None, eos_token_id=None, pad_token_id=None)
        if "num_kv_heads" in c or cfg_bool(c, "new_decoder_architecture"):
            small["num_kv_heads"] = G if s.n_kv_heads != s.n_heads else H
        return small

    def whole(self, c: Config) -> Structure:
        new = cfg_bool(c, "new_decoder_architecture")
        parallel = cfg_bool(c, "parallel_attn", default=True) or new
        # the new decoder layout has ln_attn and ln_mlp unless num_ln_in_parallel_attn == 1
        shared = parallel and (not new or cfg_int(c, "num_ln_in_parallel_attn", default=2) == 1)
        return replace(super().whole(c), norm="layer", norm_bias=True,
                       eps=cfg_float(c, "layer_norm_epsilon", default=1e-5, minimum=0.0),
                       layout="parallel" if parallel else "pre", shared_norm=shared, mlp="gelu",
                       mlp_bias=cfg_bool(c, "bias"))

    def names(self, i: int, spec: AttentionSpec) -> list[str]:
        return fused_names(self.layer_prefix.format(i=i), "self_attention", bool(spec.bias))

    def read(self, t: Mapping[str, torch.Tensor], i: int, spec: AttentionSpec) -> AttentionWeights:
        p = self.layer_prefix.format(i=i)
        H, G, dk, d = spec.n_heads, spec.n_kv_heads, spec.head_dim, spec.d_model
        W = t[f"{p}self_attention.query_key_value.weight"]
        m = H // G  # every Falcon layout is [G, m queries + key + value, dk] (MQA: G = 1)
        X = W.reshape(G, m + 2, dk, d).transpose(-1, -2)
        Wq, Wk, Wv = X[:, :m].reshape(H, d, dk), X[:, m], X[:, m + 1]
        w = dict(W_Q=Wq, W_K=Wk, W_V=Wv, W_O=split_heads_out(t[f"{p}self_attention.dense.weight"], H))
        if spec.bias:  # the fused bias follows the same [G, m + 2, dk] layout
            b = t[f"{p}self_attention.query_key_value.bias"].reshape(G, m + 2, dk)
            w.update(b_Q=b[:, :m].reshape(H, dk), b_K=b[:, m], b_V=b[:, m + 1],
                     b_O=t[f"{p}self_attention.dense.bias"])
        return AttentionWeights(spec, **w)

    def write(self, w: AttentionWeights, i: int) -> dict[str, torch.Tensor]:
        p = self.layer_prefix.format(i=i)
        s = w.spec
        H, G, dk, d = s.n_heads, s.n_kv_heads, s.head_dim, s.d_model
        m = H // G
        X = torch.cat([w.W_Q.reshape(G, m, d, dk), w.W_K[:, None], w.W_V[:, None]], dim=1)
        W = X.transpose(-1, -2).reshape(-1, d)
        out = {f"{p}self_attention.query_key_value.weight": W,
               f"{p}self_attention.dense.weight": merge_heads_out(w.W_O)}
        if s.bias:
            b = torch.cat([w.b_Q.reshape(G, m, dk), w.b_K[:, None], w.b_V[:, None]], dim=1)
            out[f"{p}self_attention.query_key_value.bias"] = b.reshape(-1)
            out[f"{p}self_attention.dense.bias"] = w.b_O
        return out

    def layout(self, model: nn.Module) -> Layout:
        """Falcon: one shared norm (parallel), ln_attn + ln_mlp (new decoder), or sequential."""
        b = base_prefix(model, "transformer")
        L = [f"{b}h.{i}." for i in range(model.config.num_hidden_layers)]
        unembed, tied = lm_head(model, "lm_head", f"{b}word_embeddings")
        norms, attn = [], []
        for p in L:
            qkv, up = Lin(f"{p}self_attention.query_key_value"), Lin(f"{p}mlp.dense_h_to_4h")
            layer = model.get_submodule(p.rstrip("."))
            if hasattr(layer, "ln_attn"):
                pair = (Norm(f"{p}ln_attn", (qkv,)), Norm(f"{p}ln_mlp", (up,)))
            elif hasattr(layer, "post_attention_layernorm"):
                pair = (Norm(f"{p}input_layernorm", (qkv,)), Norm(f"{p}post_attention_layernorm", (up,)))
            else:
                pair = (Norm(f"{p}input_layernorm", (qkv, up)),)
            norms += pair
            attn.append(pair[0].path)
        if unembed is not None and not tied:
            norms.append(Norm(f"{b}ln_f", (unembed,)))
        c = model.config
        return Layout("layer", tuple(norms),
                      tuple((Lin(f"{p}self_attention.dense"), Lin(f"{p}mlp.dense_4h_to_h")) for p in L),
                      bool(c.parallel_attn or c.new_decoder_architecture), (f"{b}word_embeddings",),
                      tuple((Lin(f"{p}mlp.dense_h_to_4h"), Lin(f"{p}mlp.dense_4h_to_h")) for p in L),
                      activation(model), unembed, tied, attn_norms=tuple(attn),
                      final=final_norm(f"{b}ln_f", unembed, tied), layers=tuple(L))

    def attention_of(self, model):
        holder, _ = super().attention_of(model)

        def forward(h, x):
            pos = torch.arange(x.shape[1])[None].expand(x.shape[0], -1)
            pe = h.rotary[0](x, pos)
            T = x.shape[1]  # its eager path adds the mask unconditionally: give it a zero one
            mask = torch.zeros(1, 1, T, T, dtype=x.dtype)
            return h.attn(x, alibi=None, attention_mask=mask, position_ids=pos, position_embeddings=pe)[0]

        return holder, forward
