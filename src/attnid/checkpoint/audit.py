"""`attnid audit`: how unbalanced is a checkpoint, per layer and per head.

For each layer and key/value group (computed in float64 on the stored weights):

* ``beta_qk``, ``beta_vo``: the conserved quantity ``C = G_left - G_right`` (weights only;
  under RoPE its commutant part) over the Gram scale ``||G_left|| + ||G_right||``. A balanced
  checkpoint reads 0; the most unbalanced one possible reads 1.
* ``tau_*``, ``mu_*``: ``trace C`` and ``lambda_min(G_left) + lambda_min(G_right)`` (raw units).
* ``key_bias_invisible``: the share ``||b_K on pass-through dims|| / ||b_K||`` that softmax
  cannot see (all of it without RoPE).
* ``value_bias_foldable``: ``||sum_g b_V^g sum_{h in g} W_O^h||``, what folding would move
  into the output bias.
* ``removable_norm``: ``||w - rebalance(w)||`` over the four weight matrices, the weight
  norm that moving to the nearest balanced point would remove (and ``removable_share``,
  the same over ``||w||``).
"""

from __future__ import annotations

from typing import Any

import torch

from attnid.checkpoint.load import Checkpoint, open_checkpoint
from attnid.symmetry.conserved import metrics
from attnid.symmetry.rebalance import rebalance_qk, rebalance_vo
from attnid.weights import AttentionWeights, grams, group_sum_out

WEIGHTS = ("W_Q", "W_K", "W_V", "W_O")


def weights_only(w: AttentionWeights) -> AttentionWeights:
    """``w`` with the query, key and value biases zeroed (the output bias kept)."""
    zero = {n: torch.zeros_like(w[n]) for n in ("b_Q", "b_K", "b_V") if getattr(w, n) is not None}
    return w.replace(**zero)


def normalised_beta(w: AttentionWeights) -> dict[str, torch.Tensor]:
    """``beta / (||G_left|| + ||G_right||)`` per group, both sides: ``[..., G]`` (QK-norm: ``[...]``)."""
    m = metrics(w)
    out = {}
    for side in ("qk", "vo"):
        if side == "qk" and w.spec.qk_norm != "none":
            scale = (w.g_Q**2).norm(dim=-1) + (w.g_K**2).norm(dim=-1)
        else:
            left, right = grams(w, side)
            scale = left.flatten(-2).norm(dim=-1) + right.flatten(-2).norm(dim=-1)
        out[f"beta_{side}"] = m[f"beta_{side}"] / scale.clamp_min(1e-300)
    return out


def audit_layer(w: AttentionWeights) -> dict[str, Any]:
    """The audit of one layer (float64 container)."""
    s = w.spec
    core = weights_only(w)
    m = metrics(core)
    row: dict[str, Any] = {}
    row.update({k: v.tolist() for k, v in normalised_beta(core).items()})
    for k in ("tau_qk", "tau_vo", "mu_qk", "mu_vo"):
        row[k] = m[k].tolist()
    if w.b_K is not None:
        total = w.b_K.norm(dim=-1)
        hidden = w.b_K[..., s.rope_dims:].norm(dim=-1) if s.qk_norm == "none" else torch.zeros_like(total)
        row["key_bias_invisible"] = (hidden / total.clamp_min(1e-300)).tolist()
    else:
        row["key_bias_invisible"] = None
    if w.b_V is not None:
        moved = torch.einsum("gv,gvd->d", w.b_V, group_sum_out(w))
        row["value_bias_foldable"] = float(moved.norm())
    else:
        row["value_bias_foldable"] = None
    bal = rebalance_vo(rebalance_qk(core, group="auto", align=True, bias_rows=False),
                       align=True, fold=False, bias_rows=False)
    removed = sum(float(((bal[n] - w[n]) ** 2).sum()) for n in WEIGHTS) ** 0.5
    size = sum(float((w[n] ** 2).sum()) for n in WEIGHTS) ** 0.5
    row["removable_norm"] = removed
    row["removable_share"] = removed / max(size, 1e-300)
    return row


def audit(model: str | Any) -> dict[str, Any]:
    """The audit of a checkpoint (path or opened `Checkpoint`); never writes anything."""
    ck = model if isinstance(model, Checkpoint) else open_checkpoint(model)
    layers = [dict(layer=i, **audit_layer(w)) for i, w in enumerate(ck.layers())]
    flat = {side: torch.tensor([b for r in layers for b in _as_list(r[f"beta_{side}"])])
            for side in ("qk", "vo")}
    summary = {}
    for side, t in flat.items():
        summary[f"beta_{side}_median"] = float(t.median())
        summary[f"beta_{side}_max"] = float(t.max())
    summary["removable_norm"] = sum(r["removable_norm"] ** 2 for r in layers) ** 0.5
    summary["removable_share_mean"] = sum(r["removable_share"] for r in layers) / len(layers)
    return {"model": str(ck.path), "architecture": ck.adapter.family, "dtype": str(ck.dtype()).split(".")[-1],
            "spec": ck.specs[0].describe(), "summary": summary, "layers": layers}


def _as_list(x: Any) -> list[float]:
    return x if isinstance(x, list) else [x]


def heat_map(report: dict[str, Any], path: str) -> None:
    """PNG: normalised beta_qk and beta_vo, layers x key/value groups."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 0.4 * len(report["layers"]) + 2), squeeze=False)
    for ax, side in zip(axes[0], ("qk", "vo"), strict=True):
        grid = [_as_list(r[f"beta_{side}"]) for r in report["layers"]]
        im = ax.imshow(grid, aspect="auto", cmap="magma", vmin=0.0, vmax=max(1e-12, max(map(max, grid))))
        ax.set_title(f"normalised beta_{side}")
        ax.set_xlabel("key/value group (head)")
        ax.set_ylabel("layer")
        fig.colorbar(im, ax=ax)
    fig.suptitle(f"attnid audit: {report['model']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
