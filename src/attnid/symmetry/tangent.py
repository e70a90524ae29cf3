"""The orbit's tangent map ``T`` and its adjoint, for QK and VO, every variant (docs/theory.md §10).

A tangent direction is parametrised by *generators* (one set per layer):

QK, no QK-norm (per kv group g, ``M_g`` in the RoPE commutant, ``kappa_g`` on b_K's
pass-through dims)::

    dW_Q^h = W_Q^h M_g     db_Q^h = b_Q^h M_g     (h in g)
    dW_K^g = -W_K^g M_g^T  db_K^g = -b_K^g M_g^T + kappa_g

QK-norm (the GL gauge is broken): gains traded ``dg_Q = g_Q * t``, ``dg_K = -g_K * t``
(``t`` tied within rotated planes), and, exact only when eps = 0, one scale per query
head and per kv group (``dW_Q^h = s_h W_Q^h``, ...).

VO (per kv group, ``C_g`` in gl(d_v), ``nu_g`` a value-bias translation)::

    dW_V^g = W_V^g C_g     db_V^g = b_V^g C_g + nu_g
    dW_O^h = -C_g W_O^h    db_O   = -sum_g nu_g sum_{h in g} W_O^h

Without ``b_O``, ``nu`` is restricted to the null space of ``nu -> sum_g nu_g Wsum_g``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from attnid.rope import project_commutant, project_tied
from attnid.spec import AttentionSpec
from attnid.weights import SIDES, AttentionWeights, Side, grams, kv_group_sum_out, pass_mask

Gens = dict[str, torch.Tensor]


@dataclass(frozen=True)
class TangentMap:
    """``T`` (generators -> weight directions) and ``T*`` at one point, for QK or VO."""

    w: AttentionWeights
    side: Side
    near: bool = False  # include QK-norm scale directions even when eps > 0

    @property
    def spec(self) -> AttentionSpec:
        return self.w.spec

    # generator containers -----------------------------------------------------------
    def zeros(self) -> Gens:
        """Zero generators. Generators are float64 whatever the weights' dtype (they are small)."""
        s, w = self.spec, self.w
        b, dt = w.batch_shape, torch.float64
        z = lambda *shape: torch.zeros(*b, *shape, dtype=dt, device=w.W_Q.device)  # noqa: E731
        G, dk, dv = s.n_kv_heads, s.head_dim, s.v_head_dim
        if self.side == "qk":
            if s.qk_norm == "none":
                out = {"M": z(G, dk, dk)}
                if w.b_K is not None and s.pass_dims:
                    out["kappa"] = z(G, dk)
                return out
            out = {"t": z(dk)}
            if self.near or s.qk_norm_eps == 0.0:
                out["s_q"] = z(s.n_heads)
                out["s_k"] = z(G)
            return out
        out = {"C": z(G, dv, dv)}
        if w.b_V is not None:
            out["nu"] = z(G, dv) if w.b_O is not None else z(self.nu_basis.shape[-1])
        return out

    def constrain(self, g: Gens) -> Gens:
        """Orthogonal projection onto the admissible generators."""
        s = self.spec
        out = dict(g)
        if "M" in out:
            out["M"] = project_commutant(out["M"], s)
        if "kappa" in out:
            out["kappa"] = out["kappa"] * pass_mask(s, out["kappa"])
        if "t" in out:
            out["t"] = project_tied(out["t"], s)
        return out

    @cached_property
    def nu_basis(self) -> torch.Tensor:
        """Without b_O: orthonormal basis ``[..., G*dv, k]`` of admissible value-bias shifts."""
        s, w = self.spec, self.w
        wsum = kv_group_sum_out(w)  # [..., G, dv, d]
        stacked = wsum.reshape(*w.batch_shape, s.n_kv_heads * s.v_head_dim, s.d_model)
        U, _, _ = torch.linalg.svd(stacked.double(), full_matrices=True)
        rank = min(stacked.shape[-2], stacked.shape[-1])
        return U[..., rank:]

    @cached_property
    def small(self) -> dict[str, torch.Tensor | None]:
        """Biases and gains in float64 (the small tensors the generator algebra multiplies)."""
        w = self.w
        return {n: None if getattr(w, n) is None else getattr(w, n).double()
                for n in ("b_Q", "b_K", "b_V", "g_Q", "g_K")}

    @cached_property
    def wsum(self) -> torch.Tensor:
        """``Wsum_g = sum_{h in g} W_O^h``: ``[..., G, dv, d]``, in the weights' dtype (float64
        weights keep ``T*T`` exact; lower precision is as exact as the weights themselves)."""
        return kv_group_sum_out(self.w)

    # T and T* -------------------------------------------------------------------------
    def apply(self, g: Gens) -> dict[str, torch.Tensor]:
        """Weight directions (only the tensors this side touches), in the weights' dtype."""
        s, w = self.spec, self.w
        m = s.kv_group_size
        g = {k: v.to(w.W_Q.dtype) for k, v in g.items()}
        out: dict[str, torch.Tensor] = {}
        if self.side == "qk":
            if "M" in g:
                M = g["M"]  # [..., G, dk, dk]
                Mh = M.repeat_interleave(m, dim=-3)  # [..., H, dk, dk]
                out["W_Q"] = w.W_Q @ Mh
                out["W_K"] = -(w.W_K @ M.transpose(-1, -2))
                if w.b_Q is not None:
                    out["b_Q"] = (w.b_Q.unsqueeze(-2) @ Mh).squeeze(-2)
                if w.b_K is not None:
                    out["b_K"] = -(w.b_K.unsqueeze(-2) @ M.transpose(-1, -2)).squeeze(-2)
                    if "kappa" in g:
                        out["b_K"] = out["b_K"] + g["kappa"]
                return out
            t = g["t"]
            out["g_Q"] = w.g_Q * t
            out["g_K"] = -w.g_K * t
            if "s_q" in g:
                out["W_Q"] = w.W_Q * g["s_q"][..., :, None, None]
                out["W_K"] = w.W_K * g["s_k"][..., :, None, None]
                if w.b_Q is not None:
                    out["b_Q"] = w.b_Q * g["s_q"][..., :, None]
                if w.b_K is not None:
                    out["b_K"] = w.b_K * g["s_k"][..., :, None]
            return out
        C = g["C"]  # [..., G, dv, dv]
        Ch = C.repeat_interleave(m, dim=-3)  # [..., H, dv, dv]
        out["W_V"] = w.W_V @ C
        out["W_O"] = -(Ch @ w.W_O)
        if w.b_V is not None:
            out["b_V"] = (w.b_V.unsqueeze(-2) @ C).squeeze(-2) + self._nu(g)
            if w.b_O is not None:
                out["b_O"] = -torch.einsum("...gv,...gvd->...d", self._nu(g), kv_group_sum_out(w))
        elif w.b_O is not None:
            out["b_O"] = torch.zeros_like(w.b_O)
        return out

    # T*T through small Gram matrices (no pass over the big weights) ------------------
    @cached_property
    def _grams(self) -> dict[str, torch.Tensor]:
        """The small matrices ``T*T`` is made of, float64 (computed in the weights' dtype)."""
        s, w = self.spec, self.w
        out: dict[str, torch.Tensor] = {}
        if self.side == "qk" and s.qk_norm == "none":
            out["GQ"], out["GK"] = (g.double() for g in grams(w, "qk"))
        elif self.side == "qk":
            out["sq"] = squared_norm(w.W_Q, 2) + (0 if w.b_Q is None else squared_norm(w.b_Q, 1))
            out["sk"] = squared_norm(w.W_K, 2) + (0 if w.b_K is None else squared_norm(w.b_K, 1))
        else:
            out["GV"], out["GO"] = (g.double() for g in grams(w, "vo"))
        return out

    def normal(self, g: Gens) -> Gens:
        """``T* T g`` (constrained), from Gram matrices only."""
        w, gr = self.small, self._grams
        out: Gens = {}
        if "M" in g:
            M = g["M"]
            out["M"] = gr["GQ"] @ M + M @ gr["GK"]
            if "kappa" in g:
                out["M"] = out["M"] - g["kappa"].unsqueeze(-1) * w["b_K"].unsqueeze(-2)
                bkM = (w["b_K"].unsqueeze(-2) @ M.transpose(-1, -2)).squeeze(-2)
                out["kappa"] = g["kappa"] - bkM
        if "t" in g:
            out["t"] = (w["g_Q"] ** 2 + w["g_K"] ** 2) * g["t"]
        if "s_q" in g:
            out["s_q"], out["s_k"] = gr["sq"] * g["s_q"], gr["sk"] * g["s_k"]
        if "C" in g:
            C = g["C"]
            out["C"] = gr["GV"] @ C + C @ gr["GO"]
            if "nu" in g:
                nu = self._nu(g)  # [..., G, dv]
                out["C"] = out["C"] + w["b_V"].unsqueeze(-1) * nu.unsqueeze(-2)
                back = (w["b_V"].unsqueeze(-2) @ C).squeeze(-2) + nu  # on b_V
                if self.w.b_O is not None:  # + Wsum Wsum^T nu, as two thin products
                    W = self.wsum
                    on_b_O = torch.einsum("...hud,...hu->...d", W, nu.to(W.dtype))  # [..., d]
                    out["nu"] = back + torch.einsum("...gvd,...d->...gv", W, on_b_O).double()
                else:
                    flat = back.reshape(*self.w.batch_shape, -1, 1)
                    out["nu"] = (self.nu_basis.transpose(-1, -2) @ flat).squeeze(-1)
        return self.constrain(out)

    def cross(self, key: str, value: torch.Tensor) -> torch.Tensor:
        """One off-diagonal block of ``T*T`` (constrained): the gauge generator (``M``/``C``) to
        the translation (``kappa``/``nu``) or back, without the big weights."""
        w = self.small
        if key == "kappa":  # -> M
            return self.constrain({"M": -value.unsqueeze(-1) * w["b_K"].unsqueeze(-2)})["M"]
        if key == "M":  # -> kappa
            bkM = (w["b_K"].unsqueeze(-2) @ value.transpose(-1, -2)).squeeze(-2)
            return self.constrain({"kappa": -bkM})["kappa"]
        if key == "nu":  # -> C
            return w["b_V"].unsqueeze(-1) * self._nu({"nu": value}).unsqueeze(-2)
        back = (w["b_V"].unsqueeze(-2) @ value).squeeze(-2)  # C -> nu
        if self.w.b_O is not None:
            return back
        flat = back.reshape(*self.w.batch_shape, -1, 1)
        return (self.nu_basis.transpose(-1, -2) @ flat).squeeze(-1)

    def _nu(self, g: Gens) -> torch.Tensor:
        s = self.spec
        if self.w.b_O is not None:
            return g["nu"]
        flat = (self.nu_basis.to(g["nu"].dtype) @ g["nu"].unsqueeze(-1)).squeeze(-1)
        return flat.reshape(*self.w.batch_shape, s.n_kv_heads, s.v_head_dim)

    def adjoint(self, d: dict[str, torch.Tensor]) -> Gens:
        """``T*``: weight directions -> generators (then constrained), float64.

        The products with the big weights run in their dtype; the small results are float64.
        """
        return self.constrain({k: v.double() for k, v in self._adjoint(d).items()})

    def _adjoint(self, d: dict[str, torch.Tensor]) -> Gens:
        s, w = self.spec, self.w
        m = s.kv_group_size
        g: Gens = {}
        if self.side == "qk":
            if s.qk_norm == "none":
                A = (w.W_Q.transpose(-1, -2) @ d["W_Q"])  # [..., H, dk, dk]
                if w.b_Q is not None:
                    A = A + w.b_Q.unsqueeze(-1) * d["b_Q"].unsqueeze(-2)
                Mg = A.reshape(*A.shape[:-3], s.n_kv_heads, m, *A.shape[-2:]).sum(-3)
                B = d["W_K"].transpose(-1, -2) @ w.W_K  # [..., G, dk, dk]
                if w.b_K is not None:
                    B = B + d["b_K"].unsqueeze(-1) * w.b_K.unsqueeze(-2)
                g["M"] = Mg - B
                if "kappa" in self.zeros():
                    g["kappa"] = d["b_K"]
                return g
            g["t"] = d["g_Q"] * w.g_Q - d["g_K"] * w.g_K
            if self.near or s.qk_norm_eps == 0.0:
                g["s_q"] = (d["W_Q"] * w.W_Q).sum((-1, -2))
                g["s_k"] = (d["W_K"] * w.W_K).sum((-1, -2))
                if w.b_Q is not None:
                    g["s_q"] = g["s_q"] + (d["b_Q"] * w.b_Q).sum(-1)
                if w.b_K is not None:
                    g["s_k"] = g["s_k"] + (d["b_K"] * w.b_K).sum(-1)
            return g
        A = w.W_V.transpose(-1, -2) @ d["W_V"]  # [..., G, dv, dv]
        if w.b_V is not None:
            A = A + w.b_V.unsqueeze(-1) * d["b_V"].unsqueeze(-2)
        B = d["W_O"] @ w.W_O.transpose(-1, -2)  # [..., H, dv, dv]
        g["C"] = A - B.reshape(*B.shape[:-3], s.n_kv_heads, m, *B.shape[-2:]).sum(-3)
        if w.b_V is not None:
            nu = d["b_V"].clone()
            if w.b_O is not None:
                nu = nu - torch.einsum("...d,...gvd->...gv", d["b_O"], kv_group_sum_out(w))
                g["nu"] = nu
            else:
                flat = nu.reshape(*w.batch_shape, -1).double()
                g["nu"] = (self.nu_basis.transpose(-1, -2) @ flat.unsqueeze(-1)).squeeze(-1)
        return g


    # squared norms of T g without forming it --------------------------------------------
    def own_sq(self, g: Gens) -> torch.Tensor:
        """``[..., G]``: squared norm of ``T g`` on each kv group's own parameters (shared ``b_O``
        and QK-norm gains left out), from the Gram matrices: ``||W M||^2 = tr(M^T W^T W M)``."""
        s, w, gr = self.spec, self.small, self._grams
        if "M" in g:
            M = g["M"]
            out = _trace(M.transpose(-1, -2) @ gr["GQ"] @ M) + _trace(M @ gr["GK"] @ M.transpose(-1, -2))
            if "kappa" in g:  # b_K's row is -b_K M^T + kappa, and GK already holds ||b_K M^T||^2
                bkM = (w["b_K"].unsqueeze(-2) @ M.transpose(-1, -2)).squeeze(-2)
                out = out + ((g["kappa"] - bkM) ** 2).sum(-1) - (bkM**2).sum(-1)
            return out
        if "s_q" in g:
            per_head = (g["s_q"] ** 2 * gr["sq"]).reshape(*self.w.batch_shape, s.n_kv_heads, s.kv_group_size)
            return per_head.sum(-1) + g["s_k"] ** 2 * gr["sk"]
        if "t" in g:  # only the shared gains move
            return torch.zeros(*self.w.batch_shape, s.n_kv_heads, dtype=torch.float64, device=g["t"].device)
        C = g["C"]
        out = _trace(C.transpose(-1, -2) @ gr["GV"] @ C) + _trace(C @ gr["GO"] @ C.transpose(-1, -2))
        if "nu" in g:  # b_V's row is b_V C + nu, and GV already holds ||b_V C||^2
            bvC = (w["b_V"].unsqueeze(-2) @ C).squeeze(-2)
            out = out + ((bvC + self._nu(g)) ** 2).sum(-1) - (bvC**2).sum(-1)
        return out


def _trace(M: torch.Tensor) -> torch.Tensor:
    return M.diagonal(dim1=-2, dim2=-1).sum(-1)


def squared_norm(t: torch.Tensor, dims: int) -> torch.Tensor:
    """Squared norm over the last ``dims`` dims, float64, without a squared copy of ``t``."""
    return torch.linalg.vector_norm(t.flatten(-dims) if dims > 1 else t, dim=-1).double() ** 2


def side_names(spec: AttentionSpec, side: Side) -> tuple[str, ...]:
    """Parameter names that belong to one side."""
    names = ("W_Q", "W_K", "b_Q", "b_K", "g_Q", "g_K") if side == "qk" else ("W_V", "W_O", "b_V", "b_O")
    return tuple(n for n in names if n in spec.param_shapes())


def tangent_basis(w: AttentionWeights, *, near: bool = False, rtol: float = 1e-10) -> torch.Tensor:
    """Orthonormal basis ``[P, k]`` of the orbit tangent space at one layer, in flat order.

    The span of ``T`` applied to every generator coordinate, both sides; for tests and
    small layers (it is dense).
    """
    if w.batch_shape:
        raise ValueError("tangent_basis takes one layer")
    cols = []
    for side in SIDES:
        tmap = TangentMap(w, side, near)
        zero = tmap.zeros()
        for key, z in zero.items():
            for idx in range(z.numel()):
                e = {k: v.clone() for k, v in zero.items()}
                e[key].view(-1)[idx] = 1.0
                d = tmap.apply(tmap.constrain(e))
                cols.append(w.replace(**{n: d.get(n, torch.zeros_like(t)) for n, t in w.items()}).flat())
    A = torch.stack(cols, dim=1)
    U, S, _ = torch.linalg.svd(A, full_matrices=False)
    return U[:, : int((S[0] * rtol < S).sum())]
