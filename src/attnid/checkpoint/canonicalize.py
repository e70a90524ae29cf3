"""`attnid canonicalize`: function-preserving surgery on a real checkpoint.

For every attention layer: drop the key bias where it is unidentified, fold the value bias
into the output bias, and balance QK (``W_Q^T W_Q = W_K^T W_K`` per kv group; under RoPE only
within the commutant) and VO; optionally fold every absorbable norm gain into its readers.

The same pipeline as `attnid rewrite`: the checkpoint is read one unit (a layer) at a time
(`attnid.checkpoint.units`); each unit's element is found from its own tensors and applied in
the compute dtype (float64; float32 for bfloat16 and float16 checkpoints); the result is
written through `attnid.checkpoint.output.write_units` into a temporary sibling of
``out_dir``, certified by `attnid diff` against the input (and end to end with transformers
for checkpoints small enough), and only then moved into place. Peak memory is a unit; the
input is never modified.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from attnid.adapters.base import read_hf_config
from attnid.checkpoint.load import open_checkpoint
from attnid.checkpoint.output import check_out_dir, write_certified
from attnid.checkpoint.units import open_units
from attnid.errors import require
from attnid.progress import Progress
from attnid.symmetry.rebalance import drop_key_bias as zero_free_key_bias
from attnid.symmetry.rebalance import fold_value_bias as fold_value_bias_into_output
from attnid.symmetry.rebalance import rebalance_qk, rebalance_vo
from attnid.weights import AttentionWeights
from attnid.whole.transforms.state import ModelTensors


@dataclass(frozen=True)
class Operations:
    drop_key_bias: bool
    fold_value_bias: bool
    balance: bool
    fold_norms: bool = False


def canonicalize(in_dir: str | Path, out_dir: str | Path, *, drop_key_bias: bool | None = None,
                 fold_value_bias: bool | None = None, balance: bool | None = None,
                 fold_norms: bool = False, force: bool = False,
                 end_to_end_max_bytes: int = 2 * 1024**3, progress: Progress | None = None) -> dict[str, Any]:
    """Canonicalize a checkpoint directory; returns its JSON. See the module docstring.

    ``None`` for an operation means: do it wherever it applies to the architecture.
    """
    from attnid.whole.transforms.norms import fold_norm_gains, foldable

    start = time.perf_counter()
    src, dst = check_out_dir(in_dir, out_dir, force)
    require("transformers", "hf")  # the layout, and the end-to-end check, need transformers
    ck = open_checkpoint(src, purpose="canonicalize")
    read_hf_config(src, ck.config)  # a config transformers refuses is refused now, not at the end
    units = open_units(ck)
    ops = Operations(
        drop_key_bias=(any("k" in s.bias and s.qk_norm == "none" and s.pass_dims for s in ck.specs)
                       if drop_key_bias is None else drop_key_bias),
        fold_value_bias=(any({"v", "o"} <= s.bias for s in ck.specs)
                         if fold_value_bias is None else fold_value_bias),
        balance=True if balance is None else balance,
        fold_norms=fold_norms,
    )
    stats = {"key_bias_dropped": 0, "value_bias_folded": 0, "heads_balanced": 0,
             "norms_folded": sum(foldable(nm) for nm in units.layout.norms) if fold_norms else 0}

    def compute(m: ModelTensors) -> ModelTensors:
        """One unit: its norms folded (when asked), then each attention layer it holds made canonical."""
        if fold_norms:
            m = fold_norm_gains(m)
        for i in range(len(m.layout.layers)):
            w = m.attention(i)
            if w is not None:
                m = m.replace(m.attention_changes(i, transform(w, ops, stats)))
        return m

    shown = progress if progress is not None else Progress(enabled=False)
    check, e2e = write_certified(ck, units, compute, dst, shown, end_to_end_max_bytes)
    worst = max([row["residual"] for row in check["layers"]] + [check["other"]["residual"]])
    return {**stats, "certified": True, "max_residual": worst, "tolerance": check["tolerance"],
            "end_to_end_rel_diff": e2e, "layers": ck.n_layers, "operations": asdict(ops),
            "architecture": ck.adapter.family, "seconds": time.perf_counter() - start,
            "out_dir": str(dst)}


def transform(w: AttentionWeights, ops: Operations, stats: dict[str, Any]) -> AttentionWeights:
    s = w.spec
    if ops.drop_key_bias and w.b_K is not None and s.qk_norm == "none" and s.pass_dims:
        w = zero_free_key_bias(w)
        stats["key_bias_dropped"] += 1
    if ops.fold_value_bias and w.b_V is not None and w.b_O is not None:
        w = fold_value_bias_into_output(w)
        stats["value_bias_folded"] += 1
    if ops.balance:
        w = rebalance_qk(w, subgroup="auto", align=True, bias_rows=False)
        w = rebalance_vo(w, align=True, fold=False, bias_rows=False)
        stats["heads_balanced"] += s.n_heads
    return w
