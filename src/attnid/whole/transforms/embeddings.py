"""Symmetries of the embeddings and the head (docs/theory.md §13.5 and §13.10).

* :func:`embedding_translation`: the stream starts from the sum of a token row and a position
  (or token-type) row, so the token table ``+ t`` and the other table ``- t`` leave every sum;
  a tied token table is also the unembedding, whose logits then move by the same amount
  at every vocabulary entry (log-probabilities ignore it);
* :func:`logit_shift`: every unembedding row plus one vector ``u`` (untied heads).
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
