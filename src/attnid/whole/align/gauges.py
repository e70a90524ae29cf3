"""The continuous gauges that bring B closest to A (docs/theory.md §13.20). Every gauge of a
layer acts as a pair: one factor ``X`` times ``M``, the other ``Y`` times ``M^{-T}`` (Q/K:
the stacked queries of a key/value group and its keys; V/O: the values and the kv group's output
rows transposed; an MLP neuron: its up row and its down column, ``M`` a scalar; a norm
coordinate: its gain and bias and its readers' column). So one problem serves all,

    min_M  ||X_B M - X_A||^2 + ||Y_B M^{-T} - Y_A||^2,

over the orthogonal group (then ``M^{-T} = M``: Procrustes on the stacked ``[X; Y]``), or over
the invertible maps (not convex: the better of the orthogonal solution and the one-sided least
squares ``X_B M = X_A``, refined by L-BFGS; exact for an exact rewrite, where the one-sided fit
already reaches zero), and, under RoPE, inside the commutant (per rotated plane a rotation, or
a scaled rotation, and any map on the pass-through dims). For a scalar the problem is the
quartic ``a c^4 - b c^3 + q c - p = 0`` of its stationary points, solved exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from attnid.numerics import sq_distance
from attnid.rope import in_commutant, plane_parts, project_commutant
from attnid.spec import AttentionSpec
from attnid.whole.fit.rotation import polar

Kind = Literal["orthogonal", "gl"]


def objective(XB: torch.Tensor, XA: torch.Tensor, YB: torch.Tensor, YA: torch.Tensor,
              M: torch.Tensor) -> torch.Tensor:
    """``[G]`` the pair's squared distance after ``M [G, k, k]`` (``X, Y [G, n, k]``)."""
    inv_t = torch.linalg.inv(M).mT
    return ((XB @ M - XA) ** 2).sum((-2, -1)) + ((YB @ inv_t - YA) ** 2).sum((-2, -1))


@dataclass(frozen=True)
class Grams:
    """What the pair problem sees of ``X, Y [G, n, k]`` (float64): ``X_B^T X_B``, ``X_B^T X_A``
    ``[G, k, k]`` and ``||X_A||^2 [G]``, the same for ``Y``. The objective is a quadratic form
    in ``M`` and ``M^{-T}``, so every fit runs on these ``k x k`` blocks: at 7B widths (``n`` =
    4,097, ``k`` = 128) one evaluation costs ``G k^3`` instead of ``G n k^2`` (32 times less),
    and the L-BFGS refinement's sixty-odd evaluations no longer dominate aligning a layer."""

    xx: torch.Tensor
    xa: torch.Tensor
    aa: torch.Tensor
    yy: torch.Tensor
    ya: torch.Tensor
    bb: torch.Tensor

    @classmethod
    def of(cls, XB: torch.Tensor, XA: torch.Tensor, YB: torch.Tensor, YA: torch.Tensor,
           block: int = 8) -> Grams:
        """Summed in float64, ``block`` groups at a time (no float64 copy of a whole layer)."""
        parts = []
        for xb, xa, yb, ya in zip(*(t.split(block) for t in (XB, XA, YB, YA)), strict=True):
            xb, xa, yb, ya = (t.to(torch.float64) for t in (xb, xa, yb, ya))
            parts.append((xb.mT @ xb, xb.mT @ xa, (xa**2).sum((-2, -1)),
                          yb.mT @ yb, yb.mT @ ya, (ya**2).sum((-2, -1))))
        return cls(*(torch.cat(p) for p in zip(*parts, strict=True)))

    def objective(self, M: torch.Tensor) -> torch.Tensor:
        """``[G]`` :func:`objective` from the blocks (``M`` float64): ``tr(M^T X_B^T X_B M) -
        2 tr(M^T X_B^T X_A) + ||X_A||^2``, and the same in ``M^{-T}`` for ``Y``; exact up to
        the cancellation of its terms (about ``eps ||X_A||^2``)."""
        N = torch.linalg.inv(M).mT

        def side(B: torch.Tensor, C: torch.Tensor, a: torch.Tensor, P: torch.Tensor) -> torch.Tensor:
            return ((B @ P) * P).sum((-2, -1)) - 2 * (C * P).sum((-2, -1)) + a

        return side(self.xx, self.xa, self.aa, M) + side(self.yy, self.ya, self.bb, N)


def _orthogonal(g: Grams, spec: AttentionSpec | None) -> torch.Tensor:
    """Procrustes on ``[X; Y]``, in the RoPE commutant when ``spec`` rotates dims."""
    S = g.xa + g.ya  # [G, k, k]: [X_B; Y_B]^T [X_A; Y_A]
    r = 0 if spec is None else spec.rope_dims
    if r == 0:
        return torch.stack([polar(s) for s in S])
    assert spec is not None
    block = torch.stack([polar(s[r:, r:]) for s in S]) if r < S.shape[-1] else None
    a, b = plane_parts(S, spec)  # <x1, y1> + <x2, y2>, <x1, y2> - <x2, y1> per plane
    n = (a**2 + b**2).sqrt().clamp_min(1e-300)
    a, b = torch.where(n > 1e-300, a / n, torch.ones_like(a)), b / n
    return in_commutant(S.shape[-1], block, a, b, spec)


def _one_sided(g: Grams, spec: AttentionSpec | None) -> torch.Tensor:
    """``argmin ||X_B M - X_A||`` (in the RoPE commutant under ``spec``) from the normal
    equations ``X_B^T X_B M = X_B^T X_A``."""
    r = 0 if spec is None else spec.rope_dims
    if r == 0:
        return torch.linalg.lstsq(g.xx, g.xa).solution
    assert spec is not None
    k = g.xa.shape[-1]
    block = torch.linalg.lstsq(g.xx[..., r:, r:], g.xa[..., r:, r:]).solution if r < k else None
    den = plane_parts(g.xx, spec)[0].clamp_min(1e-300)
    a, b = plane_parts(g.xa, spec)
    return in_commutant(k, block, a / den, b / den, spec)


def pair_fit(XB: torch.Tensor, XA: torch.Tensor, YB: torch.Tensor, YA: torch.Tensor, kind: Kind,
             spec: AttentionSpec | None = None, steps: int = 60, rounding: float = 0.0) -> torch.Tensor:
    """``M [G, k, k]`` minimising :func:`objective` (see the module), in ``XB``'s dtype;
    ``spec``: stay in its RoPE commutant (Q/K). Fitted on the float64 `Grams`. ``rounding``:
    the relative rounding of the checkpoints' storage (``eps / 2``); a start that leaves every
    group within it of ``||[X_A; Y_A]||`` is not refined (what is written is rounded by as much),
    and where B's pair is already A's to that rounding, ``M`` is the identity (no Grams made)."""
    if rounding > 0 and _at_identity(XB, XA, YB, YA, rounding):
        return torch.eye(XB.shape[-1], dtype=XB.dtype).expand(XB.shape[0], -1, -1).clone()
    g = Grams.of(XB, XA, YB, YA)
    M = _orthogonal(g, spec)
    if kind == "gl":
        cands = [M]
        ls = _one_sided(g, spec)
        if bool(torch.isfinite(ls).all()) and bool((torch.linalg.svdvals(ls)[..., -1] > 1e-8).all()):
            cands.append(ls)
        costs = torch.stack([g.objective(c) for c in cands])  # [n, G]
        best = torch.stack([cands[int(k)][i] for i, k in enumerate(costs.argmin(0))])
        M = _refine(XB, XA, YB, YA, g, best, spec, steps, rounding)
    return M.to(XB.dtype)


def _at_identity(XB: torch.Tensor, XA: torch.Tensor, YB: torch.Tensor, YA: torch.Tensor, rounding: float
                 ) -> bool:
    """Whether every group's ``||X_B - X_A||^2 + ||Y_B - Y_A||^2`` is within ``rounding^2`` of
    its ``||X_A||^2 + ||Y_A||^2`` (the objective at ``M = I``, as `_refine` judges a start; a
    rewrite that left the pair alone, as a permutation of heads does). A group at a time, no
    difference of a whole layer made, and the first group that has moved ends it."""
    for xb, xa, yb, ya in zip(XB, XA, YB, YA, strict=True):
        scale = float(torch.linalg.vector_norm(xa)) ** 2 + float(torch.linalg.vector_norm(ya)) ** 2
        if sq_distance(xb, xa) + sq_distance(yb, ya) > rounding**2 * scale:
            return False
    return True


def _refine(XB: torch.Tensor, XA: torch.Tensor, YB: torch.Tensor, YA: torch.Tensor, g: Grams,
            M0: torch.Tensor, spec: AttentionSpec | None, steps: int, rounding: float = 0.0) -> torch.Tensor:
    """L-BFGS from ``M0`` on the blocks ``g``; each group kept only where it improves, judged
    by :func:`objective` on the weights themselves (the blocks' cancellation cannot tell two
    fits apart at rounding). Not run when every group starts within ``rounding`` (relative)."""
    start = objective(XB, XA, YB, YA, M0.to(XB.dtype))
    scale = float(g.aa.sum() + g.bb.sum())
    floor = torch.clamp_min(max(rounding, 0.0) ** 2 * (g.aa + g.bb), 1e-24 * max(scale, 1e-300))
    if steps == 0 or bool((start.double() <= floor).all()):
        return M0
    P = M0.clone().requires_grad_(True)
    opt = torch.optim.LBFGS([P], max_iter=steps, line_search_fn="strong_wolfe", tolerance_grad=1e-14,
                            tolerance_change=1e-16)
    project = (lambda x: project_commutant(x, spec)) if spec is not None and spec.rope_dims else (lambda x: x)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = g.objective(project(P)).sum() / max(scale, 1e-300)
        loss.backward()
        return loss

    try:
        opt.step(closure)
    except torch.linalg.LinAlgError:  # a singular step: keep the start
        return M0
    M = project(P.detach())
    if not bool(torch.isfinite(M).all()):
        return M0
    with torch.no_grad():
        end = objective(XB, XA, YB, YA, M.to(XB.dtype))
    keep = (end < start) & torch.isfinite(end)
    return torch.where(keep[:, None, None], M, M0)


def scalar_fit(a: torch.Tensor, b: torch.Tensor, p: torch.Tensor, q: torch.Tensor, *,
               positive: bool = False) -> torch.Tensor:
    """Per entry the ``c != 0`` minimising ``a c^2 - 2 b c + p / c^2 - 2 q / c`` (``a = |x_B|^2``,
    ``b = <x_B, x_A>``, ``p = |y_B|^2``, ``q = <y_B, y_A>``): ``||c x_B - x_A||^2 + ||y_B / c -
    y_A||^2`` up to a constant. Its stationary points are the real roots of ``a c^4 - b c^3 +
    q c - p``; ``positive``: only ``c > 0`` (ReLU); 1 where nothing moves."""
    a, b, p, q = (t.to(torch.float64) for t in (a, b, p, q))
    n = a.shape[0]
    lead = a.clamp_min(1e-300)
    comp = torch.zeros(n, 4, 4, dtype=torch.float64)  # companion of c^4 + (-b/a) c^3 + 0 c^2 + (q/a) c - p/a
    comp[:, 1:, :3] = torch.eye(3, dtype=torch.float64)
    comp[:, :, 3] = torch.stack([p / lead, -q / lead, torch.zeros_like(a), b / lead], 1)
    roots = torch.linalg.eigvals(comp)  # [n, 4]
    real = roots.real
    ok = (roots.imag.abs() <= 1e-8 * roots.abs().clamp_min(1e-300)) & (real.abs() > 1e-12)
    if positive:
        ok &= real > 0
    c = torch.cat([real, torch.ones(n, 1, dtype=torch.float64)], 1)  # 1: no scaling
    ok = torch.cat([ok, torch.ones(n, 1, dtype=torch.bool)], 1)
    f = a[:, None] * c**2 - 2 * b[:, None] * c + p[:, None] / c**2 - 2 * q[:, None] / c
    f = torch.where(ok, f, torch.full_like(f, float("inf")))
    best = c.gather(1, f.argmin(1, keepdim=True))[:, 0]
    idle = (a == 0) & (p == 0)
    best = torch.where(idle, torch.ones_like(best), best)
    # no x side (a = 0: the quartic has no leading term): p / c^2 - 2 q / c is least at c = p / q
    # when q > 0, and has no minimum otherwise (it falls towards 0 as c grows): leave it at 1
    one_sided = (a == 0) & (p > 0)
    return torch.where(one_sided, torch.where(q > 0, p / q.clamp_min(1e-300), torch.ones_like(best)), best)
