"""Rebalancing: a function-preserving move along the orbit to the balanced point (docs/theory.md §11).

For a pair ``A [n1, k]``, ``B [n2, k]`` acted on by ``A S, B S^{-T}`` (QK: the kv group's
stacked query heads and its keys; VO: the values and the stacked transposed outputs):
thin QR ``A = Q_a R_a``, ``B = Q_b R_b``, SVD ``R_a R_b^T = U Sigma V^T``, then
``A <- Q_a U Sigma^{1/2}``, ``B <- Q_b V Sigma^{1/2}``: the product is unchanged and both
Gram matrices equal ``Sigma`` (the conserved quantity is zero). An optional orthogonal
Procrustes rotation then keeps the result close to where it started.

Under RoPE only the commutant may be used: the full GL move on the pass-through block and,
per rotated plane, a scaling (and a rotation within the plane). A full GL rebalance of a
RoPE layer would change the function, so it is refused.
"""

from __future__ import annotations

from typing import Literal

import torch

from attnid import numerics
from attnid.errors import AttnidError, renamed_keyword
from attnid.rope import plane_dims
from attnid.weights import AttentionWeights, kv_group_sum_out

# which subgroup of the QK gauge group the move may use
QKSubgroup = Literal["auto", "gl", "commutant"]
Group = QKSubgroup  # deprecated alias (one release): the old name of QKSubgroup


def balance_pair(A: torch.Tensor, B: torch.Tensor, *, align: bool = True,
                 apply_to: tuple[torch.Tensor, torch.Tensor] | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Balanced ``(A S, B S^{-T})`` for ``A [..., n1, k]``, ``B [..., n2, k]`` with ``k <= n1, n2``.

    ``S`` is chosen from ``(A, B)``; ``apply_to`` (e.g. the same rows with bias rows
    appended) receives the same ``S``, so the move stays on the orbit.
    """
    k = A.shape[-1]
    if A.shape[-2] < k or B.shape[-2] < k:
        raise AttnidError("rebalancing needs head_dim <= the rows it acts on (head_dim <= d_model)")
    Ra = torch.linalg.qr(A, mode="r").R  # [..., k, k]; Q is never formed (a third of a QR)
    Rb = torch.linalg.qr(B, mode="r").R
    if not (_well_conditioned(Ra) and _well_conditioned(Rb)):
        return _balance_pair_with_q(A, B, align=align, apply_to=apply_to)
    U, sig, Vh = torch.linalg.svd(Ra @ Rb.transpose(-1, -2))
    root = sig.sqrt().unsqueeze(-2)  # [..., 1, k]
    Ua, Ub = U * root, Vh.transpose(-1, -2) * root  # R_a S = U Sigma^1/2, R_b S^-T = V Sigma^1/2
    if align:  # Procrustes: (A S) O closest to A, (B S^-T) O closest to B
        O = polar(Ua.transpose(-1, -2) @ Ra + Ub.transpose(-1, -2) @ Rb)
        Ua, Ub = Ua @ O, Ub @ O
    S = torch.linalg.solve_triangular(Ra, Ua, upper=True)  # R_a^{-1} U Sigma^{1/2} O
    S_invT = torch.linalg.solve_triangular(Rb, Ub, upper=True)  # R_b^{-1} V Sigma^{1/2} O
    X, Y = (A, B) if apply_to is None else apply_to
    return X @ S, Y @ S_invT


def _well_conditioned(R: torch.Tensor) -> bool:
    """Whether a triangular factor can be solved with safely (diagonal within 1e-6 of its largest)."""
    d = R.diagonal(dim1=-2, dim2=-1).abs()
    return bool((d.amin(-1) > 1e-6 * d.amax(-1)).all())


def _balance_pair_with_q(A: torch.Tensor, B: torch.Tensor, *, align: bool,
                         apply_to: tuple[torch.Tensor, torch.Tensor] | None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`balance_pair` through the orthogonal factors, for (nearly) rank-deficient pairs
    (a dead head): ``A S = Q_a U Sigma^{1/2}`` needs no triangular solve."""
    Qa, Ra = torch.linalg.qr(A)  # [..., n1, k], [..., k, k]
    Qb, Rb = torch.linalg.qr(B)
    U, sig, Vh = torch.linalg.svd(Ra @ Rb.transpose(-1, -2))
    root = sig.sqrt().unsqueeze(-2)  # [..., 1, k]
    Ua, Ub = U * root, Vh.transpose(-1, -2) * root
    O = None
    if align:
        O = polar(Ua.transpose(-1, -2) @ Ra + Ub.transpose(-1, -2) @ Rb)
        Ua, Ub = Ua @ O, Ub @ O
    if apply_to is None:
        return Qa @ Ua, Qb @ Ub
    S = torch.linalg.solve_triangular(Ra, Ua, upper=True)
    S_invT = Ra.transpose(-1, -2) @ (U / root) if O is None else Ra.transpose(-1, -2) @ (U / root) @ O
    X, Y = apply_to
    return X @ S, Y @ S_invT


def polar(M: torch.Tensor) -> torch.Tensor:
    """Orthogonal factor of ``M`` in float64 (`attnid.numerics.polar` at its float64 cutoff,
    ``cond(M) < 8e3``), returned in ``M``'s dtype."""
    return numerics.polar(M.double()).to(M.dtype)


def _rows_qk(w: AttentionWeights) -> tuple[torch.Tensor, torch.Tensor]:
    """Stacked, bias-augmented query rows ``[..., G, m*a, dk]`` and key rows ``[..., G, b, dk]``."""
    s = w.spec
    Wq = w.W_Q if w.b_Q is None else torch.cat([w.W_Q, w.b_Q.unsqueeze(-2)], dim=-2)
    Wk = w.W_K if w.b_K is None else torch.cat([w.W_K, w.b_K.unsqueeze(-2)], dim=-2)
    G, m = s.n_kv_heads, s.kv_group_size
    A = Wq.reshape(*Wq.shape[:-3], G, m * Wq.shape[-2], Wq.shape[-1])
    return A, Wk


def _unrows_qk(w: AttentionWeights, A: torch.Tensor, B: torch.Tensor) -> AttentionWeights:
    s = w.spec
    a = s.d_model + (w.b_Q is not None)
    Wq = A.reshape(*A.shape[:-3], s.n_heads, a, s.head_dim)
    new = {"W_Q": Wq[..., : s.d_model, :], "W_K": B[..., : s.d_model, :]}
    if w.b_Q is not None:
        new["b_Q"] = Wq[..., s.d_model, :]
    if w.b_K is not None:
        new["b_K"] = B[..., s.d_model, :]
    return w.replace(**new)


def drop_key_bias(w: AttentionWeights) -> AttentionWeights:
    """Zero the key bias where it is unidentified (pass-through dims; none under full RoPE/QK-norm)."""
    s = w.spec
    if w.b_K is None or s.qk_norm != "none" or s.pass_dims == 0:
        return w
    b = w.b_K.clone()
    b[..., s.rope_dims :] = 0.0
    return w.replace(b_K=b)


def fold_value_bias(w: AttentionWeights) -> AttentionWeights:
    """Move ``b_V`` into ``b_O`` (rows of attention sum to one). Needs an output bias."""
    if w.b_V is None or w.b_O is None:
        return w
    b_O = w.b_O + torch.einsum("...gv,...gvd->...d", w.b_V, kv_group_sum_out(w))
    return w.replace(b_V=torch.zeros_like(w.b_V), b_O=b_O)


def rebalance_qk(w: AttentionWeights, *, subgroup: QKSubgroup = "auto", align: bool = True,
                 bias_rows: bool = True, group: QKSubgroup | None = None) -> AttentionWeights:
    """Balance QK. ``subgroup``: ``"gl"`` (the whole GL gauge, refused under RoPE), ``"commutant"``
    (only what commutes with RoPE) or ``"auto"`` (the largest one that preserves the function).
    ``bias_rows``: balance the bias-augmented Grams (the conserved quantity of training) or,
    when False, the weights alone (``W_Q^T W_Q = W_K^T W_K``, for checkpoints). ``group``: the
    old name of ``subgroup`` (deprecated)."""
    subgroup = renamed_keyword("group", "subgroup", group, subgroup)
    s = w.spec
    if s.qk_norm != "none":
        return _balance_gains(w)
    if subgroup == "gl" and s.rope_dims:
        raise AttnidError(
            "a full GL rebalance would change a RoPE layer's function; use subgroup='commutant'")
    w = drop_key_bias(w)
    A, B = _rows_qk(w)
    Aw, Bw = (A, B) if bias_rows else _rows_qk(w.replace(
        b_Q=None if w.b_Q is None else torch.zeros_like(w.b_Q),
        b_K=None if w.b_K is None else torch.zeros_like(w.b_K)))
    r = s.rope_dims
    if r == 0:  # no RoPE: the whole GL gauge
        return _unrows_qk(w, *balance_pair(Aw, Bw, align=align, apply_to=None if bias_rows else (A, B)))
    A2, B2 = A.clone(), B.clone()
    if s.pass_dims:
        A2[..., r:], B2[..., r:] = balance_pair(Aw[..., r:], Bw[..., r:], align=align,
                                                apply_to=(A[..., r:], B[..., r:]))
    if r:
        i1, i2 = plane_dims(s)
        na = (Aw[..., i1] ** 2 + Aw[..., i2] ** 2).sum(-2).sqrt()  # [..., G, r/2]
        nb = (Bw[..., i1] ** 2 + Bw[..., i2] ** 2).sum(-2).sqrt()
        alpha = (nb / na).sqrt().unsqueeze(-2)
        A2[..., i1], A2[..., i2] = A[..., i1] * alpha, A[..., i2] * alpha
        B2[..., i1], B2[..., i2] = B[..., i1] / alpha, B[..., i2] / alpha
    return _unrows_qk(w, A2, B2)


def _balance_gains(w: AttentionWeights) -> AttentionWeights:
    """QK-norm: trade gain between q and k until ``|g_Q| = |g_K|`` per dim (per plane)."""
    s = w.spec
    qq, kk = w.g_Q**2, w.g_K**2
    if s.rope_dims:
        i1, i2 = plane_dims(s)
        qq, kk = qq.clone(), kk.clone()
        qq[..., i1] = qq[..., i2] = qq[..., i1] + qq[..., i2]
        kk[..., i1] = kk[..., i2] = kk[..., i1] + kk[..., i2]
    alpha = (kk / qq) ** 0.25
    return w.replace(g_Q=w.g_Q * alpha, g_K=w.g_K / alpha)


def rebalance_vo(w: AttentionWeights, *, align: bool = True, fold: bool = True,
                 bias_rows: bool = True) -> AttentionWeights:
    s = w.spec
    if fold:
        w = fold_value_bias(w)
    A = w.W_V if w.b_V is None else torch.cat([w.W_V, w.b_V.unsqueeze(-2)], dim=-2)
    Aw = A if bias_rows or w.b_V is None else torch.cat([w.W_V, torch.zeros_like(w.b_V).unsqueeze(-2)], -2)
    G, m = s.n_kv_heads, s.kv_group_size
    Wo_t = w.W_O.transpose(-1, -2)  # [..., H, d, dv]
    B = Wo_t.reshape(*Wo_t.shape[:-3], G, m * s.d_model, s.v_head_dim)
    A2, B2 = balance_pair(Aw, B, align=align, apply_to=None if Aw is A else (A, B))
    new = {"W_V": A2[..., : s.d_model, :],
           "W_O": B2.reshape(*Wo_t.shape).transpose(-1, -2)}
    if w.b_V is not None:
        new["b_V"] = A2[..., s.d_model, :]
    return w.replace(**new)


def rebalance(w: AttentionWeights, *, subgroup: QKSubgroup = "auto", align: bool = True,
              fold: bool = True, bias_rows: bool = True, group: QKSubgroup | None = None
              ) -> AttentionWeights:
    """Both sides to the balanced point (the function is unchanged). ``subgroup``: as in
    :func:`rebalance_qk` (``group``: its old name, deprecated).

    >>> import torch
    >>> from attnid import Attention, AttentionSpec, randomize_
    >>> from attnid.symmetry.conserved import metrics
    >>> layer = randomize_(Attention(AttentionSpec(d_model=8, n_heads=2)).double(), 0)
    >>> w = rebalance(AttentionWeights.from_module(layer))
    >>> bool(metrics(w).qk.beta.max() < 1e-12)
    True
    """
    subgroup = renamed_keyword("group", "subgroup", group, subgroup)
    w = rebalance_qk(w, subgroup=subgroup, align=align, bias_rows=bias_rows)
    return rebalance_vo(w, align=align, fold=fold, bias_rows=bias_rows)
