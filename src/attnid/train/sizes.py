"""Every step's attention update, summed between two logged steps: its squared norm per layer
and side, and the trace of the conserved quantity's form evaluated on the update itself.

A plain SGD step changes the conserved quantities only at second order (docs/theory.md §9.3):
``C(w + d) - C(w) = C(d)`` exactly for ``d = -lr g`` on the VO side, and its commutant
projection on the QK side, so per step ``||C_after - C_before||_F <= ||d_side||^2`` and
``tau_after - tau_before = trace C(d)``. The trace needs no matrix: it is a difference of
squared norms per key/value group,

    QK: sum_{h in g} (||d W_Q^h||^2 + ||d b_Q^h||^2) - ||d W_K^g||^2 - ||d b_K^g||^2
        (the commutant projection keeps the trace: I commutes with every RoPE rotation;
        QK-norm: ||d g_Q||^2 - ||d g_K||^2, one per layer)
    VO: ||d W_V^g||^2 + ||d b_V^g||^2 - sum_{h in g} ||d W_O^h||^2

so a step costs one float64 copy of the attention weights and a squared sum per tensor and
head, all on the weights' device and read back only at a record: a read every step would wait
for the accelerator each time (on one GPU shared by several runs, for every other run's turn).
"""

from __future__ import annotations

import torch

from attnid.spec import AttentionSpec
from attnid.symmetry.conserved import flat_key
from attnid.symmetry.tangent import side_names
from attnid.train.model import GPT
from attnid.weights import SIDES, Side

# the first axis of these is the head (H) or the key/value group (G); the rest are summed
PER_HEAD = ("W_Q", "b_Q", "W_O")
PER_KV_GROUP = ("W_K", "b_K", "W_V", "b_V")


def _kv_grouped(per_head: torch.Tensor, spec: AttentionSpec) -> torch.Tensor:
    """``[..., H] -> [..., G]``: summed over each key/value group's heads."""
    return per_head.reshape(*per_head.shape[:-1], spec.n_kv_heads, spec.kv_group_size).sum(-1)


def trace_of_update(spec: AttentionSpec, sq: dict[str, torch.Tensor], side: Side) -> torch.Tensor:
    """``trace C(d)`` per key/value group ``[..., G]`` (QK-norm QK side: ``[..., 1]``) from the
    squared norms ``sq[name]`` of the update's tensors: per head or kv group (``[..., H]``,
    ``[..., G]``) for the names of :data:`PER_HEAD` and :data:`PER_KV_GROUP`, whole (``[...]``)
    for the rest."""
    if side == "qk" and spec.qk_norm != "none":
        return (sq["g_Q"] - sq["g_K"]).unsqueeze(-1)
    if side == "qk":
        left = _kv_grouped(sq["W_Q"] + sq.get("b_Q", 0), spec)
        return left - sq["W_K"] - sq.get("b_K", 0)
    return sq["W_V"] + sq.get("b_V", 0) - _kv_grouped(sq["W_O"], spec)


class UpdateSizes:
    """``before()`` and ``after()`` around each update; ``take()`` at a record returns the sums
    since the last one (``update_sq_qk``, ``update_sq_vo``, ``update_norm_max``: per layer;
    ``update_tau_qk``, ``update_tau_vo``: per layer and kv group) and starts again. Every layer
    has the same spec, so each tensor name is one float64 stack ``[L, ...]``: a step costs a
    few dozen operations whatever the depth."""

    def __init__(self, model: GPT) -> None:
        self.spec = model.blocks[0].attn.spec
        self.names = [n for n, _ in model.blocks[0].attn.named_parameters()]
        L = len(model.blocks)
        self.params = [b.attn.get_parameter(n).detach() for n in self.names for b in model.blocks]  # by name
        self._start = {n: torch.empty(L, *p.shape, dtype=torch.float64, device=p.device)
                       for n, p in model.blocks[0].attn.named_parameters()}
        self._now = {n: torch.empty_like(t) for n, t in self._start.items()}
        self._start_views = [v for n in self.names for v in self._start[n].unbind(0)]
        self._now_views = [v for n in self.names for v in self._now[n].unbind(0)]
        self.device, self.layers = self.params[0].device, L
        self._reset()

    def _reset(self) -> None:
        zero = lambda *shape: torch.zeros(self.layers, *shape, dtype=torch.float64, device=self.device)  # noqa: E731
        self.sq: dict[Side, torch.Tensor] = {side: zero() for side in SIDES}  # [L]
        self.tau: dict[Side, torch.Tensor] = {  # [L, G] (QK-norm QK side: [L, 1])
            side: zero(1 if side == "qk" and self.spec.qk_norm != "none" else self.spec.n_kv_heads)
            for side in SIDES}
        self.norm_max = zero()  # [L]: the largest single ||Δw||

    def before(self) -> None:
        torch._foreach_copy_(self._start_views, self.params)

    def after(self) -> None:
        torch._foreach_copy_(self._now_views, self.params)
        sq = {}
        for n in self.names:  # exact: float32 values differ exactly in float64
            d2 = self._now[n].sub_(self._start[n]).square_()  # [L, ...]
            sq[n] = d2.flatten(2).sum(-1) if n in PER_HEAD + PER_KV_GROUP else d2.flatten(1).sum(-1)
        total = 0.0
        for side in SIDES:
            side_sq = sum(sq[n].reshape(self.layers, -1).sum(-1) for n in side_names(self.spec, side))
            self.sq[side] += side_sq
            total = total + side_sq
            self.tau[side] += trace_of_update(self.spec, sq, side)
        torch.maximum(self.norm_max, torch.as_tensor(total).sqrt(), out=self.norm_max)

    def take(self) -> dict[str, list]:
        """The sums since the last record under their JSONL names, then reset. One read back
        from the weights' device for all of them."""
        keys = [flat_key(q, s) for q in ("update_sq", "update_tau") for s in SIDES] + ["update_norm_max"]
        parts = [self.sq[s] for s in SIDES] + [self.tau[s] for s in SIDES] + [self.norm_max]
        values = torch.cat([t.reshape(-1) for t in parts]).tolist()
        out: dict[str, list] = {}
        at = 0
        for key, t in zip(keys, parts, strict=True):
            flat, at = values[at: at + t.numel()], at + t.numel()
            width = t.shape[-1]
            out[key] = flat if t.dim() == 1 else [flat[i: i + width] for i in range(0, len(flat), width)]
        self._reset()
        return out
