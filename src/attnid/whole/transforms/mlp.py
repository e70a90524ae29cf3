"""Per-neuron MLP scaling (docs/theory.md §13.10): a gated MLP ``down(act(gate x) * up x)`` is
linear in ``up``'s row ``j``; ``relu(c z) = c relu(z)`` for ``c > 0``. Either way neuron ``j``'s
input side ``* c_j`` and ``down``'s column ``j`` ``/ c_j`` keep the output."""

from __future__ import annotations

import copy

import torch
from torch import nn

from attnid.whole.transforms.layout import get_b, get_w, layout_of, set_b_, set_w_


def mlp_scaling(model: nn.Module, layer: int, c: torch.Tensor) -> nn.Module:
    """MLP of ``layer``: up-projection rows (and bias) ``* c``, down-projection columns ``/ c``
    (``c`` ``[d_ff]``; positive for ReLU). Returns a new model."""
    lay = layout_of(model)
    if lay.mlp == "other":
        raise ValueError("only gated and ReLU MLPs scale per neuron")
    if lay.mlp == "relu" and bool((c <= 0).any()):
        raise ValueError("ReLU commutes only with positive scales")
    new = copy.deepcopy(model)
    up, down = lay.mlps[layer]
    W = get_w(new, up)
    lo, hi = up.rows or (0, W.shape[0])  # a fused map: only its up rows
    scale = torch.ones(W.shape[0], dtype=W.dtype)
    scale[lo:hi] = c.to(W.dtype)
    set_w_(new, up, W * scale[:, None])
    b = get_b(new, up)
    if b is not None:
        set_b_(new, up, b * scale)
    c = c.to(W.dtype)
    set_w_(new, down, get_w(new, down) / c[None, :])
    return new
