"""Qwen3: per-head QK-norm (RMSNorm over head_dim, gain shared across heads) before RoPE."""

from collections.abc import Mapping

import torch

from attnid.adapters.base import Adapter, Config
from attnid.adapters.registry import register
from attnid.spec import AttentionSpec
from attnid.weights import AttentionWeights


@register
class Qwen3(Adapter):
    architectures = ("Qwen3ForCausalLM", "Qwen3Model")
    model_type = "qwen3"
    family = "Qwen3"

    def qk_norm(self, c: Config) -> str:
        return "head"

    def reduce(self, c: Config) -> Config:
        # A larger eps lifts the near-null scale directions (singular values ~ eps, some
        # ~ eps^2) well above the float64 threshold; any eps > 0 has the same counts.
        return dict(super().reduce(c), rms_norm_eps=1e-2)

    def names(self, i: int, spec: AttentionSpec) -> list[str]:
        p = self.layer_prefix.format(i=i)
        return [*super().names(i, spec), f"{p}self_attn.q_norm.weight", f"{p}self_attn.k_norm.weight"]

    def read(self, t: Mapping[str, torch.Tensor], i: int, spec: AttentionSpec) -> AttentionWeights:
        p = self.layer_prefix.format(i=i)
        w = super().read(t, i, AttentionSpec(**{**spec.to_dict(), "qk_norm": "none"}))
        gains = {"g_Q": t[f"{p}self_attn.q_norm.weight"], "g_K": t[f"{p}self_attn.k_norm.weight"]}
        return AttentionWeights.from_tensors(spec, {**dict(w.items()), **gains})

    def write(self, w: AttentionWeights, i: int) -> dict[str, torch.Tensor]:
        p = self.layer_prefix.format(i=i)
        plain = AttentionWeights.from_tensors(
            AttentionSpec(**{**w.spec.to_dict(), "qk_norm": "none"}),
            {n: t for n, t in w.items() if not n.startswith("g_")})
        return {**super().write(plain, i), f"{p}self_attn.q_norm.weight": w.g_Q,
                f"{p}self_attn.k_norm.weight": w.g_K}
