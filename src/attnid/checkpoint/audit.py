"""`attnid audit`: how unbalanced is a checkpoint, per layer and per head.

For each layer and key/value group (computed in float64 on the stored weights):

* ``imbalance_qk``, ``imbalance_vo``: the conserved quantity ``C = G_left - G_right``
  (weights only; under RoPE its commutant part) over the Gram scale ``||G_left|| +
  ||G_right||``, in [0, 1]: a balanced checkpoint reads 0, the most unbalanced one possible
  reads 1. (``beta = ||C||_F`` itself, the number training and the Monitor report, has units:
  the imbalance is beta divided by that scale.)
* ``tau_*``, ``mu_*``: ``trace C`` and ``lambda_min(G_left) + lambda_min(G_right)`` (raw units).
* ``key_bias_invisible``: the share ``||b_K on pass-through dims|| / ||b_K||`` that softmax
  cannot see (all of it without RoPE).
* ``value_bias_foldable``: ``||sum_g b_V^g sum_{h in g} W_O^h||``, what folding would move
  into the output bias.
* ``removable_norm``: ``||w - rebalance(w)||`` over the four weight matrices, the weight
  norm that moving to the nearest balanced point would remove (and ``removable_share``,
  the same over ``||w||``).

Medians over heads are `attnid.stats.median` everywhere (the CLI table, its summary line,
``--json`` and the report): for an even count, the mean of the two middle values.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from attnid.checkpoint.load import Checkpoint, open_checkpoint
from attnid.stats import median
from attnid.symmetry.conserved import Metrics, flat_key, metrics
from attnid.symmetry.rebalance import rebalance_qk, rebalance_vo
from attnid.weights import SIDES, AttentionWeights, Side, grams, kv_group_sum_out

WEIGHTS = ("W_Q", "W_K", "W_V", "W_O")


def weights_only(w: AttentionWeights) -> AttentionWeights:
    """``w`` with the query, key and value biases zeroed (the output bias kept)."""
    zero = {n: torch.zeros_like(w[n]) for n in ("b_Q", "b_K", "b_V") if getattr(w, n) is not None}
    return w.replace(**zero)


def imbalance(w: AttentionWeights, m: Metrics, side: Side) -> torch.Tensor:
    """``beta / (||G_left|| + ||G_right||)`` per kv group, in [0, 1]: ``[..., G]`` (QK-norm QK side:
    ``[...]``). ``m``: ``metrics(w)``."""
    if side == "qk" and w.spec.qk_norm != "none":
        scale = (w.g_Q**2).norm(dim=-1) + (w.g_K**2).norm(dim=-1)
    else:
        left, right = grams(w, side)
        scale = left.flatten(-2).norm(dim=-1) + right.flatten(-2).norm(dim=-1)
    return m.side(side).beta / scale.clamp_min(1e-300)


@dataclass(frozen=True)
class LayerAudit:
    """The audit of one layer, float64; per key/value group ``[G]`` (QK-norm's QK side:
    one value, ``[]``)."""

    layer: int
    imbalance_qk: torch.Tensor  # [G]: ||C_QK|| over the Gram scale, in [0, 1]
    imbalance_vo: torch.Tensor  # [G]
    metrics: Metrics  # of the weights only (biases zeroed): beta, tau, mu per side
    key_bias_invisible: torch.Tensor | None  # [G]: share of ||b_K|| softmax cannot see
    value_bias_foldable: float | None  # ||what folding b_V would move into b_O||
    removable_norm: float  # ||w - rebalance(w)|| over the weight matrices
    removable_share: float  # the same over ||w||

    def imbalance(self, side: Side) -> torch.Tensor:
        return self.imbalance_qk if side == "qk" else self.imbalance_vo

    def to_dict(self) -> dict[str, Any]:
        """One object of ``audit --json``'s ``layers`` (lists over key/value groups)."""
        kbi = self.key_bias_invisible
        return {"layer": self.layer, "imbalance_qk": self.imbalance_qk.tolist(),
                "imbalance_vo": self.imbalance_vo.tolist(),
                **{k: v.tolist() for k, v in self.metrics.flat(("tau", "mu")).items()},
                "key_bias_invisible": None if kbi is None else kbi.tolist(),
                "value_bias_foldable": self.value_bias_foldable, "removable_norm": self.removable_norm,
                "removable_share": self.removable_share}

    def row(self) -> dict[str, Any]:
        """The layer's line of every audit table (the CLI's and the report's): medians and
        maxima over its heads."""
        out: dict[str, Any] = {"layer": self.layer}
        for side in SIDES:
            x = self.imbalance(side)
            out[flat_key("imbalance", side) + "_median"] = median(x)
            out[flat_key("imbalance", side) + "_max"] = float(x.max())
        for side in SIDES:
            out[flat_key("tau", side) + "_median"] = median(self.metrics.side(side).tau)
        kbi = self.key_bias_invisible
        out["key_bias_invisible_median"] = None if kbi is None else median(kbi)
        return {**out, "value_bias_foldable": self.value_bias_foldable,
                "removable_norm": self.removable_norm, "removable_share": self.removable_share}


@dataclass(frozen=True)
class AuditSummary:
    """Over every head of every layer."""

    imbalance_qk_median: float
    imbalance_qk_max: float
    imbalance_vo_median: float
    imbalance_vo_max: float
    removable_norm: float  # sqrt of the sum over layers of removable_norm^2
    removable_share_mean: float  # the mean over layers


@dataclass(frozen=True)
class Audit:
    """The audit of a checkpoint (``audit --json`` is :meth:`to_dict`)."""

    model: str
    architecture: str
    dtype: str
    spec: str
    layers: tuple[LayerAudit, ...]

    def imbalance(self, side: Side) -> torch.Tensor:
        """Every head's imbalance on one side, all layers: ``[sum of G]``."""
        return torch.cat([layer.imbalance(side).reshape(-1) for layer in self.layers])

    @property
    def summary(self) -> AuditSummary:
        qk, vo = self.imbalance("qk"), self.imbalance("vo")
        return AuditSummary(median(qk), float(qk.max()), median(vo), float(vo.max()),
                            sum(r.removable_norm**2 for r in self.layers) ** 0.5,
                            sum(r.removable_share for r in self.layers) / len(self.layers))

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "architecture": self.architecture, "dtype": self.dtype,
                "spec": self.spec, "summary": asdict(self.summary),
                "layers": [layer.to_dict() for layer in self.layers]}


def audit_layer(w: AttentionWeights, layer: int = 0) -> LayerAudit:
    """The audit of one layer (float64 container)."""
    s = w.spec
    core = weights_only(w)
    m = metrics(core)
    kbi = None
    if w.b_K is not None:
        total = w.b_K.norm(dim=-1)
        hidden = w.b_K[..., s.rope_dims:].norm(dim=-1) if s.qk_norm == "none" else torch.zeros_like(total)
        kbi = hidden / total.clamp_min(1e-300)
    foldable = None
    if w.b_V is not None:
        foldable = float(torch.einsum("gv,gvd->d", w.b_V, kv_group_sum_out(w)).norm())
    bal = rebalance_vo(rebalance_qk(core, subgroup="auto", align=True, bias_rows=False),
                       align=True, fold=False, bias_rows=False)
    removed = sum(float(((bal[n] - w[n]) ** 2).sum()) for n in WEIGHTS) ** 0.5
    size = sum(float((w[n] ** 2).sum()) for n in WEIGHTS) ** 0.5
    return LayerAudit(layer, imbalance(core, m, "qk"), imbalance(core, m, "vo"), m, kbi, foldable,
                      removed, removed / max(size, 1e-300))


def audit(model: str | Path | Checkpoint) -> Audit:
    """The audit of a checkpoint (path or opened `Checkpoint`); never writes anything."""
    ck = model if isinstance(model, Checkpoint) else open_checkpoint(model)
    layers = tuple(audit_layer(w, i) for i, w in enumerate(ck.layers()))
    dtype = str(ck.dtype()).split(".")[-1]
    return Audit(str(ck.path), ck.adapter.family, dtype, ck.specs[0].describe(), layers)


def heat_map(result: Audit, path: str | Path) -> None:
    """PNG: imbalance_qk and imbalance_vo, layers x key/value groups."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 0.4 * len(result.layers) + 2), squeeze=False)
    for ax, side in zip(axes[0], SIDES, strict=True):
        grid = [layer.imbalance(side).reshape(-1).tolist() for layer in result.layers]
        im = ax.imshow(grid, aspect="auto", cmap="magma", vmin=0.0, vmax=max(1e-12, max(map(max, grid))))
        ax.set_title(f"{flat_key('imbalance', side)} (0 = balanced, 1 = most unbalanced)", fontsize=9)
        ax.set_xlabel("key/value group (head)")
        ax.set_ylabel("layer")
        fig.colorbar(im, ax=ax)
    fig.suptitle(f"attnid audit: {result.model}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
