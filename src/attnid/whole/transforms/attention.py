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

import torch

from attnid.errors import AttnidError
from attnid.weights import AttentionWeights, kv_group_sum_out, pass_mask
from attnid.whole.transforms.layout import norm_by_path
from attnid.whole.transforms.state import ModelTensors, on_modules


def _setup(m: ModelTensors, layer: int) -> tuple[AttentionWeights, torch.Tensor, float]:
    spec = m.spec(layer)
    lay = m.layout
    if lay.post or lay.norm != "layer" or spec.bias:
        raise AttnidError("offsets need an attention without biases behind a biased LayerNorm")
    norm = norm_by_path(lay, lay.attn_norm(layer))
    b = m.norm_bias(norm)
    if b is None:
        raise AttnidError("offsets need a biased LayerNorm")
    g = m.gain(norm)
    return m.attention(layer), g, float((b / g).sum())


def _add(m: ModelTensors, layer: int, w: AttentionWeights, **dirs: torch.Tensor) -> ModelTensors:
    new = w.replace(**{k: w[k] + v for k, v in dirs.items()})
    return m.replace(m.attention_changes(layer, new))


@on_modules
def key_offset(m: ModelTensors, layer: int, kappa: torch.Tensor) -> ModelTensors:
    """Keys of ``layer`` plus ``kappa`` (``[n_kv_heads, head_dim]``, zero on rotated dims)."""
    w, g, s = _setup(m, layer)
    kappa = kappa.to(w.W_K.dtype)
    if float((kappa * (1 - pass_mask(w.spec, kappa))).abs().max()) > 0:
        raise AttnidError("a key offset on rotated dims changes the scores")
    dW_K = (1 / g)[None, :, None] * kappa[:, None, :] / s  # [G, d, dk]
    return _add(m, layer, w, W_K=dW_K)


@on_modules
def value_offset(m: ModelTensors, layer: int, c: float) -> ModelTensors:
    """Values of ``layer`` plus the ``nu`` whose output is ``c`` times all-ones."""
    w, g, s = _setup(m, layer)
    spec = w.spec
    A = kv_group_sum_out(w).reshape(-1, spec.d_model)  # [G dv, d]: nu -> output
    target = torch.full((spec.d_model, 1), c, dtype=A.dtype)
    nu = torch.linalg.lstsq(A.T, target).solution[:, 0]
    if float((A.T @ nu - target[:, 0]).norm()) > 1e-9 * max(abs(c), 1.0) * spec.d_model:
        raise AttnidError("no value offset reaches all-ones at this layer")
    nu = nu.reshape(spec.n_kv_heads, -1)
    dW_V = (1 / g)[None, :, None] * nu[:, None, :] / s  # [G, d, dv]
    return _add(m, layer, w, W_V=dW_V)
