"""Norm-gain folding on checkpoint tensors (``attnid canonicalize --fold-norms``): the
gauge ``g = 1`` of §13.2, set at every norm whose readers can absorb its gain. The layout
comes from the architecture's class built on the meta device (no memory, no weights);
tensors are read by name, folded in float64 and checked on random inputs of each norm."""

from __future__ import annotations

from collections.abc import Callable

import torch

from attnid.adapters.base import new_hf_model
from attnid.errors import AttnidError
from attnid.whole.transforms.layout import Lin, Norm, gain_offset, layout_of

Get = Callable[[str], torch.Tensor | None]  # tensor name (module path + ".weight") -> float64


def foldable_norms(config: dict) -> list[tuple[Norm, float]]:
    """Norms whose gain their readers can absorb (pre-LN, parallel; a post-LN model's last
    norm before its masked-LM transform), with their stored gain's offset (Gemma: 1)."""
    with torch.device("meta"):
        model = new_hf_model(config, head=True)
    try:
        lay = layout_of(model)
    except ValueError as e:
        raise AttnidError(f"--fold-norms: {e}") from None
    return [(n, gain_offset(model, n.path)) for n in lay.norms if n.absorb is None and n.gain]


def _as_out_in(w: torch.Tensor, lin: Lin) -> torch.Tensor:
    return w.T if lin.conv1d else w


def fold_norm_tensors(norms: list[tuple[Norm, float]], get: Get, *, seed: int = 0
                      ) -> tuple[dict[str, torch.Tensor], float]:
    """The folded tensors (float64, by name) and the largest relative change of any norm's
    readers' outputs on random normalised inputs (rounding only)."""
    out: dict[str, torch.Tensor] = {}
    gen = torch.Generator().manual_seed(seed)
    worst = 0.0
    for nm, offset in norms:
        w, b = get(f"{nm.path}.weight"), get(f"{nm.path}.bias")
        if w is None:
            raise AttnidError(f"--fold-norms: checkpoint lacks {nm.path}.weight")
        g = w + offset
        if bool((g == 0).any()):
            raise AttnidError(f"--fold-norms: {nm.path} has a zero gain, which nothing can absorb")
        out[f"{nm.path}.weight"] = torch.ones_like(g) - offset
        if b is not None:
            out[f"{nm.path}.bias"] = b / g
        z = torch.randn(8, g.shape[0], generator=gen, dtype=torch.float64)
        for lin in nm.readers:
            W = get(f"{lin.path}.weight")
            if W is None:
                raise AttnidError(f"--fold-norms: checkpoint lacks {lin.path}.weight")
            new = _as_out_in(_as_out_in(W, lin) * g[None, :], lin)
            out[f"{lin.path}.weight"] = new
            before = (z * g + (0 if b is None else b)) @ _as_out_in(W, lin).T
            after = (z + (0 if b is None else b / g)) @ _as_out_in(new, lin).T
            worst = max(worst, float((after - before).norm() / before.norm().clamp_min(1e-300)))
    return out, worst
