"""Conserved quantities of gradient flow and the paper's metrics, per head/kv group, QK and VO
(docs/theory.md §9).

Gradients are orthogonal to the orbit, so gradient flow conserves, per kv group,
``C_QK = sum_{h in g} W~_Q^hT W~_Q^h - W~_K^gT W~_K^g`` and per kv group
``C_VO = W~_V^gT W~_V^g - sum_{h in g} W_O^h W_O^hT`` (``~``: bias row appended). Under
RoPE only the commutant part is conserved (pass-through block, and per plane the
difference of squared norms); under QK-norm, the per-dim ``g_Q^2 - g_K^2`` (tied in planes).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, fields

import torch

from attnid.rope import project_commutant, project_tied
from attnid.symmetry.spectra import smallest_eigenvalues
from attnid.weights import SIDES, AttentionWeights, Side, grams


def flat_key(quantity: str, side: Side) -> str:
    """The flat name of a per-side quantity in every user-facing record (JSONL lines, Trainer
    logs, CSV columns): ``("beta", "qk") -> "beta_qk"``. The one place such names are formed."""
    return f"{quantity}_{side}"


def conserved(w: AttentionWeights, side: Side) -> torch.Tensor:
    """The conserved quantity, float64: ``[..., G, k, k]`` (QK-norm QK side: ``[..., dk]``)."""
    s = w.spec
    if side == "qk" and s.qk_norm != "none":
        return project_tied(w.g_Q.double() ** 2 - w.g_K.double() ** 2, s)
    left, right = (g.double() for g in grams(w, side))
    C = left - right
    return project_commutant(C, s) if side == "qk" else C


def _is_vector(w: AttentionWeights, side: Side) -> bool:
    """Whether ``conserved(w, side)`` is one vector per layer (QK-norm's QK side), not a
    matrix per kv group."""
    return side == "qk" and w.spec.qk_norm != "none"


def kv_group_norm(C: torch.Tensor, w: AttentionWeights, side: Side) -> torch.Tensor:
    """Frobenius norm of a conserved quantity (or of a difference of two) of ``w``'s spec:
    ``[..., G]`` (QK-norm QK side: ``[...]``)."""
    return C.norm(dim=-1) if _is_vector(w, side) else C.flatten(-2).norm(dim=-1)


group_norm = kv_group_norm  # deprecated alias (one release)


def kv_group_trace(C: torch.Tensor, w: AttentionWeights, side: Side) -> torch.Tensor:
    """Trace of a conserved quantity (or of a difference of two) of ``w``'s spec: ``[..., G]``
    (QK-norm QK side: the sum of the vector, ``[...]``)."""
    return C.sum(-1) if _is_vector(w, side) else C.diagonal(dim1=-2, dim2=-1).sum(-1)


group_trace = kv_group_trace  # deprecated alias (one release)


@dataclass(frozen=True)
class SideMetrics:
    """The paper's metrics of one side, float64, per key/value group ``[..., G]`` (QK-norm
    QK side: per layer ``[...]``)."""

    beta: torch.Tensor  # ||C||_F
    tau: torch.Tensor  # trace C
    mu: torch.Tensor  # lambda_min(G_left) + lambda_min(G_right)
    drift: torch.Tensor | None = None  # ||C_after - C_before||_F, when two points were measured

    def flat(self, side: Side, names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
        """``{"beta_qk": ..., "tau_qk": ..., ...}`` (only ``names`` when given; a missing drift
        is left out)."""
        keep = None if names is None else set(names)
        return {flat_key(f.name, side): v for f in fields(self)
                if (v := getattr(self, f.name)) is not None and (keep is None or f.name in keep)}

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> SideMetrics:
        """``fn`` applied to every tensor (e.g. ``lambda t: t[j]`` for layer ``j`` of a stack)."""
        return SideMetrics(*(None if (v := getattr(self, f.name)) is None else fn(v) for f in fields(self)))


@dataclass(frozen=True)
class Metrics:
    """Both sides' metrics: ``qk`` and ``vo``."""

    qk: SideMetrics
    vo: SideMetrics

    def side(self, side: Side) -> SideMetrics:
        return self.qk if side == "qk" else self.vo

    def flat(self, names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
        """Flat names, QK first: ``beta_qk, tau_qk, mu_qk, drift_qk, beta_vo, ...``."""
        names = None if names is None else tuple(names)
        return {k: v for side in SIDES for k, v in self.side(side).flat(side, names).items()}

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> Metrics:
        return Metrics(self.qk.map(fn), self.vo.map(fn))


def metrics(before: AttentionWeights, after: AttentionWeights | None = None) -> Metrics:
    """The paper's metrics per kv group (``[..., G]``; QK-norm QK side per layer ``[...]``).

    ``beta = ||C||_F``, ``tau = trace C``, ``mu = lambda_min(G_left) + lambda_min(G_right)``
    and, when ``after`` is given (metrics then refer to ``after``), ``drift = ||C_after -
    C_before||_F``.
    """
    point = before if after is None else after
    sides = {}
    for side in SIDES:
        C = conserved(point, side)
        # from the eigendecomposition the projection at this point reuses (symmetry.spectra)
        left, right = smallest_eigenvalues(point, side)
        sides[side] = SideMetrics(
            beta=kv_group_norm(C, point, side),
            tau=kv_group_trace(C, point, side),
            mu=left + right,
            drift=None if after is None else kv_group_norm(C - conserved(before, side), point, side))
    return Metrics(**sides)
