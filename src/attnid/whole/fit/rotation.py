"""The residual-stream rotation that maps B onto A (docs/theory.md §13.6, §13.19): orthogonal
Procrustes on gauge-fixed rows that live in the stream (embedding and unembedding rows, or a
layer's reader rows and writer columns): ``Q = argmin ||X_B Q - X_A||`` over ``O(d)``, or, under
LayerNorm, over the rotations fixing all-ones (both sides are already orthogonal to all-ones,
so the fit runs in that complement). For B an exact rotation of A the fit is exact whenever the
rows span the stream (``X_A`` of rank ``d``: a vocabulary wider than the model does it; for a
narrower one `attnid.whole.fit.fitter` adds layer 0's matched MLP rows)."""

from __future__ import annotations

import torch

from attnid import numerics
from attnid.whole.transforms.orthogonal import ones_complement


def polar(M: torch.Tensor) -> torch.Tensor:
    """The orthogonal factor of ``M``: `attnid.numerics.polar` with the SVD up to width 1024 and
    the eigenvalue route above it while ``cond(M) < 1e3`` (its docstring says why this cutoff)."""
    return numerics.polar(M, cutoff=1e-6, svd_up_to=1024)


def rows(X: torch.Tensor, n: int) -> torch.Tensor:
    """At most ``n`` rows of ``X``, evenly spaced (deterministic)."""
    if X.shape[0] <= n:
        return X
    return X[torch.linspace(0, X.shape[0] - 1, n).round().long()]


def procrustes(XB: torch.Tensor, XA: torch.Tensor, layer_norm: bool) -> torch.Tensor:
    """``Q [d, d]`` orthogonal minimising ``||XB Q - XA||`` (``Q 1 = 1`` under LayerNorm): the
    identity, with no ``d x d`` decomposition, when the rows are equal (the distance is then 0)."""
    if torch.equal(XB, XA):
        return torch.eye(XB.shape[1], dtype=XB.dtype)
    return procrustes_cross(XB.T @ XA, layer_norm)


def procrustes_cross(M: torch.Tensor, layer_norm: bool) -> torch.Tensor:
    """:func:`procrustes` from the cross product ``M = XB^T XA [d, d]`` (summed over pieces
    read one at a time)."""
    if not layer_norm:
        return polar(M)
    d = M.shape[0]
    U = ones_complement(d).to(M.dtype)  # [d, d - 1]
    R = polar(U.T @ M @ U)
    return U @ R @ U.T + torch.full((d, d), 1.0 / d, dtype=M.dtype)


def probed_least_squares(XB: torch.Tensor, XA: torch.Tensor, Z: torch.Tensor, layer_norm: bool,
                         gram: torch.Tensor | None = None) -> tuple[torch.Tensor, float] | None:
    """``(Y, defect)``: ``Y = Q Z [d, k]`` for ``Q`` the least-squares map ``argmin ||XB Q -
    XA||`` over all ``d x d`` matrices (``Q 1 = 1`` under LayerNorm, whose rows are centred),
    never formed: the normal equations ``(XB^T XB) Y = XB^T (XA Z)`` solved by Cholesky, about a
    fifth of the Procrustes fit's cost at 4096 wide (no ``d x d`` eigendecomposition). ``Q`` is
    a rotation only when B's rows are A's rotated; ``defect = ||Y^T Y - Z^T Z|| / sqrt(d)``
    estimates ``||Q^T Q - I|| / ||I||`` (`docs/theory.md` §13.19, probes), the relative residual
    of the invariant ``Q^T Q = I``, which the certificate compares like any other. None when
    the rows do not span the stream (the Gram matrix is singular). ``gram``: ``XB^T XB``
    when the caller has it (taken exactly from bfloat16 rows: `attnid.whole.fit.fitter.table_gram`)."""
    d = XB.shape[1]
    G = XB.T @ XB if gram is None else gram  # [d, d]
    rhs = XB.T @ (XA @ Z)  # [d, k]
    if layer_norm:  # the rows are orthogonal to all-ones: Q maps it to itself
        alpha = float(G.diagonal().mean())
        G = G + alpha / d
        rhs = rhs + alpha / d * Z.sum(0, keepdim=True)
    L, info = torch.linalg.cholesky_ex(G)
    if int(info) != 0:
        return None
    Y = torch.cholesky_solve(rhs, L)
    if not bool(torch.isfinite(Y).all()):
        return None
    defect = float(torch.linalg.matrix_norm(Y.T @ Y - Z.T @ Z)) / d**0.5
    return Y, defect
