"""`attnid align` and `attnid merge` on checkpoints (docs/theory.md §13.20).

`align` writes B moved by the group element that brings it closest to A
(`attnid.whole.align.align`): B's function, A's coordinates. The output goes to a temporary
sibling of OUT_DIR, is certified by `attnid diff` against B (every invariant at the dtype's
rounding) and, up to 2 GiB, end to end with transformers, and only then moved into place.
`merge` writes ``(1 - alpha) A + alpha B`` (B aligned first with ``align=True``), in A's
files and dtype. Both models are held in memory in float64 (checkpoints of small and
medium size; `attnid diff` and `attnid rewrite` stream). Inputs are never modified.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import torch

from attnid.checkpoint.load import Checkpoint, open_checkpoint
from attnid.checkpoint.output import check_out_dir, staged, verify_end_to_end
from attnid.checkpoint.tokens import read_chunks
from attnid.checkpoint.units import Units, open_units
from attnid.errors import AttnidError
from attnid.io import DTYPES, write_streaming
from attnid.progress import Progress
from attnid.whole.align import SUBGROUPS, align
from attnid.whole.transforms.state import ModelTensors

CALIBRATION_TOKENS = 8192  # at most this many calibration tokens are run through both models


def open_pair(model_a: str | Path, model_b: str | Path, purpose: str = "read"
              ) -> tuple[Checkpoint, Checkpoint, Units, Units]:
    """Both checkpoints opened and checked to be one architecture (before any work)."""
    a, b = open_checkpoint(model_a, purpose=purpose), open_checkpoint(model_b, purpose=purpose)
    if a.adapter.family != b.adapter.family or a.specs != b.specs:
        raise AttnidError(f"{model_a} and {model_b} are not the same architecture "
                          f"({a.adapter.family} {a.specs[0].describe()} x{a.n_layers} vs "
                          f"{b.adapter.family} {b.specs[0].describe()} x{b.n_layers})")
    ua, ub = open_units(a), open_units(b)
    if ua.layout != ub.layout or set(ua.to_ck) != set(ub.to_ck):
        raise AttnidError(f"{model_a} and {model_b} are not the same architecture (tied vs untied, or "
                          "different tensors)")
    for n, c in ua.to_ck.items():
        sa, sb = a.info(c).shape, b.info(ub.to_ck[n]).shape
        if sa != sb:
            raise AttnidError(f"{n} has shape {list(sa)} in {model_a} but {list(sb)} in {model_b}")
    return a, b, ua, ub


def apart(dst: Path, ck: Checkpoint, name: str) -> None:
    """Refuse an OUT_DIR that is the other input, inside it or around it."""
    other = ck.root.resolve()
    if dst == other or other in dst.parents or dst in other.parents:
        raise AttnidError(f"OUT_DIR must be neither {name} nor inside it nor around it (the inputs are "
                          "never modified)")


def load_tensors(units: Units) -> ModelTensors:
    """Every tensor of the checkpoint (state_dict names), floating ones in float64."""
    out = {}
    for n, c in units.to_ck.items():
        t = units.ck.tensor(c)
        out[n] = t.to(torch.float64) if t.is_floating_point() else t
    return ModelTensors(units.layout, out, units.ck.config)


def write_tensors(units: Units, tensors: ModelTensors, tmp: Path) -> None:
    """The checkpoint's files again under ``tmp``, each tensor the units hold taken from
    ``tensors`` in the stored dtype (every other one copied as stored)."""
    ck = units.ck
    new = {c: tensors.tensors[s] for s, c in units.to_ck.items()}

    def produce(name: str) -> torch.Tensor:
        if name not in new:
            return ck.tensor(name)
        t = new[name]
        return t.to(DTYPES[ck.info(name).dtype]) if t.is_floating_point() else t

    for f in ck.files:
        entries = [(n, f.info(n).dtype, f.info(n).shape) for n in f.names]
        write_streaming(tmp / f.path.name, entries, produce, f.metadata)


def as_stored(units: Units, m: ModelTensors) -> ModelTensors:
    """``m``'s floating tensors rounded to the checkpoint's stored dtypes (what is written)."""
    ck = units.ck
    out = {n: t.to(DTYPES[ck.info(units.to_ck[n]).dtype]) if t.is_floating_point() else t
           for n, t in m.tensors.items()}
    return ModelTensors(m.layout, out, m.config)


def certify(units: Units, b: ModelTensors, out: ModelTensors, stream_permutation: torch.Tensor | None
            ) -> tuple[float, float]:
    """`attnid diff`'s fit of the output against B (both as stored): ``(worst residual,
    rounding level)``, refused unless every residual is at rounding. A stream permutation is undone
    first: it moves stored numbers without arithmetic (so it is exact in any dtype), and
    `attnid diff` fits a rotation only where a rotation is a symmetry (not behind a tied
    head's non-uniform gain, where a permutation still is)."""
    from attnid.whole.fit import TensorSource, fit
    from attnid.whole.transforms.permutation import residual_permutation

    if stream_permutation is not None:
        out = residual_permutation(out, torch.argsort(stream_permutation))
    f = fit(TensorSource(as_stored(units, b)), TensorSource(out))
    residuals = [x for r in f.units for x in r.residuals]
    first = next((x for x in residuals if x.residual > f.tolerance), None)
    if first is not None:
        raise AttnidError(f"refused: the aligned checkpoint is not certified against B ("
                          f"{units.label(first.tensor)}: residual {first.residual:.2e}); nothing was written")
    return max((x.residual for x in residuals), default=0.0), f.tolerance


def check_subgroup(subgroup: str) -> None:
    if subgroup not in SUBGROUPS:
        raise AttnidError(f"--subgroup {subgroup}: one of {', '.join(SUBGROUPS)}")


def align_checkpoints(model_a: str | Path, model_b: str | Path, out_dir: str | Path, *,
                      subgroup: str = "full",
                      calibration: str | Path | None = None, force: bool = False,
                      end_to_end_max_bytes: int = 2 * 1024**3, progress: Progress | None = None
                      ) -> dict[str, Any]:
    """Write B aligned onto A into ``out_dir``, certified; returns its JSON (see the module)."""
    start = time.perf_counter()
    check_subgroup(subgroup)
    a, b, ua, ub = open_pair(model_a, model_b, purpose="align")
    apart(Path(out_dir).resolve(), a, "A")
    _, dst = check_out_dir(b.root, out_dir, force)
    calib = None
    if calibration is not None:  # A's tokenizer, before any work
        calib = read_chunks(a, calibration, option="--calibration", max_tokens=CALIBRATION_TOKENS).ids
    shown = progress if progress is not None else Progress(enabled=False)
    A, B = load_tensors(ua), load_tensors(ub)
    al = align(A, B, subgroup=subgroup, calibration=calib, progress=shown.line)  # type: ignore[arg-type]
    stored = as_stored(ub, al.model)
    worst, tol = certify(ub, B, stored, al.stream_permutation)
    shown.line(f"certified against B: worst residual {worst:.2e} (rounding level {tol:.1e})")
    with staged(dst, b.root, {f.path.name for f in b.files}) as tmp:
        write_tensors(ub, stored, tmp)
        e2e = verify_end_to_end(b, tmp, end_to_end_max_bytes, what="aligned")
    return {"model_a": str(a.path), "model_b": str(b.path), "out_dir": str(dst),
            "architecture": a.adapter.family, "dtype": str(b.dtype()).split(".")[-1],
            "matching": "weights" if calib is None else "activations", **al.to_dict(),
            "certified": True, "max_residual": worst, "tolerance": tol,
            "end_to_end_rel_diff": e2e, "seconds": time.perf_counter() - start}


def check_alpha(alpha: float) -> None:
    if not (math.isfinite(alpha) and 0.0 <= alpha <= 1.0):
        raise AttnidError(f"--alpha {alpha}: the weight of B must lie in [0, 1]")


def interpolate(A: ModelTensors, B: ModelTensors, alpha: float) -> ModelTensors:
    """``(1 - alpha) A + alpha B`` on every floating tensor (A's other tensors kept); exact at
    both ends (``alpha = 0`` gives A's values, ``1`` B's)."""
    out = {}
    for n, t in A.tensors.items():
        if not t.is_floating_point() or alpha == 0.0:
            out[n] = t
        elif alpha == 1.0:
            out[n] = B.tensors[n]
        else:
            out[n] = (1.0 - alpha) * t + alpha * B.tensors[n]
    return ModelTensors(A.layout, out, A.config)


def merge_checkpoints(model_a: str | Path, model_b: str | Path, out_dir: str | Path, *, alpha: float = 0.5,
                      aligned: bool = False, subgroup: str = "full", force: bool = False,
                      progress: Progress | None = None) -> dict[str, Any]:
    """Write ``(1 - alpha) A + alpha B`` (B aligned onto A first when ``aligned``) into
    ``out_dir`` in A's files and dtype; returns its JSON."""
    start = time.perf_counter()
    check_alpha(alpha)
    check_subgroup(subgroup)
    a, b, ua, ub = open_pair(model_a, model_b, purpose="merge")
    apart(Path(out_dir).resolve(), b, "B")
    _, dst = check_out_dir(a.root, out_dir, force)
    shown = progress if progress is not None else Progress(enabled=False)
    A, B = load_tensors(ua), load_tensors(ub)
    aligned_keys: dict[str, Any] = {}
    if aligned:
        al = align(A, B, subgroup=subgroup, progress=shown.line)  # type: ignore[arg-type]
        worst, _ = certify(ub, B, as_stored(ub, al.model), al.stream_permutation)
        B = al.model
        aligned_keys = {"max_residual": worst, "subgroup": subgroup,
                  "group": subgroup,  # deprecated alias key (one release)
                  "stream": al.stream, "raw_distance": al.raw_distance,
                  "aligned_distance": al.aligned_distance}
    merged = interpolate(A, B, alpha)
    with staged(dst, a.root, {f.path.name for f in a.files}) as tmp:
        write_tensors(ua, merged, tmp)
        open_checkpoint(tmp, purpose="merge")  # reads back: header, tensors and shapes as A's
    return {"model_a": str(a.path), "model_b": str(b.path), "out_dir": str(dst),
            "architecture": a.adapter.family, "alpha": alpha, "aligned": aligned, **aligned_keys,
            "seconds": time.perf_counter() - start}
