"""Fixtures for the checkpoint tools: the real MiniLM, its canonical form, and writers of variants."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from attnid.checkpoint.load import open_checkpoint
from attnid.weights import AttentionWeights


@pytest.fixture(scope="session")
def minilm_canonical(minilm, tmp_path_factory) -> Path:
    from attnid.checkpoint.canonicalize import canonicalize

    out = tmp_path_factory.mktemp("canon") / "minilm"
    canonicalize(minilm, out)
    return out


LayerFn = Callable[[int, AttentionWeights], AttentionWeights]


def write_variant(src: Path, dst: Path, layer_fn: LayerFn | None = None,
                  other_fn: Callable[[dict[str, torch.Tensor]], None] | None = None) -> Path:
    """Copy ``src`` to ``dst`` with each attention layer replaced by ``layer_fn(i, w)`` (float64
    in, stored in the checkpoint's dtype) and ``other_fn`` editing the full tensor dict in place."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    ck = open_checkpoint(src)
    tensors = load_file(dst / "model.safetensors")
    if layer_fn is not None:
        for i in range(ck.n_layers):
            w = layer_fn(i, ck.layer(i))
            for n, t in ck.adapter.write(w, i).items():
                tensors[ck.prefix + n] = t.to(tensors[ck.prefix + n].dtype).contiguous()
    if other_fn is not None:
        other_fn(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


SMALL = {
    "llama": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 32,
              "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
              "intermediate_size": 64, "vocab_size": 64, "attention_bias": True,
              "tie_word_embeddings": True},
    "gpt2": {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": 32, "n_head": 4,
             "n_layer": 2, "vocab_size": 64, "n_positions": 32},
}


def save_random(config: dict, root: Path, name: str, seed: int = 0) -> Path:
    """A random transformers checkpoint (biases away from zero) saved under ``root/name``."""
    import transformers

    rest = {k: v for k, v in config.items() if k != "model_type"}
    conf = transformers.AutoConfig.for_model(config["model_type"], **rest)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(conf) if "CausalLM" in str(
        config.get("architectures")) else transformers.AutoModel.from_config(conf)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("bias"):
                p.normal_(0.0, 0.5)
    d = root / name
    model.save_pretrained(d)
    return d


@pytest.fixture
def small() -> dict[str, dict]:
    """Configs of tiny random checkpoints (a tied, biased GQA Llama; GPT-2)."""
    return SMALL


@pytest.fixture
def variant() -> Callable[..., Path]:
    return write_variant


@pytest.fixture
def random_checkpoint() -> Callable[..., Path]:
    return save_random
