"""Fit the whole-model group element that maps B onto A and measure what it leaves
(docs/theory.md §13.17), one unit at a time:

1. gauge-fix both models (`attnid.whole.fit.canonical`: folded norm gains, LayerNorm
   centring, all-ones shifts, translations, logit shift, post-LN and parallel biases);
2. the residual rotation by Procrustes on the gauge-fixed embedding and unembedding rows; when
   the first layer then disagrees, a second rotation fitted on that layer's rows, and the one
   more of the model agrees with is kept (a table rotated twice is then the table's fault);
3. per layer, heads and neurons matched by linear assignment, the per-group Q/K and V/O
   gauges and the MLP scales by least squares (`attnid.whole.fit.compare`);
4. every gauge-fixed piece compared at the dtype's rounding, blamed on a stored tensor.

`fit` returns the element (`attnid.whole.transforms.element.GroupElement`: what
`attnid.whole.transforms.apply_element` applies to B), every residual in forward order and the
distances per unit; `attnid.checkpoint.diff` reports it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from attnid.errors import AttnidError
from attnid.whole.fit import canonical as C
from attnid.whole.fit.compare import Residual, UnitResult, compare_item, compare_unit
from attnid.whole.fit.frame import Frame, probe_count, probes
from attnid.whole.fit.rotation import procrustes, rows
from attnid.whole.fit.source import UnitSource
from attnid.whole.transforms.element import GroupElement, LayerElement
from attnid.whole.transforms.residual import rotation_refusal
from attnid.whole.transforms.state import ModelTensors


def tolerance(dtype: torch.dtype) -> float:
    """The rounding level a certified residual may reach for checkpoints stored in ``dtype``."""
    return max(8 * torch.finfo(dtype).eps, 1e-13)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 for float32/float64 checkpoints; float32 is ample for bfloat16/float16."""
    return torch.float32 if torch.finfo(dtype).eps > 1e-6 else torch.float64


@dataclass(frozen=True)
class Fit:
    element: GroupElement
    units: list[UnitResult]  # per unit: residuals (state_dict names), distances
    raw: list[float]  # per unit: ||B - A|| over the stored tensors
    tolerance: float
    dtype: torch.dtype
    probes: int | None  # None: exact (the whole stream)
    rotation: str  # "fitted on ..." or why the stream is not rotated


# ---- the rotation --------------------------------------------------------------------------------
def _stream_rows(m: ModelTensors, unit: int, cd: torch.dtype) -> torch.Tensor | None:
    """Gauge-fixed rows living in the stream: the tables and the unembedding (units 0 and L+1),
    or a layer's reader rows and writer columns."""
    lay = m.layout
    out: list[torch.Tensor] = []
    if unit == 0:
        out = [T for _, T in C.tables(m, cd)]
    elif unit == len(lay.layers) + 1:
        u = C.unembedding(m, cd)
        out = [] if u is None else [u[0]]
    else:
        i = unit - 1
        for nm in lay.norms:
            for r in nm.readers:
                if r.path.startswith(lay.layers[i]) and m.has(r):
                    out.append(C.reader(m, r, cd)[0])
        for w in lay.writers[i]:
            W = m.weight(w).to(cd)
            out.append((W - W.mean(0, keepdim=True) if lay.norm == "layer" else W).T)
    return torch.cat([rows(x, 2 * x.shape[1]) for x in out]) if out else None


def _procrustes(pairs: list[tuple[torch.Tensor | None, torch.Tensor | None]], layer_norm: bool
                ) -> torch.Tensor | None:
    xa = [a for a, b in pairs if a is not None and b is not None]
    xb = [b for a, b in pairs if a is not None and b is not None]
    if not xa:
        return None
    return procrustes(torch.cat(xb), torch.cat(xa), layer_norm)


def _uniform_final(m: ModelTensors) -> torch.Tensor | None:
    lay = m.layout
    return m.gain(lay.final) if lay.final is not None and f"{lay.final.path}.weight" in m else None


# ---- one unit --------------------------------------------------------------------------------------
class _Fitter:
    def __init__(self, a: UnitSource, b: UnitSource, k: int | None, progress: Callable[[str], None] | None
                 ) -> None:
        self.a, self.b = a, b
        self.lay = a.layout
        self.L = len(self.lay.layers)
        self.dtype = max(a.dtype(), b.dtype(), key=lambda t: torch.finfo(t).eps)
        self.tol = tolerance(self.dtype)
        self.cd = compute_dtype(self.dtype)
        ref = _spec(a)
        self.d = ref.d_model
        kk = probe_count(self.d, max(ref.head_dim, ref.v_head_dim)) if k is None else k
        self.Z = probes(self.d, kk, self.cd)
        self.progress = progress or (lambda _: None)
        self.blame: dict[int, dict[str, str]] = {}

    def frames(self, Q: torch.Tensor | None) -> tuple[Frame, Frame, Frame]:
        return Frame(self.Z, None, self.cd), Frame(self.Z, Q, self.cd), Frame(self.Z, None, self.cd)

    def canonical(self, m: ModelTensors, unit: int, frame: Frame, ignore_norm: bool = False) -> C.Canonical:
        if unit == 0:
            return C.table_unit(m, frame)
        if unit == self.L + 1:
            return C.head_unit(m, frame, ignore_norm=ignore_norm)
        i = unit - 1
        return C.layer_unit(m, i, frame, self._blame(m, i), ignore_norm=ignore_norm)

    def _blame(self, m: ModelTensors, i: int) -> dict[str, str]:
        """AttentionWeights field -> the stored tensor holding it (the adapter's layout)."""
        if i not in self.blame:
            self.blame[i] = field_names(m, i)
        return self.blame[i]

    def compare(self, ma: ModelTensors, mb: ModelTensors, unit: int, Q: torch.Tensor | None,
                with_fixed: bool = True, ignore_norm: bool = False) -> UnitResult:
        fa, fb, f0 = self.frames(Q)
        ca = self.canonical(ma, unit, fa, ignore_norm)
        cb = self.canonical(mb, unit, fb, ignore_norm)
        c0 = self.canonical(mb, unit, f0, ignore_norm) if with_fixed and Q is not None else None
        r = compare_unit(ca, cb, c0, self.tol)
        r.covered = ca.covered
        return r


def _spec(src: UnitSource):
    from attnid.adapters.registry import adapter_for

    return adapter_for(src.config).specs(src.config)[0]


def field_names(m: ModelTensors, layer: int) -> dict[str, str]:
    """Which stored tensor (``state_dict`` name) holds each `AttentionWeights` field of a layer:
    found by writing a marked copy of a tiny layer of the same structure through the adapter."""
    from dataclasses import replace

    from attnid.weights import AttentionWeights

    a = m.adapter()
    spec = m.spec(layer)
    p = m.attention_prefix(layer)
    tiny = replace(spec, d_model=2)  # which tensor holds a field does not depend on the width
    shapes = tiny.param_shapes()
    out = {}
    for field in shapes:
        w = AttentionWeights(tiny, **{n: (torch.ones if n == field else torch.zeros)(s, dtype=torch.float64)
                                      for n, s in shapes.items()})
        hits = [n for n, t in a.write(w, layer).items() if bool(t.abs().sum() > 0)]
        if hits:
            out[field] = p + hits[0]
    return out


def fit(a: UnitSource, b: UnitSource, *, probe_k: int | None = None,
        progress: Callable[[str], None] | None = None) -> Fit:
    """The group element mapping B onto A and every residual it leaves (see the module)."""
    if a.layout != b.layout:
        raise AttnidError("the two models do not have the same layout")
    f = _Fitter(a, b, probe_k, progress)
    L = f.L
    rot = _Rotations(f)
    Q, how = rot.first()
    f.progress(f"rotation: {how}")
    # every unit once, the tables, the head and the first two layers first: when they
    # disagree with the rotation, the candidate more of them agree with is kept
    first = list(dict.fromkeys(u for u in (0, L + 1, 1, 2) if u <= L + 1))
    results: dict[int, tuple[UnitResult, float, dict[str, torch.Tensor]]] = {}
    for u in [*first, *(u for u in range(1, L + 1) if u not in first)]:
        results[u] = _unit(f, u, Q, rot.note)
        f.progress(f"unit {u} of {L + 1}: worst residual {_worst(results[u][0]):.2e}")
        if u == first[-1] and Q is not None and any(_worst(results[x][0]) > f.tol for x in first):
            Q2, how2 = rot.best(first, Q, how)
            if Q2 is not Q:
                Q, how = Q2, how2
                f.progress(f"rotation: {how}")
                results |= {x: _unit(f, x, Q, None) for x in first}
    units = [results[u][0] for u in range(L + 2)]
    gains: dict[str, torch.Tensor] = {}
    for u in range(L + 2):
        gains |= results[u][2]
    layers = tuple(r.element or LayerElement() for r in units[1:L + 1])
    element = GroupElement(rotation=Q, gains=gains, layers=layers)
    return Fit(element, units, [results[u][1] for u in range(L + 2)], f.tol, f.dtype,
               None if f.Z is None else f.Z.shape[1], how)


def _unit(f: _Fitter, u: int, Q: torch.Tensor | None, note: str | None
          ) -> tuple[UnitResult, float, dict[str, torch.Tensor]]:
    """One unit compared (leftover tensors and diagnoses included), its stored distance, and
    the norm gauges it holds."""
    a, b = f.a, f.b
    ma, mb = a.load(u), b.load(u)
    r = f.compare(ma, mb, u, Q)
    r.residuals += _leftovers(f, a, ma, mb, u, r)
    if u == 0 and note:  # the token table is where a forbidden rotation shows first
        token = f"{f.lay.tables[0]}.weight"
        r.residuals = [Residual(x.tensor, x.invariant, x.residual, x.head,
                                note if x.residual > f.tol else None)
                       for x in sorted(r.residuals, key=lambda x: x.tensor != token)]
    if _worst(r) > f.tol:
        r = _diagnose(f, ma, mb, u, Q, r)
    return r, _raw(a, ma, mb, u, f.cd), _gains(ma, mb)


def _worst(r: UnitResult) -> float:
    return max((x.residual for x in r.residuals), default=0.0)


def _passing(r: UnitResult, tol: float) -> int:
    return sum(x.residual <= tol for x in r.residuals)


class _Rotations:
    """Candidate rotations: Procrustes on the tables and the unembedding together (the
    default), on each alone, on layer 0's rows; the kept one is what most pieces of the first
    units agree with (so a table rotated twice, or a head whose gain was not folded, is the
    odd one out instead of spoiling the fit)."""

    def __init__(self, f: _Fitter) -> None:
        self.f = f
        L, cd = f.L, f.cd
        ha, hb = f.a.load(L + 1), f.b.load(L + 1)
        ta, tb = f.a.load(0), f.b.load(0)
        self.why = rotation_refusal(f.lay, _uniform_final(ha)) or rotation_refusal(f.lay, _uniform_final(hb))
        self.E = (_stream_rows(ta, 0, cd), _stream_rows(tb, 0, cd))
        self.U = (_stream_rows(ha, L + 1, cd), _stream_rows(hb, L + 1, cd))
        self.ln = f.lay.norm == "layer"
        self.both = _procrustes([self.E, self.U], self.ln)
        self.note: str | None = None
        if self.why and self.both is not None:  # no symmetry here: say so where B looks rotated
            plain = f.compare(ta, tb, 0, None, with_fixed=False)
            rotated = f.compare(ta, tb, 0, self.both, with_fixed=False)
            if _worst(plain) > f.tol >= _worst(rotated):
                self.note = f"B is A with its residual stream rotated, which is no symmetry here: {self.why}"

    def first(self) -> tuple[torch.Tensor | None, str]:
        if self.why:
            return None, self.why
        return self.both, "fitted on the embedding and unembedding rows"

    def best(self, units: list[int], Q: torch.Tensor, how: str) -> tuple[torch.Tensor, str]:
        f = self.f
        loaded = {u: (f.a.load(u), f.b.load(u)) for u in units}
        cands = [(Q, how), (_procrustes([self.E], self.ln), "fitted on the embedding rows"),
                 (_procrustes([self.U], self.ln), "fitted on the unembedding rows")]
        if 1 in loaded:
            rows = _procrustes([(_stream_rows(loaded[1][0], 1, f.cd), _stream_rows(loaded[1][1], 1, f.cd))],
                               self.ln)
            cands.append((rows, "fitted on layer 0's rows"))
        score = {}
        for k, (R, _) in enumerate(cands):
            if R is not None:
                score[k] = sum(_passing(f.compare(*loaded[u], u, R, with_fixed=False), f.tol) for u in units)
        k = max(score, key=lambda k: (score[k], -k))
        return cands[k] if k else (Q, how)


def _diagnose(f: _Fitter, ma: ModelTensors, mb: ModelTensors, u: int, Q: torch.Tensor | None,
              r: UnitResult) -> UnitResult:
    """The first break of a unit, when its readers agree once their norm is left out of both
    models (readers compared as stored), is the norm's fault: its gain or bias changed without
    the readers making up for it, or (same gain, B rotated) the gain was not folded into the
    readers before the rotation (a non-uniform gain does not commute with it)."""
    k = next((k for k, x in enumerate(r.residuals) if x.residual > f.tol), None)
    if k is None or u == 0:
        return r
    plain = f.compare(ma, mb, u, Q, with_fixed=False, ignore_norm=True)
    x = r.residuals[k]
    nth = sum(y.invariant == x.invariant for y in r.residuals[:k])  # the same piece, left out norm
    same = [y for y in plain.residuals if y.invariant == x.invariant]
    if nth >= len(same) or same[nth].residual > f.tol:
        return r
    nm = _norm_of(f, ma, u, x.tensor)
    if nm is None:
        return r
    ga, gb, ba, bb = ma.gain(nm), mb.gain(nm), ma.norm_bias(nm), mb.norm_bias(nm)
    differ = lambda p, q: float((p - q).norm()) > f.tol * max(float(p.norm()), 1e-300)  # noqa: E731
    if differ(ga, gb):
        blame, why = f"{nm.path}.weight", "the norm's gain changed and its readers do not make up for it"
    elif ba is not None and bb is not None and differ(ba, bb):
        blame, why = f"{nm.path}.bias", ("the norm's bias changed and its readers' biases do not make "
                                         "up for it")
    elif Q is not None:
        blame, why = f"{nm.path}.weight", ("the norm's gain was not folded into its readers before the "
                                          "rotation (a non-uniform gain does not commute with it)")
    else:
        return r
    r.residuals[k] = Residual(blame, x.invariant, x.residual, x.head, why)
    return r


def _norm_of(f: _Fitter, m: ModelTensors, u: int, tensor: str):
    """The norm read by the map that stores ``tensor`` (None when it reads none)."""
    path = tensor.rsplit(".", 1)[0]
    reading = C.reading(m)
    if path in reading:
        return reading[path]
    if 0 < u <= f.L:  # an attention invariant blamed on another of the layer's maps
        layer = u - 1
        if any(tensor.startswith(f"{x.path}.") for x in (*f.lay.mlps[layer], *(f.lay.gates[layer:layer + 1]
                                                                             if f.lay.gates else ()))
               if x is not None):
            return reading[f.lay.mlps[layer][0].path]
        return next(n for n in f.lay.norms if n.path == f.lay.attn_norm(layer))
    return None


def _leftovers(f: _Fitter, src: UnitSource, ma: ModelTensors, mb: ModelTensors, u: int,
               r: UnitResult) -> list[Residual]:
    """Tensors no section covers (a pooler, a bias the forward never reads) must match as they are."""
    shared = {(ma.tensors[c].data_ptr(), ma.tensors[c].shape) for c in r.covered}
    out = []
    for n in src.names(u):
        if n in r.covered or n not in mb or (ma.tensors[n].data_ptr(), ma.tensors[n].shape) in shared:
            continue  # compared, or another name of a compared tensor (tied biases)
        x, y = ma.tensors[n], mb.tensors[n]
        if x.shape != y.shape:
            raise AttnidError(f"{src.label(n)} has shape {tuple(x.shape)} in A but {tuple(y.shape)} in B")
        if not x.is_floating_point():
            out.append(Residual(n, "tensor", float((x != y).any())))
            continue
        x, y = (t.to(f.cd).reshape(-1) for t in (x, y))
        out += compare_item(C.Item(n, x, float(x.norm()), "tensor"), C.Item(n, y, float(y.norm()), "tensor"),
                            None).residuals
    return out


def _gains(ma: ModelTensors, mb: ModelTensors) -> dict[str, torch.Tensor]:
    """Norm gauge of the element: ``s = g_A / g_B`` at every norm the readers absorb."""
    out = {}
    for nm in ma.layout.norms:
        if nm.absorb is None and nm.gain and f"{nm.path}.weight" in ma and f"{nm.path}.weight" in mb:
            ga, gb = ma.gain(nm).double(), mb.gain(nm).double()
            out[nm.path] = ga / torch.where(gb == 0, torch.ones_like(gb), gb)
    return out


def _raw(src: UnitSource, ma: ModelTensors, mb: ModelTensors, u: int, cd: torch.dtype) -> float:
    total = 0.0
    for n in src.names(u):
        if n in ma and n in mb and ma.tensors[n].is_floating_point():
            total += float(((ma.tensors[n].to(cd) - mb.tensors[n].to(cd)) ** 2).sum())
    return total**0.5
