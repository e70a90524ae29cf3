"""Per-head symmetries of one attention layer, on `ModelTensors` (docs/theory.md §2-§5):

* :func:`value_transform`: ``W_V -> W_V C``, ``W_O^h -> C^{-1} W_O^h``, ``b_V -> b_V C`` per
  key/value group (QuaRot's and SpinQuant's R2 when ``C`` is orthogonal; §3);
* :func:`query_key_transform`: ``W_Q -> W_Q M``, ``W_K -> W_K M^{-T}`` (biases alike) per kv group,
  ``M`` in the commutant of RoPE (per rotated plane a scaled rotation, any invertible block on
  the pass-through dims; §2, §5.2): the scores ``q M (k M^{-T})^T = q k^T`` and RoPE commutes
  with ``M``;
* :func:`head_permutation`: the query heads reordered, key/value groups as wholes (a head
  must stay with its kv group's keys and values; the output sums over heads).

The attention tensors are read and written by the family's adapter, so fused layouts (GPT-2's
``c_attn``, GPT-NeoX's ``query_key_value``, Phi-3's ``qkv_proj``) are handled alike. Each takes a
`ModelTensors` (or a Hugging Face model, see `attnid.whole.transforms.state`).
"""

from __future__ import annotations

from dataclasses import fields

import torch

from attnid.errors import AttnidError
from attnid.rope import project_commutant
from attnid.symmetry.gauge import Gauge, apply_gauge
from attnid.weights import AttentionWeights
from attnid.whole.transforms.state import ModelTensors, on_modules


def _layer(m: ModelTensors, layer: int) -> AttentionWeights:
    w = m.attention(layer)
    if w is None:
        raise AttnidError(f"layer {layer}'s attention tensors are not here")
    return w


def _invertible(X: torch.Tensor, what: str) -> None:
    s = torch.linalg.svdvals(X.to(torch.float64))
    if bool((s[..., -1] <= 1e-12 * s[..., 0]).any()):
        raise AttnidError(f"{what} must be invertible in every key/value group")


@on_modules
def value_transform(m: ModelTensors, layer: int, C: torch.Tensor) -> ModelTensors:
    """Per key/value group ``C`` (``[G, dv, dv]``, invertible): values ``* C``, the kv group's
    output rows ``C^{-1} *``, the value bias ``* C``."""
    w = _layer(m, layer)
    s = w.spec
    if tuple(C.shape) != (s.n_kv_heads, s.v_head_dim, s.v_head_dim):
        raise AttnidError(f"layer {layer}: a V/O transform is [{s.n_kv_heads}, {s.v_head_dim}, "
                          f"{s.v_head_dim}], got {list(C.shape)}")
    _invertible(C, "a V/O transform")
    return m.replace(m.attention_changes(layer, apply_gauge(w, Gauge(vo=C.to(w.W_V.dtype)))))


@on_modules
def query_key_transform(m: ModelTensors, layer: int, M: torch.Tensor) -> ModelTensors:
    """Per key/value group ``M`` (``[G, dk, dk]``, invertible, in the RoPE commutant): queries
    ``* M``, keys ``* M^{-T}`` (biases alike)."""
    w = _layer(m, layer)
    s = w.spec
    if s.qk_norm != "none":
        raise AttnidError(f"layer {layer}: under QK-norm the queries and keys are normalised per "
                          "head, so only the norm gains trade (no Q/K transform)")
    if tuple(M.shape) != (s.n_kv_heads, s.head_dim, s.head_dim):
        raise AttnidError(f"layer {layer}: a Q/K transform is [{s.n_kv_heads}, {s.head_dim}, "
                          f"{s.head_dim}], got {list(M.shape)}")
    M = M.to(torch.float64)
    off = float((project_commutant(M, s) - M).norm() / M.norm().clamp_min(1e-300))
    if off > 1e-10:
        raise AttnidError(f"layer {layer}: the Q/K transform does not commute with RoPE "
                          f"(relative distance {off:.1e} from the commutant)")
    _invertible(M, "a Q/K transform")
    return m.replace(m.attention_changes(layer, apply_gauge(w, Gauge(qk=M.to(w.W_Q.dtype)))))


@on_modules
def attention_gauge(m: ModelTensors, layer: int, g: Gauge) -> ModelTensors:
    """Any element of the layer's attention group (`attnid.symmetry.Gauge`: key-bias and
    value-bias shifts, QK-norm gain transfers and scales, as well as Q/K and V/O maps) applied to
    its tensors (the pieces cast to their dtype). What is not a symmetry of this layer is refused:
    a piece the layer has no tensor for, or a change of its output on random inputs (float64)
    beyond rounding (a key-bias shift on rotated dims, a value-bias shift the output bias cannot
    absorb, QK-norm scales with ``eps > 0``)."""
    from attnid.numerics import relative_error, tolerance

    w = _layer(m, layer)
    w64 = w.to(torch.float64)
    try:
        exact = apply_gauge(w64, _cast(g, torch.float64))
        stored = exact if w.W_Q.dtype == torch.float64 else apply_gauge(w, _cast(g, w.W_Q.dtype))
    except ValueError as e:
        raise AttnidError(f"layer {layer}: {e}") from None
    x = torch.randn(2, 8, w.spec.d_model, generator=torch.Generator().manual_seed(layer), dtype=torch.float64)
    with torch.no_grad():
        before = w64.to_module(copy=False)(x, causal=True)
        after = exact.to_module(copy=False)(x, causal=True)
    err = relative_error(after, before)
    if not err <= tolerance(torch.float64):
        raise AttnidError(f"layer {layer}: this attention gauge is not a symmetry of the layer "
                          f"(its output changes by {err:.1e}, relative)")
    return m.replace(m.attention_changes(layer, stored))


def _cast(g: Gauge, dtype: torch.dtype) -> Gauge:
    pieces = {f.name: getattr(g, f.name) for f in fields(Gauge)}
    return Gauge(**{k: None if v is None else v.to(dtype) for k, v in pieces.items()})


def kv_group_permutation(perm: torch.Tensor, n_heads: int, n_kv_heads: int) -> torch.Tensor:
    """The key/value group order of a head permutation that keeps groups whole (``[G]``)."""
    perm = torch.as_tensor(perm, dtype=torch.long)
    m = n_heads // n_kv_heads
    if tuple(perm.shape) != (n_heads,) or not torch.equal(perm.sort().values, torch.arange(n_heads)):
        raise AttnidError(f"not a permutation of the {n_heads} query heads")
    kv_groups = (perm // m).reshape(n_kv_heads, m)
    if not bool((kv_groups == kv_groups[:, :1]).all()):
        raise AttnidError("a head permutation must move key/value groups as wholes")
    return kv_groups[:, 0]


group_permutation = kv_group_permutation  # deprecated alias (one release)


@on_modules
def head_permutation(m: ModelTensors, layer: int, perm: torch.Tensor) -> ModelTensors:
    """New query head ``h`` is old head ``perm[h]`` (``[H]``), its key/value group moving along."""
    w = _layer(m, layer)
    s = w.spec
    gp = kv_group_permutation(perm, s.n_heads, s.n_kv_heads)
    perm = torch.as_tensor(perm, dtype=torch.long)
    new = {n: t[perm] for n, t in (("W_Q", w.W_Q), ("W_O", w.W_O), ("b_Q", w.b_Q)) if t is not None}
    new |= {n: t[gp] for n, t in (("W_K", w.W_K), ("W_V", w.W_V), ("b_K", w.b_K), ("b_V", w.b_V))
            if t is not None}
    return m.replace(m.attention_changes(layer, w.replace(**new)))
