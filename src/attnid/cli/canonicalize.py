"""``attnid canonicalize``: function-preserving surgery on a checkpoint."""

from __future__ import annotations

from typing import Annotated

import typer

from attnid.cli.app import Json, app, emit_json, sized_progress


@app.command("canonicalize")
def canonicalize_cmd(
    in_dir: Annotated[str, typer.Argument(
        help="Model directory (config.json + safetensors), or org/name from the local Hugging Face cache.")],
    out_dir: Annotated[str, typer.Argument(help="Where the canonical checkpoint goes.")],
    drop_key_bias: Annotated[bool | None, typer.Option(
        "--drop-key-bias/--keep-key-bias", help="Zero the unidentified key bias.")] = None,
    fold_value_bias: Annotated[bool | None, typer.Option(
        "--fold-value-bias/--keep-value-bias", help="Fold b_V into b_O.")] = None,
    balance: Annotated[bool | None, typer.Option(
        "--balance/--no-balance", help="Balance QK and VO per head/kv group.")] = None,
    fold_norms: Annotated[bool, typer.Option(
        "--fold-norms", help="Fold every absorbable norm gain into its readers (gain 1).")] = False,
    force: Annotated[bool, typer.Option("--force", help="Replace a non-empty OUT_DIR.")] = False,
    json_out: Json = False,
) -> None:
    """Function-preserving surgery on a checkpoint, verified before anything is written.

    Default: every operation that applies to the architecture.
    """
    from attnid.allocator import streamed

    streamed()  # before torch is imported (`attnid.allocator`)
    from attnid.checkpoint.canonicalize import canonicalize
    from attnid.errors import require_extras

    require_extras("hf", what="attnid canonicalize")
    result = canonicalize(in_dir, out_dir, drop_key_bias=drop_key_bias,
                          fold_value_bias=fold_value_bias, balance=balance, fold_norms=fold_norms,
                          force=force, progress=sized_progress(in_dir, above=2**28))
    if json_out:
        emit_json(result)
    else:
        e2e = result["end_to_end_rel_diff"]
        typer.echo(
            f"{result['architecture']}: {result['layers']} layers -> {out_dir}\n"
            f"  key bias dropped in {result['key_bias_dropped']} layers, value bias folded in "
            f"{result['value_bias_folded']}, {result['heads_balanced']} heads balanced"
            + (f", {result['norms_folded']} norm gains folded" if fold_norms else "") + "\n"
            f"  certified by attnid diff: every residual <= {result['max_residual']:.2e} "
            f"(rounding level {result['tolerance']:.1e})\n  end to end: "
            + ("skipped (large checkpoint)" if e2e is None else f"{e2e:.2e}")
            + f"; {result['seconds']:.1f}s")
