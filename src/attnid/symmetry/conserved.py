"""Conserved quantities of gradient flow and the paper's metrics, per head/group, QK and VO
(docs/theory.md §9).

Gradients are orthogonal to the orbit, so gradient flow conserves, per key group,
``C_QK = sum_{h in g} W~_Q^hT W~_Q^h - W~_K^gT W~_K^g`` and per value group
``C_VO = W~_V^gT W~_V^g - sum_{h in g} W_O^h W_O^hT`` (``~``: bias row appended). Under
RoPE only the commutant part is conserved (pass-through block, and per plane the
difference of squared norms); under QK-norm, the per-dim ``g_Q^2 - g_K^2`` (tied in planes).
"""

from __future__ import annotations

import torch

from attnid.rope import project_commutant, project_tied
from attnid.symmetry.spectra import smallest_eigenvalues
from attnid.weights import AttentionWeights, grams


def conserved(w: AttentionWeights, side: str) -> torch.Tensor:
    """The conserved quantity, float64: ``[..., G, k, k]`` (QK-norm QK side: ``[..., dk]``)."""
    s = w.spec
    if side == "qk" and s.qk_norm != "none":
        return project_tied(w.g_Q.double() ** 2 - w.g_K.double() ** 2, s)
    left, right = (g.double() for g in grams(w, side))
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
        # from the eigendecomposition the projection at this point reuses (symmetry.spectra)
        left, right = smallest_eigenvalues(point, side)
        out[f"mu_{side}"] = left + right
        if after is not None:
            diff = C - conserved(before, side)
            out[f"drift_{side}"] = diff.flatten(-2).norm(dim=-1) if mat else diff.norm(dim=-1)
    return out
