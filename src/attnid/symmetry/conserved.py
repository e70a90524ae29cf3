"""Conserved quantities of gradient flow and the paper's metrics, per head/group, QK and VO.

Gradients are orthogonal to the orbit, so gradient flow conserves, per key group,
``C_QK = sum_{h in g} W~_Q^hT W~_Q^h - W~_K^gT W~_K^g`` and per value group
``C_VO = W~_V^gT W~_V^g - sum_{h in g} W_O^h W_O^hT`` (``~``: bias row appended). Under
RoPE only the commutant part is conserved (pass-through block, and per plane the
difference of squared norms); under QK-norm, the per-dim ``g_Q^2 - g_K^2`` (tied in planes).
"""

from __future__ import annotations

import torch

from attnid.symmetry.tangent import project_commutant, project_tied
from attnid.symmetry.weights import AttentionWeights


def _grouped(x: torch.Tensor, G: int) -> torch.Tensor:
    """``[..., H, a, b] -> [..., G, a, b]`` summed over each group's heads."""
    return x.reshape(*x.shape[:-3], G, x.shape[-3] // G, *x.shape[-2:]).sum(-3)


def grams(w: AttentionWeights, side: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(left, right) Gram matrices per group: ``[..., G, k, k]`` each (cached on ``w``).

    QK: ``(sum_{h in g} W~_Q^hT W~_Q^h, W~_K^gT W~_K^g)``; VO: ``(W~_V^T W~_V, sum W_O W_O^T)``.
    """
    # memoised on the container, keyed by the tensors' version counters, so that views of
    # parameters that were since updated in place are recomputed
    cache = w.__dict__.setdefault("_gram_cache", {})
    versions = tuple(t._version for _, t in w.items())
    if side not in cache or cache[side][0] != versions:
        cache[side] = (versions, _grams(w, side))
    return cache[side][1]


def _grams(w: AttentionWeights, side: str) -> tuple[torch.Tensor, torch.Tensor]:
    s = w.spec
    if side == "qk":
        a = w.W_Q.transpose(-1, -2) @ w.W_Q
        if w.b_Q is not None:
            a = a + w.b_Q.unsqueeze(-1) * w.b_Q.unsqueeze(-2)
        left = _grouped(a, s.n_kv_heads)
        right = w.W_K.transpose(-1, -2) @ w.W_K
        if w.b_K is not None:
            right = right + w.b_K.unsqueeze(-1) * w.b_K.unsqueeze(-2)
        return left, right
    left = w.W_V.transpose(-1, -2) @ w.W_V
    if w.b_V is not None:
        left = left + w.b_V.unsqueeze(-1) * w.b_V.unsqueeze(-2)
    right = _grouped(w.W_O @ w.W_O.transpose(-1, -2), s.n_kv_heads)
    return left, right


def conserved(w: AttentionWeights, side: str) -> torch.Tensor:
    """The conserved quantity: ``[..., G, k, k]`` (QK-norm QK side: ``[..., dk]``)."""
    s = w.spec
    if side == "qk" and s.qk_norm != "none":
        return project_tied(w.g_Q**2 - w.g_K**2, s)
    left, right = grams(w, side)
    C = left - right
    return project_commutant(C, s) if side == "qk" else C


def metrics(before: AttentionWeights, after: AttentionWeights | None = None) -> dict[str, torch.Tensor]:
    """The paper's metrics per group (``[..., G]``; QK-norm QK side per layer ``[...]``).

    ``beta = ||C||_F``, ``tau = trace C``, ``mu = lambda_min(G_left) + lambda_min(G_right)``
    and, when ``after`` is given (metrics then refer to ``after``), ``drift = ||C_after -
    C_before||_F``.
    """
    out: dict[str, torch.Tensor] = {}
    point = before if after is None else after
    for side in ("qk", "vo"):
        C = conserved(point, side)
        mat = C.ndim >= 2 and not (side == "qk" and point.spec.qk_norm != "none")
        out[f"beta_{side}"] = C.flatten(-2).norm(dim=-1) if mat else C.norm(dim=-1)
        out[f"tau_{side}"] = C.diagonal(dim1=-2, dim2=-1).sum(-1) if mat else C.sum(-1)
        left, right = grams(point, side)
        out[f"mu_{side}"] = torch.linalg.eigvalsh(left)[..., 0] + torch.linalg.eigvalsh(right)[..., 0]
        if after is not None:
            diff = C - conserved(before, side)
            out[f"drift_{side}"] = diff.flatten(-2).norm(dim=-1) if mat else diff.norm(dim=-1)
    return out
