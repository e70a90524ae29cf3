"""The additive gauges, fitted to bring B's stored tensors closest to A's (docs/theory.md
§13.20): each is a translation along directions the function cannot see, so the least-squares
amount is a mean of differences.

* embedding translation (§13.8): token rows ``+ t``, an extra table's rows ``- t``, with
  ``t = (sum_tokens (E_A - E_B) - sum_rows (T_A - T_B)) / (V + n)``;
* writes along all-ones (§13.5, LayerNorm): each writer column and bias, each table row, takes
  the all-ones component of A's (a tied token table: one constant for all rows);
* logit shift (§13.11, an untied unembedding): every row ``+ mean(U_A - U_B)``, the bias ``+
  mean(c_A - c_B)``.

LayerNorm bias transfer and centring (§13.3, §13.4) are not fitted: they trade a norm's bias
against its readers' columns and biases, and are left as B has them.
"""

from __future__ import annotations

import torch

from attnid.whole.transforms.embeddings import embedding_translation, logit_shift
from attnid.whole.transforms.residual import ones_shift, table_shift
from attnid.whole.transforms.state import ModelTensors


def fit_additive(a: ModelTensors, b: ModelTensors, with_tables: bool = True) -> ModelTensors:
    """``b`` moved by the additive gauges nearest ``a`` (stored tensors; a whole model or one
    unit of it: each gauge whose tensors are there; ``with_tables=False``: the tables are another
    unit's, here only to be read)."""
    lay = b.layout
    has_tables = with_tables and all(f"{t}.weight" in b for t in lay.tables)
    tables = [f"{t}.weight" for t in lay.tables]
    if lay.padding_idx is None and has_tables:  # RoBERTa's pad rows trade otherwise (§13.13): left be
        for k in range(1, len(tables)):
            dE = (a.tensors[tables[0]] - b.tensors[tables[0]]).sum(0)
            dT = (a.tensors[tables[k]] - b.tensors[tables[k]]).sum(0)
            n = b.tensors[tables[0]].shape[0] + b.tensors[tables[k]].shape[0]
            b = embedding_translation(b, (dE - dT) / n, k)
    if lay.norm == "layer":
        for i, writers in enumerate(lay.writers):
            for w, lin in enumerate(writers):
                if not b.has(lin):
                    continue
                col = (a.weight(lin) - b.weight(lin)).mean(0)  # [in]: the all-ones part per column
                bias = 0.0 if b.bias(lin) is None else float((a.bias(lin) - b.bias(lin)).mean())
                b = ones_shift(b, i, w, col, bias)
        for k, name in enumerate(tables if has_tables else []):
            c = (a.tensors[name] - b.tensors[name]).mean(1)  # [rows]
            if k == 0 and lay.tied:
                c = torch.full_like(c, float(c.mean()))
            b = table_shift(b, k, c)
    if lay.unembed is not None and not lay.tied and b.has(lay.unembed):
        u = (a.weight(lay.unembed) - b.weight(lay.unembed)).mean(0)
        c = 0.0 if b.bias(lay.unembed) is None else float((a.bias(lay.unembed) - b.bias(lay.unembed)).mean())
        b = logit_shift(b, u, c)
    return b
