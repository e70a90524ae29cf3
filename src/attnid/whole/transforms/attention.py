"""Offsets that an attention without biases reads from a biased LayerNorm (GPT-NeoX with
``attention_bias=False``; docs/theory.md §13.14). Behind ``y = g * xhat + b`` a reader ``W``
sees the constant ``W b``; ``W -> W + v (1/g)^T / s`` with ``s = sum(b / g)`` adds the constant
``v`` to its outputs and nothing else (``xhat`` is orthogonal to all-ones):

* :func:`key_offset`: keys ``+ kappa`` on pass-through (unrotated) dims: every key's score
  moves by the same ``q . kappa``, which softmax ignores;
* :func:`value_offset`: values ``+ nu`` with ``sum_h nu_h W_O^h = c 1``: the output moves
  along all-ones, which every later LayerNorm removes.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from attnid.adapters.registry import adapter_for
from attnid.weights import AttentionWeights, group_sum_out, pass_mask
from attnid.whole.transforms.layout import ParamsBySuffix, layout_of


def _setup(model: nn.Module, layer: int):
    config = model.config.to_dict()
    adapter = adapter_for(config)
    spec = adapter.specs(config)[layer]
    lay = layout_of(model)
    if lay.post or lay.norm != "layer" or spec.bias:
        raise ValueError("offsets need an attention without biases behind a biased LayerNorm")
    params = ParamsBySuffix(model)
    norm = model.get_submodule(lay.attn_norm(layer))
    if getattr(norm, "bias", None) is None:
        raise ValueError("offsets need a biased LayerNorm")
    g, b = norm.weight.detach(), norm.bias.detach()
    return adapter, spec, params, adapter.read(params, layer, spec), g, float((b / g).sum())


def _add(model: nn.Module, adapter, layer: int, params: ParamsBySuffix, w: AttentionWeights,
         **dirs: torch.Tensor) -> nn.Module:
    zero = w.map(torch.zeros_like).replace(**dirs)
    new = copy.deepcopy(model)
    with torch.no_grad():
        for name, delta in adapter.write(zero, layer).items():
            new.get_parameter(params.full(name)).add_(delta)
    return new


def key_offset(model: nn.Module, layer: int, kappa: torch.Tensor) -> nn.Module:
    """Keys of ``layer`` plus ``kappa`` (``[n_kv_heads, head_dim]``, zero on rotated dims)."""
    adapter, spec, params, w, g, s = _setup(model, layer)
    kappa = kappa.to(w.W_K.dtype)
    if float((kappa * (1 - pass_mask(spec, kappa))).abs().max()) > 0:
        raise ValueError("a key offset on rotated dims changes the scores")
    dW_K = (1 / g)[None, :, None] * kappa[:, None, :] / s  # [G, d, dk]
    return _add(model, adapter, layer, params, w, W_K=dW_K)


def value_offset(model: nn.Module, layer: int, c: float) -> nn.Module:
    """Values of ``layer`` plus the ``nu`` whose output is ``c`` times all-ones."""
    adapter, spec, params, w, g, s = _setup(model, layer)
    A = group_sum_out(w).reshape(-1, spec.d_model)  # [G dv, d]: nu -> output
    target = torch.full((spec.d_model, 1), c, dtype=A.dtype)
    nu = torch.linalg.lstsq(A.T, target).solution[:, 0]
    if float((A.T @ nu - target[:, 0]).norm()) > 1e-9 * max(abs(c), 1.0) * spec.d_model:
        raise ValueError("no value offset reaches all-ones at this layer")
    nu = nu.reshape(spec.n_kv_heads, -1)
    dW_V = (1 / g)[None, :, None] * nu[:, None, :] / s  # [G, d, dv]
    return _add(model, adapter, layer, params, w, W_V=dW_V)
