"""Symmetries of the residual stream (docs/theory.md §13.5, §13.6, §13.9).

* :func:`residual_rotation`: the stream ``x -> x Q`` (``Q`` orthogonal; fixing all-ones under
  LayerNorm, which commutes only with such ``Q``); untied unembedding only;
* :func:`ones_shift` (LayerNorm): a write into the stream plus a multiple of all-ones
  (``W -> W + 1 a^T``, bias ``+ c 1``): every reader sees the stream through a LayerNorm;
* :func:`table_shift` (LayerNorm): each row of an embedding table plus ``c_r 1``;
* :func:`parallel_bias_transfer`: a parallel layer's two output biases trade ``delta``.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from attnid.whole.transforms.layout import get_b, get_w, layout_of, norm_params, set_b_, set_w_


def residual_rotation(model: nn.Module, Q: torch.Tensor) -> nn.Module:
    """``x -> x Q`` on the residual stream (``Q`` orthogonal ``[d, d]``; ``Q 1 = 1`` under
    LayerNorm). The norms' gains stay: a reader ``W`` of a norm with gain ``g`` becomes
    ``W diag(g) Q diag(1/g)`` and the norm's bias ``b -> g * (Q^T (b / g))``; writers ``Q^T W``,
    their biases and the embedding rows rotate. Returns a new model."""
    lay = layout_of(model)
    if lay.post:
        raise ValueError("post-LN: the stream is a LayerNorm's output, whose gain breaks rotations")
    if lay.tied or lay.unembed is None:
        raise ValueError("a tied unembedding (or a bare model's output) breaks residual rotations")
    Q = Q.to(torch.float64)
    ones = torch.ones(Q.shape[0], dtype=Q.dtype)
    if lay.norm == "layer" and float((Q @ ones - ones).abs().max()) > 1e-10:
        raise ValueError("under LayerNorm the rotation must fix all-ones (Q 1 = 1)")
    new = copy.deepcopy(model)
    for t in lay.tables:
        E = new.get_submodule(t).weight
        with torch.no_grad():
            E.copy_(E @ Q.to(E.dtype))
    for nm in lay.norms:
        g, b = norm_params(new, nm.path)
        for lin in nm.readers:
            set_w_(new, lin, (get_w(new, lin) * g[None, :]) @ Q / g[None, :])
        if b is not None:
            with torch.no_grad():
                b.copy_(g * (Q.T @ (b / g)))
    for lin in (x for layer in lay.writers for x in layer):
        set_w_(new, lin, Q.T @ get_w(new, lin))
        c = get_b(new, lin)
        if c is not None:
            set_b_(new, lin, Q.T @ c)
    return new


def _ones(model: nn.Module, d: int) -> torch.Tensor:
    return torch.ones(d, dtype=next(model.parameters()).dtype)


def ones_shift(model: nn.Module, layer: int, which: int, a: torch.Tensor, c: float = 0.0
               ) -> nn.Module:
    """LayerNorm models: writer ``which`` (0 attention, 1 MLP) of ``layer``:
    ``W -> W + 1 a^T`` (``a`` ``[in]``), bias ``+ c 1``. Returns a new model."""
    lay = layout_of(model)
    if lay.norm != "layer":
        raise ValueError("all-ones shifts need LayerNorm")
    new = copy.deepcopy(model)
    lin = lay.writers[layer][which]
    W = get_w(new, lin)
    one = _ones(new, W.shape[0])
    set_w_(new, lin, W + one[:, None] * a.to(W.dtype)[None, :])
    if c:
        b = get_b(new, lin)
        if b is None:
            raise ValueError(f"{lin.path} has no bias")
        set_b_(new, lin, b + c * one)
    return new


def table_shift(model: nn.Module, table: int, c: torch.Tensor) -> nn.Module:
    """LayerNorm models: row ``r`` of embedding table ``table`` plus ``c[r] 1``. A tied token
    table is also the unembedding: only a constant ``c`` keeps the log-probabilities."""
    lay = layout_of(model)
    if lay.norm != "layer":
        raise ValueError("all-ones shifts need LayerNorm")
    if table == 0 and lay.tied and float((c - c[0]).abs().max()) > 0:
        raise ValueError("a tied token table takes only a constant shift")
    new = copy.deepcopy(model)
    E = new.get_submodule(lay.tables[table]).weight
    with torch.no_grad():
        E.add_(c.to(E.dtype)[:, None])
    return new


def parallel_bias_transfer(model: nn.Module, layer: int, delta: torch.Tensor) -> nn.Module:
    """Parallel layout: attention output bias ``+ delta``, MLP output bias ``- delta``."""
    lay = layout_of(model)
    if not lay.parallel:
        raise ValueError("only a parallel layer adds both outputs to one stream")
    new = copy.deepcopy(model)
    att, mlp = lay.writers[layer]
    ba, bm = get_b(new, att), get_b(new, mlp)
    if ba is None or bm is None:
        raise ValueError("both output biases are needed")
    set_b_(new, att, ba + delta.to(ba.dtype))
    set_b_(new, mlp, bm - delta.to(bm.dtype))
    return new
