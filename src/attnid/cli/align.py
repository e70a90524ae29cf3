"""``attnid align``, ``attnid merge``, ``attnid barrier``: B brought onto A modulo the
whole-model symmetry group, weights interpolated, and the loss along the path."""

from __future__ import annotations

from typing import Annotated

import typer

from attnid.cli.app import Json, app, console, emit_json, narrow_table, read_ahead, sized_progress

ModelA = Annotated[str, typer.Argument(help="Reference checkpoint A (directory, config.json, .safetensors).")]
ModelB = Annotated[str, typer.Argument(help="Checkpoint B of the same architecture.")]
SubgroupOpt = Annotated[str, typer.Option(
    "--subgroup", help="Which subgroup of the symmetry group to align with: none, permutations, "
                       "orthogonal (and per-kv-group orthogonal Q/K, V/O maps), rotation (the stream "
                       "rotated), full.")]
Force = Annotated[bool, typer.Option("--force", help="Replace a non-empty OUT_DIR.")]
ROUNDS = 8  # attnid.whole.align.stream.ROUNDS, not imported here: it imports torch (a test holds them equal)
RoundsOpt = Annotated[int, typer.Option(
    "--rounds", help="At most N rounds refining the stream's rotation or permutation once every other "
                     "part is fitted (each round one more pass over both models; 0: none). Fewer "
                     "rounds are faster on large models that differ for real.")]
RefineOpt = Annotated[int | None, typer.Option(
    "--refine", help="After matching, N steps lowering the mid-point loss on the calibration text with "
                     "the continuous part of the group (permutations kept; the output still B's "
                     "function, certified).")]


@app.command("align")
def align_cmd(
    model_a: ModelA,
    model_b: ModelB,
    out_dir: Annotated[str, typer.Argument(
        help="Where B aligned onto A goes (B's function, A's coordinates).")],
    subgroup: SubgroupOpt = "full",
    calibration: Annotated[str | None, typer.Option(
        "--calibration", help="Match heads, neurons and the stream on activations over this text file "
                              "(tokenized with A's tokenizer) instead of on the weights; with "
                              "--refine, also the text the refinement lowers the loss on.")] = None,
    refine: RefineOpt = None,
    rounds: RoundsOpt = ROUNDS,
    force: Force = False,
    json_out: Json = False,
) -> None:
    """Write B moved by the symmetry-group element that brings its weights closest to A's
    (with --refine, then moved within the group to lower the loss between A and B): the same
    function as B (certified by `attnid diff` against B, and end to end), in A's
    coordinates. Reports the raw and aligned distances and the share of each part."""
    from attnid.allocator import streamed

    streamed(return_freed=True)  # before torch is imported (`attnid.allocator`)
    read_ahead(model_a, model_b)  # the first units read while torch is imported
    from attnid.checkpoint.align import align_checkpoints
    from attnid.errors import require_extras

    require_extras("hf", what="attnid align")
    r = align_checkpoints(model_a, model_b, out_dir, subgroup=subgroup, calibration=calibration,
                          refine=refine, force=force, rounds=rounds,
                          progress=sized_progress(model_a, model_b, above=2**26, always=refine is not None))
    if json_out:
        emit_json(r)
        return
    _print_alignment(r)
    _print_refined(r["refined"])
    e2e = r["end_to_end_rel_diff"]
    typer.echo(f"written {out_dir}: certified by attnid diff against B\n  every residual <= "
               f"{r['max_residual']:.2e} (rounding level {r['tolerance']:.1e}); end to end: "
               + ("skipped (large checkpoint)" if e2e is None else f"{e2e:.2e}"))


def _print_alignment(r: dict) -> None:
    from attnid.whole.align import PARTS

    table = narrow_table(f"{r['model_b']} aligned onto {r['model_a']} ({r['architecture']}, subgroup "
                         f"{r['subgroup']})", ["layer", "raw distance", "aligned distance",
                                            *(f"{p} share" for p in PARTS)])
    rows = [("embeddings", r["embeddings"]), *((str(x["layer"]), x) for x in r["layers"]),
            ("head", r["head"]), ("total", r)]
    for name, x in rows:
        table.add_row(name, f"{x['raw_distance']:.4g}", f"{x['aligned_distance']:.4g}",
                      *(_share(x["shares"][p]) for p in PARTS))
    out = console()
    out.print(table)
    out.print("stream: " + r["stream"].replace("; ", "\n  "))


def _print_refined(r: dict | None) -> None:
    if r is not None:
        typer.echo(f"refined {', '.join(r['parts'])} ({r['steps']} steps, {r['seconds']:.1f} s): calibration "
                   f"loss at alpha {', '.join(f'{t:g}' for t in r['alphas'])} {r['loss_before']:.4f} -> "
                   f"{r['loss_after']:.4f}" + ("" if r["kept"] else " (not lower: kept as matched)"))


def _share(x: float) -> str:
    return f"{0.0 if abs(x) < 5e-4 else x:.3f}"  # no "-0.000"


@app.command("merge")
def merge_cmd(
    model_a: ModelA,
    model_b: ModelB,
    out_dir: Annotated[str, typer.Argument(help="Where the merged checkpoint goes (A's files and dtype).")],
    alpha: Annotated[float, typer.Option("--alpha", help="Weight of B, in [0, 1].")] = 0.5,
    align: Annotated[bool, typer.Option("--align", help="Align B onto A first (attnid align).")] = False,
    subgroup: SubgroupOpt = "full",
    calibration: Annotated[str | None, typer.Option(
        "--calibration", help="With --align: match on activations over this text file (A's tokenizer), "
                              "and refine on it with --refine.")] = None,
    refine: RefineOpt = None,
    rounds: RoundsOpt = ROUNDS,
    force: Force = False,
    json_out: Json = False,
) -> None:
    """Write (1 - alpha) A + alpha B, with B first aligned onto A when --align."""
    from attnid.allocator import streamed

    streamed(return_freed=True)  # before torch is imported (`attnid.allocator`)
    read_ahead(model_a, model_b)  # the first units read while torch is imported
    from attnid.checkpoint.align import merge_checkpoints
    from attnid.errors import require_extras

    require_extras("hf", what="attnid merge")
    r = merge_checkpoints(model_a, model_b, out_dir, alpha=alpha, aligned=align, subgroup=subgroup,
                          calibration=calibration, refine=refine, force=force, rounds=rounds,
                          progress=sized_progress(model_a, model_b, above=2**26, always=refine is not None))
    if json_out:
        emit_json(r)
        return
    if align:
        _print_refined(r["refined"])
    how = (f"B aligned onto A (subgroup {r['subgroup']}: distance {r['raw_distance']:.4g} -> "
           f"{r['aligned_distance']:.4g})" if align else "B as stored (no alignment)")
    typer.echo(f"written {out_dir}: (1 - {alpha:g}) A + {alpha:g} B, {how}")


@app.command("barrier")
def barrier_cmd(
    model_a: ModelA,
    model_b: ModelB,
    calibration: Annotated[str, typer.Option(
        "--calibration", help="Text file the loss is measured on (A's tokenizer).")],
    align: Annotated[bool, typer.Option("--align", help="Also the path to B aligned onto A.")] = False,
    subgroup: SubgroupOpt = "full",
    rounds: RoundsOpt = ROUNDS,
    refine: RefineOpt = None,
    refine_calibration: Annotated[str | None, typer.Option(
        "--refine-calibration", help="With --refine: the text the refinement lowers the loss on (not "
                                     "the measured text, or the barrier is measured in sample).")] = None,
    alphas: Annotated[int, typer.Option("--alphas", help="Points along the path, ends included.")] = 11,
    context: Annotated[int | None, typer.Option(
        "--context", help="Tokens per chunk (default: the model's context, at most 256).")] = None,
    max_tokens: Annotated[int, typer.Option(
        "--max-tokens", help="At most this many tokens of the data.")] = 65536,
    plot: Annotated[str | None, typer.Option(
        "--plot", help="Write the loss along the path (the suffix picks the format: .png, .svg, "
                       ".pdf).")] = None,
    json_out: Json = False,
) -> None:
    """The loss along the straight path from A to B (and, with --align, to B aligned onto A),
    and the mid-point barrier: the loss at alpha = 0.5 less the mean of the end losses."""
    from pathlib import Path

    from attnid.allocator import streamed

    streamed(return_freed=True)  # before torch is imported (`attnid.allocator`)
    from attnid.checkpoint.barrier import barrier, plot_path
    from attnid.errors import AttnidError, require_extras

    require_extras("hf", *(["report"] if plot else []), what="attnid barrier" + (" --plot" if plot else ""))
    if plot:  # refuse before the work, not after it
        from attnid.cli.audit import _check_format

        if not Path(plot).resolve().parent.is_dir():
            raise AttnidError(f"--plot {plot}: its folder does not exist")
        _check_format(plot)
    if max_tokens < 2:
        raise AttnidError(f"--max-tokens {max_tokens}: at least one chunk of 2 tokens")
    r = barrier(model_a, model_b, calibration, aligned=align, subgroup=subgroup, alphas=alphas,
                context=context, max_tokens=max_tokens, refine=refine, refine_calibration=refine_calibration,
                rounds=rounds,
                progress=sized_progress(model_a, model_b, above=2**26, always=refine is not None))
    if plot:
        plot_path(r["alphas"], r["losses"], plot, f"{Path(r['model_a']).name} -> {Path(r['model_b']).name}")
    if json_out:
        emit_json(r)
        return
    for name, ys in r["losses"].items():
        typer.echo(f"{name}: loss " + " ".join(f"{y:.4f}" for y in ys) + f"; mid-point barrier "
                   f"{r['barriers'][name]:.4f}")
