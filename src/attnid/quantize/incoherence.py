"""Refining the residual rotation R1 for quantization: a weight-incoherence proxy minimised
over the rotations by Cayley-parametrised Adam (OptRot's idea, data-free), started at the best
Hadamard (docs/theory.md §13.23).

Round-to-nearest with a per-row range loses most on a row whose energy sits in a few large
entries; the rotation moves the residual side of every reader ``W -> W Q`` (rows ``[out, d]``)
and writer ``W -> Q^T W`` (columns ``[d, in]``). The proxy is each quantized row's fourth
moment over its squared second moment (its kurtosis: ``d sum x^4 / (sum x^2)^2``, 1 for a
flat row, ``d`` for a one-hot one), averaged over rows. Row norms do not change under a rotation
of their entries, so only the spread within each row is scored. The proxy is differentiable;
the search (`attnid.quantize.search`) keeps the refined rotation only when the real objective,
RTN included, is lower with it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from attnid.whole.transforms.orthogonal import cayley, skew

__all__ = ["kurtosis", "refine_rotation"]


def kurtosis(rows: torch.Tensor) -> torch.Tensor:
    """Mean over the rows of ``rows [n, d]`` of ``d sum x^4 / (sum x^2)^2`` (scalar)."""
    sq = rows.square()
    return (rows.shape[1] * sq.square().sum(1) / sq.sum(1).square().clamp_min(1e-30)).mean()


def refine_rotation(readers: torch.Tensor, writers: torch.Tensor, start: torch.Tensor, *, steps: int = 100,
                    lr: float = 2e-3, progress: Callable[[int, int], None] | None = None
                    ) -> tuple[torch.Tensor, list[float]]:
    """``(Q, proxy per step)``: the rotation ``start @ cayley(skew(A))`` after ``steps`` Adam steps on
    ``A`` lowering ``kurtosis(readers @ Q) + kurtosis((Q^T writers)^T)``.

    ``readers [n, d]``: rows of the maps reading the residual stream (``W -> W Q``: each row
    mixed along ``d``); ``writers [d, m]``: the maps writing it side by side (``W -> Q^T W``:
    the rotation mixes their output rows, each quantized along its ``m`` inputs). ``progress``
    is called with ``(step, steps)`` after each step."""
    dt = torch.float64
    R, W, Q0 = readers.to(dt), writers.to(dt), start.to(dt)
    A = torch.zeros_like(Q0, requires_grad=True)
    opt = torch.optim.Adam([A], lr=lr)
    trace: list[float] = []
    for step in range(steps):
        Q = Q0 @ cayley(skew(A))
        loss = kurtosis(R @ Q) + kurtosis(Q.T @ W)
        trace.append(float(loss.detach()))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if progress is not None:
            progress(step + 1, steps)
    with torch.no_grad():
        Q = Q0 @ cayley(skew(A))
        trace.append(float(kurtosis(R @ Q) + kurtosis(Q.T @ W)))
    return Q.detach(), trace
