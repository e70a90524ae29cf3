"""Symmetries of the residual stream (docs/theory.md §13.5, §13.6, §13.9).

* :func:`residual_rotation`: the stream ``x -> x Q`` (``Q`` orthogonal; fixing all-ones under
  LayerNorm, which commutes only with such ``Q``); an untied unembedding, or a tied one whose
  final norm has a uniform gain (which commutes with every ``Q``);
* :func:`ones_shift` (LayerNorm): a write into the stream plus a multiple of all-ones
  (``W -> W + 1 a^T``, bias ``+ c 1``): every reader sees the stream through a LayerNorm;
* :func:`table_shift` (LayerNorm): each row of an embedding table plus ``c_r 1``;
* :func:`parallel_bias_transfer`: a parallel layer's two output biases trade ``delta``.

Each takes a `ModelTensors` (or a Hugging Face model, see `attnid.whole.transforms.state`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch

from attnid.errors import AttnidError
from attnid.whole.transforms.layout import Layout
from attnid.whole.transforms.orthogonal import hadamard, hadamard_factors, kron_right
from attnid.whole.transforms.state import ModelTensors, on_modules, weight_change


def rotation_refusal(lay: Layout, final_gain: torch.Tensor | None = None) -> str | None:
    """Why the residual stream of this layout cannot rotate (None when it can): post-LN, a
    bare model's hidden states, a tied head behind a non-uniform final gain."""
    if lay.post:
        return ("post-LN: the residual stream is a LayerNorm's output, whose gain does not "
                "commute with rotations")
    if lay.unembed is None:
        return "a bare model returns its hidden states in fixed coordinates"
    if lay.tied and final_gain is not None:
        spread = float((final_gain - final_gain.mean()).abs().max())
        if spread > 1e-12 * max(float(final_gain.abs().max()), 1e-300):
            return (f"tied embeddings: the final norm {lay.final.path}'s gain is not uniform "
                    f"(spread {spread:.2e}), so it does not commute with a rotation")
    return None


def check_orthogonal(Q: torch.Tensor, lay: Layout, d: int) -> torch.Tensor:
    """``Q`` as float64 after checking it is orthogonal ``[d, d]`` (and fixes all-ones under
    LayerNorm)."""
    Q = Q.to(torch.float64)
    eye = torch.eye(d, dtype=torch.float64)
    if tuple(Q.shape) != (d, d) or float((Q.T @ Q - eye).abs().max()) > 1e-10:
        raise AttnidError(f"the residual rotation must be an orthogonal {d} x {d} matrix")
    ones = torch.ones(d, dtype=torch.float64)
    if lay.norm == "layer" and float((Q @ ones - ones).abs().max()) > 1e-10:
        raise AttnidError("under LayerNorm the rotation must fix all-ones (Q 1 = 1)")
    return Q


Rotate = Callable[[torch.Tensor], torch.Tensor]  # X [..., d] -> X Q
_last: list[tuple[weakref.ref, int, bool, bool]] = []  # the rotation checked last: Hadamard or not


def _verified(Q: torch.Tensor, lay: Layout) -> tuple[torch.Tensor, Rotate]:
    """`check_orthogonal` of ``Q`` and how to apply it, ``X -> X Q``: for `hadamard` ``(d)`` a
    Kronecker product of small factors (`attnid.whole.transforms.orthogonal.kron_right`: a
    checkpoint rewritten with R1 = Hadamard costs a few passes over each weight instead of a
    ``d x d`` product), else the product. The last rotation checked is remembered (the same
    tensor, unchanged since), so a checkpoint rewritten unit by unit checks it once; what is
    applied is made from ``Q`` at each call, so that a ``Q`` with a gradient keeps it whether
    the check ran with gradients on or off (`attnid.whole.align.refine_units` runs both)."""
    layer_norm = lay.norm == "layer"
    d = Q.shape[0]
    factors = hadamard_factors(d)
    hit = _last and _last[0][0]() is Q and Q._version == _last[0][1] and (_last[0][2] or not layer_norm)
    if hit:
        Q64, is_hadamard = Q.to(torch.float64), _last[0][3]
    else:
        Q64 = check_orthogonal(Q, lay, d)
        is_hadamard = factors is not None and torch.equal(Q64, hadamard(d))
        _last[:] = [(weakref.ref(Q), Q._version, layer_norm, is_hadamard)]
    if is_hadamard and factors is not None:
        def rotate(X: torch.Tensor) -> torch.Tensor:
            return kron_right(X, factors, d**-0.5)
    else:
        cast: dict[torch.dtype, torch.Tensor] = {}

        def rotate(X: torch.Tensor) -> torch.Tensor:
            if X.dtype not in cast:
                cast[X.dtype] = Q64.to(X.dtype)
            return X @ cast[X.dtype]
    return Q64, rotate


@on_modules
def residual_rotation(m: ModelTensors, Q: torch.Tensor) -> ModelTensors:
    """``x -> x Q`` on the residual stream (``Q`` orthogonal ``[d, d]``; ``Q 1 = 1`` under
    LayerNorm). The norms' gains stay: a reader ``W`` of a norm with gain ``g`` becomes
    ``W diag(g) Q diag(1/g)`` and the norm's bias ``b -> g * (Q^T (b / g))``; writers ``Q^T W``,
    their biases and the embedding rows rotate. A tied head behind a uniform final gain ``c 1``
    rotates with its table (its LayerNorm bias ``-> Q^T b``)."""
    lay = m.layout
    final = lay.final if lay.final is not None and f"{lay.final.path}.weight" in m else None
    why = rotation_refusal(lay, None if final is None else m.gain(final))
    if why:
        raise AttnidError(f"cannot rotate the residual stream: {why}")
    Q, rotate = _verified(Q, lay)  # X -> X Q; Q^T Y = (Y^T Q)^T
    out: dict[str, torch.Tensor] = {}
    for t in lay.tables:
        if f"{t}.weight" in m:
            out[f"{t}.weight"] = rotate(m.tensors[f"{t}.weight"])
    for nm in lay.norms:
        if not m.complete([f"{nm.path}.weight", *(f"{r.path}.weight" for r in nm.readers)],
                          f"rotating the readers of {nm.path}"):
            continue
        g, b = m.gain(nm), m.norm_bias(nm)
        for lin in nm.readers:  # the product divided in place: two full-size temporaries, not three
            out.update(weight_change(lin, rotate(m.weight(lin) * g[None, :]).div_(g[None, :])))
        if b is not None:
            out[f"{nm.path}.bias"] = g * rotate((b / g)[None, :])[0]
    if lay.tied and final is not None and m.norm_bias(final) is not None:
        out[f"{final.path}.bias"] = rotate(m.norm_bias(final)[None, :])[0]
    for lin in (x for layer in lay.writers for x in layer):
        if not m.has(lin):
            continue
        out.update(weight_change(lin, rotate(m.weight(lin).T).T))
        c = m.bias(lin)
        if c is not None:
            out[f"{lin.path}.bias"] = rotate(c[None, :])[0]
    return m.replace(out)


@on_modules
def ones_shift(m: ModelTensors, layer: int, which: int, a: torch.Tensor, c: float = 0.0
               ) -> ModelTensors:
    """LayerNorm models: writer ``which`` (0 attention, 1 MLP) of ``layer``:
    ``W -> W + 1 a^T`` (``a`` ``[in]``), bias ``+ c 1``."""
    lay = m.layout
    if lay.norm != "layer":
        raise AttnidError("all-ones shifts need LayerNorm")
    lin = lay.writers[layer][which]
    W = m.weight(lin)
    one = torch.ones(W.shape[0], dtype=W.dtype)
    out = weight_change(lin, W + one[:, None] * a.to(W.dtype)[None, :])
    if c:
        b = m.bias(lin)
        if b is None:
            raise AttnidError(f"{lin.path} has no bias")
        out[f"{lin.path}.bias"] = b + c * one
    return m.replace(out)


@on_modules
def table_shift(m: ModelTensors, table: int, c: torch.Tensor) -> ModelTensors:
    """LayerNorm models: row ``r`` of embedding table ``table`` plus ``c[r] 1``. A tied token
    table is also the unembedding: only a constant ``c`` keeps the log-probabilities."""
    lay = m.layout
    if lay.norm != "layer":
        raise AttnidError("all-ones shifts need LayerNorm")
    if table == 0 and lay.tied and float((c - c[0]).abs().max()) > 0:
        raise AttnidError("a tied token table takes only a constant shift")
    E = m.tensors[f"{lay.tables[table]}.weight"]
    return m.replace({f"{lay.tables[table]}.weight": E + c.to(E.dtype)[:, None]})


@on_modules
def parallel_bias_transfer(m: ModelTensors, layer: int, delta: torch.Tensor) -> ModelTensors:
    """Parallel layout: attention output bias ``+ delta``, MLP output bias ``- delta``."""
    lay = m.layout
    if not lay.parallel:
        raise AttnidError("only a parallel layer adds both outputs to one stream")
    att, mlp = lay.writers[layer]
    ba, bm = m.bias(att), m.bias(mlp)
    if ba is None or bm is None:
        raise AttnidError("both output biases are needed")
    return m.replace({f"{att.path}.bias": ba + delta.to(ba.dtype),
                      f"{mlp.path}.bias": bm - delta.to(bm.dtype)})
