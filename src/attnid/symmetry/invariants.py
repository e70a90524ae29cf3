"""The invariants of one attention layer's symmetry group, and the group element that best
maps one layer onto another (what `attnid diff` certifies and fits per layer; docs/theory.md
§2-§5).

* QK, per query head: ``W~_Q^h W~_K^gT`` with ``W~ = [W; b]`` (bias row appended) and the
  key bias's pass-through part removed (key-bias translation). Under RoPE the product is
  split into what RoPE keeps apart: the pass-through block, and per rotated plane its
  ``cos`` part ``q1 k1^T + q2 k2^T`` and its ``sin`` part ``q1 k2^T - q2 k1^T``; only the
  commutant of RoPE leaves these unchanged, so a full GL rotation of Q/K under RoPE is caught.
  QK-norm: ``W_Q``, ``W_K`` and the gain product ``g_Q g_K`` directly.
* VO, per head: ``W_V^g W_O^h``; with an elementwise output gate (``vo_gauge="diagonal"``)
  only per-dim scalings commute with the gate, so per dim ``v_j o_j^T``.
* the effective output bias ``b_O + sum_g b_V^g sum_{h in g} W_O^h`` (value-bias folding).

Each residual is relative to the product of the factors' norms, the size rounding acts on.
Products are compared in an orthonormal basis of the factors' column spaces (``[..., 2k,
2k]``, never ``d x d``). :func:`align` fits, per kv group, the gauge that best maps B onto A
(least squares on the stacked query heads and on the values; RoPE: within the commutant);
:func:`compare_layers` reports the distance after alignment and the share of the raw
difference that is pure gauge (what the fitted element leaves is then projected off the
orbit's tangent space at A, the first-order step that makes small differences, as in
fine-tuning, come out right).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

from attnid.errors import AttnidError
from attnid.rope import in_commutant, plane_dims
from attnid.spec import AttentionSpec
from attnid.symmetry.projection import remove_tangent
from attnid.weights import AttentionWeights, kv_group_sum_out

VOGauge = Literal["gl", "diagonal"]
@dataclass(frozen=True)
class LayerDiff:
    raw_distance: float  # ||B - A|| over the layer's stored tensors
    aligned_distance: float  # ||g.B - A|| after the fitted group element
    gauge_share: float  # 1 - aligned^2 / raw^2 (clipped to [0, 1]; 1 when A == B)
    worst_tensor: str  # the invariant with the largest residual
    worst_head: int
    residual: float  # that residual (relative to the factors' scale)
    residuals: dict[str, float]  # max over heads, per invariant

    def to_dict(self) -> dict[str, Any]:
        return {"raw_distance": self.raw_distance, "aligned_distance": self.aligned_distance,
                "gauge_share": self.gauge_share, "worst_tensor": self.worst_tensor,
                "worst_head": self.worst_head, "residual": self.residual, "residuals": self.residuals}


# ---- invariants -------------------------------------------------------------------------
def _basis(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Orthonormal basis ``[..., d, <=2k]`` of the column spaces of ``a, b [..., d, k]``."""
    return torch.linalg.qr(torch.cat([a, b], dim=-1))[0]


def _with_bias(x: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    row = torch.zeros_like(x[..., :1, :]) if b is None else b.unsqueeze(-2)
    return torch.cat([x, row], dim=-2)


def _qk_parts(q: torch.Tensor, k: torch.Tensor, spec: AttentionSpec) -> torch.Tensor:
    """``q [H, a, dk]``, ``k [H, b, dk]`` -> the RoPE-separated products ``[H, n, a, b]``."""
    r = spec.rope_dims
    parts = [q[..., r:] @ k[..., r:].transpose(-1, -2)]
    if r:
        i1, i2 = plane_dims(spec)
        q1, q2, k1, k2 = q[..., i1], q[..., i2], k[..., i1], k[..., i2]  # [H, a, r/2]
        cos = torch.einsum("hap,hbp->hpab", q1, k1) + torch.einsum("hap,hbp->hpab", q2, k2)
        sin = torch.einsum("hap,hbp->hpab", q1, k2) - torch.einsum("hap,hbp->hpab", q2, k1)
        parts = [parts[0].unsqueeze(1), cos, sin]
        return torch.cat(parts, dim=1)
    return parts[0].unsqueeze(1)


def _block_residuals(dP: torch.Tensor, scale: torch.Tensor, names: tuple[str, str, str, str]
                     ) -> dict[str, torch.Tensor]:
    """Split ``dP [H, n, a+1, b+1]`` (bias row/column last) into its four blocks, per head."""
    sq = dP**2
    blocks = {names[0]: sq[..., :-1, :-1], names[1]: sq[..., -1:, :-1],
              names[2]: sq[..., :-1, -1:], names[3]: sq[..., -1:, -1:]}
    return {n: b.sum(dim=(-3, -2, -1)).sqrt() / scale for n, b in blocks.items()}


def _key_bias(w: AttentionWeights) -> torch.Tensor | None:
    """The key bias with its invisible (pass-through) part removed."""
    if w.b_K is None:
        return None
    b = w.b_K.clone()
    b[..., w.spec.rope_dims:] = 0.0
    return b


def qk_residuals(A: AttentionWeights, B: AttentionWeights) -> dict[str, torch.Tensor]:
    """Per query head, relative residual of each QK invariant block: ``{name: [H]}``."""
    s = A.spec
    m = s.kv_group_size
    if s.qk_norm != "none":
        out = {}
        for n in ("W_Q", "W_K"):
            d = (A[n] - B[n]).flatten(-2).norm(dim=-1) / A[n].flatten(-2).norm(dim=-1).clamp_min(1e-300)
            out[n] = d.repeat_interleave(m) if n == "W_K" else d
        g_A, g_B = A.g_Q * A.g_K, B.g_Q * B.g_K
        out["g_Q*g_K"] = ((g_A - g_B).norm() / g_A.norm().clamp_min(1e-300)).expand(s.n_heads)
        return out
    kA, kB = (x.repeat_interleave(m, dim=0) for x in (A.W_K, B.W_K))  # [H, d, dk]
    U, V = _basis(A.W_Q, B.W_Q), _basis(kA, kB)
    qa, qb = _with_bias(U.mT @ A.W_Q, A.b_Q), _with_bias(U.mT @ B.W_Q, B.b_Q)
    bkA, bkB = (None if b is None else b.repeat_interleave(m, dim=0) for b in (_key_bias(A), _key_bias(B)))
    ka, kb = _with_bias(V.mT @ kA, bkA), _with_bias(V.mT @ kB, bkB)
    scale = torch.maximum(qa.flatten(-2).norm(dim=-1) * ka.flatten(-2).norm(dim=-1),
                          qb.flatten(-2).norm(dim=-1) * kb.flatten(-2).norm(dim=-1)).clamp_min(1e-300)
    parts = 1 + s.rope_dims  # the pass-through block, each plane's cos and sin parts
    step = max(1, 2**24 // (parts * qa.shape[-2] * ka.shape[-2]))  # heads at a time: bounded memory
    out: dict[str, list[torch.Tensor]] = {}
    for h in range(0, s.n_heads, step):
        c = slice(h, h + step)
        dP = _qk_parts(qa[c], ka[c], s) - _qk_parts(qb[c], kb[c], s)
        for n, r in _block_residuals(dP, scale[c], ("W_Q·W_K", "b_Q·W_K", "W_Q·b_K", "b_Q·b_K")).items():
            out.setdefault(n, []).append(r)
    return {n: torch.cat(r) for n, r in out.items()}


def effective_out_bias(w: AttentionWeights) -> torch.Tensor:
    """``b_O + sum_g b_V^g sum_{h in g} W_O^h`` (zeros when neither bias exists): ``[d]``."""
    out = torch.zeros(w.spec.d_model, dtype=w.W_O.dtype) if w.b_O is None else w.b_O
    if w.b_V is not None:
        out = out + torch.einsum("gv,gvd->d", w.b_V, kv_group_sum_out(w))
    return out


def vo_residuals(A: AttentionWeights, B: AttentionWeights, vo_gauge: VOGauge = "gl"
                 ) -> dict[str, torch.Tensor]:
    """Per head, relative residual of the VO invariant and of the effective output bias."""
    s = A.spec
    m = s.kv_group_size
    vA, vB = (x.repeat_interleave(m, dim=0) for x in (A.W_V, B.W_V))  # [H, d, dv]
    oA, oB = A.W_O.mT, B.W_O.mT  # [H, d, dv]
    U, V = _basis(vA, vB), _basis(oA, oB)
    va, vb, oa, ob = U.mT @ vA, U.mT @ vB, V.mT @ oA, V.mT @ oB  # [H, c, dv]
    if vo_gauge == "diagonal":
        dP = torch.einsum("hav,hbv->hvab", va, oa) - torch.einsum("hav,hbv->hvab", vb, ob)
    else:
        dP = (va @ oa.mT - vb @ ob.mT).unsqueeze(1)
    scale = torch.maximum(va.flatten(-2).norm(dim=-1) * oa.flatten(-2).norm(dim=-1),
                          vb.flatten(-2).norm(dim=-1) * ob.flatten(-2).norm(dim=-1)).clamp_min(1e-300)
    out = {"W_V·W_O": (dP**2).sum(dim=(-3, -2, -1)).sqrt() / scale}
    if A.b_V is not None or A.b_O is not None:
        d = (effective_out_bias(A) - effective_out_bias(B)).norm()
        d = d / torch.maximum(_bias_scale(A), _bias_scale(B)).clamp_min(1e-300)
        out["b_O+b_V·W_O"] = d.expand(s.n_heads)
    return out


def _bias_scale(w: AttentionWeights) -> torch.Tensor:
    """``||b_O|| + sum_g ||b_V^g|| ||sum_{h in g} W_O^h||``: what rounding acts on."""
    t = torch.zeros((), dtype=w.W_O.dtype) if w.b_O is None else w.b_O.norm()
    if w.b_V is not None:
        t = t + (w.b_V.norm(dim=-1) * kv_group_sum_out(w).flatten(-2).norm(dim=-1)).sum()
    return t


# ---- alignment (for the distances) ------------------------------------------------------
def _fit(X: torch.Tensor, Y: torch.Tensor, spec: AttentionSpec) -> torch.Tensor:
    """``M [G, k, k]`` minimising ``||X M - Y||`` (``X, Y [G, n, k]``), in the RoPE commutant."""
    r = spec.rope_dims
    if r == 0:
        return torch.linalg.lstsq(X, Y).solution
    block = torch.linalg.lstsq(X[..., r:], Y[..., r:]).solution if spec.pass_dims else None
    i1, i2 = plane_dims(spec)
    x1, x2, y1, y2 = X[..., i1], X[..., i2], Y[..., i1], Y[..., i2]  # [G, n, r/2]
    den = ((x1**2).sum(-2) + (x2**2).sum(-2)).clamp_min(1e-300)
    a = ((x1 * y1).sum(-2) + (x2 * y2).sum(-2)) / den
    b = ((x1 * y2).sum(-2) - (x2 * y1).sum(-2)) / den
    return in_commutant(X.shape[-1], block, a, b, spec)


def fit_gauge(A: AttentionWeights, B: AttentionWeights, vo_gauge: VOGauge = "gl"
              ) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The per-kv-group gauge that best maps B onto A: ``(M, C)``, ``M [G, dk, dk]`` fitted on the
    stacked query heads in the RoPE commutant (None under QK-norm), ``C [G, dv, dv]`` on the
    values (least squares; diagonal with an output gate)."""
    s = A.spec
    G, m = s.n_kv_heads, s.kv_group_size
    M = None
    if s.qk_norm == "none":
        stack = lambda W: W.reshape(G, m * s.d_model, s.head_dim)  # noqa: E731
        M = _fit(stack(B.W_Q), stack(A.W_Q), s)
    if vo_gauge == "diagonal":
        C = torch.diag_embed((B.W_V * A.W_V).sum(-2) / (B.W_V**2).sum(-2).clamp_min(1e-300))
    else:
        C = torch.linalg.lstsq(B.W_V, A.W_V).solution  # [G, dv, dv]
    return M, C


def align(A: AttentionWeights, B: AttentionWeights, vo_gauge: VOGauge = "gl") -> AttentionWeights:
    """The group element applied to B that best maps it onto A (key-bias pass part set to A's,
    value bias folded when an output bias exists)."""
    m = A.spec.kv_group_size
    M, C = fit_gauge(A, B, vo_gauge)
    new: dict[str, torch.Tensor | None] = {}
    if M is not None:
        Mh, M_invT = M.repeat_interleave(m, dim=0), torch.linalg.pinv(M).mT
        new["W_Q"], new["W_K"] = B.W_Q @ Mh, B.W_K @ M_invT
        if B.b_Q is not None:
            new["b_Q"] = (B.b_Q.unsqueeze(-2) @ Mh).squeeze(-2)
        if B.b_K is not None:
            new["b_K"] = (B.b_K.unsqueeze(-2) @ M_invT).squeeze(-2)
    new["W_V"] = B.W_V @ C
    new["W_O"] = torch.linalg.pinv(C).repeat_interleave(m, dim=0) @ B.W_O
    if B.b_V is not None:
        new["b_V"] = (B.b_V.unsqueeze(-2) @ C).squeeze(-2)
    return bias_gauge(A, B.replace(**new))


def bias_gauge(A: AttentionWeights, B: AttentionWeights) -> AttentionWeights:
    """B with its invisible key bias set to A's and its value bias folded the way A's is."""
    if B.b_K is not None and A.spec.qk_norm == "none":
        bk = B.b_K.clone()
        bk[..., A.spec.rope_dims:] = A.b_K[..., A.spec.rope_dims:]
        B = B.replace(b_K=bk)
    if A.b_V is not None and A.b_O is not None:  # fold: only the effective output bias matters
        B = B.replace(b_V=A.b_V, b_O=effective_out_bias(B) - _folded(A))
    return B


def _folded(w: AttentionWeights) -> torch.Tensor:
    return torch.einsum("gv,gvd->d", w.b_V, kv_group_sum_out(w))


def distance(A: AttentionWeights, B: AttentionWeights) -> float:
    return float(sum(((A[n] - B[n]) ** 2).sum() for n, _ in A.items())) ** 0.5


def compare_layers(A: AttentionWeights, B: AttentionWeights, vo_gauge: VOGauge = "gl") -> LayerDiff:
    """Diff of one layer (float64 containers of the same spec)."""
    if A.spec != B.spec:
        raise AttnidError(f"the layers differ in architecture: {A.spec.describe()} vs {B.spec.describe()}")
    res = {**qk_residuals(A, B), **vo_residuals(A, B, vo_gauge)}
    per_name = {n: float(t.max()) for n, t in res.items()}
    worst = max(per_name, key=per_name.__getitem__)
    raw = distance(A, B)
    # the fitted group element, then (first order, as for rho) the orbit-tangent part of what is left
    start = min((align(A, B, vo_gauge), bias_gauge(A, B)), key=lambda x: distance(A, x))
    rest = start - A if vo_gauge == "diagonal" else remove_tangent(A, start - A)
    aligned = min(raw, distance(A, start), (rest.dot(rest).item()) ** 0.5)
    share = 1.0 if raw == 0.0 else min(1.0, max(0.0, 1.0 - (aligned / raw) ** 2))
    return LayerDiff(raw_distance=raw, aligned_distance=aligned, gauge_share=share, worst_tensor=worst,
                     worst_head=int(res[worst].argmax()), residual=per_name[worst], residuals=per_name)
