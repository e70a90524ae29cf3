"""``attnid reproduce``: every claim in one report."""

from __future__ import annotations

from typing import Annotated

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
    from attnid.progress import Progress
    from attnid.report.reproduce import reproduce

    with Progress() as progress:
        summary = reproduce(out, quick=quick, progress=progress)
    for c in sorted(summary["claims"], key=lambda c: c["holds"]):
        typer.echo(f"{'HOLDS' if c['holds'] else 'FAILS'}  [{c['section']}] {c['claim']}")
    typer.echo(f"{summary['holds']}/{summary['total']} claims hold; report in {out}/report.md "
               f"and {out}/report.html ({summary['seconds']:.0f} s)")
