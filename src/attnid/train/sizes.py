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
    """``[H] -> [G]``: summed over each key/value group's heads."""
    return per_head.reshape(spec.n_kv_heads, spec.kv_group_size).sum(-1)


def trace_of_update(spec: AttentionSpec, sq: dict[str, torch.Tensor], side: Side) -> torch.Tensor:
    """``trace C(d)`` per key/value group ``[G]`` (QK-norm QK side: ``[1]``) from the squared
    norms ``sq[name]`` of the update's tensors, per head or kv group (``[H]``, ``[G]``) for the
    names of :data:`PER_HEAD` and :data:`PER_KV_GROUP`, whole (``[]``) for the rest."""
    zero = torch.zeros(spec.n_kv_heads, dtype=torch.float64, device=next(iter(sq.values())).device)
    if side == "qk" and spec.qk_norm != "none":
        return (sq["g_Q"] - sq["g_K"]).reshape(1)
    if side == "qk":
        left = _kv_grouped(sq["W_Q"] + sq.get("b_Q", 0), spec)
        return left - sq["W_K"] - sq.get("b_K", zero)
    return sq["W_V"] + sq.get("b_V", zero) - _kv_grouped(sq["W_O"], spec)


class UpdateSizes:
    """``before()`` and ``after()`` around each update; ``take()`` at a record returns the sums
    since the last one (``update_sq_qk``, ``update_sq_vo``, ``update_norm_max``: per layer;
    ``update_tau_qk``, ``update_tau_vo``: per layer and kv group) and starts again."""

    def __init__(self, model: GPT) -> None:
        self.specs = [b.attn.spec for b in model.blocks]
        self.names = [[n for n, _ in b.attn.named_parameters()] for b in model.blocks]
        self.params = [p.detach() for b in model.blocks for p in b.attn.parameters()]  # layer-major
        self.device = self.params[0].device
        self._start = [torch.empty_like(p, dtype=torch.float64) for p in self.params]
        self._delta = [torch.empty_like(p, dtype=torch.float64) for p in self.params]
        self._reset()

    def _reset(self) -> None:
        zero = lambda *shape: torch.zeros(shape, dtype=torch.float64, device=self.device)  # noqa: E731
        n = len(self.specs)
        self.sq: dict[Side, list[torch.Tensor]] = {side: [zero() for _ in range(n)] for side in SIDES}
        self.tau: dict[Side, list[torch.Tensor]] = {
            side: [zero(1 if side == "qk" and s.qk_norm != "none" else s.n_kv_heads) for s in self.specs]
            for side in SIDES}
        self.norm_max = [zero() for _ in range(n)]  # the largest single ||Δw||

    def before(self) -> None:
        torch._foreach_copy_(self._start, self.params)

    def after(self) -> None:
        torch._foreach_copy_(self._delta, self.params)
        torch._foreach_sub_(self._delta, self._start)  # exact: float32 values differ exactly in float64
        torch._foreach_mul_(self._delta, self._delta)
        squares = iter(self._delta)
        for i, (spec, names) in enumerate(zip(self.specs, self.names, strict=True)):
            sq = {}
            for name in names:
                t = next(squares)  # [H or G, ...] or a whole tensor
                sq[name] = t.flatten(1).sum(1) if name in PER_HEAD + PER_KV_GROUP else t.sum()
            total = 0.0
            for side in SIDES:
                side_sq = sum(sq[n].sum() for n in side_names(spec, side))
                self.sq[side][i] += side_sq
                total = total + side_sq
                self.tau[side][i] += trace_of_update(spec, sq, side)
            self.norm_max[i] = torch.maximum(self.norm_max[i], torch.as_tensor(total).sqrt())

    def take(self) -> dict[str, list]:
        """The sums since the last record under their JSONL names, then reset. One read back
        from the weights' device for all of them."""
        parts = [self.sq[side] for side in SIDES] + [self.tau[side] for side in SIDES] + [self.norm_max]
        values = torch.cat([t.reshape(-1) for part in parts for t in part]).tolist()
        out: dict[str, list] = {}
        at = 0
        keys = [flat_key(q, s) for q in ("update_sq", "update_tau") for s in SIDES] + ["update_norm_max"]
        for key, part in zip(keys, parts, strict=True):
            rows = []
            for t in part:
                rows.append(values[at] if t.dim() == 0 else values[at: at + t.numel()])
                at += t.numel()
            out[key] = rows
        self._reset()
        return out
