"""`attnid diff`: are two checkpoints the same function modulo the whole-model symmetry group?

The group `attnid.count_model` counts (docs/theory.md §13): norm gain transfers, the
residual-stream rotation, LayerNorm centring and bias transfer, writes along all-ones,
embedding translations, logit shift, parallel-bias transfer, MLP neuron scaling, the attention
group of every layer (RoPE commutant, GQA, biases, QK-norm), and the permutations of heads and
MLP neurons. `attnid.whole.fit` gauge-fixes both checkpoints, fits the element that maps B onto
A (Procrustes for the rotation, linear assignment for the permutations, least squares per
group) and compares every gauge-fixed piece at the dtype's rounding, one layer at a time (any
size, sharded safetensors included). B is *certified* when every residual is at rounding;
otherwise the first piece that breaks, in forward order, is named by its layer, head and the
checkpoint tensor to blame. A tied model and an untied one (QuaRot and SpinQuant untie a tied
model to rotate its stream) are compared as two untied models, the tied head being its token
table (docs/theory.md §13.21). Per layer: the stored distance, the distance after the fitted
element, and the share of the difference the rotation and the permutations explain.

`compare_layers` (the attention group of one layer, `attnid.symmetry.invariants`) is re-exported.
"""

from __future__ import annotations

from typing import Any

from attnid.checkpoint.load import Checkpoint, open_checkpoint
from attnid.checkpoint.units import Units, layout_of_config, open_units
from attnid.errors import AttnidError
from attnid.numerics import rounding_tolerance
from attnid.progress import Progress
from attnid.symmetry.invariants import compare_layers as compare_layers
from attnid.whole.fit.compare import UnitResult
from attnid.whole.fit.fitter import Fit, fit
from attnid.whole.fit.frame import accept_bound
from attnid.whole.transforms.layout import Layout

tolerance = rounding_tolerance  # the rounding level a certified residual may reach (the 2-eps rule)


def covers(lay: Layout, rotation: str) -> list[str]:
    """What the fitted element spans for this architecture (docs/theory.md §13.19)."""
    out = []
    if any(nm.absorb is None and nm.gain for nm in lay.norms):
        out.append("norm gains folded into their readers (gain transfer)")
    out.append(f"residual-stream rotation ({rotation})" if rotation.startswith("fitted")
               else f"no residual-stream rotation: {rotation}")
    if lay.norm == "layer":
        out.append("LayerNorm centring and bias transfer; writes along all-ones")
    if lay.post:
        out.append("post-LN: each norm's bias moved into the next output bias")
    if len(lay.tables) > 1:
        pad = " (and RoBERTa's pad rows)" if lay.padding_idx is not None else ""
        out.append("embedding translations" + pad)
    if lay.unembed is not None:
        out.append("logit shift")
    if lay.parallel:
        out.append("parallel-bias transfer")
    out += ["permutations of heads within and across key/value groups, and of MLP neurons "
            "(linear assignment)",
            "QK gauge per key/value group (GL; under RoPE only its commutant; QK-norm: gain transfer); "
            "key-bias translation (pass-through dims)",
            "VO gauge per key/value group (GL); value-bias folding into the output bias"]
    if lay.mlp != "other":
        out.append("MLP neuron scaling (" + ("gated: the up half" if lay.mlp == "gated" else "ReLU: positive")
                   + ")")
    out.append("every other tensor must match to rounding")
    return out


def diff(model_a: str | Checkpoint, model_b: str | Checkpoint, *, probes: int | None = None,
         progress: Progress | None = None) -> dict[str, Any]:
    """Compare two checkpoints of one architecture modulo the whole-model symmetry group
    (`attnid.whole.fit.fit`, streamed one unit at a time); the JSON of `attnid diff`."""
    a = model_a if isinstance(model_a, Checkpoint) else open_checkpoint(model_a)
    b = model_b if isinstance(model_b, Checkpoint) else open_checkpoint(model_b)
    if a.adapter.family != b.adapter.family or a.specs != b.specs:
        raise AttnidError(f"{a.path} and {b.path} are not the same architecture "
                          f"({a.adapter.family} {a.specs[0].describe()} x{a.n_layers} vs "
                          f"{b.adapter.family} {b.specs[0].describe()} x{b.n_layers})")
    for x in (a, b):  # read while the layout is built: the tables, the head, the first layer
        x.read_ahead(x.read_order(layers=1))
    tied_a, tied_b = (layout_of_config(x).tied for x in (a, b))
    untie = tied_a != tied_b  # compared as two untied models
    names_a, names_b = {_rel(a, n) for n in a.index}, {_rel(b, n) for n in b.index}
    if untie:  # the untied one's head is the tied one's token table
        names_a, names_b = names_a - _heads(a, b), names_b - _heads(a, b)
    if names_a != names_b:
        extra = sorted(names_a ^ names_b)[:3]
        raise AttnidError(f"{a.path} and {b.path} hold different tensors (e.g. {', '.join(extra)})")
    for n in sorted(names_a):
        sa, sb = a.info(_full(a, n)).shape, b.info(_full(b, n)).shape
        if sa != sb:
            raise AttnidError(f"{n} has shape {list(sa)} in {a.path} but {list(sb)} in {b.path}")
    if probes is not None and probes < 1:
        raise AttnidError(f"--probes must be a positive number of directions, got {probes}")
    ua, ub = open_units(a, untie=untie), open_units(b, untie=untie)
    if ua.layout != ub.layout:
        raise AttnidError(f"{a.path} and {b.path} are not the same architecture (tied vs untied?)")
    shown = progress if progress is not None else Progress(enabled=False)
    f = fit(ua, ub, probe_k=probes, progress=shown.line)
    return to_dict(a, b, ua, f)


def to_dict(a: Checkpoint, b: Checkpoint, units: Units, f: Fit) -> dict[str, Any]:
    """The JSON of `attnid diff` from a fit (names in checkpoint terms)."""
    L = len(units.layout.layers)
    tol = f.tolerance
    brk = None
    rows, outside = [], []
    for u, r in enumerate(f.units):
        layer = u - 1 if 0 < u <= L else None
        for x in r.residuals:
            if brk is None and x.residual > tol:
                brk = {"layer": layer, "tensor": units.label(x.tensor), "head": x.head,
                       "residual": x.residual, "invariant": x.invariant, "reason": x.reason}
        if layer is None:
            outside += r.residuals
        else:
            rows.append(_layer_row(layer, r, f.raw[u], units))
    worst = max(outside, key=lambda x: x.residual, default=None)
    other = {"worst_tensor": None if worst is None else units.label(worst.tensor),
             "residual": 0.0 if worst is None else worst.residual}
    return {"model_a": str(a.path), "model_b": str(b.path), "architecture": a.adapter.family,
            "dtype": str(f.dtype).split(".")[-1], "tolerance": tol, "certified": brk is None,
            "covers": covers(units.layout, f.rotation), "rotation": f.rotation,
            "probes": f.probes, "probe_bound": probe_bound(f.probes), "break": brk, "other": other,
            "layers": rows}


def probe_bound(k: int | None) -> dict[str, float] | None:
    """Through ``k`` probes: at most the probability of certifying a piece broken by 2, 4 and 8
    times the tolerance (`attnid.whole.fit.frame.accept_bound`); None when exact."""
    return None if k is None else {f"break_{c}x": accept_bound(k, c) for c in (2, 4, 8)}


def _share(x: float, y: float, of: float) -> float:
    return 0.0 if of == 0.0 else min(1.0, max(0.0, (x - y) / of))


def _layer_row(layer: int, r: UnitResult, raw: float, units: Units) -> dict[str, Any]:
    d = r.distances  # squared
    worst = max(r.residuals, key=lambda x: x.residual)
    residuals: dict[str, float] = {}
    for x in r.residuals:
        residuals[x.invariant] = max(residuals.get(x.invariant, 0.0), x.residual)
    aligned = d["aligned"] ** 0.5
    return {"layer": layer, "raw_distance": raw, "gauge_fixed_distance": d["fixed"] ** 0.5,
            "rotated_distance": d["rotated"] ** 0.5, "permuted_distance": d["permuted"] ** 0.5,
            "aligned_distance": aligned,
            "gauge_share": 1.0 if raw == 0.0 else min(1.0, max(0.0, 1.0 - (aligned / raw) ** 2)),
            "rotation_share": _share(d["fixed"], d["rotated"], d["fixed"]),
            "permutation_share": _share(d["rotated"], d["permuted"], d["fixed"]),
            "worst_tensor": units.label(worst.tensor), "worst_invariant": worst.invariant,
            "worst_head": worst.head, "residual": worst.residual, "residuals": residuals}


def _heads(a: Checkpoint, b: Checkpoint) -> set[str]:
    """The head tensors either checkpoint stores (without the outer prefix)."""
    out = set()
    for ck in (a, b):
        lay = layout_of_config(ck)
        name = None if lay.unembed is None else ck.resolve(f"{lay.unembed.path}.weight")
        if name is not None:
            out.add(_rel(ck, name))
    return out


def _full(ck: Checkpoint, rel: str) -> str:
    return ck.prefix + rel if ck.prefix + rel in ck.index else rel


def _rel(ck: Checkpoint, name: str) -> str:
    """A tensor name without the checkpoint's outer prefix (where it has it)."""
    return name[len(ck.prefix):] if name.startswith(ck.prefix) else name
