"""Eigendecompositions of the Gram matrices, computed once per point and shared (docs/theory.md §10.4).

Two consumers need the spectrum of the same small matrices at the same point: the metric
``mu`` (smallest eigenvalues of the Gram matrices, §9.4) after a step, and the projection's
Sylvester preconditioner (§10.5) before the next one. In a training loop the point after
step t is the point before step t + 1, so one eigendecomposition per side and step serves
both when it is cached on the container (`attnid.weights.memoised`).

The preconditioner's matrices are the *gauge* Gram matrices: the Gram matrices without the
bias rows that a translation frees (``b_K`` outside RoPE's rotated dims when ``kappa``
exists; ``b_V`` when ``nu`` exists and there is ``b_O``). The full Gram matrix is then the
gauge one plus the rank-one ``b b^T``, and its smallest eigenvalue is the smallest root of
the secular equation of that update (§10.4), found by bisection from the cached spectrum.
"""

from __future__ import annotations

import torch

from attnid.weights import AttentionWeights, Side, grams, memoised, pass_mask


def freed_bias(w: AttentionWeights, side: Side) -> tuple[int, torch.Tensor, torch.Tensor | None] | None:
    """Which bias row a translation frees from which gauge Gram matrix, or None when the gauge
    Gram matrices are the full ones: ``(0 = left or 1 = right, the bias row, the part of it
    that stays)``, float64 ``[..., G, k]`` (the part that stays is None when nothing does).

    QK: ``kappa`` (b_K and pass-through dims) frees b_K's pass-through dims from the right
    Gram matrix; its RoPE-rotated dims stay. VO: ``nu`` frees all of b_V from the left one
    when b_O exists.
    """
    s = w.spec
    if side == "qk" and s.qk_norm == "none" and w.b_K is not None and s.pass_dims:
        b = w.b_K.double()
        return 1, b, (b * (1 - pass_mask(s, b)) if s.rope_dims else None)
    if side == "vo" and w.b_V is not None and w.b_O is not None:
        return 0, w.b_V.double(), None
    return None


def _working_dtype(w: AttentionWeights) -> torch.dtype:
    """The weights' precision for the small eigenproblems: float64 stays, the rest is float32."""
    return torch.float64 if w.W_Q.dtype == torch.float64 else torch.float32


def _outer(b: torch.Tensor) -> torch.Tensor:
    return b.unsqueeze(-1) * b.unsqueeze(-2)


def gauge_grams(w: AttentionWeights, side: Side) -> tuple[torch.Tensor, torch.Tensor]:
    """(left, right) Gram matrices of the gauge block, float64 ``[..., G, k, k]``: `grams`
    with the freed bias rows left out."""
    grams_ = [g.double() for g in grams(w, side)]
    freed = freed_bias(w, side)
    if freed is not None:
        which, b, kept = freed
        grams_[which] = grams_[which] - _outer(b) + (0 if kept is None else _outer(kept))
    return grams_[0], grams_[1]


def gauge_eigh(w: AttentionWeights, side: Side) -> tuple[torch.Tensor, ...]:
    """``(la, U, mu, V)``: eigenvalues (ascending, clamped at 0) and eigenvectors of the two
    gauge Gram matrices, float64, cached on ``w``.

    Computed in the weights' precision: float32 weights are only float32-accurate, and their
    eigenvectors in float32 cost half as much. Any orthonormal-enough ``U`` keeps the
    preconditioner symmetric positive definite, so the projection stays exact (§10.5).
    """
    def compute() -> tuple[torch.Tensor, ...]:
        out: list[torch.Tensor] = []
        for G in gauge_grams(w, side):
            la, U = torch.linalg.eigh(G.to(_working_dtype(w)))
            out += [la.double().clamp_min(0), U.double()]  # a PSD Gram: no negative rounding
        return tuple(out)

    return memoised(w, ("gauge_eigh", side), compute)


def smallest_eigenvalues(w: AttentionWeights, side: Side) -> tuple[torch.Tensor, torch.Tensor]:
    """Smallest eigenvalue of each full Gram matrix of `grams`: two float64 ``[..., G]``.

    From `gauge_eigh` (which the projection at the same point reuses), with the freed bias
    rows added back through the secular equation of a rank-one update; directly by
    ``eigvalsh`` under QK-norm (no preconditioner needs the QK spectrum there) and, for the
    key side, when RoPE keeps part of ``b_K`` in the gauge matrix (the difference is not
    rank-one). Clamped at 0 (the matrices are positive semi-definite).
    """
    if side == "qk" and w.spec.qk_norm != "none":
        return _eigvalsh_min(w, side, 0), _eigvalsh_min(w, side, 1)
    la, U, mu, V = gauge_eigh(w, side)
    out = [la[..., 0], mu[..., 0]]
    freed = freed_bias(w, side)
    if freed is not None:
        which, b, kept = freed
        vals, vecs = (la, U) if which == 0 else (mu, V)
        out[which] = (smallest_after_rank_one(vals, (b.unsqueeze(-2) @ vecs).squeeze(-2)) if kept is None
                      else _eigvalsh_min(w, side, which))
    return out[0], out[1]


def _eigvalsh_min(w: AttentionWeights, side: Side, which: int) -> torch.Tensor:
    """Smallest eigenvalue of one full Gram matrix by ``eigvalsh``, in the weights' precision."""
    G = grams(w, side)[which].to(_working_dtype(w))
    return torch.linalg.eigvalsh(G)[..., 0].double().clamp_min(0)  # a PSD Gram, like gauge_eigh


def smallest_after_rank_one(la: torch.Tensor, z: torch.Tensor, iters: int = 64) -> torch.Tensor:
    """Smallest eigenvalue of ``diag(la) + z z^T`` (``la`` ascending), float64 ``[...]``.

    It lies in ``[la_1, min(la_2, la_1 + z_1^2)]`` (interlacing; the Rayleigh quotient of the
    first unit vector) and is the root there of the secular equation
    ``f(x) = 1 + sum_i z_i^2 / (la_i - x)``, which increases on that interval; bisection
    halves it ``iters`` times (64: to float64 resolution). ``z_1 = 0`` or ``la_1 = la_2``
    give exactly ``la_1``.
    """
    la, z = la.double(), z.double()
    z2 = z * z
    lo = la[..., 0]
    hi = lo + z2[..., 0]
    if la.shape[-1] > 1:
        hi = torch.minimum(hi, la[..., 1])
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        f = 1 + (z2 / (la - mid.unsqueeze(-1))).sum(-1)
        below = f < 0  # the root is above mid (NaN from 0/0 at la_1 = mid: keep the lower half)
        lo = torch.where(below, mid, lo)
        hi = torch.where(below, hi, mid)
    return torch.where(z2[..., 0] == 0, la[..., 0], 0.5 * (lo + hi))
