"""Whether a changed norm gain explains a break (docs/theory.md §13.22): blame in checkpoint
terms names the norm's tensor, not the reader where the break first shows.

A norm ``y = g * z (+ b)`` is read by linear maps ``W``; changing ``g -> g * s`` without the
readers making up for it scales every reader's input columns by the one vector ``s``. So the
break is the gain's when B, its gain times one ``s``, is A's function again: ``s`` fitted on B's
readers in B's stream coordinates against A's (what every other symmetry leaves free fitted
too), then the unit compared again:

* an MLP's readers (gate, up): neurons matched by the fit's permutation, the scalable rows
  (the up half, a ReLU's up) by a per-row factor (alternating least squares);
* attention: the total OV circuit ``sum_h W_V^h W_O^h`` (``[d, d]``, the same for every head
  permutation and per-kv-group V/O gauge): rows scaled by ``s``;
* the head: the rows centred over the vocabulary (the logit shift).

A's readers are taken to B's coordinates with the fitted rotation (``W_A Q^T``; the OV circuit
``Q OV_A Q^T``). Under LayerNorm the fit is made on the stored readers (a reader's component
along all-ones, which LayerNorm's output never has, is taken to be unchanged). Exact, on one
unit: it runs only where a break was found.
"""

from __future__ import annotations

import torch

from attnid.whole.transforms.layout import Lin, Norm
from attnid.whole.transforms.state import ModelTensors

SWEEPS = 60  # alternating least-squares sweeps (row and column scales)


def _rows(m: ModelTensors, lins: list[Lin], nm: Norm, dtype: torch.dtype) -> torch.Tensor:
    """The readers' ``[out, d]`` weights (a fused map's own rows), the gain applied."""
    out = []
    for lin in lins:
        W = m.weight(lin).to(dtype)
        if lin.rows is not None:
            W = W[lin.rows[0]:lin.rows[1]]
        out.append(W * m.gain(nm).to(dtype)[None, :])
    return torch.cat(out)


def column_fit(X: torch.Tensor, Y: torch.Tensor, scalable: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(c, s)`` minimising ``||diag(c) X diag(s) - Y||`` with ``c = 1`` off ``scalable`` rows
    (alternating least squares; ``scalable`` None: no row factors)."""
    s = torch.ones(X.shape[1], dtype=X.dtype)
    c = torch.ones(X.shape[0], dtype=X.dtype)
    for _ in range(SWEEPS if scalable is not None and bool(scalable.any()) else 1):
        if scalable is not None:
            Xs = X * s[None, :]
            fit = (Xs * Y).sum(1) / (Xs**2).sum(1).clamp_min(1e-300)
            c = torch.where(scalable, fit, torch.ones_like(fit))
        Xc = X * c[:, None]
        s = (Xc * Y).sum(0) / (Xc**2).sum(0).clamp_min(1e-300)
    return c, s


def _mlp(ma: ModelTensors, mb: ModelTensors, layer: int, nm: Norm, Q: torch.Tensor | None,
         perm: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    lay = ma.layout
    up = lay.mlps[layer][0]
    gate = lay.gates[layer] if lay.gates else None
    lins = [x for x in (gate, up) if x is not None]
    Ya, Xb = _rows(ma, lins, nm, dtype), _rows(mb, lins, nm, dtype)
    f = Xb.shape[0] // len(lins)
    if perm is not None:  # B's neuron perm[i] is A's neuron i
        Xb = Xb[torch.cat([perm + k * f for k in range(len(lins))])]
    if Q is not None:
        Ya = Ya @ Q.T
    scalable = torch.zeros(Xb.shape[0], dtype=torch.bool)
    if lay.mlp != "other":  # the up half (ReLU: its only reader) takes per-neuron factors
        k = lins.index(up)
        scalable[k * f:(k + 1) * f] = True
    return column_fit(Xb, Ya, scalable)[1]


def _ov(m: ModelTensors, layer: int, nm: Norm, dtype: torch.dtype) -> torch.Tensor:
    """``diag(g) sum_h W_V^h W_O^h`` ``[d, d]``."""
    w = m.attention(layer)
    s = w.spec
    V = w.W_V.to(dtype).repeat_interleave(s.kv_group_size, dim=0)  # [H, d, dv]
    return m.gain(nm).to(dtype)[:, None] * torch.einsum("hdv,hve->de", V, w.W_O.to(dtype))


def _attention(ma: ModelTensors, mb: ModelTensors, layer: int, nm: Norm, Q: torch.Tensor | None,
               dtype: torch.dtype) -> torch.Tensor:
    Ya, Xb = _ov(ma, layer, nm, dtype), _ov(mb, layer, nm, dtype)
    if Q is not None:
        Ya = Q @ Ya @ Q.T
    return column_fit(Xb.T, Ya.T)[1]  # rows of the circuit: the stream read (its columns here)


def _head(ma: ModelTensors, mb: ModelTensors, nm: Norm, Q: torch.Tensor | None, dtype: torch.dtype
          ) -> torch.Tensor:
    lin = ma.layout.unembed
    Ya, Xb = _rows(ma, [lin], nm, dtype), _rows(mb, [lin], nm, dtype)
    if Q is not None:
        Ya = Ya @ Q.T
    Ya, Xb = Ya - Ya.mean(0, keepdim=True), Xb - Xb.mean(0, keepdim=True)  # the logit shift
    return column_fit(Xb, Ya)[1]


def gain_fit(ma: ModelTensors, mb: ModelTensors, layer: int | None, nm: Norm,
             Q: torch.Tensor | None, neurons: torch.Tensor | None) -> ModelTensors | None:
    """B with ``nm``'s gain times the ``s`` that takes its readers' inputs nearest to A's (fitted
    on the MLP's readers when they read ``nm``, else on the OV circuit, or the head's rows, in
    the layer (None: the head) where a break showed); None where no such fit applies. The
    caller compares it with A again: a break this repairs is the gain's."""
    dtype = torch.float64
    Q = None if Q is None else Q.to(dtype)
    lay = ma.layout
    paths = {r.path for r in nm.readers}
    if layer is None:
        if lay.unembed is None or lay.tied or lay.unembed.path not in paths:
            return None
        s = _head(ma, mb, nm, Q, dtype)
    elif lay.mlps[layer][0].path in paths:
        s = _mlp(ma, mb, layer, nm, Q, neurons, dtype)
    elif ma.attention(layer) is not None:
        s = _attention(ma, mb, layer, nm, Q, dtype)
    else:
        return None
    if not bool(torch.isfinite(s).all()):
        return None
    g = mb.gain(nm).to(dtype) * s
    return mb.replace({f"{nm.path}.weight": (g - nm.offset).to(mb.tensors[f"{nm.path}.weight"].dtype)})
