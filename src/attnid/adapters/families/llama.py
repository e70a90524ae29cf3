"""Llama and Mistral: separate q/k/v/o projections, GQA, RoPE (half pairing), optional biases."""

from attnid.adapters.base import Adapter
from attnid.adapters.registry import register


@register
class Llama(Adapter):
    architectures = ("LlamaForCausalLM", "LlamaModel")
    model_type = "llama"
    family = "Llama"


@register
class Mistral(Adapter):
    architectures = ("MistralForCausalLM", "MistralModel")
    model_type = "mistral"
    family = "Mistral"
