"""Finite gauge transforms: random elements of a layer's symmetry group, applied as pure functions.

Every transform below leaves the layer's function unchanged exactly (QK-norm scales only
when eps = 0); `tests/symmetry/test_gauge.py` checks it in float64 to 1e-10 relative.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from attnid.rope import project_commutant, project_tied
from attnid.symmetry.tangent import TangentMap
from attnid.weights import AttentionWeights, kv_group_sum_out, pass_mask


@dataclass(frozen=True, kw_only=True)
class Gauge:
    """One element of an attention layer's group. Absent pieces (None) act as the identity.

    The same field names in the whole model: `attnid.whole.transforms.LayerElement` is a Gauge
    with the layer's head and neuron permutations and MLP scales added."""

    qk: torch.Tensor | None = None  # [..., G, dk, dk] M: W_Q -> W_Q M, W_K -> W_K M^{-T} (RoPE commutant)
    kappa: torch.Tensor | None = None  # [..., G, dk] key-bias shift on pass-through dims
    vo: torch.Tensor | None = None  # [..., G, dv, dv] C: W_V -> W_V C, W_O -> C^{-1} W_O
    nu: torch.Tensor | None = None  # [..., G, dv] value-bias shift, compensated in b_O
    log_t: torch.Tensor | None = None  # [..., dk] QK-norm gain transfer (tied in planes)
    c_q: torch.Tensor | None = None  # [..., H] QK-norm query scales (> 0; exact when eps = 0)
    c_k: torch.Tensor | None = None  # [..., G] QK-norm key scales

    def is_identity(self) -> bool:
        """Every piece absent (a subclass's added pieces too)."""
        return all(getattr(self, f.name) is None for f in fields(self))


def random_gauge(w: AttentionWeights, *, scale: float = 0.5, seed: int = 0,
                 bias_shift: float = 10.0) -> Gauge:
    """A random, well-conditioned element of the symmetry group of ``w``'s spec."""
    s = w.spec
    gen = torch.Generator().manual_seed(seed)
    b, dt = w.batch_shape, w.W_Q.dtype
    G, dk, dv = s.n_kv_heads, s.head_dim, s.v_head_dim

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*b, *shape, generator=gen, dtype=torch.float64).to(dt)

    eye = lambda n: torch.eye(n, dtype=dt)  # noqa: E731
    out: dict[str, torch.Tensor] = {}
    if s.qk_norm == "none":
        out["qk"] = project_commutant(eye(dk) + scale * rnd(G, dk, dk) / dk**0.5, s)
        if w.b_K is not None:
            out["kappa"] = bias_shift * rnd(G, dk) * pass_mask(s, w.W_Q)
    else:
        out["log_t"] = project_tied(scale * rnd(dk), s)
        if s.qk_norm_eps == 0.0:
            out["c_q"] = torch.exp(scale * rnd(s.n_heads))
            out["c_k"] = torch.exp(scale * rnd(G))
    out["vo"] = eye(dv) + scale * rnd(G, dv, dv) / dv**0.5
    if w.b_V is not None:
        nu = bias_shift * rnd(G, dv)
        if w.b_O is None:  # only shifts that the other kv groups' biases cannot see
            tmap = TangentMap(w.replace(W_O=_gauged_out(w.W_O, out["vo"], s.kv_group_size)), "vo")
            basis = tmap.nu_basis  # [..., G*dv, k]
            coef = (basis.transpose(-1, -2) @ nu.reshape(*b, -1, 1))
            nu = (basis @ coef).reshape(*b, G, dv)
        out["nu"] = nu
    return Gauge(**out)


def _gauged_out(W_O: torch.Tensor, C: torch.Tensor, m: int) -> torch.Tensor:
    return torch.linalg.solve(C.repeat_interleave(m, dim=-3), W_O)  # C^{-1} W_O^h


def apply_gauge(w: AttentionWeights, g: Gauge) -> AttentionWeights:
    """The transformed weights (new tensors; ``w`` is not modified)."""
    s = w.spec
    m = s.kv_group_size
    new: dict[str, torch.Tensor | None] = {}
    if g.qk is not None:
        Mh = g.qk.repeat_interleave(m, dim=-3)
        M_invT = torch.linalg.inv(g.qk).transpose(-1, -2)
        new["W_Q"] = w.W_Q @ Mh
        new["W_K"] = w.W_K @ M_invT
        if w.b_Q is not None:
            new["b_Q"] = (w.b_Q.unsqueeze(-2) @ Mh).squeeze(-2)
        if w.b_K is not None:
            new["b_K"] = (w.b_K.unsqueeze(-2) @ M_invT).squeeze(-2)
    if g.kappa is not None:
        if w.b_K is None:
            raise ValueError("a key-bias shift (kappa) needs a key bias")
        new["b_K"] = new.get("b_K", w.b_K) + g.kappa
    if g.log_t is not None:
        if w.g_Q is None or w.g_K is None:
            raise ValueError("a QK-norm gain transfer (log_t) needs QK-norm gains")
        new["g_Q"] = w.g_Q * torch.exp(g.log_t)
        new["g_K"] = w.g_K * torch.exp(-g.log_t)
    if (g.c_q is None) != (g.c_k is None):
        raise ValueError("QK-norm scales come in pairs: c_q with c_k")
    if g.c_q is not None and g.c_k is not None:
        new["W_Q"] = new.get("W_Q", w.W_Q) * g.c_q[..., :, None, None]
        new["W_K"] = new.get("W_K", w.W_K) * g.c_k[..., :, None, None]
        if w.b_Q is not None:
            new["b_Q"] = new.get("b_Q", w.b_Q) * g.c_q[..., :, None]
        if w.b_K is not None:
            new["b_K"] = new.get("b_K", w.b_K) * g.c_k[..., :, None]
    if g.vo is not None:
        new["W_V"] = w.W_V @ g.vo
        new["W_O"] = _gauged_out(w.W_O, g.vo, m)
        if w.b_V is not None:
            new["b_V"] = (w.b_V.unsqueeze(-2) @ g.vo).squeeze(-2)
    if g.nu is not None:
        if w.b_V is None:
            raise ValueError("a value-bias shift (nu) needs a value bias")
        out_w = w.replace(**{k: v for k, v in new.items() if k == "W_O"})
        new["b_V"] = new.get("b_V", w.b_V) + g.nu
        if w.b_O is not None:
            new["b_O"] = w.b_O - torch.einsum("...gv,...gvd->...d", g.nu, kv_group_sum_out(out_w))
    return w.replace(**new)
