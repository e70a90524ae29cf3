"""Symmetries at a residual norm ``y = g * xhat + b`` read by linear maps ``W y + c``
(docs/theory.md §13.2-§13.4, §13.12).

* :func:`norm_gain_transfer`: ``g, b -> s g, s b``, readers' input columns ``/ s``;
  :func:`fold_norm_gains` takes ``s = 1 / g`` at every norm that allows it (the one folding
  path: modules, and checkpoints through `attnid.checkpoint.canonicalize` and `attnid rewrite`);
* :func:`norm_bias_transfer` (LayerNorm): ``b -> b + delta``, each reader's bias ``- W delta``
  (a reader without a bias absorbs it with a centring move instead);
* :func:`centring_move` (LayerNorm): ``xhat`` is orthogonal to all-ones, so a reader
  ``W -> W + v (1/g)^T`` sees only the constant ``v sum(b / g)``, taken off its bias.

Each takes a `ModelTensors` (or a Hugging Face model, see `attnid.whole.transforms.state`).
"""

from __future__ import annotations

import torch

from attnid.errors import AttnidError
from attnid.whole.transforms.layout import Norm, norm_by_path
from attnid.whole.transforms.state import ModelTensors, gain_change, on_modules, weight_change


def _names(nm: Norm) -> list[str]:
    return [f"{nm.path}.weight", *(f"{r.path}.weight" for r in nm.readers)]


def _transfer_gain(m: ModelTensors, nm: Norm, s: torch.Tensor) -> dict[str, torch.Tensor]:
    """The changes of a gain transfer by ``s`` at ``nm`` (gain ``* s``, readers ``/ s``)."""
    if nm.absorb is not None or not nm.gain:
        raise AttnidError(f"{nm.path}'s gain is seen beyond its readers (the residual stream or "
                          "a tied unembedding)")
    g, b = m.gain(nm), m.norm_bias(nm)
    s = s.to(g.dtype)
    out = gain_change(nm, g * s)
    if b is not None:
        out[f"{nm.path}.bias"] = b * s
    for lin in nm.readers:
        out.update(weight_change(lin, m.weight(lin) / s[None, :]))
    return out


@on_modules
def norm_gain_transfer(m: ModelTensors, norm: str, s: torch.Tensor) -> ModelTensors:
    """Norm ``norm``'s gain (and bias) times ``s`` (``[d]``, nonzero), its readers' input
    columns ``/ s``."""
    return m.replace(_transfer_gain(m, norm_by_path(m.layout, norm), s))


def foldable(nm: Norm) -> bool:
    """Whether the readers of ``nm`` can take its gain (pre-LN, parallel, a post-LN model's
    last norm before its masked-LM transform; not a tied or absent head)."""
    return nm.absorb is None and nm.gain


@on_modules
def fold_norm_gains(m: ModelTensors) -> ModelTensors:
    """Every norm whose gain its readers can absorb gets gain 1 (a LayerNorm bias ``b / g``),
    the gain going into its readers' input columns: the gauge fixed by ``g = 1``. Norms
    seen elsewhere (post-LN residual paths, a tied or absent unembedding) keep theirs. Norms
    whose tensors are not here are left alone (a checkpoint is folded one layer at a time)."""
    out: dict[str, torch.Tensor] = {}
    for nm in m.layout.norms:
        if not foldable(nm) or not m.complete(_names(nm), f"folding {nm.path}"):
            continue
        g = m.gain(nm)
        if bool((g == 0).any()):
            raise AttnidError(f"{nm.path} has a zero gain: nothing to fold it into")
        out.update(_transfer_gain(m, nm, 1 / g))
        out.update(gain_change(nm, torch.ones_like(g)))  # g * (1 / g), without its rounding
    return m.replace(out)


@on_modules
def norm_bias_transfer(m: ModelTensors, norm: str, delta: torch.Tensor) -> ModelTensors:
    """LayerNorm bias ``b -> b + delta`` (``[d]``); each reader ``W y + c`` gets
    ``c - W delta``, or, without a bias, ``W + v (1/g)^T`` with ``v = -W delta / sum((b + delta)/g)``
    (needs that sum nonzero). Post-LN: the residual sum's other term takes ``- delta`` too."""
    nm = norm_by_path(m.layout, norm)
    g, b = m.gain(nm), m.norm_bias(nm)
    if b is None:
        raise AttnidError(f"{norm} has no bias")
    delta = delta.to(g.dtype)
    out = {f"{norm}.bias": b + delta}
    for lin in nm.readers:
        W, c = m.weight(lin), m.bias(lin)
        if c is not None:
            out[f"{lin.path}.bias"] = c - W @ delta
        else:
            v = -(W @ delta) / ((b + delta) / g).sum()
            out.update(weight_change(lin, W + v[:, None] / g[None, :]))
    if nm.absorb is not None:
        out[f"{nm.absorb.path}.bias"] = m.bias(nm.absorb) - delta
    return m.replace(out)


@on_modules
def centring_move(m: ModelTensors, norm: str, reader: int, v: torch.Tensor) -> ModelTensors:
    """LayerNorm ``norm``'s reader number ``reader``: ``W -> W + v (1/g)^T`` (``v`` ``[out]``),
    its bias ``- v sum(b / g)``."""
    lay = m.layout
    if lay.norm != "layer":
        raise AttnidError("centring moves need a LayerNorm (an RMSNorm's output is not centred)")
    nm = norm_by_path(lay, norm)
    lin = nm.readers[reader]
    if lay.tied and lin == lay.unembed:
        raise AttnidError("the reader is a tied unembedding (the token table moves with it)")
    g, b = m.gain(nm), m.norm_bias(nm)
    W, c = m.weight(lin), m.bias(lin)
    v = v.to(W.dtype)
    out = weight_change(lin, W + v[:, None] / g[None, :])
    if b is not None:
        if c is None:
            raise AttnidError("a biased LayerNorm read without a bias: use norm_bias_transfer")
        out[f"{lin.path}.bias"] = c - v * (b / g).sum()
    return m.replace(out)
