"""Stage 1 of the alignment (docs/theory.md §13.20): the residual stream of B brought into A's
coordinates, by a rotation where one is a symmetry (B's norm gains first moved to A's) and
else by a permutation (gains moved along), fitted on the gauge-free table rows or on the
stream's activations. It is then refined by the driver (`attnid.whole.align.aligner`): with
every other part fitted, the rotation (or permutation) that best maps all of B's stream-side
weights (tables, unembedding, every reader's folded columns, every writer's rows and biases)
onto A's is fitted again, as long as the total distance drops (alternating minimisation;
each round applies an exact transform). Everything here reads one unit at a time: the first
fit a sample of the table rows, the refinement a ``[d, d]`` cross product summed over units."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from attnid.errors import AttnidError
from attnid.whole.align.activations import Pair
from attnid.whole.fit.fitter import table_rows
from attnid.whole.fit.match import assignment
from attnid.whole.fit.rotation import procrustes, procrustes_cross, rows
from attnid.whole.fit.source import UnitSource
from attnid.whole.transforms.norms import foldable, norm_gain_transfer
from attnid.whole.transforms.permutation import permutation_refusal
from attnid.whole.transforms.residual import rotation_refusal
from attnid.whole.transforms.state import ModelTensors

ROUNDS = 8  # at most this many refinements of the stream
ROWS_EXTRA = 256  # each stream-side piece of the refinement: at most d + this many rows (evenly spaced)


def gains_to(a: ModelTensors, b: ModelTensors) -> ModelTensors:
    """B's absorbable norm gains moved to A's (a rotation commutes only with a uniform gain)."""
    for nm in b.layout.norms:
        if foldable(nm) and f"{nm.path}.weight" in b:
            gb = b.gain(nm)
            s = a.gain(nm) / torch.where(gb == 0, torch.ones_like(gb), gb)
            s = torch.where(s == 0, torch.ones_like(s), s)
            if not torch.all(s == 1):  # already A's: the transfer would multiply by 1 (a 7B layer's copies)
                b = norm_gain_transfer(b, nm.path, s)
    return b


def _rows(src: UnitSource) -> torch.Tensor:
    """Gauge-free stream rows (token rows and unembedding rows, centred; the final gain folded
    in, so that moving B's gains to A's leaves them) for the stream fit, float64."""
    E, U = table_rows(src, torch.float64)
    return E if U is None else torch.cat([E, U])


def _final_gain(src: UnitSource) -> torch.Tensor | None:
    lay = src.layout
    name = None if lay.final is None else f"{lay.final.path}.weight"
    if name is None or src.shape(name) is None:
        return None
    return src.rows(name, 0, src.shape(name)[0]).to(torch.float64) + lay.final.offset


def fit_stream(a: UnitSource, b: UnitSource, rotate: bool, acts: Pair | None = None
               ) -> tuple[torch.Tensor | None, torch.Tensor | None, str]:
    """How B's stream is aligned: ``(rotation, permutation, how)`` (matched on the tables'
    rows, or on the stream's activations with ``acts``, whose sums it then lets go of: a
    ``[d, d]`` float64 cross product nothing reads again); neither when the stream cannot move."""
    on = "the embedding and unembedding rows" if acts is None else "the stream's activations"
    sums = None
    if acts is not None:
        if acts.stream is None:
            raise AttnidError("internal: the stream's activations were already fitted on")
        sums, acts.stream = acts.stream, None
    lay = b.layout
    why = rotation_refusal(lay, _final_gain(a)) or rotation_refusal(lay, _final_gain(b))
    if rotate and why is None:
        ln = lay.norm == "layer"
        Q = procrustes(_rows(b), _rows(a), ln) if sums is None else sums.rotation(ln)
        return Q, None, f"rotation fitted on {on}"
    no = permutation_refusal(ModelTensors(lay, {}))
    if no:
        return None, None, f"not aligned: {no}"
    # A's coordinate i is B's perm[i]
    perm = assignment(-(_rows(a).T @ _rows(b))) if sums is None else sums.permutation()
    how = f"permutation matched on {on}"
    if rotate:
        how += f" (no rotation: {why})"
    return None, perm, how


def permuted(g: torch.Tensor, perm: torch.Tensor | None) -> torch.Tensor:
    return g if perm is None else g[perm]


def stream_pieces(m: ModelTensors) -> Iterator[torch.Tensor]:
    """Every stream-side piece of ``m`` ``[n, d]`` (each at most ``d + ROWS_EXTRA`` rows, evenly
    spaced): table rows, the unembedding's and every reader's columns with their norm's gain
    folded in, every writer's output columns and bias. Made one at a time, the rows sampled
    before the gain is folded in (a full-size scaled copy of every reader would be about 0.5 GB
    a layer at 7B widths)."""
    lay = m.layout
    for t in lay.tables:
        if f"{t}.weight" in m:
            yield _sampled(m.tensors[f"{t}.weight"])
    norms = {nm.path: nm for nm in (*lay.norms, *(() if lay.final is None else (lay.final,)))}
    for nm in norms.values():  # the final norm once, whether or not lay.norms lists it
        if f"{nm.path}.weight" not in m:
            continue
        g = m.gain(nm)
        readers = {r.path: r for r in nm.readers if m.has(r) and not (lay.tied and r == lay.unembed)}
        for lin in readers.values():
            yield _sampled(m.weight(lin)) * g[None, :]
    for lin in {w.path: w for ws in lay.writers for w in ws if m.has(w)}.values():
        yield _sampled(m.weight(lin).T)
        if m.bias(lin) is not None:
            yield m.bias(lin)[None, :]


def _sampled(p: torch.Tensor) -> torch.Tensor:
    return rows(p, p.shape[1] + ROWS_EXTRA)


def cross(a: ModelTensors, b: ModelTensors) -> torch.Tensor | None:
    """``X_B^T X_A [d, d]`` (float64) over the stream-side pieces of one unit of both models."""
    out = None
    for pa, pb in zip(stream_pieces(a), stream_pieces(b), strict=True):
        c = (pb.T @ pa).to(torch.float64)
        out = c if out is None else out + c
    return out


def refit(M: torch.Tensor, rotate: bool, layer_norm: bool) -> torch.Tensor:
    """From the summed cross product: the rotation (Procrustes) or the permutation (linear
    assignment: A's coordinate i is B's ``r[i]``) that best maps B's stream-side weights onto A's."""
    if rotate:
        return procrustes_cross(M, layer_norm)
    return assignment(-M.T)
