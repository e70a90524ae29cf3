"""The activation-aware weight-quantization objective of `attnid rewrite --optimize` (issue 27;
docs/theory.md §13.23).

For each linear layer ``W`` of a decoder layer, the change its round-to-nearest (`fake_quantize`)
causes is carried, on calibration activations, to the first place the symmetry group no longer
acts, and compared there with what the same place holds in the float model:

* ``v``, ``o``: the attention's output (the residual stream), through the attention
  probabilities and the output map: ``sum_h P_h (X dW_V) W_O^h`` and ``Z dW_O``;
* ``q``, ``k``: the causal attention scores after RoPE, ``rope(X dW_Q) rope(K)^T`` and
  ``rope(Q) rope(X dW_K)^T``;
* ``gate``, ``up``, ``down``: the MLP's output, ``((act(G + X dW_g) - act(G)) * U) W_d^T``,
  ``(act(G) * X dW_u^T) W_d^T`` and ``H dW_d^T``.

Each term is the squared error divided by the squared float value at the same place (the
*reference*), and the objective is the sum over linear layers and layers. The reference is a
product across the pair the group couples (``W_V A`` with ``A^-1 W_O``, up with down, a norm
gain with its readers, ``Q M`` with ``K M^-T``, the stream with every reader and writer), so it
is the same for every group element; the error is measured through the unquantized partner, so
scaling one factor by ``t`` and the other by ``1/t`` leaves it unchanged (RTN is positively
homogeneous, ``Q(t W) = t Q(W)``). The activations are held in the folded, unrotated frame
(`LayerCalibration`); a transformed layer's inputs are those activations rotated by the
element's residual rotation and multiplied by the layer's current norm gains, and everything
downstream (keys, values, ``Z``, ``H``) is recomputed from the transformed weights.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass

import torch

from attnid.errors import AttnidError
from attnid.quantize.rtn import Scheme, fake_quantize
from attnid.rope import apply_rope, rope_tables
from attnid.weights import AttentionWeights
from attnid.whole.transforms.layout import Layout, Lin, Norm
from attnid.whole.transforms.state import ModelTensors

__all__ = ["ATTENTION", "KINDS", "MLP", "LayerCalibration", "Terms", "layer_terms", "mlp_norm",
           "objective_value", "rtn_change"]

ATTENTION = ("q", "k", "v", "o")
MLP = ("gate", "up", "down")
KINDS = ATTENTION + MLP
Terms = dict[str, tuple[float, float]]  # kind -> (squared error, squared reference)


@dataclass(frozen=True)
class LayerCalibration:
    """One decoder layer's calibration activations, in the folded and unrotated frame: each
    norm's output at gain 1 (what a reader sees once the gain is folded into it), chunked."""

    attn_in: torch.Tensor  # [c, T, d]
    mlp_in: torch.Tensor  # [c, T, d]
    probs: torch.Tensor  # [c, H, T, T] the attention probabilities (causal, softmaxed)


def rtn_change(W: torch.Tensor, scheme: Scheme) -> torch.Tensor:
    """``fake_quantize(W) - W`` of a weight ``[out, in]`` (rows and blocks along ``in``)."""
    return fake_quantize(W, scheme) - W


def objective_value(terms: Collection[Terms]) -> float:
    """The objective: the sum of every term's error over its reference."""
    return sum(e / r for t in terms for e, r in t.values() if r > 0)


def mlp_norm(lay: Layout, layer: int) -> Norm:
    """The norm the MLP of ``layer`` reads (the one whose readers hold its up projection)."""
    up = lay.mlps[layer][0]
    for nm in lay.norms:
        if up in nm.readers:
            return nm
    raise AttnidError(f"layer {layer}: no norm reads {up.path}")


def _norm(lay: Layout, path: str) -> Norm:
    return next(n for n in lay.norms if n.path == path)


def _sq(x: torch.Tensor) -> float:
    return float(x.double().square().sum())


def layer_terms(m: ModelTensors, layer: int, calib: LayerCalibration, scheme: Scheme,
                rotation: torch.Tensor | None, act: Callable[[torch.Tensor], torch.Tensor],
                kinds: Collection[str] = KINDS, refs: Terms | None = None) -> Terms:
    """The terms of ``kinds`` (`KINDS`) of one transformed layer ``m`` (a `ModelTensors` holding
    it), ``rotation`` the residual rotation applied to it (None: none), ``act`` the MLP's
    activation; ``refs``: terms of the same layer under any element, whose references are
    taken instead of recomputed."""
    out: Terms = {}
    if any(k in ATTENTION for k in kinds):
        out |= _attention_terms(m, layer, calib, scheme, rotation, kinds, refs)
    if any(k in MLP for k in kinds):
        out |= _mlp_terms(m, layer, calib, scheme, rotation, act, kinds, refs)
    return out


def _inputs(m: ModelTensors, nm: Norm, x: torch.Tensor, rotation: torch.Tensor | None) -> torch.Tensor:
    """A norm's readers' input ``[c, T, d]``: the gain-1 output, rotated, times the current gain."""
    if rotation is not None:
        x = x @ rotation.to(x.dtype)
    return x * m.gain(nm).to(x.dtype)


def _attention_terms(m: ModelTensors, i: int, calib: LayerCalibration, scheme: Scheme,
                     rotation: torch.Tensor | None, kinds: Collection[str], refs: Terms | None) -> Terms:
    w: AttentionWeights | None = m.attention(i)
    if w is None:
        raise AttnidError(f"internal: layer {i}'s attention is not in this unit")
    s = w.spec
    H, G = s.n_heads, s.n_kv_heads
    X = _inputs(m, _norm(m.layout, m.layout.attn_norm(i)), calib.attn_in, rotation)  # [c, T, d]
    T = X.shape[1]
    dt = X.dtype

    c = X.shape[0]
    Xf = X.reshape(c * T, -1)

    def heads(W: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:  # [n, d, k] -> [c, n, T, k]
        n, d, k = W.shape
        y = (Xf @ W.to(dt).permute(1, 0, 2).reshape(d, n * k)).reshape(c, T, n, k).transpose(1, 2)
        return y if b is None else y + b.to(dt)[None, :, None, :]

    def output(Zh: torch.Tensor, W: torch.Tensor) -> torch.Tensor:  # [c, H, T, dv] [H, dv, d] -> [cT, d]
        return Zh.transpose(1, 2).reshape(c * T, -1) @ W.reshape(-1, W.shape[-1])

    def per_query(y: torch.Tensor) -> torch.Tensor:  # [c, G, T, k] -> [c, H, T, k]
        return y.repeat_interleave(H // G, dim=1)

    def change(W: torch.Tensor) -> torch.Tensor:  # W [n, d, k]: quantized as rows (n, k) over d
        n, d, k = W.shape
        stored = W.permute(0, 2, 1).reshape(n * k, d)
        return rtn_change(stored, scheme).reshape(n, k, d).permute(0, 2, 1)

    cos, sin = rope_tables(s, torch.arange(T), dt)
    rope = lambda y: apply_rope(y, s, cos, sin)  # noqa: E731
    mask = torch.ones(T, T, dtype=torch.bool).tril()

    def scores(a: torch.Tensor, b: torch.Tensor) -> float:  # both already rotated by RoPE
        return _sq((a @ b.transpose(-1, -2)).masked_fill(~mask, 0))

    out: Terms = {}
    if "q" in kinds or "k" in kinds:
        q, k = rope(heads(w.W_Q, w.b_Q)), rope(per_query(heads(w.W_K, w.b_K)))
        ref = _ref(refs, ("q", "k"), lambda: scores(q, k))
        if "q" in kinds:
            out["q"] = (scores(rope(heads(change(w.W_Q), None)), k), ref)
        if "k" in kinds:
            out["k"] = (scores(q, rope(per_query(heads(change(w.W_K), None)))), ref)
    if "v" in kinds or "o" in kinds:
        P = calib.probs.to(dt)  # [c, H, T, T]
        W_O = w.W_O.to(dt)  # [H, dv, d]
        Z = P @ per_query(heads(w.W_V, w.b_V))  # [c, H, T, dv]
        ref = _ref(refs, ("v", "o"), lambda: _sq(output(Z, W_O)))
        if "v" in kinds:
            out["v"] = (_sq(output(P @ per_query(heads(change(w.W_V), None)), W_O)), ref)
        if "o" in kinds:
            stored = W_O.reshape(H * s.v_head_dim, -1).T  # [d, H dv]
            out["o"] = (_sq(Z.transpose(1, 2).reshape(c * T, -1) @ rtn_change(stored, scheme).T), ref)
    return out


def _ref(refs: Terms | None, kinds: tuple[str, ...], compute: Callable[[], float]) -> float:
    """A reference from ``refs`` (they are the same for every group element) or computed."""
    for k in kinds:
        if refs is not None and k in refs:
            return refs[k][1]
    return compute()


def _weight(m: ModelTensors, lin: Lin, dt: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    b = m.bias(lin)
    return m.weight(lin).to(dt), None if b is None else b.to(dt)


def _mlp_terms(m: ModelTensors, i: int, calib: LayerCalibration, scheme: Scheme,
               rotation: torch.Tensor | None, act: Callable[[torch.Tensor], torch.Tensor],
               kinds: Collection[str], refs: Terms | None) -> Terms:
    lay = m.layout
    X = _inputs(m, mlp_norm(lay, i), calib.mlp_in, rotation).flatten(0, 1)  # [n, d]
    dt = X.dtype
    up_lin, down_lin = lay.mlps[i]
    Wu, bu = _weight(m, up_lin, dt)  # [f, d]
    Wd, _ = _weight(m, down_lin, dt)  # [d, f]
    U = X @ Wu.T + (0 if bu is None else bu)
    if lay.mlp == "gated":
        Wg, bg = _weight(m, lay.gates[i], dt)
        Gp = X @ Wg.T + (0 if bg is None else bg)
        A = act(Gp)
        Hn = A * U  # [n, f]
    else:
        Wg = Gp = None
        A = None
        Hn = act(U)
    ref = _ref(refs, MLP, lambda: _sq(Hn @ Wd.T))
    out: Terms = {}
    if "gate" in kinds and Wg is not None:
        dG = X @ rtn_change(Wg, scheme).T
        out["gate"] = (_sq(((act(Gp + dG) - A) * U) @ Wd.T), ref)
    if "up" in kinds:
        dU = X @ rtn_change(Wu, scheme).T
        changed = A * dU if A is not None else act(U + dU) - Hn
        out["up"] = (_sq(changed @ Wd.T), ref)
    if "down" in kinds:
        out["down"] = (_sq(Hn @ rtn_change(Wd, scheme).T), ref)
    return out
