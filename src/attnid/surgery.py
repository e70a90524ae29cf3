"""`attnid canonicalize`: function-preserving surgery on a real checkpoint.

For every attention layer: drop the key bias where it is unidentified, fold the value bias
into the output bias, and balance QK (``W_Q^T W_Q = W_K^T W_K`` per group; under RoPE only
within the commutant) and VO. Tensors stream through safetensors one layer at a time. The
output is written to a temporary directory, verified (every layer in float64 on probe
inputs, and end to end with transformers for checkpoints small enough), and only then moved
into place. The input directory is never modified.
"""

from __future__ import annotations

import math
import os
import secrets
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from attnid.adapters.base import Adapter, hf_model_class
from attnid.adapters.config import load_config
from attnid.adapters.registry import adapter_for
from attnid.errors import AttnidError, require
from attnid.io import (
    DTYPES,
    all_names,
    read_bytes,
    read_header,
    read_tensor,
    weight_files,
    weight_prefix,
    write_streaming,
)
from attnid.spec import AttentionSpec
from attnid.symmetry.rebalance import drop_key_bias as zero_free_key_bias
from attnid.symmetry.rebalance import fold_value_bias as fold_value_bias_into_output
from attnid.symmetry.rebalance import rebalance_qk, rebalance_vo
from attnid.weights import AttentionWeights

# per-layer tolerance on the relative output error, by checkpoint dtype
TOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}


@dataclass(frozen=True)
class Operations:
    drop_key_bias: bool
    fold_value_bias: bool
    balance: bool
    fold_norms: bool = False


@dataclass
class Plan:
    """What one canonicalization reads and rewrites: the checkpoint, its layers, their tensors."""

    src: Path
    config: dict[str, Any]
    adapter: Adapter
    specs: list[AttentionSpec]
    files: list[Path]
    index: dict[str, tuple[Path, dict[str, Any], int]]  # tensor name -> (file, header, data start)
    prefix: str  # what the checkpoint puts before the adapter's names ("model.", "")
    owner: dict[str, int] = field(default_factory=dict)  # rewritten tensor -> its layer
    folded: dict[str, torch.Tensor] = field(default_factory=dict)  # --fold-norms: name -> float64


def canonicalize(in_dir: str | Path, out_dir: str | Path, *, drop_key_bias: bool | None = None,
                 fold_value_bias: bool | None = None, balance: bool | None = None,
                 fold_norms: bool = False, force: bool = False,
                 end_to_end_max_bytes: int = 2 * 1024**3) -> dict[str, Any]:
    """Canonicalize a checkpoint directory; returns the report. See the module docstring.

    ``None`` for an operation means: do it wherever it applies to the architecture.
    """
    start = time.perf_counter()
    src, dst = _check_dirs(in_dir, out_dir, force)
    plan = make_plan(src)
    ops = Operations(
        drop_key_bias=(any("k" in s.bias and s.qk_norm == "none" and s.pass_dims for s in plan.specs)
                       if drop_key_bias is None else drop_key_bias),
        fold_value_bias=(any({"v", "o"} <= s.bias for s in plan.specs)
                         if fold_value_bias is None else fold_value_bias),
        balance=True if balance is None else balance,
        fold_norms=fold_norms,
    )
    stats = {"max_abs_diff": 0.0, "max_rel_diff": 0.0, "key_bias_dropped": 0,
             "value_bias_folded": 0, "heads_balanced": 0, "norms_folded": 0}
    if fold_norms:
        _plan_fold(plan, stats)
    e2e = _write_verified(plan, ops, stats, dst, end_to_end_max_bytes)
    return {**stats, "end_to_end_rel_diff": e2e, "layers": len(plan.specs),
            "operations": asdict(ops), "architecture": plan.adapter.family,
            "seconds": time.perf_counter() - start, "out_dir": str(dst)}


def _check_dirs(in_dir: str | Path, out_dir: str | Path, force: bool) -> tuple[Path, Path]:
    src, dst = Path(in_dir).resolve(), Path(out_dir).resolve()
    if not src.is_dir():
        raise AttnidError(f"{in_dir} is not a directory")
    if dst == src or dst in src.parents or src in dst.parents:
        raise AttnidError("OUT_DIR must be neither IN_DIR nor inside it nor around it "
                          "(the input is never modified)")
    if dst.exists() and not dst.is_dir():
        raise AttnidError(f"{out_dir} exists and is not a directory")
    if dst.exists() and any(dst.iterdir()) and not force:
        raise AttnidError(f"{out_dir} exists and is not empty (use --force to replace it)")
    return src, dst


def make_plan(src: Path) -> Plan:
    """Read config and headers; check every attention tensor the adapter names is there."""
    _, config = load_config(str(src))
    adapter = adapter_for(config)
    if not adapter.closed_form:
        raise AttnidError(f"cannot canonicalize {adapter.family}: attnid lacks {adapter.missing}")
    specs = adapter.specs(config)
    files = weight_files(src)
    index = all_names(files)
    prefix = weight_prefix(index, adapter.names(0, specs[0])[0])
    plan = Plan(src, config, adapter, specs, files, index, prefix)
    for i, s in enumerate(specs):
        for n in adapter.names(i, s):
            if plan.prefix + n not in index:
                raise AttnidError(f"checkpoint lacks {plan.prefix + n} (layer {i} of {adapter.family})")
            plan.owner[plan.prefix + n] = i
    return plan


def _plan_fold(plan: Plan, stats: dict[str, Any]) -> None:
    """--fold-norms: every absorbable norm gain into its readers (float64, checked per norm)."""
    require("transformers", "hf")
    from attnid.whole.transforms.fold import fold_norm_tensors, foldable_norms  # torch + transformers

    def full(name: str) -> str | None:
        parts = name.split(".")
        for k in range(len(parts)):  # the checkpoint may drop the class's outer prefix
            cand = ".".join(parts[k:])
            if cand in plan.index:
                return cand
        if name.startswith("lm_head."):  # GPT-NeoX checkpoints keep the older head name
            return full("embed_out." + name[len("lm_head."):])
        return None

    def get(name: str) -> torch.Tensor | None:
        n = full(name)
        if n is None:
            return None
        p, header, st = plan.index[n]
        t = read_tensor(p, header, st, n)
        if not torch.isfinite(t).all():
            raise AttnidError(f"{n} holds NaN or Inf values")
        return t.double()

    norms = foldable_norms(plan.config)
    folded, worst = fold_norm_tensors(norms, get)
    if not math.isfinite(worst) or worst > 1e-10:
        raise AttnidError(f"refused: folding norm gains changed a reader's output by {worst:.2e}")
    plan.folded = {full(k): v for k, v in folded.items()}
    stats["norms_folded"] = len(norms)
    stats["max_rel_diff"] = max(stats["max_rel_diff"], worst)


def rewrite_layer(plan: Plan, i: int, ops: Operations, stats: dict[str, Any],
                  gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Layer ``i``'s rewritten tensors (full names, stored dtype), checked in float64 first."""
    s, adapter, prefix = plan.specs[i], plan.adapter, plan.prefix
    raw = {}
    for n in adapter.names(i, s):
        p, header, st = plan.index[prefix + n]
        raw[n] = read_tensor(p, header, st, prefix + n)
        if prefix + n in plan.folded:  # a norm's gain folded into this reader first
            raw[n] = plan.folded[prefix + n].to(raw[n].dtype)
        if not torch.isfinite(raw[n]).all():
            raise AttnidError(f"{prefix + n} holds NaN or Inf values")
    dtype = next(iter(raw.values())).dtype
    w0 = adapter.read({k: v.double() for k, v in raw.items()}, i, s)
    written = {k: v.to(dtype) for k, v in adapter.write(transform(w0, ops, stats), i).items()}
    for k, v in written.items():
        if tuple(v.shape) != tuple(raw[k].shape):
            raise AttnidError(f"internal: {k} changed shape {tuple(raw[k].shape)} -> {tuple(v.shape)}")
    stored = adapter.read({k: v.double() for k, v in written.items()}, i, s)
    _check_layer(w0, stored, dtype, gen, stats, i)
    return {prefix + k: v for k, v in written.items()}


def _write_verified(plan: Plan, ops: Operations, stats: dict[str, Any], dst: Path,
                    end_to_end_max_bytes: int) -> float | None:
    """Write into a fresh sibling of ``dst``, verify, then move it into place; returns the
    end-to-end relative difference (``None`` when the checkpoint is too big to load twice)."""
    cache: dict[str, torch.Tensor] = {}
    gen = torch.Generator().manual_seed(0)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.parent / f".{dst.name}.{secrets.token_hex(4)}.tmp"
    tmp.mkdir()  # mode 0o777 less the umask, like any folder the user creates
    try:
        _copy_other_files(plan.src, tmp, {p.name for p in plan.files})
        for p in plan.files:
            header, st = read_header(p)
            entries = [(n, v["dtype"], v["shape"], v["data_offsets"][1] - v["data_offsets"][0])
                       for n, v in header.items() if n != "__metadata__"]

            def produce(name: str, p=p, header=header, st=st) -> torch.Tensor | bytes:
                if name in plan.owner:
                    if name not in cache:
                        cache.update(rewrite_layer(plan, plan.owner[name], ops, stats, gen))
                    return cache.pop(name)
                if name in plan.folded:
                    return plan.folded[name].to(DTYPES[header[name]["dtype"]])
                return read_bytes(p, header, st, name)  # untouched: copied as stored, any dtype

            write_streaming(tmp / p.name, entries, produce, header.get("__metadata__"))
        e2e = None
        if sum(p.stat().st_size for p in plan.files) <= end_to_end_max_bytes:
            e2e = _end_to_end(plan.src, tmp, plan.config)
            if e2e > 10 * TOL.get(_checkpoint_dtype(plan.files[0]), 1e-5):
                raise AttnidError(f"refused: the rewritten model's outputs differ by {e2e:.2e} "
                                  "(relative); nothing was written")
        if dst.exists():
            shutil.rmtree(dst)
        os.replace(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
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
        w = rebalance_qk(w, group="auto", align=True, bias_rows=False)
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
    if not math.isfinite(rel) or rel > TOL.get(dtype, 1e-5):
        raise AttnidError(f"refused: layer {i} output changed by {rel:.2e} (relative) after surgery; "
                          "nothing was written")


def _copy_other_files(src: Path, dst: Path, weights: set[str]) -> None:
    for item in src.rglob("*"):
        rel = item.relative_to(src)
        if item.is_dir() or (len(rel.parts) == 1 and item.name in weights):
            continue
        target = dst / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(item, target)


def _checkpoint_dtype(path: Path) -> torch.dtype:
    header, _ = read_header(path)
    kinds = [v["dtype"] for k, v in header.items() if k != "__metadata__"]
    return DTYPES.get(max(set(kinds), key=kinds.count), torch.float32)


def _end_to_end(src: Path, out: Path, config: dict[str, Any]) -> float:
    """Load both checkpoints with transformers, run probe tokens, return the relative difference."""
    require("transformers", "hf")
    import transformers  # optional heavy dependency: loaded only here

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    loader = hf_model_class(config)  # the one resolver of an architecture to its class
    try:
        a = loader.from_pretrained(src).eval()
        b = loader.from_pretrained(out).eval()
    except Exception as e:
        raise AttnidError(f"refused: transformers could not load the rewritten checkpoint: {e}") from None
    vocab = int(config.get("vocab_size", 100))
    ids = torch.randint(0, min(vocab, 1000), (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ya = a(input_ids=ids)
        yb = b(input_ids=ids)
    ta = ya.logits if hasattr(ya, "logits") and ya.logits is not None else ya.last_hidden_state
    tb = yb.logits if hasattr(yb, "logits") and yb.logits is not None else yb.last_hidden_state
    return float((ta - tb).double().norm() / ta.double().norm())


