"""Qwen2 / Qwen2.5: q, k and v biases (no output bias) under RoPE with GQA."""

from attnid.adapters.base import Adapter, Config
from attnid.adapters.registry import register


@register
class Qwen2(Adapter):
    architectures = ("Qwen2ForCausalLM", "Qwen2Model")
    model_type = "qwen2"
    family = "Qwen2"

    def bias(self, c: Config) -> str:
        return "qkv"
