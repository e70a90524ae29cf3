"""Split an update into its orbit-tangent part and the rest, batched over kv groups and layers.

The least-squares generators solve the normal equations ``T*T x = T* delta``. For the
plain gauge these are Sylvester equations (``G_Q M + M G_K = W_Q^T dW_Q - dW_K^T W_K``),
solved exactly with two symmetric eigendecompositions per kv group (docs/theory.md §10.4); the RoPE
commutant, the bias translations and the QK-norm directions couple them, so the solve is
preconditioned conjugate gradients with that Sylvester solve as the preconditioner (one
iteration when nothing couples).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from attnid.symmetry.spectra import gauge_eigh
from attnid.symmetry.tangent import Gens, TangentMap, side_names, squared_norm
from attnid.weights import SIDES, AttentionWeights, Side, kv_group_sum_out


def _dot(a: Gens, b: Gens, nb: int) -> torch.Tensor:
    return sum((a[k] * b[k]).sum(dim=tuple(range(nb, a[k].ndim))) for k in a)  # type: ignore[return-value]


def _axpy(a: torch.Tensor, x: Gens, y: Gens) -> Gens:
    """``y + a x`` per generator, ``a`` one scalar per batch entry."""
    return {k: y[k] + _bc(a, x[k]) * x[k] for k in y}


def _bc(a: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return a.reshape(*a.shape, *([1] * (like.ndim - a.ndim)))


class _Preconditioner:
    """Symmetric block elimination: Sylvester solve for the gauge, exact solve for translations.

    For generators ``(x, y)`` = (gauge ``M``/``C``, translation ``kappa``/``nu``) the normal
    operator is ``[[A, B], [B^T, D]]``. With ``S`` the Sylvester operator whose Gram
    matrices leave out the bias rows that the translation frees, this applies the exact
    inverse of ``[[S + B D^-1 B^T, B], [B^T, D]]``: symmetric positive definite (so CG
    stays valid), and the exact inverse whenever the translation frees the whole bias.
    """

    def __init__(self, tmap: TangentMap) -> None:
        self.tmap = tmap
        w = tmap.small
        self.eig: tuple[torch.Tensor, ...] | None = None
        self.diag: dict[str, torch.Tensor] = {}
        self.D_chol: torch.Tensor | None = None
        gens = tmap.zeros()
        self.main = "M" if "M" in gens else ("C" if "C" in gens else None)
        self.trans = "kappa" if "kappa" in gens else ("nu" if "nu" in gens else None)
        gr = tmap._grams
        if self.main is not None:  # the gauge Grams leave out the bias rows the translation frees
            self.eig = gauge_eigh(tmap.w, tmap.side)
        if self.trans == "nu" and tmap.w.b_O is not None:
            self.D_chol = _translation_factor(tmap)
        if "t" in gens:
            self.diag["t"] = w["g_Q"] ** 2 + w["g_K"] ** 2
        if "s_q" in gens:
            self.diag["s_q"], self.diag["s_k"] = gr["sq"], gr["sk"]

    def _sylvester(self, v: torch.Tensor) -> torch.Tensor:
        la, U, mu, V = self.eig  # type: ignore[misc]
        X = (U.transpose(-1, -2) @ v @ V) / (la.unsqueeze(-1) + mu.unsqueeze(-2))
        return U @ X @ V.transpose(-1, -2)

    def _d_inv(self, v: torch.Tensor) -> torch.Tensor:
        if self.D_chol is None:
            return v
        L = self.D_chol
        flat = v.reshape(*v.shape[:-2], -1, 1).to(L.dtype)
        # two triangular solves (cholesky_solve would copy the factor on every call)
        y = torch.linalg.solve_triangular(L, flat, upper=False)
        return torch.linalg.solve_triangular(L.transpose(-1, -2), y, upper=True).reshape(v.shape).to(v.dtype)

    def __call__(self, r: Gens) -> Gens:
        out = {k: (v / self.diag[k] if k in self.diag else v) for k, v in r.items()}
        if self.main is not None:
            rm = r[self.main]
            if self.trans is not None:
                y = self._d_inv(r[self.trans])
                rm = rm - self.tmap.cross(self.trans, y)
            out[self.main] = self.tmap.constrain({self.main: self._sylvester(rm)})[self.main]
            if self.trans is not None:
                back = self.tmap.cross(self.main, out[self.main])
                out[self.trans] = self._d_inv(r[self.trans] - back)
        return self.tmap.constrain(out)


def _translation_factor(tmap: TangentMap) -> torch.Tensor:
    """Cholesky factor of ``D = I + Wsum Wsum^T`` ([G dv, G dv] per layer), the value-bias
    translations' block of ``T*T`` and the one big product of the solve. It only
    preconditions, so it is formed in float32: its rounding costs CG an iteration, never
    accuracy."""
    W = kv_group_sum_out(tmap.w).float().reshape(*tmap.w.batch_shape, -1, tmap.spec.d_model)  # [..., G dv, d]
    D = W @ W.transpose(-1, -2) + torch.eye(W.shape[-2], dtype=W.dtype, device=W.device)
    return torch.linalg.cholesky(D)


def solve_generators(tmap: TangentMap, delta: dict[str, torch.Tensor], *, tol: float = 1e-13,
                     max_iter: int = 200) -> tuple[Gens, Gens, int]:
    """Least-squares generators for ``delta`` by preconditioned CG on ``T*T x = T* delta``.

    Returns the generators, ``T* delta`` and the number of iterations.
    """
    nb = len(tmap.w.batch_shape)
    apply_normal = tmap.normal
    precond = _Preconditioner(tmap)
    x = tmap.zeros()
    r = rhs = tmap.adjoint(delta)
    z = precond(r)
    p = z
    rz = _dot(r, z, nb)
    norm0 = rz.abs().clamp_min(torch.finfo(rz.dtype).tiny)
    it = 0
    for it in range(1, max_iter + 1):  # noqa: B007
        Ap = apply_normal(p)
        pAp = _dot(p, Ap, nb)
        step = torch.where(pAp > 0, rz / pAp.clamp_min(torch.finfo(pAp.dtype).tiny), 0.0)
        x = _axpy(step, p, x)
        r = _axpy(-step, Ap, r)
        z = precond(r)
        rz_new = _dot(r, z, nb)
        if bool((rz_new.abs() <= tol**2 * norm0).all()):
            break
        carry = rz_new / rz.clamp_min(torch.finfo(rz.dtype).tiny)  # share of the old direction kept
        p = _axpy(carry, p, z)
        rz = rz_new
    return x, rhs, it


@dataclass(frozen=True)
class Projection:
    """An update split into its tangent part (invisible to the function) and the visible rest, one side.

    ``rho`` and ``rho_layer`` come from the generators and Gram matrices alone; the tangent
    part itself is formed only when asked for (``tangent``, ``visible``).
    """

    side: Side
    tmap: TangentMap
    generators: Gens  # least-squares generators of the update (float64)
    delta: dict[str, torch.Tensor]
    rho: torch.Tensor  # [..., G]: tangent share of each kv group's (own-parameter) squared norm
    rho_layer: torch.Tensor  # [...]: tangent share over the whole side
    delta_sq: torch.Tensor  # [...]: squared norm of the update on this side (float64)
    iterations: int

    @cached_property
    def tangent(self) -> dict[str, torch.Tensor]:
        """The tangent part: same names, shapes and dtype as the update's side."""
        raw = self.tmap.apply(self.generators)
        return {n: raw[n] if n in raw else torch.zeros_like(d) for n, d in self.delta.items()}

    @property
    def visible(self) -> dict[str, torch.Tensor]:
        """``delta`` minus its tangent part: what the function sees."""
        return {k: self.delta[k] - self.tangent[k] for k in self.delta}


def project(w: AttentionWeights, delta: AttentionWeights, side: Side, *, near: bool = False,
            tol: float | None = None) -> Projection:
    """Project ``delta`` (an update at the point ``w``) onto the orbit tangent space of one side.

    ``tol``: relative residual of the least-squares solve; by default ``1e-13`` for float64
    weights and ``1e-7`` for lower precision (whose own rounding is larger than that).

    >>> import torch
    >>> from attnid import Attention, AttentionSpec, randomize_
    >>> layer = randomize_(Attention(AttentionSpec(d_model=8, n_heads=2)).double(), 0)
    >>> w = AttentionWeights.from_module(layer)
    >>> step = w.map(torch.randn_like)
    >>> p = project(w, step, "qk")
    >>> bool(((p.rho >= 0) & (p.rho <= 1)).all())
    True
    """
    names = side_names(w.spec, side)
    d = {n: delta[n] for n in names}
    tmap = TangentMap(w, side, near)
    if tol is None:
        tol = 1e-13 if w.W_Q.dtype == torch.float64 else 1e-7
    gens, rhs, iters = solve_generators(tmap, d, tol=tol)
    nb = len(w.batch_shape)
    tiny = torch.finfo(torch.float64).tiny
    rho = tmap.own_sq(gens) / _kv_group_sq(d, w, side).clamp_min(tiny)
    delta_sq = sum(squared_norm(t, t.ndim - nb) if t.ndim > nb else t.double() ** 2 for t in d.values())
    # least squares: ||T g||^2 = <T g, delta> = <g, T* delta> (to the solver's tolerance)
    tangent_sq = _dot(gens, rhs, nb).clamp_min(0.0)
    rho_layer = tangent_sq / torch.as_tensor(delta_sq).clamp_min(tiny)
    return Projection(side, tmap, gens, d, rho, rho_layer, torch.as_tensor(delta_sq), iters)


def _kv_group_sq(t: dict[str, torch.Tensor], w: AttentionWeights, side: Side) -> torch.Tensor:
    """Squared norm of each kv group's own parameters: ``[..., G]`` (shared tensors excluded)."""
    s = w.spec
    G, m = s.n_kv_heads, s.kv_group_size

    def per_head(x: torch.Tensor, extra: int) -> torch.Tensor:  # [..., H, *] -> [..., G]
        sq = squared_norm(x, extra)
        return sq.reshape(*sq.shape[:-1], G, m).sum(-1)

    def per_kv_group(x: torch.Tensor, extra: int) -> torch.Tensor:
        return squared_norm(x, extra)

    if side == "qk":
        out = per_head(t["W_Q"], 2) + per_kv_group(t["W_K"], 2)
        if "b_Q" in t:
            out = out + per_head(t["b_Q"], 1)
        if "b_K" in t:
            out = out + per_kv_group(t["b_K"], 1)
        return out
    out = per_kv_group(t["W_V"], 2) + per_head(t["W_O"], 2)
    if "b_V" in t:
        out = out + per_kv_group(t["b_V"], 1)
    return out


def remove_tangent(w: AttentionWeights, delta: AttentionWeights, *, near: bool = False
                   ) -> AttentionWeights:
    """``delta`` minus its tangent part on both sides (the `project` correction)."""
    out = dict(delta.items())
    for side in SIDES:
        p = project(w, delta, side, near=near)
        out.update(p.visible)
    return delta.replace(**out)
