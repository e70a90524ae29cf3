"""Whole-model symmetries as function-preserving maps, on a Llama-layout Hugging Face model
(pre-LN RMSNorm, gated MLP, rotary positions: Llama, Mistral, Qwen2, Phi-3's separate-proj
cousins). Each returns a new model (deep copy); the input is never touched.

* :func:`norm_gain_transfer`: a norm's gain times ``s``, its readers' input columns ``/ s``;
* :func:`residual_rotation`: the residual stream rotated by an orthogonal ``Q`` (untied
  unembedding only), each norm's readers conjugated by its gain;
* :func:`mlp_scaling`: a gated MLP's up-projection rows times ``c``, down-projection
  columns ``/ c``;
* :func:`logit_shift`: every unembedding row plus one vector ``u`` (log-probabilities
  ignore a shift constant across the vocabulary).
"""

from __future__ import annotations

import copy

import torch
from torch import nn


def _layers(model: nn.Module) -> list[nn.Module]:
    return list(model.model.layers)


def _readers(model: nn.Module) -> dict[str, list[nn.Linear]]:
    """Norm name -> the Linear layers that read its output."""
    out: dict[str, list[nn.Linear]] = {}
    for i, layer in enumerate(_layers(model)):
        a, m = layer.self_attn, layer.mlp
        out[f"model.layers.{i}.input_layernorm"] = [a.q_proj, a.k_proj, a.v_proj]
        out[f"model.layers.{i}.post_attention_layernorm"] = [m.gate_proj, m.up_proj]
    out["model.norm"] = [model.lm_head]
    return out


def norm_gain_transfer(model: nn.Module, norm: str, s: torch.Tensor) -> nn.Module:
    """``g -> g * s`` on norm ``norm``, readers' input columns ``/ s`` (``s`` nonzero, ``[d]``)."""
    new = copy.deepcopy(model)
    with torch.no_grad():
        n = new.get_submodule(norm)
        n.weight.mul_(s.to(n.weight.dtype))  # Gemma's (1 + w) gain is not handled here
        for lin in _readers(new)[norm]:
            lin.weight.div_(s.to(lin.weight.dtype))
    return new


def residual_rotation(model: nn.Module, Q: torch.Tensor) -> nn.Module:
    """``x -> x Q`` on the residual stream (``Q`` orthogonal ``[d, d]``); untied models only.

    RMSNorm commutes with ``Q`` but its gain ``g`` does not: a reader ``W`` of a norm becomes
    ``W diag(g) Q diag(1/g)`` (the gains stay), so ``Q = I`` is the identity map."""
    if model.lm_head.weight is model.model.embed_tokens.weight:
        raise ValueError("a tied unembedding breaks residual rotations")
    new = copy.deepcopy(model)
    with torch.no_grad():
        Q = Q.to(new.lm_head.weight.dtype)
        new.model.embed_tokens.weight.copy_(new.model.embed_tokens.weight @ Q)
        for name, readers in _readers(new).items():
            g = new.get_submodule(name).weight
            for lin in readers:  # reads g * (x Q) / rms
                lin.weight.copy_(lin.weight * g[None, :] @ Q / g[None, :])
        for layer in _layers(new):
            for lin in (layer.self_attn.o_proj, layer.mlp.down_proj):  # writes: [d, in]
                lin.weight.copy_(Q.T @ lin.weight)
    return new


def mlp_scaling(model: nn.Module, layer: int, c: torch.Tensor) -> nn.Module:
    """Gated MLP of ``layer``: up-projection rows ``* c``, down-projection columns ``/ c``."""
    new = copy.deepcopy(model)
    with torch.no_grad():
        m = _layers(new)[layer].mlp
        m.up_proj.weight.mul_(c[:, None].to(m.up_proj.weight.dtype))
        m.down_proj.weight.div_(c[None, :].to(m.down_proj.weight.dtype))
    return new


def logit_shift(model: nn.Module, u: torch.Tensor) -> nn.Module:
    """Every unembedding row plus ``u`` (``[d]``): the logits move by a per-position constant."""
    new = copy.deepcopy(model)
    with torch.no_grad():
        new.lm_head.weight.add_(u.to(new.lm_head.weight.dtype)[None, :])
    return new
