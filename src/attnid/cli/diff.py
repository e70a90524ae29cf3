"""``attnid diff``: compare two checkpoints modulo the attention symmetry group."""

from __future__ import annotations

from typing import Annotated

import typer

from attnid.cli.app import Json, app, console, emit_json


@app.command("diff")
def diff_cmd(
    model_a: Annotated[str, typer.Argument(
        help="Reference checkpoint (directory, config.json, .safetensors, or a Hugging Face "
             "id such as org/name, read from the local cache).")],
    model_b: Annotated[str, typer.Argument(help="Checkpoint to compare with it (same architecture).")],
    json_out: Json = False,
) -> None:
    """Is B the function of A up to the attention symmetries? Exit 0: certified to the dtype's
    rounding; exit 1: not, and the layer, tensor and size of the break are named."""
    from attnid.checkpoint.diff import diff
    from attnid.errors import require_extras

    require_extras("hf", what="attnid diff")
    r = diff(model_a, model_b)
    if json_out:
        emit_json(r)
    else:
        _print(r)
    raise typer.Exit(0 if r["certified"] else 1)


def _print(r: dict) -> None:
    from rich.table import Table

    table = Table(title=f"{r['model_b']} vs {r['model_a']}  ({r['architecture']}, {r['dtype']})")
    for col in ("layer", "raw distance", "aligned distance", "gauge share", "worst invariant", "residual"):
        table.add_column(col, justify="right")
    for x in r["layers"]:
        table.add_row(str(x["layer"]), f"{x['raw_distance']:.3g}", f"{x['aligned_distance']:.3g}",
                      f"{x['gauge_share']:.4f}", f"{x['worst_tensor']} (head {x['worst_head']})",
                      f"{x['residual']:.2e}")
    out = console()
    out.print(table)
    o = r["other"]
    if o["worst_tensor"] is not None and o["residual"] == 0.0:
        out.print("outside attention: every tensor identical")
    elif o["worst_tensor"] is not None:
        out.print(f"outside attention: largest difference {o['residual']:.2e} in {o['worst_tensor']}")
    out.print("covers: " + "; ".join(r["covers"]))
    b = r["break"]
    if b is None:
        out.print(f"CERTIFIED: B computes A's function up to {r['dtype']} rounding "
                  f"(every residual <= {r['tolerance']:.1e})")
    else:
        where = "outside attention" if b["layer"] is None else f"layer {b['layer']}, head {b['head']}"
        out.print(f"NOT CERTIFIED: {where}, {b['tensor']}: residual {b['residual']:.2e} "
                  f"(rounding level {r['tolerance']:.1e})")
