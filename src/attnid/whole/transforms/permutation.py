"""A permutation of the residual stream's coordinates (docs/theory.md §13.20): every tensor
with a stream axis permuted along it, the norms' gains and biases included. Unlike a general
rotation (§13.6) a permutation ``P`` commutes with every diagonal gain once the gain is
permuted too (``(g P) * (z P) = (g * z) P``), and with the mean and the RMS a norm takes, so
it is a symmetry of every pre-LN model with an unembedding, tied or not, whatever its gains:
the stream ``x -> x P``, tables and writers ``-> W P``, norm gains and biases ``-> g P``,
readers ``-> P^T W``; a tied unembedding follows its table. Post-LN models (their stream is a
norm's output feeding heads that are not listed here) and bare models (hidden states read in
fixed coordinates) are refused.
"""

from __future__ import annotations

import torch

from attnid.errors import AttnidError
from attnid.whole.transforms.state import ModelTensors, on_modules, weight_change


def permutation_refusal(m: ModelTensors) -> str | None:
    """Why the stream of this model cannot be permuted (None when it can)."""
    lay = m.layout
    if lay.post:
        return "post-LN: the stream is a norm's output read by maps attnid does not permute"
    if lay.unembed is None:
        return "a bare model returns its hidden states in fixed coordinates"
    return None


@on_modules
def residual_permutation(m: ModelTensors, perm: torch.Tensor) -> ModelTensors:
    """New stream coordinate ``i`` is old coordinate ``perm[i]`` (``[d]`` long)."""
    why = permutation_refusal(m)
    if why:
        raise AttnidError(f"cannot permute the residual stream: {why}")
    lay = m.layout
    perm = torch.as_tensor(perm, dtype=torch.long)
    d = m.tensors[f"{lay.tables[0]}.weight"].shape[1] if f"{lay.tables[0]}.weight" in m else perm.numel()
    if tuple(perm.shape) != (d,) or not torch.equal(perm.sort().values, torch.arange(d)):
        raise AttnidError(f"not a permutation of the {d} stream coordinates")
    out: dict[str, torch.Tensor] = {}
    for t in lay.tables:
        if f"{t}.weight" in m:
            out[f"{t}.weight"] = m.tensors[f"{t}.weight"][:, perm]
    norms = {nm.path: nm for nm in (*lay.norms, *(() if lay.final is None else (lay.final,)))}
    readers = {}
    for nm in norms.values():
        for suffix in (".weight", ".bias"):
            if nm.path + suffix in m:
                out[nm.path + suffix] = m.tensors[nm.path + suffix][perm]
        readers |= {r.path: r for r in nm.readers}
    for lin in readers.values():  # a fused map read whole once
        if m.has(lin) and not (lay.tied and lin == lay.unembed):
            out.update(weight_change(lin, m.weight(lin)[:, perm]))
    writers = {lin.path: lin for ws in lay.writers for lin in ws}
    for lin in writers.values():
        if m.has(lin):
            out.update(weight_change(lin, m.weight(lin)[perm]))
            if m.bias(lin) is not None:
                out[f"{lin.path}.bias"] = m.bias(lin)[perm]
    return m.replace(out)
