"""Stage 1 of the alignment (docs/theory.md §13.20): the residual stream of B brought into A's
coordinates, by a rotation where one is a symmetry (B's norm gains first moved to A's) and
else by a permutation (gains moved along), fitted on the gauge-free table rows or on the
stream's activations, then refined: with every other part fitted, the rotation (or
permutation) that best maps all of B's stream-side weights (tables, unembedding, every
reader's folded columns, every writer's rows and biases) onto A's is fitted again, as long as
the total distance drops (alternating minimisation; each round applies an exact transform)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from attnid.whole.align.activations import Activations, stream_permutation, stream_rotation
from attnid.whole.fit.fitter import table_rows
from attnid.whole.fit.match import assignment
from attnid.whole.fit.rotation import procrustes
from attnid.whole.fit.source import TensorSource
from attnid.whole.transforms.norms import foldable, norm_gain_transfer
from attnid.whole.transforms.permutation import permutation_refusal, residual_permutation
from attnid.whole.transforms.residual import residual_rotation, rotation_refusal
from attnid.whole.transforms.state import ModelTensors

ROUNDS = 8  # at most this many refinements of the stream

def gains_to(a: ModelTensors, b: ModelTensors) -> ModelTensors:
    """B's absorbable norm gains moved to A's (a rotation commutes only with a uniform gain)."""
    for nm in b.layout.norms:
        if foldable(nm) and f"{nm.path}.weight" in b:
            gb = b.gain(nm)
            s = a.gain(nm) / torch.where(gb == 0, torch.ones_like(gb), gb)
            b = norm_gain_transfer(b, nm.path, torch.where(s == 0, torch.ones_like(s), s))
    return b


def _rows(m: ModelTensors) -> torch.Tensor:
    """Gauge-free stream rows (token rows and unembedding rows, centred) for the stream fit."""
    E, U = table_rows(TensorSource(m), torch.float64)
    return E if U is None else torch.cat([E, U])


Pair = tuple[Activations, Activations]  # A's and B's activations on the calibration tokens


def fit_stream(a: ModelTensors, b: ModelTensors, rotate: bool, acts: Pair | None = None
               ) -> tuple[ModelTensors, torch.Tensor | None, torch.Tensor | None, str]:
    """B with its stream aligned: ``(b, rotation, permutation, how)`` (matched on the tables'
    rows, or on the stream's activations with ``acts``)."""
    on = "the embedding and unembedding rows" if acts is None else "the stream's activations"
    lay = b.layout
    final = lambda m: None if lay.final is None or f"{lay.final.path}.weight" not in m else m.gain(lay.final)  # noqa: E731
    why = rotation_refusal(lay, final(a)) or rotation_refusal(lay, final(b))
    if rotate and why is None:
        b = gains_to(a, b)  # the stream itself does not change
        ln = lay.norm == "layer"
        Q = procrustes(_rows(b), _rows(a), ln) if acts is None else stream_rotation(*acts, ln)
        return residual_rotation(b, Q), Q, None, f"rotation fitted on {on}"
    no = permutation_refusal(b)
    if no:
        return b, None, None, f"not aligned: {no}"
    # A's coordinate i is B's perm[i]
    perm = assignment(-(_rows(a).T @ _rows(b))) if acts is None else stream_permutation(*acts)
    how = f"permutation matched on {on}"
    if rotate:
        how += f" (no rotation: {why})"
    return residual_permutation(b, perm), None, perm, how


def permuted(g: torch.Tensor, perm: torch.Tensor | None) -> torch.Tensor:
    return g if perm is None else g[perm]


def stream_weights(m: ModelTensors) -> torch.Tensor:
    """Every stream-side row of ``m`` ``[n, d]``: table rows, the unembedding's and every
    reader's columns with their norm's gain folded in, every writer's output columns and bias."""
    lay = m.layout
    rows = [m.tensors[f"{t}.weight"] for t in lay.tables if f"{t}.weight" in m]
    norms = {nm.path: nm for nm in (*lay.norms, *(() if lay.final is None else (lay.final,)))}
    for nm in norms.values():  # the final norm once, whether or not lay.norms lists it
        if f"{nm.path}.weight" not in m:
            continue
        g = m.gain(nm)
        readers = {r.path: r for r in nm.readers if m.has(r) and not (lay.tied and r == lay.unembed)}
        rows += [m.weight(lin) * g[None, :] for lin in readers.values()]
    for lin in {w.path: w for ws in lay.writers for w in ws if m.has(w)}.values():
        rows.append(m.weight(lin).T)
        if m.bias(lin) is not None:
            rows.append(m.bias(lin)[None, :])
    return torch.cat([r.to(torch.float64) for r in rows])


def total(a: ModelTensors, b: ModelTensors) -> float:
    """``||B - A||^2`` over the floating tensors, a tied table once."""
    seen: set[tuple[int, tuple[int, ...]]] = set()
    sq = 0.0
    for n, t in a.tensors.items():
        key = (t.data_ptr(), tuple(t.shape))
        if t.is_floating_point() and key not in seen:
            seen.add(key)
            sq += float(((t - b.tensors[n]) ** 2).sum())
    return sq


def refine_stream(a: ModelTensors, b: ModelTensors, Q: torch.Tensor | None, perm: torch.Tensor | None,
                  rest: Callable[[ModelTensors, torch.Tensor | None, torch.Tensor | None], ModelTensors]
                  ) -> tuple[ModelTensors, torch.Tensor | None, torch.Tensor | None, int]:
    """``b`` (its stream moved by ``Q`` or ``perm``) with the stream refitted against A while
    ``rest(b, Q, perm)`` (every later stage) brings the total distance down; ``(b, Q, perm,
    rounds kept)``."""
    ln = a.layout.norm == "layer"
    done = rest(b, Q, perm)
    best = total(a, done)
    rounds = 0
    for _ in range(ROUNDS):
        XA, XB = stream_weights(a), stream_weights(done)
        if Q is not None:
            R = procrustes(XB, XA, ln)
            cand, Qn, pn = residual_rotation(b, R), Q @ R, None
        else:
            r = assignment(-(XA.T @ XB))
            if torch.equal(r, torch.arange(r.numel())):
                break
            cand, Qn, pn = residual_permutation(b, r), None, perm[r]
        out = rest(cand, Qn, pn)
        d = total(a, out)
        if not d < best * (1 - 1e-9):
            break
        b, Q, perm, done, best, rounds = cand, Qn, pn, out, d, rounds + 1
    return b, Q, perm, rounds
