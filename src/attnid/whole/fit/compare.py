"""One unit of B against the same unit of A, both gauge-fixed (`attnid.whole.fit.canonical`)
and B in A's frame: heads and neurons matched (`attnid.whole.fit.match`), the per-kv-group Q/K
and V/O gauges and the MLP scales fitted, every piece's residual relative to what rounding acts
on, each residual blamed on the stored tensor that breaks it (docs/theory.md §13.19).

Distances (squared, summed over the unit's gauge-fixed pieces): ``fixed`` (gauge-fixed, nothing
fitted, B unrotated), ``rotated`` (B in A's frame), ``permuted`` (and heads and neurons
matched), ``aligned`` (and the per-kv-group gauges and MLP scales fitted).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from attnid.symmetry.invariants import align, distance, fit_gauge, qk_residuals, vo_residuals
from attnid.weights import AttentionWeights
from attnid.whole.fit.canonical import MLP, Attention, Canonical, Item
from attnid.whole.fit.frame import NARROW
from attnid.whole.fit.match import match_heads, match_neurons
from attnid.whole.transforms.element import LayerElement

QK_ORDER = ("W_Q·W_K", "b_Q·W_K", "W_Q·b_K", "b_Q·b_K", "W_Q", "W_K", "g_Q*g_K")
VO_ORDER = ("W_V·W_O", "b_O+b_V·W_O")


@dataclass(frozen=True)
class Residual:
    """One compared piece: the ``state_dict`` name blamed, the invariant, the worst head."""

    tensor: str
    invariant: str
    residual: float
    head: int | None = None
    reason: str | None = None


@dataclass
class UnitResult:
    residuals: list[Residual] = field(default_factory=list)
    distances: dict[str, float] = field(default_factory=lambda: dict.fromkeys(
        ("fixed", "rotated", "permuted", "aligned"), 0.0))
    element: LayerElement | None = None
    covered: set[str] = field(default_factory=set)  # the state_dict names its sections compared

    def add(self, stage_values: dict[str, float]) -> None:
        for k, v in stage_values.items():
            self.distances[k] += v


def _rel(a: torch.Tensor, b: torch.Tensor, scale: float) -> float:
    den = max(scale, float(a.norm()), float(b.norm()))
    return 0.0 if den == 0.0 else float((a - b).norm()) / den


def _sq(a: torch.Tensor | None, b: torch.Tensor | None) -> float:
    if a is None or b is None:
        return 0.0 if a is None and b is None else float(((a if b is None else b) ** 2).sum())
    return float(((a - b) ** 2).sum())


# ---- plain items -------------------------------------------------------------------------------
def compare_item(a: Item, b: Item, b_fixed: Item | None) -> UnitResult:
    r = UnitResult([Residual(a.blame, a.what or "tensor", _rel(a.value, b.value, max(a.scale, b.scale)))])
    d = _sq(a.value, b.value)
    fixed = d
    if b_fixed is not None:  # B unrotated, maybe through fewer probes (the stream is the last axis)
        k, K = b_fixed.value.shape[-1], a.value.shape[-1]
        fixed = _sq(a.value if k == K else a.value[..., :k] * (K / k) ** 0.5, b_fixed.value)
    r.add({"fixed": fixed, "rotated": d, "permuted": d, "aligned": d})
    return r


# ---- attention ---------------------------------------------------------------------------------
def narrow(w: AttentionWeights, k: int) -> AttentionWeights:
    """A probed layer through its first ``k`` probes (the same invariants, a smaller sketch)."""
    if w.spec.d_model <= k:
        return w
    new = {"W_Q": w.W_Q[..., :k, :], "W_K": w.W_K[..., :k, :], "W_V": w.W_V[..., :k, :],
           "W_O": w.W_O[..., :k]}
    if w.b_O is not None:
        new["b_O"] = w.b_O[..., :k]
    return AttentionWeights(replace(w.spec, d_model=k), **{n: new.get(n, t) for n, t in w.items()})


def narrowed(w: AttentionWeights, k: int) -> AttentionWeights:
    """`narrow`, rescaled by ``sqrt(K / k)`` so that squared distances through the ``k``
    probes still estimate those through all ``K`` (`attnid.whole.fit.frame.Frame.narrow`)."""
    if w.spec.d_model <= k:
        return w
    n = narrow(w, k)
    c = (w.spec.d_model / k) ** 0.5
    return n.replace(**{f: t * c for f, t in n.items() if f in ("W_Q", "W_K", "W_V", "W_O", "b_O")})


def permute_heads(w: AttentionWeights, perm: torch.Tensor) -> AttentionWeights:
    m = w.spec.kv_group_size
    kv_groups = perm.reshape(-1, m)[:, 0] // m
    new = {n: t[perm] for n, t in (("W_Q", w.W_Q), ("W_O", w.W_O), ("b_Q", w.b_Q)) if t is not None}
    new |= {n: t[kv_groups] for n, t in (("W_K", w.W_K), ("W_V", w.W_V), ("b_K", w.b_K), ("b_V", w.b_V))
            if t is not None}
    return w.replace(**new)


def _fits(x: torch.Tensor, y: torch.Tensor, tol: float) -> bool:
    return float((x - y).norm()) <= tol * max(float(y.norm()), 1e-300)


def _blame_attention(name: str, a: Attention, b: AttentionWeights, M: torch.Tensor | None,
                     C: torch.Tensor, tol: float) -> str:
    """The stored tensor a broken attention invariant points at (the side the fitted gauge
    cannot match; a bias the spec stores before the norm's bias it also reads)."""
    A, names = a.w, a.blame
    m = A.spec.kv_group_size

    def first(*fields: str) -> str:
        return next((names[f] for f in fields if f in names), names["W_Q"])

    if name == "W_Q·W_K":
        query_fits = M is not None and _fits(b.W_Q @ M.repeat_interleave(m, dim=0), A.W_Q, tol)
        return first("W_K") if query_fits else first("W_Q")
    if name in ("W_Q", "W_K"):
        return first(name)
    if name == "g_Q*g_K":
        return first("g_Q", "g_K")
    if name == "b_Q·W_K":
        return first("b_Q", "norm_bias", "W_Q")
    if name == "W_Q·b_K":
        return first("b_K", "norm_bias", "W_K")
    if name == "b_Q·b_K":
        return first("b_Q", "b_K", "norm_bias")
    if name == "W_V·W_O":
        return first("W_O") if _fits(b.W_V @ C, A.W_V, tol) else first("W_V")
    value_fits = A.b_V is not None and b.b_V is not None and _fits(b.b_V @ C, A.b_V, tol)
    if "b_V" in names and ("b_O" not in names or not value_fits):
        return names["b_V"]
    return first("b_O", "absorbed_bias", "norm_bias", "W_O")


def compare_attention(a: Attention, b: Attention, b_fixed: Attention | None, tol: float
                      ) -> tuple[UnitResult, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Residuals per invariant (worst head), distances, and the fitted ``(heads, M, C)``."""
    A = a.w
    perm = match_heads(A, b.w)
    B = permute_heads(b.w, perm)
    na, nb = (narrow(x, NARROW) for x in (A, B)) if a.probed else (A, B)  # invariants: fewer probes do
    res = {**qk_residuals(na, nb), **vo_residuals(na, nb)}
    M, C = fit_gauge(A, B)
    out = UnitResult()
    for name in (*QK_ORDER, *VO_ORDER):
        if name in res:
            t = res[name]
            out.residuals.append(Residual(_blame_attention(name, a, B, M, C, tol), name,
                                          float(t.max()), int(t.argmax())))
    aligned = align(A, B)
    fixed = distance(A, b.w) if b_fixed is None else distance(narrowed(A, b_fixed.w.spec.d_model), b_fixed.w)
    out.add({"fixed": fixed**2, "rotated": distance(A, b.w) ** 2,
             "permuted": distance(A, B) ** 2, "aligned": min(distance(A, aligned), distance(A, B)) ** 2})
    return out, perm, M, C


# ---- MLP ---------------------------------------------------------------------------------------
def _permute(x: MLP, perm: torch.Tensor) -> MLP:
    pick = lambda t: None if t is None else t[perm]  # noqa: E731
    return MLP(x.up[perm], x.down[perm], pick(x.gate), pick(x.up_bias), pick(x.gate_bias), x.kind,
               x.blame, x.up_scale, x.gate_scale)


def _scales(a: MLP, b: MLP, closest: bool = False) -> torch.Tensor | None:
    """Per-neuron ``c`` mapping B's neurons onto A's: the least-squares fit of the up rows
    (exact for an exact rewrite; what the residuals are measured with), or, ``closest``, the
    one of that fit, the down columns' fit and no scaling that leaves each neuron nearest to
    A's (for the distances of neurons that differ for real). ReLU: positive."""
    if a.kind == "other":
        return None
    up = (a.up * b.up).sum(1) / (b.up**2).sum(1).clamp_min(1e-300)
    cands = up[None]
    if closest:
        dot = (a.down * b.down).sum(1)
        down = (b.down**2).sum(1) / torch.where(dot == 0, torch.ones_like(dot), dot)
        cands = torch.stack([up, down, torch.ones_like(up)])  # [3, f]
    if a.kind == "relu":
        cands = cands.clamp_min(1e-12)  # a negative fit is no symmetry: the residual will say so
    cands = torch.where(cands == 0, torch.ones_like(cands), cands)
    c = cands[..., None]
    cost = ((c * b.up - a.up) ** 2).sum(-1) + ((b.down / c - a.down) ** 2).sum(-1)
    return cands.gather(0, cost.argmin(0)[None])[0]


def _scaled(x: MLP, c: torch.Tensor | None) -> MLP:
    if c is None:
        return x
    return MLP(x.up * c[:, None], x.down / c[:, None], x.gate,
               None if x.up_bias is None else x.up_bias * c, x.gate_bias, x.kind, x.blame,
               x.up_scale, x.gate_scale)


def _mlp_sq(a: MLP, b: MLP) -> float:
    return sum(_sq(x, y) for x, y in ((a.up, b.up), (a.down, b.down), (a.gate, b.gate),
                                      (a.up_bias, b.up_bias), (a.gate_bias, b.gate_bias)))


def compare_mlp(a: MLP, b: MLP, b_fixed: MLP | None, tol: float = 0.0
                ) -> tuple[UnitResult, torch.Tensor, torch.Tensor | None]:
    perm = match_neurons(a, b, tol)
    bp = _permute(b, perm)
    g = _scaled(bp, _scales(a, bp))
    c = _scales(a, bp, closest=True)
    out = UnitResult()
    pieces = (("gate", a.gate, g.gate, 0.0), ("gate_bias", a.gate_bias, g.gate_bias, a.gate_scale),
              ("up", a.up, g.up, 0.0), ("up_bias", a.up_bias, g.up_bias, a.up_scale),
              ("down", a.down, g.down, 0.0))
    for name, x, y, scale in pieces:
        if x is not None and y is not None:
            out.residuals.append(Residual(a.blame[name], f"MLP {name.replace('_', ' ')}",
                                          _rel(x, y, scale)))
    out.add({"fixed": _mlp_sq(a, b_fixed or b), "rotated": _mlp_sq(a, b), "permuted": _mlp_sq(a, bp),
             "aligned": _mlp_sq(a, _scaled(bp, c))})
    return out, perm, c


# ---- a unit ------------------------------------------------------------------------------------
def compare_unit(a: Canonical, b: Canonical, b_fixed: Canonical | None, tol: float) -> UnitResult:
    """Every section of one unit, in forward order; the fitted per-layer element."""
    out = UnitResult()
    heads = qk = vo = neurons = scales = None
    fixed = b_fixed.sections if b_fixed is not None else [None] * len(a.sections)
    for sa, sb, sf in zip(a.sections, b.sections, fixed, strict=True):
        if isinstance(sa, Attention):
            r, heads, qk, vo = compare_attention(sa, sb, sf, tol)
        elif isinstance(sa, MLP):
            r, neurons, scales = compare_mlp(sa, sb, sf, tol)
        else:
            r = compare_item(sa, sb, sf)
        out.residuals += r.residuals
        out.add(r.distances)
    if heads is not None or neurons is not None:
        out.element = LayerElement(heads=heads, qk=qk, vo=vo, neurons=neurons, mlp=scales)
    return out
