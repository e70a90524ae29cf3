"""One file per model family; importing this package registers them all.

Each file owns every part of its family (`attnid.adapters.base.PARTS`: config -> spec, tensor
names, structure, whole-model layout, layer finder), or says in ``lacks`` why it has none;
tests/adapters/test_families.py checks each part of each family on its tiny model.
"""

from attnid.adapters.families import (
    bert,
    deepseek,
    falcon,
    gemma,
    gpt2,
    gpt_neox,
    llama,
    llama_positions,
    olmo2,
    phi3,
    qwen2,
    qwen3,
)

__all__ = [
    "bert", "deepseek", "falcon", "gemma", "gpt2", "gpt_neox", "llama", "llama_positions", "olmo2", "phi3",
    "qwen2", "qwen3",
]
