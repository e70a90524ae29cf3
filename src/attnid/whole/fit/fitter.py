"""Fit the whole-model group element that maps B onto A and measure what it leaves
(docs/theory.md §13.19), one unit at a time:

1. gauge-fix both models (`attnid.whole.fit.canonical`: folded norm gains, LayerNorm
   centring, all-ones shifts, translations, logit shift, post-LN and parallel biases);
2. the residual rotation by Procrustes on the gauge-fixed embedding and unembedding rows
   (completed with layer 0's matched MLP rows where the tables do not span the stream); when
   the first layer then disagrees, a second rotation fitted on that layer's rows, and the one
   more of the model agrees with is kept (a table rotated twice is then the table's fault);
3. per layer, heads and neurons matched by linear assignment, the per-kv-group Q/K and V/O
   gauges and the MLP scales by least squares (`attnid.whole.fit.compare`);
4. every gauge-fixed piece compared at the dtype's rounding, blamed on a stored tensor.

`fit` returns the element (`attnid.whole.transforms.element.GroupElement`: what
`attnid.whole.transforms.apply_element` applies to B), every residual in forward order and the
distances per unit; `attnid.checkpoint.diff` reports it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from functools import cached_property

import torch

import attnid.whole.fit.canonical as C
from attnid.errors import AttnidError
from attnid.numerics import rounding_tolerance as tolerance
from attnid.numerics import sq_distance
from attnid.whole.fit.compare import Residual, UnitResult, compare_item, compare_unit
from attnid.whole.fit.frame import Frame, Rotation, probe_count, probes, stored_gram
from attnid.whole.fit.match import assignment
from attnid.whole.fit.rotation import probed_least_squares, procrustes, rows
from attnid.whole.fit.source import UnitSource, read_ahead
from attnid.whole.transforms.element import GroupElement, LayerElement
from attnid.whole.transforms.residual import rotation_refusal
from attnid.whole.transforms.state import ModelTensors


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 for float32/float64 checkpoints; float32 is ample for bfloat16/float16."""
    return torch.float32 if torch.finfo(dtype).eps > 1e-6 else torch.float64


class _Converted(Mapping[str, torch.Tensor]):
    """A unit's tensors, each floating one converted to the compute dtype once, when first read
    (every later read, and every alias of it, is that copy, and the stored one is let go): the
    gauge fixing, the probes and the stored distance share one conversion."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], dtype: torch.dtype) -> None:
        self.raw, self.dtype = dict(tensors), dtype
        self.done: dict[tuple, torch.Tensor] = {}  # storage of a stored tensor -> its copy

    def __getitem__(self, name: str) -> torch.Tensor:
        t = self.raw[name]
        if not t.is_floating_point() or t.dtype == self.dtype:
            return t
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride())
        if key not in self.done:
            self.done[key] = t.to(self.dtype)
        self.raw[name] = self.done[key]
        return self.raw[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.raw)

    def __len__(self) -> int:
        return len(self.raw)

    def __contains__(self, name: object) -> bool:
        return name in self.raw


def _load(src: UnitSource, unit: int, dtype: torch.dtype, check: bool = False) -> ModelTensors:
    """A unit of ``src`` whose floating tensors read as ``dtype`` (`_Converted`)."""
    m = src.load(unit, check=check)
    return ModelTensors(m.layout, _Converted(m.tensors, dtype), m.config)


@dataclass(frozen=True)
class Fit:
    units: list[UnitResult]  # per unit: residuals (state_dict names), distances
    raw: list[float]  # per unit: ||B - A|| over the stored tensors
    tolerance: float
    dtype: torch.dtype
    probes: int | None  # None: exact (the whole stream)
    rotation: str  # "fitted on ..." or why the stream is not rotated
    stream: Rotation | None  # the rotation the units were compared under
    gains: dict[str, torch.Tensor]
    layers: tuple[LayerElement, ...]

    @cached_property
    def element(self) -> GroupElement:
        """The fitted element (its rotation's matrix fitted now where only its probed image
        was: Procrustes on the same rows)."""
        Q = None if self.stream is None else self.stream.matrix()
        return GroupElement(rotation=Q, gains=self.gains, layers=self.layers)


# ---- the rotation --------------------------------------------------------------------------------
def _layer_rows(m: ModelTensors, layer: int, cd: torch.dtype) -> torch.Tensor | None:
    """Gauge-fixed rows of a layer that live in the stream: its readers' rows and its writers'
    columns (mixed by the layer's own gauges: a candidate fit only)."""
    lay = m.layout
    out: list[torch.Tensor] = []
    for nm in lay.norms:
        for r in nm.readers:
            if r.path.startswith(lay.layers[layer]) and m.has(r):
                out.append(C.reader(m, r, cd)[0])
    for w in lay.writers[layer]:
        W = m.weight(w).to(cd)
        out.append((W - W.mean(0, keepdim=True) if lay.norm == "layer" else W).T)
    return torch.cat([rows(x, x.shape[1] + ROWS_EXTRA) for x in out]) if out else None


ROWS_EXTRA = 256  # rows beyond the width that a Procrustes fit reads from each table
CHUNKS = 8  # contiguous chunks the rows are read in, spread over the table


def sampled_rows(src: UnitSource, name: str, n: int, skip: int = 0) -> torch.Tensor:
    """About ``n`` rows of a table, read as ``CHUNKS`` contiguous chunks spread over it (a
    checkpoint reads only those bytes); rows below ``skip`` are left out."""
    total = src.shape(name)[0]
    if total - skip <= n:
        return src.rows(name, skip, total)
    size = -(-n // CHUNKS)
    starts = torch.linspace(skip, total - size, CHUNKS).long().tolist()
    return torch.cat([src.rows(name, s, s + size) for s in starts])


def table_blocks(src: UnitSource) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """The stored rows the rotation is fitted on, each block with the gain folded into it: about
    ``2 d`` sampled token rows (``gain`` None) and, with an untied head behind a final norm,
    unembedding rows with that norm's gain ``[d]`` (float64)."""
    lay = src.layout
    d = src.shape(f"{lay.tables[0]}.weight")[1]
    un = None if lay.unembed is None or lay.tied else f"{lay.unembed.path}.weight"
    if un is not None and (src.shape(un) is None or lay.final is None):
        un = None
    n = 2 * d // (2 if un else 1) + ROWS_EXTRA  # about 2d rows in all: well conditioned
    skip = 0 if lay.padding_idx is None else lay.padding_idx + 1
    out: list[tuple[torch.Tensor, torch.Tensor | None]] = [
        (sampled_rows(src, f"{lay.tables[0]}.weight", n, skip), None)]
    if un is not None:
        g = src.rows(f"{lay.final.path}.weight", 0, d).to(torch.float64) + lay.final.offset
        out.append((sampled_rows(src, un, n), g))
    return out


def prepared(block: tuple[torch.Tensor, torch.Tensor | None], cd: torch.dtype, layer_norm: bool
             ) -> torch.Tensor:
    """A block's gauge-free rows: gained, less their mean row (a translation, a uniform shift,
    the logit shift drop out), ``P`` of them under LayerNorm (all-ones shifts drop out)."""
    X, g = block
    X = X.to(cd) if g is None else X.to(cd) * g.to(cd)[None, :]
    X = X - X.mean(0, keepdim=True)
    return X - X.mean(1, keepdim=True) if layer_norm else X


def table_rows(src: UnitSource, cd: torch.dtype, blocks: list[tuple[torch.Tensor, torch.Tensor | None]]
               | None = None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Gauge-free stream rows for the rotation (`prepared` `table_blocks`, or ``blocks`` when
    already read): ``(E, U)``, U None without an untied head behind a final norm."""
    rows = [prepared(b, cd, src.layout.norm == "layer") for b in blocks or table_blocks(src)]
    return rows[0], rows[1] if len(rows) > 1 else None


def table_gram(blocks: list[tuple[torch.Tensor, torch.Tensor | None]], cd: torch.dtype, layer_norm: bool
               ) -> torch.Tensor | None:
    """``X^T X [d, d]`` of the `prepared` rows of bfloat16 ``blocks``, its products taken on
    the stored rows by the CPU's bfloat16 units, which take them exactly
    (`attnid.whole.fit.frame.stored_gram`): per block ``diag(g) (Y^T Y - n mu mu^T) diag(g)``
    for stored rows ``Y`` with mean row ``mu``, then ``P . P`` under LayerNorm. None (take the
    float32 product of the prepared rows instead) when the mean rows carry more than half of
    the products: the subtraction would then lose what float32 keeps."""
    G = None
    for Y, g in blocks:
        YY = stored_gram(Y.to(cd))
        mu = Y.to(torch.float64).mean(0)
        n = Y.shape[0]
        if float(n * (mu @ mu)) > 0.5 * float(YY.diagonal().sum()):
            return None
        part = YY.double() - n * torch.outer(mu, mu)
        if g is not None:
            part = g[:, None] * part * g[None, :]
        G = part if G is None else G + part
    if G is None:
        return None
    if layer_norm:
        G = G - G.mean(0, keepdim=True)
        G = G - G.mean(1, keepdim=True)
    return G.to(cd)


def _procrustes(pairs: list[tuple[torch.Tensor | None, torch.Tensor | None]], layer_norm: bool
                ) -> torch.Tensor | None:
    xa = [a for a, b in pairs if a is not None and b is not None]
    xb = [b for a, b in pairs if a is not None and b is not None]
    if not xa:
        return None
    return procrustes(torch.cat(xb), torch.cat(xa), layer_norm)


def _rotation(pairs: list[tuple[torch.Tensor | None, torch.Tensor | None]], layer_norm: bool,
              Z: torch.Tensor | None, tol: float, gram: torch.Tensor | None = None) -> Rotation | None:
    """The rotation fitted on ``pairs`` of rows: with probes, the least-squares map through them
    (`attnid.whole.fit.rotation.probed_least_squares`), kept while its orthogonality residual is
    at most half the rounding level (B's rows an exact rotation of A's); otherwise, and
    without probes, Procrustes (exactly orthogonal: the rows need not agree)."""
    if Z is not None:
        xa = [a for a, b in pairs if a is not None and b is not None]
        xb = [b for a, b in pairs if a is not None and b is not None]
        ls = probed_least_squares(torch.cat(xb), torch.cat(xa), Z, layer_norm, gram) if xa else None
        if ls is not None and ls[1] <= LEAST_SQUARES_DEFECT * tol:
            return Rotation(QZ=ls[0], full=lambda: _procrustes(pairs, layer_norm), defect=ls[1])
    Q = _procrustes(pairs, layer_norm)
    return None if Q is None else Rotation(Q)


LEAST_SQUARES_DEFECT = 0.5  # the least-squares rotation kept up to this share of the rounding level


# ---- one unit --------------------------------------------------------------------------------------
class _Fitter:
    def __init__(self, a: UnitSource, b: UnitSource, k: int | None, progress: Callable[[str], None] | None
                 ) -> None:
        self.a, self.b = a, b
        self.lay = a.layout
        self.L = len(self.lay.layers)
        stored = a.dtype(), b.dtype()
        self.dtype = max(stored, key=lambda t: torch.finfo(t).eps)
        self.tol = tolerance(self.dtype)
        self.cd = compute_dtype(self.dtype)
        # each model's products at its storage precision when that is bfloat16 (`stored_product`)
        self.bf16 = (stored[0] == torch.bfloat16, stored[1] == torch.bfloat16)
        ref = _spec(a)
        self.d = ref.d_model
        kk = probe_count(self.d, max(ref.head_dim, ref.v_head_dim)) if k is None else k
        self.Z = probes(self.d, kk, self.cd)
        self.progress = progress or (lambda _: None)
        self.blame: dict[int, dict[str, str]] = {}

    def frames(self, Q: Rotation | None) -> tuple[Frame, Frame, Frame]:
        fa = Frame(self.Z, None, self.cd, bf16=self.bf16[0])
        f0 = Frame(self.Z, None, self.cd, bf16=self.bf16[1])  # B's, unrotated
        return fa, f0 if Q is None else Q.frame(self.Z, self.cd, self.bf16[1]), f0

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

    def compare(self, ma: ModelTensors, mb: ModelTensors, unit: int, Q: Rotation | None,
                with_fixed: bool = True, ignore_norm: bool = False) -> UnitResult:
        fa, fb, f0 = self.frames(Q)
        ca = self.canonical(ma, unit, fa, ignore_norm)
        cb = self.canonical(mb, unit, fb, ignore_norm)
        layer = 0 < unit <= self.L  # the rotation's share is reported per layer
        # B unrotated, for the rotation's share only: a distance estimate, so through NARROW probes
        c0 = None
        if with_fixed and layer and Q is not None:
            c0 = self.canonical(mb, unit, f0.narrow(), ignore_norm)
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
        progress: Callable[[str], None] | None = None, rotate: bool = True) -> Fit:
    """The group element mapping B onto A and every residual it leaves (see the module).
    ``rotate=False``: B's stream compared as it is, no rotation fitted (a caller that knows
    none moved it: `attnid align`'s certificate of what it wrote)."""
    if a.layout != b.layout:
        raise AttnidError("the two models do not have the same layout")
    L = len(a.layout.layers)
    # every unit once, the tables, the head and the first two layers first: when they
    # disagree with the rotation, the candidate more of them agree with is kept
    first = list(dict.fromkeys(u for u in (0, L + 1, 1, 2) if u <= L + 1))
    order = [*first, *(u for u in range(1, L + 1) if u not in first)]
    read_ahead((a, b), *order[:2])  # the rotation reads the tables and the head: read while it starts
    f = _Fitter(a, b, probe_k, progress)
    rot = _Rotations(f) if rotate else None
    Q, how = rot.first() if rot is not None else (None, "none: B's stream compared as it is")
    f.progress(f"rotation: {how}")
    results: dict[int, tuple[UnitResult, float, dict[str, torch.Tensor]]] = {}
    for k, u in enumerate(order):
        if k + 2 < len(order):  # two units ahead of the one compared: read while it computes
            read_ahead((a, b), order[k + 2])
        results[u] = _unit(f, u, Q, rot)
        f.progress(f"unit {u} of {L + 1}: worst residual {_worst(results[u][0]):.2e}")
        if u == first[-1] and rot is not None and Q is not None and any(_worst(results[x][0]) > f.tol
                                                                          for x in first):
            Q2, how2 = rot.best(first, Q, how)
            if Q2 is not Q:
                Q, how = Q2, how2
                f.progress(f"rotation: {how}")
                results |= {x: _unit(f, x, Q, rot) for x in first}
    broken = next((u for u in range(L + 2) if _worst(results[u][0]) > f.tol), None)
    if broken is not None:  # only the first break is named: diagnose that unit alone
        ma, mb = _load(a, broken, f.cd), _load(b, broken, f.cd)
        results[broken] = (_diagnose(f, ma, mb, broken, Q, results[broken][0]), *results[broken][1:])
    units = [results[u][0] for u in range(L + 2)]
    gains: dict[str, torch.Tensor] = {}
    for u in range(L + 2):
        gains |= results[u][2]
    layers = tuple(r.element or LayerElement() for r in units[1:L + 1])
    return Fit(units, [results[u][1] for u in range(L + 2)], f.tol, f.dtype,
               None if f.Z is None else f.Z.shape[1], how, Q, gains, layers)


def _unit(f: _Fitter, u: int, Q: Rotation | None, rot: _Rotations | None
          ) -> tuple[UnitResult, float, dict[str, torch.Tensor]]:
    """One unit compared (leftover tensors and diagnoses included), its stored distance, and
    the norm gauges it holds."""
    a, b = f.a, f.b
    ma, mb = _load(a, u, f.cd), _load(b, u, f.cd)  # every value reaches the distance
    raw = _raw(a, ma, mb, u)
    if not math.isfinite(raw):  # NaN or Inf somewhere in the unit: the checked load names it
        a.load(u), b.load(u)
        raise AttnidError(f"NaN or Inf in the tensors of unit {u}")
    r = f.compare(ma, mb, u, Q)
    r.residuals += _leftovers(f, a, ma, mb, u, r)
    if u == 0 and Q is not None and Q.QZ is not None:  # fitted through the probes: Q^T Q = I checked
        r.residuals.append(Residual(f"{f.lay.tables[0]}.weight", "rotation Q^T Q = I", Q.defect))
    note = rot.note(ma, mb, r) if u == 0 and rot is not None else None
    if note:  # the token table is where a forbidden rotation shows first
        token = f"{f.lay.tables[0]}.weight"
        r.residuals = [Residual(x.tensor, x.invariant, x.residual, x.head,
                                note if x.residual > f.tol else None)
                       for x in sorted(r.residuals, key=lambda x: x.tensor != token)]
    return r, raw, _gains(ma, mb)


def _worst(r: UnitResult) -> float:
    return max((x.residual for x in r.residuals), default=0.0)


def _passing(r: UnitResult, tol: float) -> int:
    return sum(x.residual <= tol for x in r.residuals)


class _Rotations:
    """Candidate rotations: Procrustes on sampled rows of the token table and the unembedding
    together (the default), on each alone, on layer 0's rows; the kept one is what most pieces
    of the first units agree with (so a table rotated twice, or a head whose gain was not
    folded, is the odd one out instead of spoiling the fit)."""

    def __init__(self, f: _Fitter) -> None:
        self.f = f
        lay = f.lay
        gains = []
        for src in (f.a, f.b):
            name = None if lay.final is None else f"{lay.final.path}.weight"
            g = None if name is None or src.shape(name) is None else src.rows(name, 0, src.shape(name)[0])
            gains.append(None if g is None else g.double() + lay.final.offset)
        self.why = rotation_refusal(lay, gains[0]) or rotation_refusal(lay, gains[1])
        self.ln = lay.norm == "layer"
        ea, ua = table_rows(f.a, f.cd)
        blocks = table_blocks(f.b)
        eb, ub = table_rows(f.b, f.cd, blocks)
        self.E, self.U = (ea, eb), (ua, ub)
        # B's Gram matrix for the least squares: its products exact on the bfloat16 units
        same = (ua is None) == (ub is None)  # every block of B's paired with one of A's
        gram = table_gram(blocks, f.cd, self.ln) if f.bf16[1] and f.Z is not None and same else None
        self.completed = ""
        if not self.why and _short(self.E, self.U, f.d - self.ln) and f.L:
            both = _procrustes([self.E, self.U], self.ln)
            if both is not None:
                both, self.completed = _completed(f, self.E, self.U, both, self.ln)
            self.both = None if both is None else Rotation(both)
        else:
            self.both = _rotation([self.E, self.U], self.ln, f.Z, f.tol, gram)

    def first(self) -> tuple[Rotation | None, str]:
        if self.why:
            return None, self.why
        return self.both, _how("fitted on the embedding and unembedding rows" + self.completed, self.both)

    def note(self, ma: ModelTensors, mb: ModelTensors, r: UnitResult) -> str | None:
        """Where the stream may not rotate but B's tables are A's rotated: say so."""
        f = self.f
        if not self.why or self.both is None or _worst(r) <= f.tol:
            return None
        if _worst(f.compare(ma, mb, 0, self.both, with_fixed=False)) > f.tol:
            return None
        return f"B is A with its residual stream rotated, which is no symmetry here: {self.why}"

    def best(self, units: list[int], Q: Rotation, how: str) -> tuple[Rotation, str]:
        f = self.f
        loaded = {u: (_load(f.a, u, f.cd, True), _load(f.b, u, f.cd, True)) for u in units}
        cands = [(Q, how), (_rotation([self.E], self.ln, f.Z, f.tol), "fitted on the embedding rows"),
                 (_rotation([self.U], self.ln, f.Z, f.tol), "fitted on the unembedding rows")]
        if 1 in loaded:
            rows_a, rows_b = (_layer_rows(m, 0, f.cd) for m in loaded[1])
            cands.append((_rotation([(rows_a, rows_b)], self.ln, f.Z, f.tol), "fitted on layer 0's rows"))
        score = {}
        for k, (R, _) in enumerate(cands):
            if R is not None:
                score[k] = sum(_passing(f.compare(*loaded[u], u, R, with_fixed=False), f.tol) for u in units)
        k = max(score, key=lambda k: (score[k], -k))
        return (cands[k][0], _how(*cands[k][::-1])) if k else (Q, how)


def _how(text: str, R: Rotation | None) -> str:
    return text if R is None or R.QZ is None else f"{text} (least squares through the probes)"


RowPair = tuple[torch.Tensor | None, torch.Tensor | None]  # (A's rows, B's rows)


def _short(E: RowPair, U: RowPair, need: int) -> bool:
    """Whether the centred table rows (each table loses one dimension to its mean) cannot span
    the ``need`` dimensions of the stream: a vocabulary narrower than the model (characters)."""
    return sum(x[0].shape[0] - 1 for x in (E, U) if x[0] is not None) < need


def _completed(f: _Fitter, E: RowPair, U: RowPair, Q: torch.Tensor, ln: bool) -> tuple[torch.Tensor, str]:
    """The rotation completed where the tables leave it free. Fitted on rows spanning only a
    subspace ``S`` of the stream, ``Q`` is exact on ``S`` and arbitrary on its complement. Layer
    0's MLP reader rows (gains folded; a gated MLP's gate rows) are only permuted by the group,
    and scaled by a positive factor under ReLU, so normalised they are A's rows up to a
    permutation: matched on their projection onto ``S`` (where ``Q`` is already right), they
    join the tables in a second Procrustes fit that spans the stream."""
    lay = f.lay
    lin = (lay.gates[0] if lay.gates else None) or lay.mlps[0][0]
    ma, mb = _load(f.a, 1, f.cd), _load(f.b, 1, f.cd)
    if not (ma.has(lin) and mb.has(lin)):
        return Q, ""
    xa, xb = (C.reader(m, lin, f.cd)[0] for m in (ma, mb))  # [n, d]
    xa, xb = (x / x.norm(dim=1, keepdim=True).clamp_min(1e-300) for x in (xa, xb))
    ta = torch.cat([x[0] for x in (E, U) if x[0] is not None])
    _, sv, Vh = torch.linalg.svd(ta, full_matrices=False)
    V = Vh[sv > sv[0] * 1e-6].T  # [d, r]: the span of A's table rows
    perm = assignment(-((xb @ Q @ V) @ (xa @ V).T))  # B's row i is A's row perm[i]
    pairs = [E, U, (xa[perm], xb)]
    full = _procrustes(pairs, ln)
    return (Q, "") if full is None else (full, f", completed with layer 0's MLP rows, the tables spanning "
                                                f"{V.shape[1]} of {f.d} dimensions")


def _diagnose(f: _Fitter, ma: ModelTensors, mb: ModelTensors, u: int, Q: Rotation | None,
              r: UnitResult) -> UnitResult:
    """The first break of a unit, named by a norm's tensor when the norm explains it: when its
    readers agree once their norm is left out of both models (readers compared as stored), its
    gain or bias changed without the readers making up for it, or (same gain, B rotated) the
    gain was not folded into the readers before the rotation (a non-uniform gain does not
    commute with it); when one rescaling of the readers' inputs takes B's readers to A's
    (`attnid.whole.fit.gains`), its gain changed (B's gain folded or not)."""
    k = next((k for k, x in enumerate(r.residuals) if x.residual > f.tol), None)
    if k is None or u == 0:
        return r
    x = r.residuals[k]
    nm = _norm_of(f, ma, u, x.tensor)
    if nm is None:
        return r
    found = _stored_norm(f, ma, mb, u, Q, r, k, nm)
    if found is None and _gain_repairs(f, ma, mb, u, Q, r, k, nm):
        found = (f"{nm.path}.weight", "one rescaling of the readers' inputs repairs it: the norm's "
                                      "gain changed and its readers do not make up for it")
    if found is not None:
        r.residuals[k] = Residual(found[0], x.invariant, x.residual, x.head, found[1])
    return r


def _gain_repairs(f: _Fitter, ma: ModelTensors, mb: ModelTensors, u: int, Q: Rotation | None,
                  r: UnitResult, k: int, nm) -> bool:
    """Whether B with ``nm``'s gain refitted (`attnid.whole.fit.gains.gain_fit`) passes every
    piece of the unit up to the break ``k`` (at ``GAIN_TOLERANCE`` times the rounding level)."""
    from attnid.whole.fit.gains import gain_fit

    layer = u - 1 if u <= f.L else None
    fixed = gain_fit(ma, mb, layer, nm, None if Q is None else Q.matrix(),
                     None if r.element is None else r.element.neurons)
    if fixed is None:
        return False
    again = f.compare(ma, fixed, u, Q, with_fixed=False).residuals
    return len(again) == len(r.residuals) and all(x.residual <= GAIN_TOLERANCE * f.tol for x in again[:k + 1])


GAIN_TOLERANCE = 10  # the repaired pieces may reach 10 times the rounding level (a fitted gain)


def _stored_norm(f: _Fitter, ma: ModelTensors, mb: ModelTensors, u: int, Q: Rotation | None,
                 r: UnitResult, k: int, nm) -> tuple[str, str] | None:
    """(tensor, reason) when the readers as stored agree and the norm's stored gain or bias
    does not (see `_diagnose`), else None."""
    x = r.residuals[k]
    plain = f.compare(ma, mb, u, Q, with_fixed=False, ignore_norm=True)
    nth = sum(y.invariant == x.invariant for y in r.residuals[:k])  # the same piece, left out norm
    same = [y for y in plain.residuals if y.invariant == x.invariant]
    if nth >= len(same) or same[nth].residual > f.tol:
        return None
    ga, gb, ba, bb = ma.gain(nm), mb.gain(nm), ma.norm_bias(nm), mb.norm_bias(nm)
    differ = lambda p, q: float((p - q).norm()) > f.tol * max(float(p.norm()), 1e-300)  # noqa: E731
    if differ(ga, gb):
        return f"{nm.path}.weight", "the norm's gain changed and its readers do not make up for it"
    if ba is not None and bb is not None and differ(ba, bb):
        return f"{nm.path}.bias", "the norm's bias changed and its readers' biases do not make up for it"
    if Q is not None:
        return f"{nm.path}.weight", ("the norm's gain was not folded into its readers before the "
                                     "rotation (a non-uniform gain does not commute with it)")
    return None


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


def _raw(src: UnitSource, ma: ModelTensors, mb: ModelTensors, u: int) -> float:
    """``||B - A||`` over the unit's stored tensors, in the compute dtype the unit is read in
    (the difference of two bfloat16 or float16 values is exact in float32)."""
    total = 0.0
    for n in src.names(u):
        if n in ma and n in mb and ma.tensors[n].is_floating_point():
            total += sq_distance(ma.tensors[n], mb.tensors[n])
    return total**0.5
