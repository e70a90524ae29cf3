"""Symmetries at a residual norm ``y = g * xhat + b`` read by linear maps ``W y + c``
(docs/theory.md §13.2-§13.4, §13.12).

* :func:`norm_gain_transfer`: ``g, b -> s g, s b``, readers' input columns ``/ s``;
  :func:`fold_norm_gains` takes ``s = 1 / g`` at every norm that allows it;
* :func:`norm_bias_transfer` (LayerNorm): ``b -> b + delta``, each reader's bias ``- W delta``
  (a reader without a bias absorbs it with a centring move instead);
* :func:`centring_move` (LayerNorm): ``xhat`` is orthogonal to all-ones, so a reader
  ``W -> W + v (1/g)^T`` sees only the constant ``v sum(b / g)``, taken off its bias.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from attnid.whole.transforms.layout import (
    Norm,
    get_b,
    get_w,
    layout_of,
    norm_by_path,
    norm_params,
    set_b_,
    set_gain_,
    set_w_,
)


def _transfer_gain_(model: nn.Module, nm: Norm, s: torch.Tensor) -> None:
    if nm.absorb is not None or not nm.gain:
        raise ValueError(f"{nm.path}'s gain is seen beyond its readers (the residual stream or "
                         "a tied unembedding)")
    g, b = norm_params(model, nm.path)
    s = s.to(g.dtype)
    set_gain_(model, nm.path, g * s)
    if b is not None:
        with torch.no_grad():
            b.mul_(s)
    for lin in nm.readers:
        set_w_(model, lin, get_w(model, lin) / s[None, :])


def norm_gain_transfer(model: nn.Module, norm: str, s: torch.Tensor) -> nn.Module:
    """Norm ``norm``'s gain (and bias) times ``s`` (``[d]``, nonzero), its readers' input
    columns ``/ s``. Returns a new model."""
    new = copy.deepcopy(model)
    _transfer_gain_(new, norm_by_path(layout_of(new), norm), s)
    return new


def fold_norm_gains(model: nn.Module) -> nn.Module:
    """Every norm whose gain its readers can absorb gets gain 1 (a LayerNorm bias ``b / g``),
    the gain going into its readers' input columns: the gauge fixed by ``g = 1``. Norms
    seen elsewhere (post-LN residual paths, a tied or absent unembedding) keep theirs."""
    new = copy.deepcopy(model)
    for nm in layout_of(new).norms:
        if nm.absorb is None and nm.gain:
            g = norm_params(new, nm.path)[0]
            if bool((g == 0).any()):
                raise ValueError(f"{nm.path} has a zero gain: nothing to fold it into")
            _transfer_gain_(new, nm, 1 / g)
            set_gain_(new, nm.path, torch.ones_like(g))  # g * (1 / g), without its rounding
    return new


def norm_bias_transfer(model: nn.Module, norm: str, delta: torch.Tensor) -> nn.Module:
    """LayerNorm bias ``b -> b + delta`` (``[d]``); each reader ``W y + c`` gets
    ``c - W delta``, or, without a bias, ``W + v (1/g)^T`` with ``v = -W delta / sum((b + delta)/g)``
    (needs that sum nonzero). Post-LN: the residual sum's other term takes ``- delta`` too.
    Returns a new model."""
    new = copy.deepcopy(model)
    nm = norm_by_path(layout_of(new), norm)
    g, b = norm_params(new, norm)
    if b is None:
        raise ValueError(f"{norm} has no bias")
    delta = delta.to(g.dtype)
    for lin in nm.readers:
        W, c = get_w(new, lin), get_b(new, lin)
        if c is not None:
            set_b_(new, lin, c - W @ delta)
        else:
            v = -(W @ delta) / ((b + delta) / g).sum()
            set_w_(new, lin, W + v[:, None] / g[None, :])
    if nm.absorb is not None:
        set_b_(new, nm.absorb, get_b(new, nm.absorb) - delta)
    with torch.no_grad():
        b.add_(delta)
    return new


def centring_move(model: nn.Module, norm: str, reader: int, v: torch.Tensor) -> nn.Module:
    """LayerNorm ``norm``'s reader number ``reader``: ``W -> W + v (1/g)^T`` (``v`` ``[out]``),
    its bias ``- v sum(b / g)``. Returns a new model."""
    new = copy.deepcopy(model)
    lay = layout_of(new)
    if lay.norm != "layer":
        raise ValueError("centring moves need a LayerNorm (an RMSNorm's output is not centred)")
    lin = norm_by_path(lay, norm).readers[reader]
    if lay.tied and lin == lay.unembed:
        raise ValueError("the reader is a tied unembedding (the token table moves with it)")
    g, b = norm_params(new, norm)
    W, c = get_w(new, lin), get_b(new, lin)
    v = v.to(W.dtype)
    if b is not None:
        if c is None:
            raise ValueError("a biased LayerNorm read without a bias: use norm_bias_transfer")
        set_b_(new, lin, c - v * (b / g).sum())
    set_w_(new, lin, W + v[:, None] / g[None, :])
    return new
