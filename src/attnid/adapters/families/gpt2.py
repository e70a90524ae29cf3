"""GPT-2: Conv1D layers (weights stored [in, out]) with one fused ``c_attn``; all four biases."""

from collections.abc import Mapping
from dataclasses import replace

import torch
from torch import nn

from attnid.adapters.base import Adapter, Config, cfg, cfg_float, cfg_int, find_first
from attnid.adapters.layout import Layout, Lin, Norm, activation, base_prefix, final_norm, lm_head
from attnid.adapters.registry import register
from attnid.spec import AttentionSpec
from attnid.structure import Structure
from attnid.weights import AttentionWeights


@register
class GPT2(Adapter):
    architectures = ("GPT2LMHeadModel", "GPT2Model")
    model_type = "gpt2"
    family = "GPT-2"
    layer_prefix = "h.{i}."
    tie_default = True

    def bias(self, c: Config) -> str:
        return "qkvo"

    def rope(self, c: Config) -> float:
        return 0.0

    def reduce(self, c: Config) -> Config:
        return dict(c, n_embd=8, n_head=2, n_layer=1, vocab_size=32, n_positions=64, n_inner=16,
                    bos_token_id=None, eos_token_id=None, pad_token_id=None)

    def whole(self, c: Config) -> Structure:
        act = str(cfg(c, "activation_function", default="gelu_new"))
        return replace(super().whole(c), norm="layer", norm_bias=True,
                       eps=cfg_float(c, "layer_norm_epsilon", default=1e-5, minimum=0.0),
                       mlp="relu" if act == "relu" else "gelu", mlp_bias=True,
                       positions=cfg_int(c, "n_positions", "max_position_embeddings"))

    def names(self, i: int, spec: AttentionSpec) -> list[str]:
        p = self.layer_prefix.format(i=i)
        return [f"{p}attn.c_attn.weight", f"{p}attn.c_attn.bias", f"{p}attn.c_proj.weight",
                f"{p}attn.c_proj.bias"]

    def read(self, t: Mapping[str, torch.Tensor], i: int, spec: AttentionSpec) -> AttentionWeights:
        p = self.layer_prefix.format(i=i)
        d, H = spec.d_model, spec.n_heads
        W = t[f"{p}attn.c_attn.weight"]  # [d, 3d] (in, out)
        b = t[f"{p}attn.c_attn.bias"]  # [3d]
        per = [W[:, j * d:(j + 1) * d].reshape(d, H, -1).permute(1, 0, 2) for j in range(3)]
        bias = [b[j * d:(j + 1) * d].reshape(H, -1) for j in range(3)]
        return AttentionWeights(spec, W_Q=per[0], W_K=per[1], W_V=per[2],
                                W_O=t[f"{p}attn.c_proj.weight"].reshape(H, -1, d),
                                b_Q=bias[0], b_K=bias[1], b_V=bias[2], b_O=t[f"{p}attn.c_proj.bias"])

    def write(self, w: AttentionWeights, i: int) -> dict[str, torch.Tensor]:
        p = self.layer_prefix.format(i=i)
        d = w.spec.d_model
        W = torch.cat([x.permute(1, 0, 2).reshape(d, -1) for x in (w.W_Q, w.W_K, w.W_V)], dim=1)
        b = torch.cat([x.reshape(-1) for x in (w.b_Q, w.b_K, w.b_V)])
        return {f"{p}attn.c_attn.weight": W, f"{p}attn.c_attn.bias": b,
                f"{p}attn.c_proj.weight": w.W_O.reshape(-1, d), f"{p}attn.c_proj.bias": w.b_O}

    def layout(self, model: nn.Module) -> Layout:
        b = base_prefix(model, "transformer")
        n = model.config.n_layer
        L = [f"{b}h.{i}." for i in range(n)]
        unembed, tied = lm_head(model, "lm_head", f"{b}wte")
        norms = [Norm(f"{p}ln_1", (Lin(f"{p}attn.c_attn", True),)) for p in L]
        norms = [x for i, p in enumerate(L)
                 for x in (norms[i], Norm(f"{p}ln_2", (Lin(f"{p}mlp.c_fc", True),)))]
        if unembed is not None and not tied:  # a tied head cannot absorb the final gain
            norms.append(Norm(f"{b}ln_f", (unembed,)))
        return Layout("layer", tuple(norms),
                      tuple((Lin(f"{p}attn.c_proj", True), Lin(f"{p}mlp.c_proj", True)) for p in L),
                      False, (f"{b}wte", f"{b}wpe"),
                      tuple((Lin(f"{p}mlp.c_fc", True), Lin(f"{p}mlp.c_proj", True)) for p in L),
                      activation(model), unembed, tied, final=final_norm(f"{b}ln_f", unembed, tied),
                      layers=tuple(L))

    def attention_of(self, model):
        attn = find_first(model, "Attention")

        def forward(m, x):
            return m(x, attention_mask=None)[0]

        return attn, forward
