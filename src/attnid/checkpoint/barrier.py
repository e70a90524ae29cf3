"""`attnid barrier`: the loss along the straight path ``(1 - alpha) A + alpha B`` between two
checkpoints of one causal language model, before and after B is aligned onto A
(docs/theory.md §13.20). The mid-point barrier is the loss at ``alpha = 0.5`` less the mean
of the two end losses. The text is tokenized with A's own tokenizer (read offline) and cut
into chunks of the model's context; the loss is the mean next-token cross-entropy (nats).
Each path is streamed: every point's forward runs one decoder layer at a time, the layer's
weights at that point made as both checkpoints' tensors are read (`attnid.whole.layerwise`).
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

from attnid.checkpoint.evaluate import TokenLoss, batch_nll, check_causal
from attnid.checkpoint.tokens import Batches, read_chunks
from attnid.checkpoint.units import Units
from attnid.errors import AttnidError
from attnid.progress import Progress
from attnid.whole.align.aligner import check_rounds
from attnid.whole.align.stream import ROUNDS
from attnid.whole.layerwise import LayerwiseLM, Segment, Source

END_LOSS_RTOL = 1e-4  # aligned B against B, both evaluated in float32


def path_losses(lm: LayerwiseLM, a: Source, b: Source, data: Batches, alphas: list[float],
                progress: Progress | None = None, label: str = "") -> list[float]:
    """The loss at each ``alpha`` of the straight path from ``a`` to ``b`` (`batch_nll` summed),
    streamed a layer at a time (`attnid.whole.layerwise`)."""
    shown = (lambda line: progress.line(f"{label}: {line}")) if progress is not None else None
    parts = lm.run(Segment(a, b), alphas, data.ids, data.batch, batch_nll, shown)
    out = [TokenLoss(sum(x.total for x in row), sum(x.count for x in row)).mean for row in parts]
    if progress is not None:
        for k, (t, y) in enumerate(zip(alphas, out, strict=True)):
            progress.line(f"{label} alpha {t:.3f} ({k + 1}/{len(alphas)}): loss {y:.4f}")
    return out


def mid_barrier(alphas: list[float], losses: list[float]) -> float:
    """Loss at ``alpha = 0.5`` (interpolated linearly when not sampled) less the mean end loss."""
    mid = losses[len(losses) // 2]
    for k in range(len(alphas) - 1):
        (x0, y0), (x1, y1) = (alphas[k], losses[k]), (alphas[k + 1], losses[k + 1])
        if x0 <= 0.5 <= x1:
            mid = y0 if x1 == x0 else y0 + (y1 - y0) * (0.5 - x0) / (x1 - x0)
            break
    return mid - 0.5 * (losses[0] + losses[-1])


def check_alphas(n: int) -> list[float]:
    if n < 3:
        raise AttnidError(f"--alphas {n}: at least 3 points (both ends and the middle)")
    return [k / (n - 1) for k in range(n)]


def barrier(model_a: str | Path, model_b: str | Path, data: str | Path, *, aligned: bool = False,
            subgroup: str = "full", alphas: int = 11, context: int | None = None, max_tokens: int = 65536,
            refine: int | None = None, refine_calibration: str | Path | None = None,
            rounds: int = ROUNDS, progress: Progress | None = None) -> dict[str, Any]:
    """The losses along the path (naive; and aligned with ``aligned``, at most ``rounds``
    refinements of the stream; and refined for ``refine`` steps on the ``refine_calibration``
    text) and their barriers."""
    from attnid.checkpoint.align import (
        REFINE_TOKENS,
        aligned_files,
        check_refine,
        check_subgroup,
        open_pair,
        refined_files,
    )

    start = time.perf_counter()
    ts = check_alphas(alphas)
    check_subgroup(subgroup)
    check_rounds(rounds)
    if refine is not None and not aligned:
        raise AttnidError("--refine acts on the alignment: add --align")
    check_refine(refine, refine_calibration, subgroup, "--refine-calibration")
    a, b, ua, ub = open_pair(model_a, model_b, purpose="barrier")
    check_causal(a)
    chunks = read_chunks(a, data, context=context, max_tokens=max_tokens, option="--calibration")
    calib = None if refine_calibration is None else read_chunks(
        a, refine_calibration, context=context, max_tokens=REFINE_TOKENS,
        option="--refine-calibration").ids
    shown = progress if progress is not None else Progress(enabled=False)
    written, al, refined = None, None, None
    try:
        if aligned:  # first: the alignment's memory is given back before the evaluator's is taken
            dst = b.root.parent / f"{b.root.name}-aligned"
            al, written, _, _ = aligned_files(ua, ub, dst, subgroup, progress=shown.line,
                                              rounds=rounds)  # streamed, certified: still B's function
        lm = LayerwiseLM(ua)  # one layer's weights at a time, A's class and config, float32
        curves = {"naive": path_losses(lm, ua, ub, chunks, ts, shown, "naive")}
        if written is not None:
            curves["aligned"] = path_losses(lm, ua, _units(written, ub), chunks, ts, shown, "aligned")
            if refine is not None:
                assert calib is not None and al is not None  # check_refine
                del lm  # its tables and head (float32) are not held through the refinement's own
                written, _, _, refined = refined_files(ua, ub, al, written, dst, calib, refine, shown)
                lm = LayerwiseLM(ua)
                curves["refined"] = path_losses(lm, ua, _units(written, ub), chunks, ts, shown, "refined")
    finally:
        if written is not None:
            shutil.rmtree(written, ignore_errors=True)
    distances = {"naive": None}
    if al is not None:
        for name in ("aligned", "refined"):
            if name not in curves:
                continue
            end, want = curves[name][-1], curves["naive"][-1]
            if abs(end - want) > END_LOSS_RTOL * abs(want):  # the aligned B is B: the same loss
                raise AttnidError(f"refused: {name} B's loss {end:.6f} is not B's {want:.6f}")
        distances = {"raw": al.raw_distance, "aligned": al.aligned_distance}
    return {"model_a": str(a.path), "model_b": str(b.path), "data": str(data), "tokens": chunks.tokens,
            "context": int(chunks.ids.shape[1]), "alphas": ts, "subgroup": subgroup if aligned else None,
            "group": subgroup if aligned else None,  # deprecated alias key (one release)
            "losses": curves, "barriers": {k: mid_barrier(ts, v) for k, v in curves.items()},
            "distances": distances if aligned else None, "refined": refined,
            "seconds": time.perf_counter() - start}


def _units(folder: Path, ub: Units) -> Units:
    """A written B (aligned, refined) read as B is (untied when B is)."""
    from attnid.checkpoint.load import open_checkpoint
    from attnid.checkpoint.units import open_units

    return open_units(open_checkpoint(folder, purpose="barrier"), untie=ub.untied is not None)


def plot_path(alphas: list[float], curves: dict[str, list[float]], path: str | Path,
              title: str = "") -> None:
    """The loss along the path, one line per curve, the mid-point barrier in the legend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, ys in curves.items():
        ax.plot(alphas, ys, marker="o", ms=3, label=f"{name} (barrier {mid_barrier(alphas, ys):.3f})")
    ax.set_xlabel("alpha (0: A, 1: B)")
    ax.set_ylabel("loss (nats per token)")
    ax.set_title(title or "loss along the straight path", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
