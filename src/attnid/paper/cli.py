"""The paper's commands, ``attnid reproduce`` and ``attnid experiment``, registered on the
library's CLI through the ``attnid.commands`` entry point (the library never imports this)."""

from __future__ import annotations

from typing import Annotated, Literal

import typer

from attnid.cli.app import app


@app.command("reproduce")
def reproduce_cmd(
    out: Annotated[str, typer.Option("--out", help="Output directory.")] = "attnid-report",
    quick: Annotated[bool, typer.Option(
        "--quick", help="A smaller run: shorter training, fewer arbiter checks.")] = False,
) -> None:
    """Reproduce every claim of the paper: tables, figures, report.md and report.html.

    Progress goes to stderr: a live status on a terminal, timestamped lines otherwise.
    """
    from attnid.errors import require_extras

    require_extras("hf", "report", what="attnid reproduce")  # before any work: nothing written
    from attnid.paper.reproduce import reproduce
    from attnid.progress import Progress

    with Progress() as progress:
        summary = reproduce(out, quick=quick, progress=progress)
    for c in sorted(summary["claims"], key=lambda c: c["holds"]):
        typer.echo(f"{'HOLDS' if c['holds'] else 'FAILS'}  [{c['section']}] {c['claim']}")
    typer.echo(f"{summary['holds']}/{summary['total']} claims hold; report in {out}/report.md "
               f"and {out}/report.html ({summary['seconds']:.0f} s)")


experiment_app = typer.Typer(help="Training experiments.", no_args_is_help=True)
app.add_typer(experiment_app, name="experiment")


@experiment_app.command("paper")
def experiment_paper(
    out: Annotated[str, typer.Option("--out", help="Output directory.")] = "attnid-experiment",
    scale: Annotated[Literal["quick", "cpu", "paper"], typer.Option(
        "--scale", help="Run length and model size.")] = "cpu",
    device: Annotated[str, typer.Option("--device")] = "cpu",
    seed: Annotated[int, typer.Option("--seed")] = 0,
    beyond: Annotated[bool, typer.Option("--beyond/--paper-only",
                                         help="Also RoPE, GQA and projection cases.")] = True,
) -> None:
    """The paper's four cases and SGD sweep (plus RoPE, GQA, projection): figures and tables."""
    from pathlib import Path

    from attnid.errors import require_extras

    require_extras("report", what="attnid experiment paper")
    from attnid.paper.document import write_table
    from attnid.paper.experiment import run_experiment
    from attnid.paper.training import training_section
    from attnid.progress import Progress

    with Progress() as progress:
        data = run_experiment(Path(out), scale=scale, beyond=beyond, seed=seed, device=device,
                              progress=progress)
        progress.stage("drawing figures")
        section = training_section(data, Path(out) / "figures")
    (Path(out) / "tables").mkdir(parents=True, exist_ok=True)
    for t in section.tables:
        write_table(t.rows, Path(out) / "tables" / t.stem)
    for c in sorted(section.claims, key=lambda c: c.holds):
        typer.echo(f"{'HOLDS' if c.holds else 'FAILS'}  {c.claim}  [{c.evidence}]")
    typer.echo(f"figures and tables in {out}")
