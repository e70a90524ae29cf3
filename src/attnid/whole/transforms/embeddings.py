"""Symmetries of the embeddings and the head (docs/theory.md §13.8, §13.11, §13.13).

* :func:`embedding_translation`: the stream starts from the sum of a token row and a position
  (or token-type) row, so the token table ``+ t`` and the other table ``- t`` leave every sum;
  a tied token table is also the unembedding, whose logits then move by the same amount
  at every vocabulary entry (log-probabilities ignore it);
* :func:`logit_shift`: every unembedding row plus one vector ``u`` (untied heads);
* RoBERTa (§13.13): :func:`padding_translation` (the pad token's row ``+ u``, position row
  ``padding_idx`` ``- u``: that token only ever sits there) and
  :func:`unreachable_positions_move` (position rows below ``padding_idx`` are never read).
"""

from __future__ import annotations

import torch

from attnid.errors import AttnidError
from attnid.whole.transforms.state import ModelTensors, on_modules


def _table(m: ModelTensors, i: int) -> tuple[str, torch.Tensor]:
    name = f"{m.layout.tables[i]}.weight"
    return name, m.tensors[name]


@on_modules
def embedding_translation(m: ModelTensors, t: torch.Tensor, table: int = 1) -> ModelTensors:
    """Token table rows ``+ t``, table ``table``'s rows (1: positions or token types) ``- t``."""
    lay = m.layout
    if not 0 < table < len(lay.tables):
        raise AttnidError(f"no embedding table {table} to translate against (have {len(lay.tables)})")
    (n0, tok), (n1, other) = _table(m, 0), _table(m, table)
    return m.replace({n0: tok + t.to(tok.dtype)[None, :], n1: other - t.to(other.dtype)[None, :]})


@on_modules
def logit_shift(m: ModelTensors, u: torch.Tensor, c: float = 0.0) -> ModelTensors:
    """Every unembedding row plus ``u`` (``[d]``), its bias plus ``c``: the logits move by a
    per-position constant. A tied unembedding takes only ``c``."""
    lay = m.layout
    if lay.unembed is None or (lay.tied and bool(u.any())):
        raise AttnidError("a logit shift needs an unembedding of its own (tied: only its bias)")
    W = m.tensors[f"{lay.unembed.path}.weight"]
    out = {} if lay.tied else {f"{lay.unembed.path}.weight": W + u.to(W.dtype)[None, :]}
    if c:
        out[f"{lay.unembed.path}.bias"] = m.bias(lay.unembed) + c
    return m.replace(out)


def _padding(m: ModelTensors) -> int:
    if m.layout.padding_idx is None:
        raise AttnidError("only RoBERTa's positions start after padding_idx")
    return m.layout.padding_idx


@on_modules
def padding_translation(m: ModelTensors, u: torch.Tensor) -> ModelTensors:
    """Token row ``padding_idx`` ``+ u``, position row ``padding_idx`` ``- u``. A tied pad row is
    also a decoder row: then ``u`` must be ``c / g`` (``g``: the head LayerNorm's gain, bias
    ``b``), whose logit change ``c sum(b / g)`` the pad's decoder bias takes back."""
    pad = _padding(m)
    lay = m.layout
    (n0, tok), (n1, pos) = _table(m, 0), _table(m, 1)
    u = u.to(tok.dtype)
    out: dict[str, torch.Tensor] = {}
    if lay.tied:
        head_norm = lay.norms[-1]
        g, b = m.gain(head_norm), m.norm_bias(head_norm)
        c = float(u @ (1 / g)) / float((1 / g) @ (1 / g))
        if float((u - c / g).norm()) > 1e-12 * float(u.norm()):
            raise AttnidError("a tied pad row moves only along 1 / g of the head's LayerNorm")
        bias = m.bias(lay.unembed).clone()
        bias[pad] -= c * (b / g).sum()
        out[f"{lay.unembed.path}.bias"] = bias
    tok, pos = tok.clone(), pos.clone()
    tok[pad] += u
    pos[pad] -= u
    out.update({n0: tok, n1: pos})
    return m.replace(out)


@on_modules
def unreachable_positions_move(m: ModelTensors, delta: torch.Tensor) -> ModelTensors:
    """Position rows ``0 .. padding_idx - 1`` plus ``delta`` (``[padding_idx, d]``)."""
    pad = _padding(m)
    name, pos = _table(m, 1)
    pos = pos.clone()
    pos[:pad] += delta.to(pos.dtype)
    return m.replace({name: pos})
