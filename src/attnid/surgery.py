"""`attnid canonicalize`: function-preserving surgery on a real checkpoint.

For every attention layer: drop the key bias where it is unidentified, fold the value bias
into the output bias, and balance QK (``W_Q^T W_Q = W_K^T W_K`` per group; under RoPE only
within the commutant) and VO. Tensors stream through safetensors one layer at a time. The
output is written to a temporary directory, verified (every layer in float64 on probe
inputs, and end to end with transformers for checkpoints small enough), and only then moved
into place. The input directory is never modified.
"""

from __future__ import annotations

import json
import math
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from attnid.adapters.config import load_config
from attnid.adapters.registry import adapter_for
from attnid.errors import AttnidError
from attnid.io import all_names, read_bytes, read_header, read_tensor, weight_files, write_streaming
from attnid.symmetry.rebalance import drop_key_bias, fold_value_bias, rebalance_qk, rebalance_vo
from attnid.weights import AttentionWeights

# per-layer tolerance on the relative output error, by checkpoint dtype
TOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}


@dataclass(frozen=True)
class Operations:
    drop_key_bias: bool
    fold_value_bias: bool
    balance: bool


def canonicalize(in_dir: str | Path, out_dir: str | Path, *, drop_key_bias_: bool | None = None,
                 fold_value_bias_: bool | None = None, balance: bool | None = None,
                 force: bool = False, end_to_end_max_bytes: int = 2 * 1024**3) -> dict[str, Any]:
    """Canonicalize a checkpoint directory; returns the report. See the module docstring."""
    start = time.perf_counter()
    src, dst = Path(in_dir).resolve(), Path(out_dir).resolve()
    if not src.is_dir():
        raise AttnidError(f"{in_dir} is not a directory")
    if dst == src:
        raise AttnidError("OUT_DIR must differ from IN_DIR (the input is never modified)")
    if dst.exists() and any(dst.iterdir()) and not force:
        raise AttnidError(f"{out_dir} exists and is not empty (use --force to replace it)")
    _, config = load_config(str(src))
    adapter = adapter_for(config)
    if not adapter.closed_form:
        raise AttnidError(f"cannot canonicalize {adapter.family}: attnid lacks {adapter.missing}")
    specs = adapter.specs(config)
    files = weight_files(src)
    index = all_names(files)
    prefix = _prefix(index, adapter.names(0, specs[0])[0])
    ops = Operations(
        drop_key_bias=(any("k" in s.bias and s.qk_norm == "none" and s.pass_dims for s in specs)
                       if drop_key_bias_ is None else drop_key_bias_),
        fold_value_bias=(any({"v", "o"} <= s.bias for s in specs)
                         if fold_value_bias_ is None else fold_value_bias_),
        balance=True if balance is None else balance,
    )
    owner: dict[str, int] = {}
    for i, s in enumerate(specs):
        for n in adapter.names(i, s):
            if prefix + n not in index:
                raise AttnidError(f"checkpoint lacks {prefix + n} (layer {i} of {adapter.family})")
            owner[prefix + n] = i

    stats = {"max_abs_diff": 0.0, "max_rel_diff": 0.0, "key_bias_dropped": 0,
             "value_bias_folded": 0, "heads_balanced": 0}
    cache: dict[str, torch.Tensor] = {}
    gen = torch.Generator().manual_seed(0)

    def layer_tensors(i: int) -> None:
        s = specs[i]
        raw = {}
        for n in adapter.names(i, s):
            p, header, st = index[prefix + n]
            raw[n] = read_tensor(p, header, st, prefix + n)
        dtype = next(iter(raw.values())).dtype
        for n, t in raw.items():
            if not torch.isfinite(t).all():
                raise AttnidError(f"{prefix + n} holds NaN or Inf values")
        w0 = adapter.read({k: v.double() for k, v in raw.items()}, i, s)
        w1 = transform(w0, ops, stats)
        written = {k: v.to(dtype) for k, v in adapter.write(w1, i).items()}
        for k, v in written.items():
            if tuple(v.shape) != tuple(raw[k].shape):
                raise AttnidError(f"internal: {k} changed shape {tuple(raw[k].shape)} -> {tuple(v.shape)}")
        stored = adapter.read({k: v.double() for k, v in written.items()}, i, s)
        _check_layer(w0, stored, dtype, gen, stats, i)
        cache.update({prefix + k: v for k, v in written.items()})

    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", dir=dst.parent))
    try:
        _copy_other_files(src, tmp, {p.name for p in files})
        for p in files:
            header, st = read_header(p)
            entries = [(n, v["dtype"], v["shape"]) for n, v in header.items() if n != "__metadata__"]

            def produce(name: str, p=p, header=header, st=st) -> torch.Tensor | bytes:
                if name in owner:
                    if name not in cache:
                        layer_tensors(owner[name])
                    return cache.pop(name)
                return read_bytes(p, header, st, name)  # untouched: copied as stored

            write_streaming(tmp / p.name, entries, produce, header.get("__metadata__"))
        total_bytes = sum(p.stat().st_size for p in files)
        e2e = None
        if total_bytes <= end_to_end_max_bytes:
            e2e = _end_to_end(src, tmp, config)
            dtype = _checkpoint_dtype(files[0])
            if e2e > 10 * TOL.get(dtype, 1e-5):
                raise AttnidError(f"refused: the rewritten model's outputs differ by {e2e:.2e} "
                                  "(relative); nothing was written")
        if dst.exists():
            shutil.rmtree(dst)
        tmp.replace(dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {**stats, "end_to_end_rel_diff": e2e, "layers": len(specs),
            "operations": ops.__dict__, "architecture": adapter.family,
            "seconds": time.perf_counter() - start, "out_dir": str(dst)}


def transform(w: AttentionWeights, ops: Operations, stats: dict[str, Any]) -> AttentionWeights:
    s = w.spec
    if ops.drop_key_bias and w.b_K is not None and s.qk_norm == "none" and s.pass_dims:
        w = drop_key_bias(w)
        stats["key_bias_dropped"] += 1
    if ops.fold_value_bias and w.b_V is not None and w.b_O is not None:
        w = fold_value_bias(w)
        stats["value_bias_folded"] += 1
    if ops.balance:
        w = rebalance_qk(w, mode="auto", align=True, bias_rows=False)
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


def _prefix(index: dict[str, Any], first: str) -> str:
    for name in index:
        if name.endswith(first) and (len(name) == len(first) or name[-len(first) - 1] == "."):
            return name[: -len(first)]
    raise AttnidError(f"checkpoint has no tensor named like {first!r}: wrong architecture in config?")


def _copy_other_files(src: Path, dst: Path, weights: set[str]) -> None:
    for item in src.rglob("*"):
        rel = item.relative_to(src)
        if item.is_dir() or (len(rel.parts) == 1 and item.name in weights):
            continue
        target = dst / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(item, target)


def _checkpoint_dtype(path: Path) -> torch.dtype:
    from attnid.io import DTYPES

    header, _ = read_header(path)
    kinds = [v["dtype"] for k, v in header.items() if k != "__metadata__"]
    return DTYPES.get(max(set(kinds), key=kinds.count), torch.float32)


def _end_to_end(src: Path, out: Path, config: dict[str, Any]) -> float:
    """Load both checkpoints with transformers, run probe tokens, return the relative difference."""
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    arch = (config.get("architectures") or [None])[0]
    cls = getattr(transformers, arch, None) if arch else None
    loader = cls if cls is not None else transformers.AutoModel
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


def report_json(r: dict[str, Any]) -> str:
    return json.dumps(r, indent=2)
