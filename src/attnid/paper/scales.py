"""How big `attnid reproduce` runs: the sizes of every section at each ``--scale``, in one place.

    quick    ~1 min of CPU: the whole pipeline, smaller tables, 3 whole-model checks
    default  the run a newcomer waits for (at most 8 min on a quiet 2-core machine)
    full     the run `reproduce` made by default until this release (every check, the longer
             training)
    paper    the paper's model and steps (6 layers, 6 heads, d 384, context 256, batch 64,
             5,000 steps) for a GPU; the other sections at ``full`` size

A section reads its sizes with :func:`sizes_of` (a plain `attnid.paper.document.Context`
counts as ``quick`` when ``ctx.quick``, else ``full``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal, get_args

from attnid.paper.document import Context
from attnid.paper.runs import precision_for
from attnid.progress import Progress

Scale = Literal["quick", "default", "full", "paper"]
SCALE_NAMES: tuple[str, ...] = get_args(Scale)


@dataclass(frozen=True)
class Sizes:
    """What one scale runs (the training scale names a row of `attnid.paper.experiment.SCALES`)."""

    training: str  # the experiment's scale
    table1_widths: tuple[int, ...]  # d_model of Table 1's cells (every H <= 8 dividing it)
    table3_confirm: bool  # each Table 3 count confirmed by the arbiter at a second seed
    table4_whole_numeric: bool  # Table 4's whole-model cells of the families without a closed form
    table5_arbiter_widths: tuple[int, ...]  # Table 5's widths also counted by the arbiter
    whole_checked: tuple[str, ...] | None  # bundled families the whole-model arbiter checks; None: all
    whole_confirm: bool  # each whole-model check confirmed at a second seed
    pretrained_quick: bool  # Context.quick, which the pretrained section reads


WHOLE_SAMPLE = ("gpt2", "Llama-2-7b", "Qwen3-8B")  # LayerNorm + positions; RMSNorm; QK-norm
# one bundled model per architecture (the cheapest reduced config of each): the 70B configs and
# the second size of a family add minutes and no structure
WHOLE_PER_ARCHITECTURE = ("Llama-2-7b", "Mistral-7B-v0.1", "Phi-3-mini-4k-instruct", "Qwen2.5-0.5B",
                          "Qwen3-8B", "bert-base-uncased", "falcon-7b", "gemma-7b", "gpt2", "pythia-1.4b",
                          "roberta-base")

SIZES: dict[str, Sizes] = {
    "quick": Sizes("quick", table1_widths=(8, 12, 16), table3_confirm=False, table4_whole_numeric=False,
                   table5_arbiter_widths=(4, 6), whole_checked=WHOLE_SAMPLE, whole_confirm=False,
                   pretrained_quick=True),
    "default": Sizes("default", table1_widths=(8, 12, 16), table3_confirm=False, table4_whole_numeric=False,
                     table5_arbiter_widths=(4, 6), whole_checked=WHOLE_PER_ARCHITECTURE, whole_confirm=False,
                     pretrained_quick=False),
    "full": Sizes("full", table1_widths=(8, 12, 16, 24), table3_confirm=True, table4_whole_numeric=True,
                  table5_arbiter_widths=(4, 6, 8), whole_checked=None, whole_confirm=True,
                  pretrained_quick=False),
}
SIZES["paper"] = replace(SIZES["full"], training="paper")  # the other sections as at full


@dataclass(frozen=True)
class RunContext(Context):
    """A :class:`Context` that knows its scale, device and where its training runs come from."""

    scale: str = "default"
    device: str = "cpu"
    jobs: int = 1  # training runs at a time, each its own process when > 1
    from_runs: Path | None = None  # an experiment folder whose runs the training section reads


def sizes_of(ctx: Context) -> Sizes:
    """The sizes ``ctx`` asks for: its ``scale``, or (a plain `Context`, whose scale may be
    None) ``quick`` when ``ctx.quick``, else ``full``."""
    return SIZES[ctx.scale or ("quick" if ctx.quick else "full")]


PAPER_JOBS = 7  # the paper's four cases and three more sweep runs: all at once on one GPU


def experiment_options(ctx: Context) -> dict[str, Any]:
    """How the context's scale trains (`attnid.paper.experiment.run_experiment`'s options): at
    ``paper`` scale the paper's four cases and sweep only (no RoPE, GQA or projection runs),
    with TF32 matmuls on CUDA (`attnid.paper.runs.precision`)."""
    scale, device = sizes_of(ctx).training, getattr(ctx, "device", "cpu")
    return {"scale": scale, "device": device, "beyond": scale != "paper", "jobs": getattr(ctx, "jobs", 1),
            "precision": precision_for(scale, device)}


def train_runs(out: str | Path, scale: str = "paper", *, device: str = "cpu", jobs: int = 1,
               cuda_graph: bool = True, progress: Progress | None = None) -> Path:
    """The training of `attnid reproduce` alone, into ``out/experiment`` (torch and numpy
    only); the report is built later, anywhere, with ``reproduce OUT --from-runs
    OUT/experiment``. Returns the experiment folder. ``cuda_graph=False``: on CUDA, the
    forward and backward passes run op by op instead of as a replayed graph."""
    from attnid.paper.experiment import run_experiment

    ctx = RunContext(Path(out), SIZES[scale].pretrained_quick, progress or Progress(enabled=False),
                     scale=scale, device=device, jobs=jobs)
    run_experiment(ctx.out / "experiment", **experiment_options(ctx), cuda_graph=cuda_graph,
                   progress=ctx.progress)
    return ctx.out / "experiment"
