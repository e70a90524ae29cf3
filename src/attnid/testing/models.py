"""Tiny Hugging Face models for tests, built with the architecture's own class:

- :func:`tiny_model`: float64, eval, eager attention, random generic weights
  (`attnid.whole.check.tiny_model`: the arbiter's and the transforms' models);
- :func:`random_hf_model` / :func:`save_random`: transformers' own initialisation under
  ``torch.manual_seed(seed)``, then norm gains and biases moved away from 1 and 0 (the
  checkpoints the commands read);
- :func:`model_function`: what the architecture computes (log-probabilities for a head, the
  last hidden states for a bare model), in float64;
- :func:`random_element`: a random whole-model group element with every part a layout allows.

transformers is imported inside the functions: ``import attnid.testing`` stays light.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from attnid.whole import transforms as T
from attnid.whole.transforms.orthogonal import (
    random_commutant,
    random_head_permutation,
    random_orthogonal,
    random_rotation_fixing_ones,
)
from attnid.whole.transforms.residual import rotation_refusal


def tiny_model(config: dict[str, Any], seed: int = 0) -> nn.Module:
    """The architecture's own class at ``config``: float64, eval, eager attention, random
    generic weights, no padding rows (`attnid.whole.check.tiny_model`)."""
    from attnid.whole.check import tiny_model as build

    return build(config, seed)


def random_hf_model(config: dict[str, Any], *, seed: int = 0, dtype: torch.dtype = torch.float32,
                    gains: tuple[float, float] | None = None, bias_std: float | None = None) -> nn.Module:
    """transformers' own initialisation of ``config`` (``AutoModelForCausalLM`` when its
    ``architectures`` name a causal LM, else ``AutoModel``) under ``torch.manual_seed(seed)``;
    then, in parameter order, every norm weight drawn from ``U(gains)`` and every bias from
    ``N(0, bias_std)`` (each left as initialised when None); then converted to ``dtype``."""
    import transformers

    c = {k: v for k, v in config.items() if k != "model_type"}
    conf = transformers.AutoConfig.for_model(config["model_type"], **c)
    torch.manual_seed(seed)
    auto = (transformers.AutoModelForCausalLM if "CausalLM" in str(config.get("architectures"))
            else transformers.AutoModel)
    model = auto.from_config(conf)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if gains is not None and ("norm" in n or "ln_" in n) and n.endswith("weight"):
                p.uniform_(*gains)
            elif bias_std is not None and n.endswith("bias"):
                p.normal_(0.0, bias_std)
    return model.to(dtype)


def save_random(config: dict[str, Any], path: Path, *, seed: int = 0, dtype: torch.dtype = torch.float32,
                gains: tuple[float, float] | None = None, bias_std: float | None = None,
                shard: str | None = None) -> Path:
    """:func:`random_hf_model` saved under ``path`` (``shard``: transformers' ``max_shard_size``)."""
    model = random_hf_model(config, seed=seed, dtype=dtype, gains=gains, bias_std=bias_std)
    model.save_pretrained(path, **({"max_shard_size": shard} if shard else {}))
    return Path(path)


def model_function(model: nn.Module) -> torch.Tensor:
    """The model's function on three seeded sequences of 6 tokens (token 1, RoBERTa's pad, at
    one place; random token types where the model has them), in float64: log-probabilities for
    a head, the last hidden states for a bare model."""
    from attnid.whole.check import Float64Mode

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (3, 6), generator=gen)
    ids[0, 2] = 1  # RoBERTa's pad token (an ordinary token elsewhere)
    n_types = getattr(model.config, "type_vocab_size", 0)
    kw = {"token_type_ids": torch.randint(0, n_types, (3, 6), generator=gen)} if n_types else {}
    with torch.no_grad(), Float64Mode():
        out = model(input_ids=ids, **kw)
    if hasattr(out, "logits"):
        return torch.log_softmax(out.logits, -1)
    return out.last_hidden_state


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def random_element(model: nn.Module) -> T.GroupElement:
    """A seeded random whole-model group element with every part the layout allows: per layer
    a head permutation, a Q/K commutant map (none under QK-norm), V/O rotations, a neuron
    permutation and MLP scales; the residual rotation where the model admits one; the norm
    gains no reader absorbs."""
    mt = T.ModelTensors.of(model)
    lay = mt.layout
    layers = []
    for i in range(len(lay.layers)):
        s = mt.spec(i)
        f = mt.weight(lay.mlps[i][1]).shape[1]
        layers.append(T.LayerElement(
            heads=random_head_permutation(s, _gen(i)),
            qk=None if s.qk_norm != "none" else random_commutant(s, _gen(i)),
            vo=torch.stack([random_orthogonal(s.v_head_dim, _gen(10 + g)) for g in range(s.n_kv_heads)]),
            neurons=torch.randperm(f, generator=_gen(i)),
            mlp=None if lay.mlp == "other" else torch.exp(torch.randn(f, generator=_gen(i),
                                                                      dtype=torch.float64))))
    d = mt.spec(0).d_model
    rot = None
    if rotation_refusal(lay, mt.gain(lay.final) if lay.final else None) is None:
        rotate = random_rotation_fixing_ones if lay.norm == "layer" else random_orthogonal
        rot = rotate(d, _gen(3))
    gains = {nm.path: torch.exp(torch.randn(d, generator=_gen(7), dtype=torch.float64))
             for nm in lay.norms if nm.absorb is None and nm.gain}
    return T.GroupElement(rotation=rot, gains=gains, layers=tuple(layers))
