"""`attnid canonicalize`: function-preserving surgery on a real checkpoint.

For every attention layer: drop the key bias where it is unidentified, fold the value bias
into the output bias, and balance QK (``W_Q^T W_Q = W_K^T W_K`` per kv group; under RoPE only
within the commutant) and VO; optionally fold every absorbable norm gain into its readers.
The checkpoint is read through `attnid.checkpoint.load.Checkpoint` (the one reader) and
written one tensor at a time (`attnid.io.write_streaming`), so peak memory is one layer.
The output goes to a temporary sibling of ``out_dir``, is verified (every layer in float64
on probe inputs, and end to end with transformers for checkpoints small enough) and only
then moved into place. The input is never modified.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from attnid.adapters.base import read_hf_config
from attnid.checkpoint.load import Checkpoint, open_checkpoint
from attnid.checkpoint.output import check_out_dir, staged, verify_end_to_end
from attnid.errors import AttnidError, require
from attnid.io import DTYPES, write_streaming
from attnid.numerics import tolerance
from attnid.symmetry.rebalance import drop_key_bias as zero_free_key_bias
from attnid.symmetry.rebalance import fold_value_bias as fold_value_bias_into_output
from attnid.symmetry.rebalance import rebalance_qk, rebalance_vo
from attnid.weights import AttentionWeights


@dataclass(frozen=True)
class Operations:
    drop_key_bias: bool
    fold_value_bias: bool
    balance: bool
    fold_norms: bool = False


def canonicalize(in_dir: str | Path, out_dir: str | Path, *, drop_key_bias: bool | None = None,
                 fold_value_bias: bool | None = None, balance: bool | None = None,
                 fold_norms: bool = False, force: bool = False,
                 end_to_end_max_bytes: int = 2 * 1024**3) -> dict[str, Any]:
    """Canonicalize a checkpoint directory; returns its JSON. See the module docstring.

    ``None`` for an operation means: do it wherever it applies to the architecture.
    """
    start = time.perf_counter()
    src, dst = check_out_dir(in_dir, out_dir, force)
    require("transformers", "hf")  # the result is verified by loading it with transformers
    ck = open_checkpoint(src, purpose="canonicalize")
    read_hf_config(src, ck.config)  # a config transformers refuses is refused now, not at the end
    ops = Operations(
        drop_key_bias=(any("k" in s.bias and s.qk_norm == "none" and s.pass_dims for s in ck.specs)
                       if drop_key_bias is None else drop_key_bias),
        fold_value_bias=(any({"v", "o"} <= s.bias for s in ck.specs)
                         if fold_value_bias is None else fold_value_bias),
        balance=True if balance is None else balance,
        fold_norms=fold_norms,
    )
    stats = {"max_abs_diff": 0.0, "max_rel_diff": 0.0, "key_bias_dropped": 0,
             "value_bias_folded": 0, "heads_balanced": 0, "norms_folded": 0}
    if fold_norms:
        require("transformers", "hf")
    folded = FoldedNorms(ck, stats) if fold_norms else None
    e2e = _write_verified(ck, ops, folded, stats, dst, end_to_end_max_bytes)
    return {**stats, "end_to_end_rel_diff": e2e, "layers": ck.n_layers,
            "operations": asdict(ops), "architecture": ck.adapter.family,
            "seconds": time.perf_counter() - start, "out_dir": str(dst)}


class FoldedNorms:
    """--fold-norms: every absorbable norm gain folded into its readers by the one folding path
    (`attnid.whole.transforms.fold_norm_gains` on `ModelTensors`), one unit (a layer) at a
    time, each fold checked on random inputs of the norm's readers (float64)."""

    def __init__(self, ck: Checkpoint, stats: dict[str, Any]) -> None:
        from attnid.checkpoint.units import open_units  # transformers: only with --fold-norms
        from attnid.whole.transforms.norms import foldable

        self.units = open_units(ck)
        self.unit_of = {c: self.units.unit_of[s] for s, c in self.units.to_ck.items()}
        self.stats = stats
        self.cache: dict[int, dict[str, torch.Tensor]] = {}
        self.gen = torch.Generator().manual_seed(0)
        stats["norms_folded"] = sum(foldable(nm) for nm in self.units.layout.norms)

    def get(self, name: str) -> torch.Tensor | None:
        """The folded float64 tensor of checkpoint name ``name`` (None where folding leaves it)."""
        if name not in self.unit_of:
            return None
        u = self.unit_of[name]
        if u not in self.cache:
            from attnid.checkpoint.units import fold_check
            from attnid.whole.transforms.norms import fold_norm_gains

            if len(self.cache) > 2:  # units come in order: keep a few
                self.cache.pop(next(iter(self.cache)))
            before = self.units.load(u, torch.float64)
            after = fold_norm_gains(before)
            worst = fold_check(before, after, self.gen)
            if not math.isfinite(worst) or worst > tolerance(torch.float64):
                raise AttnidError(f"refused: folding norm gains changed a reader's output by {worst:.2e}")
            self.stats["max_rel_diff"] = max(self.stats["max_rel_diff"], worst)
            self.cache[u] = {self.units.to_ck[n]: t for n, t in after.tensors.items()
                             if t is not before.tensors[n]}
        return self.cache[u].get(name)


def rewrite_layer(ck: Checkpoint, i: int, ops: Operations, folded: FoldedNorms | None,
                  stats: dict[str, Any], gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Layer ``i``'s rewritten tensors (full names, stored dtype), checked in float64 first."""
    s, adapter, prefix = ck.specs[i], ck.adapter, ck.prefix
    raw = {}
    for n in adapter.names(i, s):
        raw[n] = ck.tensor(prefix + n)
        f = None if folded is None else folded.get(prefix + n)
        if f is not None:  # a norm's gain folded into this reader first
            raw[n] = f.to(raw[n].dtype)
    dtype = next(iter(raw.values())).dtype
    w0 = adapter.read({k: v.double() for k, v in raw.items()}, i, s)
    written = {k: v.to(dtype) for k, v in adapter.write(transform(w0, ops, stats), i).items()}
    for k, v in written.items():
        if tuple(v.shape) != tuple(raw[k].shape):
            raise AttnidError(f"internal: {k} changed shape {tuple(raw[k].shape)} -> {tuple(v.shape)}")
    stored = adapter.read({k: v.double() for k, v in written.items()}, i, s)
    _check_layer(w0, stored, dtype, gen, stats, i)
    return {prefix + k: v for k, v in written.items()}


def _write_verified(ck: Checkpoint, ops: Operations, folded: FoldedNorms | None,
                    stats: dict[str, Any], dst: Path, end_to_end_max_bytes: int) -> float | None:
    """Write into a fresh sibling of ``dst``, verify, then move it into place; returns the
    end-to-end relative difference (``None`` when the checkpoint is too big to load twice)."""
    owner = ck.layer_of()
    cache: dict[str, torch.Tensor] = {}
    gen = torch.Generator().manual_seed(0)
    e2e = None
    with staged(dst, ck.root, {f.path.name for f in ck.files}) as tmp:
        for f in ck.files:
            def produce(name: str) -> torch.Tensor:
                if name in owner:
                    if name not in cache:
                        cache.update(rewrite_layer(ck, owner[name], ops, folded, stats, gen))
                    return cache.pop(name)
                new = None if folded is None else folded.get(name)
                if new is not None:
                    return new.to(DTYPES[ck.info(name).dtype])
                return ck.tensor(name)  # untouched: its stored bytes, any dtype

            entries = [(n, f.info(n).dtype, f.info(n).shape) for n in f.names]
            write_streaming(tmp / f.path.name, entries, produce, f.metadata)
        e2e = verify_end_to_end(ck, tmp, end_to_end_max_bytes)
    return e2e


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


def _check_layer(w0: AttentionWeights, w1: AttentionWeights, dtype: torch.dtype,
                 gen: torch.Generator, stats: dict[str, Any], i: int) -> None:
    """Both layers as float64 `attnid.Attention` on probe inputs; refuse beyond the dtype's tolerance."""
    x = torch.randn(4, 16, w0.spec.d_model, generator=gen, dtype=torch.float64)
    with torch.no_grad():
        y0 = w0.to_module(copy=False)(x, causal=True)
        y1 = w1.to_module(copy=False)(x, causal=True)
    abs_diff = float((y1 - y0).abs().max())
    rel = float((y1 - y0).norm() / y0.norm().clamp_min(1e-300))
    stats["max_abs_diff"] = max(stats["max_abs_diff"], abs_diff)
    stats["max_rel_diff"] = max(stats["max_rel_diff"], rel)
    if not math.isfinite(rel) or rel > tolerance(dtype):
        raise AttnidError(f"refused: layer {i} output changed by {rel:.2e} (relative) after surgery; "
                          "nothing was written")


