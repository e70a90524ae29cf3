"""``attnid diff``: compare two checkpoints modulo the whole-model symmetry group."""

from __future__ import annotations

from typing import Annotated

import typer

from attnid.cli.app import Json, app, console, emit_json, narrow_table, read_ahead, sized_progress


@app.command("diff")
def diff_cmd(
    model_a: Annotated[str, typer.Argument(
        help="Reference checkpoint (directory, config.json, .safetensors, sharded too, or a "
             "Hugging Face id such as org/name, read from the local cache).")],
    model_b: Annotated[str, typer.Argument(help="Checkpoint to compare with it (same architecture).")],
    probes: Annotated[int | None, typer.Option(
        "--probes", help="Compare through K random stream directions (default: the whole stream "
                         "up to width 512, else enough for the head fits).")] = None,
    json_out: Json = False,
) -> None:
    """Is B the function of A up to the whole model's symmetries (norm gains, residual rotation,
    permutations, attention gauges, MLP scaling, ...)? Exit 0: certified to the dtype's
    rounding; exit 1: not, and the layer, checkpoint tensor and size of the first break are
    named; exit 2: bad input."""
    from attnid.allocator import keep_freed_memory, streamed

    streamed()  # before torch is imported (`attnid.allocator`)
    read_ahead(model_a, model_b)  # the first units read while torch is imported
    from attnid.checkpoint.diff import diff
    from attnid.checkpoint.load import open_checkpoint
    from attnid.errors import require_extras

    require_extras("hf", what="attnid diff")
    keep_freed_memory()  # a streamed pass: freed blocks reused, not mapped afresh per unit
    a, b = open_checkpoint(model_a), open_checkpoint(model_b)
    r = diff(a, b, probes=probes, progress=sized_progress(model_a, model_b, above=2**28))
    if json_out:
        emit_json(r)
    else:
        _print(r)
    raise typer.Exit(0 if r["certified"] else 1)


def _print(r: dict) -> None:
    table = narrow_table(f"{r['model_a']} vs {r['model_b']}  ({r['architecture']}, {r['dtype']})",
                         ["layer", "raw distance", "aligned distance", "gauge share", "rotation share",
                          "permutation share", "worst", "residual"])
    for x in r["layers"]:
        head = "" if x["worst_head"] is None else f", head {x['worst_head']}"
        table.add_row(str(x["layer"]), f"{x['raw_distance']:.3g}", f"{x['aligned_distance']:.3g}",
                      f"{x['gauge_share']:.4f}", f"{x['rotation_share']:.4f}",
                      f"{x['permutation_share']:.4f}", f"{x['worst_invariant']}{head}",
                      f"{x['residual']:.2e}")
    out = console()
    out.print(table)
    o = r["other"]
    if o["worst_tensor"] is not None:
        out.print(f"embeddings and head: largest residual {o['residual']:.2e} ({o['worst_tensor']})")
    out.print("covers:\n" + "\n".join(f"  {c}" for c in r["covers"]))
    b = r["break"]
    if b is None:
        out.print(f"CERTIFIED: B computes A's function up to {r['dtype']} rounding "
                  f"(every residual <= {r['tolerance']:.1e})")
    else:
        where = "outside the layers" if b["layer"] is None else f"layer {b['layer']}"
        if b["head"] is not None:
            where += f", head {b['head']}"
        out.print(f"NOT CERTIFIED: {where}, {b['tensor']} ({b['invariant']}): residual "
                  f"{b['residual']:.2e} (rounding level {r['tolerance']:.1e})"
                  + (f"\n  {b['reason']}" if b["reason"] else ""))
