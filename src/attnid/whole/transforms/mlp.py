"""MLP symmetries (docs/theory.md §13.10). A gated MLP ``down(act(gate x) * up x)`` is linear
in ``up``'s row ``j``; ``relu(c z) = c relu(z)`` for ``c > 0``. Either way neuron ``j``'s input
side ``* c_j`` and ``down``'s column ``j`` ``/ c_j`` keep the output (:func:`mlp_scaling`). Any
MLP is a sum over its neurons, so permuting them (every input row, the gate's too, and the
down columns alike) keeps it (:func:`neuron_permutation`).

Each takes a `ModelTensors` (or a Hugging Face model, see `attnid.whole.transforms.state`).
"""

from __future__ import annotations

import torch

from attnid.errors import AttnidError
from attnid.whole.transforms.layout import Lin
from attnid.whole.transforms.state import ModelTensors, on_modules, weight_change


def _rows(lin: Lin, n: int) -> tuple[int, int]:
    return lin.rows or (0, n)


def _mlp(m: ModelTensors, layer: int) -> tuple[Lin, Lin, Lin | None]:
    up, down = m.layout.mlps[layer]
    gate = m.layout.gates[layer] if m.layout.gates else None
    return up, down, gate


@on_modules
def mlp_scaling(m: ModelTensors, layer: int, c: torch.Tensor) -> ModelTensors:
    """MLP of ``layer``: up-projection rows (and bias) ``* c``, down-projection columns ``/ c``
    (``c`` ``[d_ff]``: nonzero for a gated MLP, positive for ReLU). A fused ``gate_up_proj``
    scales only its up rows."""
    lay = m.layout
    if lay.mlp == "other":
        raise AttnidError("only gated and ReLU MLPs scale per neuron (GELU and SiLU are not "
                          "homogeneous)")
    if lay.mlp == "relu" and bool((c <= 0).any()):
        raise AttnidError("ReLU commutes only with positive scales")
    if bool((c == 0).any()):
        raise AttnidError("a zero scale is not invertible")
    up, down, _ = _mlp(m, layer)
    W = m.weight(up)
    lo, hi = _rows(up, W.shape[0])
    scale = torch.ones(W.shape[0], dtype=W.dtype)
    scale[lo:hi] = c.to(W.dtype)
    out = weight_change(up, W * scale[:, None])
    b = m.bias(up)
    if b is not None:
        out[f"{up.path}.bias"] = b * scale
    Wd = m.weight(down)
    out.update(weight_change(down, Wd / c.to(Wd.dtype)[None, :]))
    return m.replace(out)


@on_modules
def neuron_permutation(m: ModelTensors, layer: int, perm: torch.Tensor) -> ModelTensors:
    """MLP of ``layer``: new neuron ``j`` is old neuron ``perm[j]`` (``perm`` a permutation of
    ``range(d_ff)``): the rows of the up projection, of the gate and their biases, the columns
    of the down projection."""
    up, down, gate = _mlp(m, layer)
    perm = torch.as_tensor(perm, dtype=torch.long)
    f = m.weight(down).shape[1]
    if tuple(perm.shape) != (f,) or not torch.equal(perm.sort().values, torch.arange(f)):
        raise AttnidError(f"layer {layer}: not a permutation of the {f} MLP neurons")
    out: dict[str, torch.Tensor] = {}
    for lin in {x.path: x for x in (up, gate) if x is not None}.values():  # fused: one map
        W, b = m.weight(lin), m.bias(lin)
        idx = torch.arange(W.shape[0])
        for part in {up, gate} - {None}:
            if part.path == lin.path:
                lo, hi = _rows(part, W.shape[0])
                idx[lo:hi] = lo + perm
        out.update(weight_change(lin, W[idx]))
        if b is not None:
            out[f"{lin.path}.bias"] = b[idx]
    out.update(weight_change(down, m.weight(down)[:, perm]))
    return m.replace(out)
