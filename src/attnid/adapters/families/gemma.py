"""Gemma: separate projections with an explicit head_dim (not d_model / n_heads)."""

from attnid.adapters.base import Adapter
from attnid.adapters.registry import register


@register
class Gemma(Adapter):
    architectures = ("GemmaForCausalLM", "GemmaModel")
    model_type = "gemma"
    family = "Gemma"
    tie_default = True
