"""`attnid align` and `attnid merge` on checkpoints (docs/theory.md §13.20).

`align` writes B moved by the group element that brings it closest to A
(`attnid.whole.align.align`): B's function, A's coordinates. The output goes to a temporary
sibling of OUT_DIR, is certified by `attnid diff` against B (every invariant at the dtype's
rounding) and, up to 2 GiB, end to end with transformers, and only then moved into place.
`merge` writes ``(1 - alpha) A + alpha B`` (B aligned first with ``align=True``), in A's
files and dtype. Both stream: the two checkpoints are read one unit (a layer) at a time, in
float64 (float32 for bfloat16 and float16 checkpoints), and B's aligned units are written as
they are made (each pass of the stream's refinement into its own temporary file, the best
kept). A tied checkpoint and an untied one are aligned and merged as two untied models
(docs/theory.md §13.21): the output is untied. Inputs are never modified.
"""

from __future__ import annotations

import math
import os
import secrets
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from attnid.checkpoint.evaluate import check_causal
from attnid.checkpoint.load import Checkpoint, open_checkpoint
from attnid.checkpoint.output import (
    check_out_dir,
    copy_other_files,
    staged,
    untie_files,
    verify_end_to_end,
    write_units,
)
from attnid.checkpoint.tokens import read_chunks
from attnid.checkpoint.units import Units, layout_of_config, open_units
from attnid.errors import AttnidError
from attnid.progress import Progress
from attnid.whole.align import SUBGROUPS
from attnid.whole.align.aligner import Alignment, activations, align_sources, check_rounds, stream_rotated
from attnid.whole.align.stream import ROUNDS
from attnid.whole.fit.fitter import compute_dtype
from attnid.whole.fit.source import read_ahead
from attnid.whole.transforms.element import LayerElement
from attnid.whole.transforms.state import ModelTensors

CALIBRATION_TOKENS = 8192  # at most this many calibration tokens are run through both models
REFINE_TOKENS = 2**17  # at most this many a refinement fits on (fewer over-fit the mid-point)


def calibration_ids(ck: Checkpoint, calibration: str | Path | None, refine: int | None
                    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The calibration text's chunks (A's tokenizer), before any work: ``(the first
    CALIBRATION_TOKENS for matching on activations, up to REFINE_TOKENS for a refinement)``."""
    if calibration is None:
        return None, None
    ids = read_chunks(ck, calibration, option="--calibration",
                      max_tokens=CALIBRATION_TOKENS if refine is None else REFINE_TOKENS).ids
    return ids[:max(1, CALIBRATION_TOKENS // ids.shape[1])], ids if refine is not None else None


def open_pair(model_a: str | Path, model_b: str | Path, purpose: str = "read"
              ) -> tuple[Checkpoint, Checkpoint, Units, Units]:
    """Both checkpoints opened and checked to be one architecture (before any work)."""
    a, b = open_checkpoint(model_a, purpose=purpose), open_checkpoint(model_b, purpose=purpose)
    if a.adapter.family != b.adapter.family or a.specs != b.specs:
        raise AttnidError(f"{model_a} and {model_b} are not the same architecture "
                          f"({a.adapter.family} {a.specs[0].describe()} x{a.n_layers} vs "
                          f"{b.adapter.family} {b.specs[0].describe()} x{b.n_layers})")
    untie = layout_of_config(a).tied != layout_of_config(b).tied  # as `attnid diff`: two untied models
    ua, ub = open_units(a, untie=untie), open_units(b, untie=untie)
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


def load_tensors(units: Units, dtype: torch.dtype = torch.float64) -> ModelTensors:
    """Every tensor of the checkpoint (state_dict names), floating ones in ``dtype``."""
    out = {}
    for n, c in units.to_ck.items():
        t = units.ck.tensor(c)
        out[n] = t.to(dtype) if t.is_floating_point() else t
    return ModelTensors(units.layout, out, units.ck.config)


class Written:
    """Each pass of the alignment written as B's files into a fresh temporary sibling of ``dst``
    (`attnid.whole.align.aligner.Output`)."""

    def __init__(self, units: Units, dst: Path) -> None:
        self.units, self.dst = units, dst

    def run(self, compute: Callable[[int], Any]) -> Path:
        tmp = self.dst.parent / f".{self.dst.name}.{secrets.token_hex(4)}.tmp"
        tmp.mkdir(parents=True)
        try:
            write_units(self.units, lambda u: compute(u).model, tmp)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return tmp

    def drop(self, handle: Path) -> None:
        shutil.rmtree(handle, ignore_errors=True)


class Unpermuted:
    """A checkpoint's units with a stream permutation, and each layer's head and neuron
    permutations, undone as they are read. They move stored numbers without arithmetic, so
    this is exact in any dtype, and each is a symmetry whichever permutation it is: a
    certificate of the output read this way against B certifies the output itself. Undoing
    the alignment's own head and neuron permutations lets `attnid diff`'s matching find every
    head and neuron at its namesake (no ``[f, f]`` search: 1.4 s a 7B layer)."""

    def __init__(self, units: Units, perm: torch.Tensor | None,
                 layers: tuple[LayerElement, ...] = ()) -> None:
        self.units, self.inv = units, None if perm is None else torch.argsort(perm)
        self.layers = layers
        self.layout, self.config = units.layout, units.config

    def __getattr__(self, name: str) -> Any:
        return getattr(self.units, name)

    def load(self, unit: int, dtype: torch.dtype | None = None, *, check: bool = True) -> ModelTensors:
        from attnid.whole.transforms.heads import head_permutation
        from attnid.whole.transforms.mlp import neuron_permutation
        from attnid.whole.transforms.permutation import residual_permutation

        m = self.units.load(unit, dtype, check=check)
        m = m if self.inv is None else residual_permutation(m, self.inv)
        i = unit - 1  # unit 0 holds the tables, unit i + 1 layer i
        el = self.layers[i] if 0 <= i < len(self.layers) else None
        if el is not None and el.heads is not None:
            m = head_permutation(m, i, torch.argsort(el.heads))
        if el is not None and el.neurons is not None:
            m = neuron_permutation(m, i, torch.argsort(el.neurons))
        return m

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        t = self.units.rows(name, start, stop)  # a table's rows, the unembedding's, a gain
        if self.inv is None:
            return t
        return t[self.inv] if t.dim() == 1 else t[:, self.inv]


def certify(ub: Units, out: Path, stream_permutation: torch.Tensor | None,
            layers: tuple[LayerElement, ...] = (), rotated: bool = True) -> tuple[float, float]:
    """`attnid diff`'s fit of the written output against B: ``(worst residual, rounding level)``,
    refused unless every residual is at rounding. A stream permutation is undone first
    (`attnid diff` fits a rotation only where a rotation is a symmetry: not behind a tied head's
    non-uniform gain, where a permutation still is), and the ``layers``' head and neuron
    permutations (`Unpermuted`). ``rotated=False`` (the alignment moved no stream by a
    rotation): compared without fitting one, and with one fitted only if that fails (the
    fit reads the tables of both: 1.6 s of a 7B-shaped certificate's 7)."""
    from attnid.whole.fit import fit

    uo = open_units(open_checkpoint(out, purpose="align"), untie=ub.untied is not None)
    src: Any = uo if stream_permutation is None and not layers else Unpermuted(uo, stream_permutation, layers)
    f = fit(ub, src, rotate=rotated)
    if not rotated and max((x.residual for r in f.units for x in r.residuals), default=0.0) > f.tolerance:
        f = fit(ub, src)
    residuals = [x for r in f.units for x in r.residuals]
    first = next((x for x in residuals if x.residual > f.tolerance), None)
    if first is not None:
        raise AttnidError(f"refused: the aligned checkpoint is not certified against B ("
                          f"{ub.label(first.tensor)}: residual {first.residual:.2e}); nothing was written")
    return max((x.residual for x in residuals), default=0.0), f.tolerance


def aligned_files(ua: Units, ub: Units, dst: Path, subgroup: str, acts: Any = None,
                  progress: Callable[[str], None] | None = None, rounds: int = ROUNDS
                  ) -> tuple[Alignment, Path, float, float]:
    """B aligned onto A, streamed (at most ``rounds`` refinements of the stream), written into a
    temporary sibling of ``dst`` and certified against B: ``(alignment, the written folder,
    worst residual, rounding level)``; the caller removes the folder."""
    al, tmp = align_sources(ua, ub, Written(ub, dst), subgroup=subgroup, acts=acts,  # type: ignore[arg-type]
                            dtype=compute_dtype(ub.dtype()), progress=progress, rounds=rounds)
    try:
        copy_other_files(ub.ck.root, tmp, {f.path.name for f in ub.ck.files})
        if ub.untied:
            untie_files(ub.ck, ub, tmp)
        worst, tol = certify(ub, tmp, al.stream_permutation, al.element.layers,
                             stream_rotated(al.element.rotation, compute_dtype(ub.dtype())))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return al, tmp, worst, tol


def check_subgroup(subgroup: str) -> None:
    if subgroup not in SUBGROUPS:
        raise AttnidError(f"--subgroup {subgroup}: one of {', '.join(SUBGROUPS)}")


def check_refine(refine: int | None, calibration: str | Path | None, subgroup: str,
                 option: str = "--calibration") -> None:
    """``--refine N`` needs N >= 1, calibration text and a subgroup with a continuous part."""
    if refine is None:
        return
    if refine < 1:
        raise AttnidError(f"--refine {refine}: at least one step")
    if calibration is None:
        raise AttnidError(f"--refine needs {option} FILE (the text the loss is lowered on)")
    if subgroup in ("none", "permutations"):
        raise AttnidError(f"--refine: subgroup {subgroup} has no continuous part to refine")


def refined_files(ua: Units, ub: Units, al: Alignment, written: Path, dst: Path,
                  calibration: torch.Tensor, steps: int, progress: Progress
                  ) -> tuple[Path, float | None, float | None, dict[str, Any]]:
    """The aligned B in ``written`` refined for the barrier (`attnid.whole.align.refine_units`): the
    refined B written into a fresh temporary sibling of ``dst`` and certified against B, and
    ``written`` removed; ``(folder, worst residual, rounding level, the refinement's JSON)``.
    When the refinement does not lower the calibration loss, ``written`` is kept as it is
    (residual and level None: the caller's certificate stands)."""
    from attnid.whole.align.refine_units import refine_units
    from attnid.whole.layerwise import LayerwiseLM
    from attnid.whole.transforms.element import apply_element

    uw = open_units(open_checkpoint(written, purpose="align"), untie=ub.untied is not None)
    r = refine_units(ua, uw, LayerwiseLM(ua), calibration, steps, subgroup=al.subgroup,  # a unit at a time
                     permuted_stream=al.stream_permutation is not None, progress=progress)
    if not r.kept:
        return written, None, None, r.to_dict()
    tmp = dst.parent / f".{dst.name}.{secrets.token_hex(4)}.tmp"
    tmp.mkdir(parents=True)
    try:
        # the refined element, applied a unit at a time (in the compute dtype: float32 for
        # bfloat16 checkpoints, float64 otherwise)
        cd = compute_dtype(uw.dtype())
        write_units(uw, lambda u: apply_element(uw.load(u, cd), r.element), tmp)
        copy_other_files(written, tmp, {f.path.name for f in uw.ck.files})
        worst, tol = certify(ub, tmp, al.stream_permutation, al.element.layers)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(written, ignore_errors=True)
    return tmp, worst, tol, r.to_dict()


def align_checkpoints(model_a: str | Path, model_b: str | Path, out_dir: str | Path, *,
                      subgroup: str = "full",
                      calibration: str | Path | None = None, refine: int | None = None,
                      force: bool = False, rounds: int = ROUNDS,
                      end_to_end_max_bytes: int = 2 * 1024**3, progress: Progress | None = None
                      ) -> dict[str, Any]:
    """Write B aligned onto A into ``out_dir``, certified; returns its JSON (see the module).
    ``refine``: that many steps of `attnid.whole.align.refine_units` on the ``calibration`` text
    after the matching (causal language models; the output certified against B again).
    ``rounds``: at most this many refinements of the stream, each one more pass over both
    checkpoints."""
    start = time.perf_counter()
    check_subgroup(subgroup)
    check_rounds(rounds)
    check_refine(refine, calibration, subgroup)
    a, b, ua, ub = open_pair(model_a, model_b, purpose="align")
    if refine is not None:
        check_causal(a)  # the refinement lowers a next-token loss
    apart(Path(out_dir).resolve(), a, "A")
    _, dst = check_out_dir(b.root, out_dir, force)
    calib, fitted = calibration_ids(a, calibration, refine)
    shown = progress if progress is not None else Progress(enabled=False)
    acts = None
    if calib is not None:  # both models run on the tokens, a layer at a time
        acts = activations(ua, ub, subgroup, calib, shown.line)
    al, written, worst, tol = aligned_files(ua, ub, dst, subgroup, acts, shown.line, rounds)
    acts = None  # the activations' memory given back before the refinement's is taken
    refined: dict[str, Any] | None = None
    try:
        if refine is not None:
            assert fitted is not None  # check_refine
            written, w, t, refined = refined_files(ua, ub, al, written, dst, fitted, refine, shown)
            worst, tol = (worst, tol) if w is None or t is None else (w, t)
        shown.line(f"certified against B: worst residual {worst:.2e} (rounding level {tol:.1e})")
        with staged(dst) as tmp:
            for item in written.iterdir():
                os.replace(item, tmp / item.name)
            e2e = verify_end_to_end(b, tmp, end_to_end_max_bytes, what="aligned")
    finally:
        shutil.rmtree(written, ignore_errors=True)
    return {"model_a": str(a.path), "model_b": str(b.path), "out_dir": str(dst),
            "architecture": a.adapter.family, "dtype": str(b.dtype()).split(".")[-1],
            "matching": "weights" if calib is None else "activations", **al.to_dict(),
            "certified": True, "max_residual": worst, "tolerance": tol, "untied": ub.untied,
            "end_to_end_rel_diff": e2e, "refined": refined, "seconds": time.perf_counter() - start}


def check_alpha(alpha: float) -> None:
    if not (math.isfinite(alpha) and 0.0 <= alpha <= 1.0):
        raise AttnidError(f"--alpha {alpha}: the weight of B must lie in [0, 1]")


def interpolate(A: ModelTensors, B: ModelTensors, alpha: float) -> ModelTensors:
    """``(1 - alpha) A + alpha B`` on every floating tensor (A's other tensors kept); exact at
    both ends (``alpha = 0`` gives A's values, ``1`` B's)."""
    out = {}
    for n, t in A.tensors.items():
        if n not in B.tensors or not t.is_floating_point() or alpha == 0.0:
            out[n] = t
        elif alpha == 1.0:
            out[n] = B.tensors[n]
        else:
            out[n] = (1.0 - alpha) * t + alpha * B.tensors[n]
    return ModelTensors(A.layout, out, A.config)


def merge_checkpoints(model_a: str | Path, model_b: str | Path, out_dir: str | Path, *, alpha: float = 0.5,
                      aligned: bool = False, subgroup: str = "full", calibration: str | Path | None = None,
                      refine: int | None = None, force: bool = False, rounds: int = ROUNDS,
                      progress: Progress | None = None) -> dict[str, Any]:
    """Write ``(1 - alpha) A + alpha B`` (B aligned onto A first when ``aligned``: matched on
    activations over ``calibration`` when given, refined for ``refine`` steps on it; at most
    ``rounds`` refinements of the stream) into ``out_dir`` in A's files and dtype; returns its
    JSON."""
    start = time.perf_counter()
    check_alpha(alpha)
    check_subgroup(subgroup)
    check_rounds(rounds)
    if (calibration is not None or refine is not None) and not aligned:
        raise AttnidError("--calibration and --refine act on the alignment: add --align")
    check_refine(refine, calibration, subgroup)
    a, b, ua, ub = open_pair(model_a, model_b, purpose="merge")
    if refine is not None:
        check_causal(a)  # the refinement lowers a next-token loss
    apart(Path(out_dir).resolve(), b, "B")
    _, dst = check_out_dir(a.root, out_dir, force)
    calib, fitted = calibration_ids(a, calibration, refine)
    shown = progress if progress is not None else Progress(enabled=False)
    aligned_keys: dict[str, Any] = {}
    written = None
    try:
        if aligned:
            acts = None if calib is None else activations(ua, ub, subgroup, calib, shown.line)
            al, written, worst, _ = aligned_files(ua, ub, dst, subgroup, acts, progress=shown.line,
                                                  rounds=rounds)
            acts = None  # given back before the refinement's memory is taken
            refined = None
            if refine is not None:
                assert fitted is not None  # check_refine
                written, w, _, refined = refined_files(ua, ub, al, written, dst, fitted, refine, shown)
                worst = worst if w is None else w
            ub = open_units(open_checkpoint(written, purpose="merge"), untie=ub.untied is not None)
            aligned_keys = {"max_residual": worst, "subgroup": subgroup,
                            "group": subgroup,  # deprecated alias key (one release)
                            "stream": al.stream, "raw_distance": al.raw_distance,
                            "aligned_distance": al.aligned_distance,
                            "matching": "weights" if calib is None else "activations", "refined": refined}
        cd = compute_dtype(ua.dtype())

        def mixed(u: int) -> ModelTensors:
            read_ahead((ub,), u + 1, u + 2)  # B's next units read while this one mixes (A's: write_units)
            return interpolate(ua.load(u, cd), ub.load(u, cd), alpha)

        with staged(dst, a.root, {f.path.name for f in a.files}) as tmp:
            write_units(ua, mixed, tmp)
            if ua.untied:
                untie_files(a, ua, tmp)
            open_checkpoint(tmp, purpose="merge")  # reads back: header, tensors and shapes as A's
    finally:
        if written is not None:
            shutil.rmtree(written, ignore_errors=True)
    return {"model_a": str(a.path), "model_b": str(b.path), "out_dir": str(dst),
            "architecture": a.adapter.family, "alpha": alpha, "aligned": aligned, **aligned_keys,
            "untied": ua.untied, "seconds": time.perf_counter() - start}
