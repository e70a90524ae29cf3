"""The numerical rules every check shares: tolerances per dtype, the relative error, the 2-eps
rule for stored checkpoints, and the polar decomposition.

- :data:`TOLERANCE` / :func:`tolerance`: the relative error a function-preserving transform may
  leave, by the dtype it *computes* in (float64 1e-10, float32 1e-5, ...).
- :func:`rounding_tolerance`: the 2-eps rule: the rounding level a certified residual may
  reach for checkpoints *stored* in a dtype (`attnid diff`, `attnid.whole.fit`).
- :func:`relative_error`: ``||got - want|| / ||want||`` in float64, NaN counted as ``inf``.
- :func:`polar`: the orthogonal factor of a (batch of) square matrices, the Procrustes solution.

`attnid.testing` re-exports them for tests and adapter authors; library modules import them
from here (never from `attnid.testing`).

>>> rounding_tolerance(torch.bfloat16) == 2 * torch.finfo(torch.bfloat16).eps
True
"""

from __future__ import annotations

import torch

# Relative error a function-preserving transform may leave, by the dtype it computes in:
# float64 rounding of the transforms here is ~1e-13, so 1e-10 leaves room for depth and
# ill-conditioning and still catches any genuine change.
TOLERANCE: dict[torch.dtype, float] = {
    torch.float64: 1e-10,
    torch.float32: 1e-5,
    torch.float16: 5e-3,
    torch.bfloat16: 3e-2,
}


def tolerance(dtype: torch.dtype) -> float:
    """The relative tolerance for ``dtype`` (float32's for anything not in the table)."""
    return TOLERANCE.get(dtype, TOLERANCE[torch.float32])


def rounding_tolerance(dtype: torch.dtype) -> float:
    """The rounding level a certified residual may reach for checkpoints stored in ``dtype``:
    ``2 eps`` (1e-13 at least): the first-order bound of storage rounding (each of the four
    stored factors of a compared product off by at most ``eps / 2`` relative, the residual
    being relative to the product of the factor norms). Exact rewrites stored in bfloat16 or
    float16 leave 0.22-0.26 eps on every family (measured over random rewrites of every step);
    in bfloat16 a 5% change to one value projection is refused, a 3% one is not (docs/theory.md
    §13.19)."""
    return max(2 * torch.finfo(dtype).eps, 1e-13)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """``||got - want|| / ||want||`` in float64 (``inf`` when the result is not finite).

    >>> relative_error(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.0]))
    0.0
    """
    diff = (got.detach().double() - want.detach().double()).norm()
    err = float(diff / want.detach().double().norm().clamp_min(torch.finfo(torch.float64).tiny))
    return err if err == err else float("inf")  # NaN -> inf: never passes a tolerance


DISTANCE_CHUNK = 1 << 18  # elements per step of a squared distance: the difference stays in cache


def sums_of_products(x: torch.Tensor, y: torch.Tensor, dim: int) -> torch.Tensor:
    """``(x * y).sum(dim)`` of two ``[n, p]`` tensors (0: per column ``[p]``, 1: per row ``[n]``)
    without the full-size product: along ``x``'s stored rows (a transposed view, such as a down
    projection's ``[f, d]``: its stored ``[d, f]``'s, which a row-wise pass would read across,
    25 times slower), a block of at most :data:`DISTANCE_CHUNK` numbers at a time (1 MiB in
    float32: in cache, and under the 2 MiB above which the streamed commands map a block
    afresh, `attnid.allocator.return_freed_memory`). The same inputs in the same layout give
    the same bits: ``x`` paired with its copy gives ``sums_of_products(x, x, dim)`` exactly.

    >>> sums_of_products(torch.tensor([[1.0, 2.0], [3.0, 4.0]]), torch.ones(2, 2), 1)
    tensor([3., 7.])
    """
    if x.stride(0) == 1 and x.stride(1) != 1:
        x, y, dim = x.T, y.T, 1 - dim
    rows = max(1, DISTANCE_CHUNK // max(1, x.shape[1]))
    parts = [(a * b).sum(dim) for a, b in zip(x.split(rows), y.split(rows), strict=True)]
    if not parts:  # no rows
        return (x * y).sum(dim)
    return torch.cat(parts) if dim == 1 else sum(parts[1:], parts[0])


def sq_distance(x: torch.Tensor, y: torch.Tensor) -> float:
    """``||x - y||^2``, a cache-sized chunk at a time: no full-size difference is made (a 32000 x
    4096 table's would be 0.5 GB in float32). Each chunk's norm in the tensors' dtype (float32
    for bfloat16 and float16), the chunks' sum in float64: about 1e-7 relative in float32, where
    one float32 reduction over a 45M-element weight drifts by 1e-3.

    >>> sq_distance(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 4.0]))
    4.0
    """
    dt = torch.promote_types(x.dtype, torch.float32)  # bfloat16 and float16 differences in float32
    if (x.is_contiguous() and y.is_contiguous()) or x.dim() < 2:
        x, y = x.reshape(-1), y.reshape(-1)  # views: blocks of DISTANCE_CHUNK numbers
    # a strided view (a head's slice of a projection) stays as it is, a block of its leading
    # rows at a time: no contiguous copy of the whole (a block of 2 MiB or more is mapped
    # afresh by the streamed commands, `attnid.allocator.return_freed_memory`)
    rows = max(1, DISTANCE_CHUNK // max(1, x[0].numel()))
    total = 0.0
    for a, b in zip(x.split(rows), y.split(rows), strict=True):
        total += float(torch.linalg.vector_norm(a.to(dt) - b.to(dt))) ** 2
    return total


def row_sq_distances(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``((x - y) ** 2).sum(1)`` of two ``[n, p]`` tensors, a block of at most
    :data:`DISTANCE_CHUNK` numbers at a time (no full-size difference; as `sums_of_products`).

    >>> row_sq_distances(torch.tensor([[1.0, 2.0], [3.0, 4.0]]), torch.zeros(2, 2))
    tensor([ 5., 25.])
    """
    rows = max(1, DISTANCE_CHUNK // max(1, x.shape[1]))
    parts = [((a - b) ** 2).sum(1) for a, b in zip(x.split(rows), y.split(rows), strict=True)]
    return torch.cat(parts) if parts else ((x - y) ** 2).sum(1)


def _svd_polar(M: torch.Tensor) -> torch.Tensor:
    U, _, Vh = torch.linalg.svd(M)
    return U @ Vh


def polar(M: torch.Tensor, *, cutoff: float | None = None, svd_up_to: int = 0) -> torch.Tensor:
    """Orthogonal factor of ``M [..., k, k]`` (``U V^T`` of its SVD: the Procrustes solution
    maximising ``tr(O^T M)``), computed in ``M``'s dtype.

    ``O = M (M^T M)^{-1/2}`` from a symmetric eigendecomposition of ``M^T M`` (about half an
    SVD's time), polished by one Newton-Schulz step ``O (3 - O^T O) / 2``, which squares the
    orthogonality error. Forming ``M^T M`` squares the condition number, so the eigenvalue
    route leaves an error of about ``eps * cond(M)^2`` before the polish; it is taken only when
    ``lambda_min > cutoff * lambda_max`` (``cond(M)^2 < 1 / cutoff``) and the SVD otherwise,
    and for widths ``k <= svd_up_to`` (small enough that the SVD's accuracy costs nothing).

    ``cutoff`` defaults to ``sqrt(eps)`` of the dtype: the error before the polish is then at
    most ``sqrt(eps)`` and after it at rounding (float64: 1.5e-8, the per-head rebalancing
    of `attnid.symmetry.rebalance`). The residual-stream rotation of `attnid.whole.fit.rotation`
    passes ``1e-6`` with ``svd_up_to=1024``: its ``M`` is a ``d x d`` product of table rows that
    span the stream (well conditioned), the fitted rotation is certified afterwards at the
    storage rounding (a poor one is refused, not trusted), and in float32 at 7B widths the
    looser cutoff keeps the eigenvalue route that ``sqrt(eps) = 3.5e-4`` would send to the
    SVD. Either way the two cutoffs only choose the route to the same factor.

    >>> M = torch.tensor([[2.0, 1.0], [0.0, 1.0]], dtype=torch.float64)
    >>> O = polar(M)
    >>> bool(torch.allclose(O, _svd_polar(M)) and torch.allclose(O.T @ O, torch.eye(2, dtype=M.dtype)))
    True
    """
    if M.shape[-1] <= svd_up_to:
        return _svd_polar(M)
    limit = torch.finfo(M.dtype).eps ** 0.5 if cutoff is None else cutoff
    lam, V = torch.linalg.eigh(M.transpose(-1, -2) @ M)  # ascending
    if not bool((lam[..., 0] > limit * lam[..., -1]).all()):
        return _svd_polar(M)
    O = M @ (V * lam.rsqrt().unsqueeze(-2)) @ V.transpose(-1, -2)
    return 1.5 * O - 0.5 * O @ (O.transpose(-1, -2) @ O)
