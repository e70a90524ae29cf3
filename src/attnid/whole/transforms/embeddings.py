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

import copy

import torch
from torch import nn

from attnid.whole.transforms.layout import layout_of


def embedding_translation(model: nn.Module, t: torch.Tensor, table: int = 1) -> nn.Module:
    """Token table rows ``+ t``, table ``table``'s rows (1: positions or token types) ``- t``."""
    lay = layout_of(model)
    if not 0 < table < len(lay.tables):
        raise ValueError(f"no embedding table {table} to translate against (have {len(lay.tables)})")
    new = copy.deepcopy(model)
    tok, other = (new.get_submodule(lay.tables[i]).weight for i in (0, table))
    with torch.no_grad():
        tok.add_(t.to(tok.dtype)[None, :])
        other.sub_(t.to(other.dtype)[None, :])
    return new


def logit_shift(model: nn.Module, u: torch.Tensor, c: float = 0.0) -> nn.Module:
    """Every unembedding row plus ``u`` (``[d]``), its bias plus ``c``: the logits move by a
    per-position constant. A tied unembedding takes only ``c``."""
    lay = layout_of(model)
    if lay.unembed is None or (lay.tied and bool(u.any())):
        raise ValueError("a logit shift needs an unembedding of its own (tied: only its bias)")
    new = copy.deepcopy(model)
    head = new.get_submodule(lay.unembed.path)
    with torch.no_grad():
        head.weight.add_(u.to(head.weight.dtype)[None, :])
        if c:
            head.bias.add_(c)
    return new


def _padding(model: nn.Module):
    lay = layout_of(model)
    if lay.padding_idx is None:
        raise ValueError("only RoBERTa's positions start after padding_idx")
    return lay, lay.padding_idx


def padding_translation(model: nn.Module, u: torch.Tensor) -> nn.Module:
    """Token row ``padding_idx`` ``+ u``, position row ``padding_idx`` ``- u``. A tied pad row is
    also a decoder row: then ``u`` must be ``c / g`` (``g``: the head LayerNorm's gain, bias
    ``b``), whose logit change ``c sum(b / g)`` the pad's decoder bias takes back."""
    lay, pad = _padding(model)
    new = copy.deepcopy(model)
    tok, pos = (new.get_submodule(lay.tables[i]).weight for i in (0, 1))
    u = u.to(tok.dtype)
    with torch.no_grad():
        if lay.tied:
            head_norm = new.get_submodule(lay.norms[-1].path)
            g, b = head_norm.weight, head_norm.bias
            c = float(u @ (1 / g)) / float((1 / g) @ (1 / g))
            if float((u - c / g).norm()) > 1e-12 * float(u.norm()):
                raise ValueError("a tied pad row moves only along 1 / g of the head's LayerNorm")
            new.get_submodule(lay.unembed.path).bias[pad] -= c * (b / g).sum()
        tok[pad] += u
        pos[pad] -= u
    return new


def unreachable_positions_move(model: nn.Module, delta: torch.Tensor) -> nn.Module:
    """Position rows ``0 .. padding_idx - 1`` plus ``delta`` (``[padding_idx, d]``)."""
    lay, pad = _padding(model)
    new = copy.deepcopy(model)
    pos = new.get_submodule(lay.tables[1]).weight
    with torch.no_grad():
        pos[:pad] += delta.to(pos.dtype)
    return new
