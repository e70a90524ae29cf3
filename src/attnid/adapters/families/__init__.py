"""One file per model family; importing this package registers them all."""

from attnid.adapters.families import (
    bert,
    deepseek,
    falcon,
    gemma,
    gpt2,
    gpt_neox,
    llama,
    olmo2,
    phi3,
    qwen2,
    qwen3,
)

__all__ = [
    "bert", "deepseek", "falcon", "gemma", "gpt2", "gpt_neox", "llama", "olmo2", "phi3", "qwen2", "qwen3",
]
