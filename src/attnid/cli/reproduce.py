"""``attnid reproduce``: every claim in one report."""

from __future__ import annotations

from typing import Annotated

import typer

from attnid.cli.app import app


@app.command("reproduce")
def reproduce_cmd(
    out: Annotated[str, typer.Option("--out", help="Output directory.")] = "attnid-report",
    quick: Annotated[bool, typer.Option("--quick", help="A smaller run (about 3 minutes).")] = False,
) -> None:
    """Reproduce every claim of the paper: tables, figures, report.md and report.html."""
    from rich.console import Console

    from attnid.report.reproduce import reproduce

    console = Console(stderr=True)
    with console.status("starting") as status:
        summary = reproduce(out, quick=quick, progress=lambda msg: status.update(msg))
    for c in summary["claims"]:
        typer.echo(f"{'HOLDS' if c['holds'] else 'FAILS'}  [{c['section']}] {c['claim']}")
    typer.echo(f"{summary['holds']}/{summary['total']} claims hold; report in {out}/report.md "
               f"and {out}/report.html ({summary['seconds']:.0f} s)")
