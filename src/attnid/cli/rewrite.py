"""``attnid rewrite``: QuaRot/SpinQuant/FPTQuant-style rewrites of a checkpoint, verified."""

from __future__ import annotations

from typing import Annotated, Literal

import typer

from attnid.cli.app import Json, app, emit_json, sized_progress


@app.command("rewrite")
def rewrite_cmd(
    in_dir: Annotated[str, typer.Argument(help="Model directory (config.json + safetensors, sharded too).")],
    out_dir: Annotated[str, typer.Argument(help="Where the rewritten checkpoint goes.")],
    fold_norms: Annotated[bool, typer.Option(
        "--fold-norms", help="Fold every absorbable norm gain into its readers (gain 1).")] = False,
    rotate_residual: Annotated[Literal["hadamard", "random"] | None, typer.Option(
        "--rotate-residual", help="Rotate the residual stream (R1); under LayerNorm the rotation fixes "
                                  "all-ones.")] = None,
    rotate_values: Annotated[Literal["hadamard", "random"] | None, typer.Option(
        "--rotate-values", help="Rotate each key/value group's values and its heads' output rows "
                                "(R2).")] = None,
    qk_planes: Annotated[bool, typer.Option(
        "--qk-planes", help="Random per-kv-group Q/K transforms in the RoPE commutant.")] = False,
    scale_mlp: Annotated[bool, typer.Option(
        "--scale-mlp", help="Random positive per-neuron MLP scales (ReLU; gated: the up half).")] = False,
    permute_mlp: Annotated[bool, typer.Option(
        "--permute-mlp", help="Permute each MLP's neurons at random.")] = False,
    permute_heads: Annotated[bool, typer.Option(
        "--permute-heads", help="Permute key/value groups and the heads within each at random.")] = False,
    untie: Annotated[bool, typer.Option(
        "--untie", help="Write a tied model's head as a tensor of its own (lm_head.weight; "
                        "tie_word_embeddings false), which takes the final norm's gain: what "
                        "--rotate-residual needs when that gain is not uniform (QuaRot, "
                        "SpinQuant).")] = False,
    optimize: Annotated[str | None, typer.Option(
        "--optimize", help="Search the group element under which round-to-nearest of the weights "
                           "hurts least, for this scheme: w4, w3, w4:64, w3:64, w8 (needs "
                           "--calibration; alone: no other rewrite option).")] = None,
    calibration: Annotated[str | None, typer.Option(
        "--calibration", help="Calibration text for --optimize (tokenized with the model's "
                              "tokenizer; its first 512 tokens are used).")] = None,
    optimize_parts: Annotated[str | None, typer.Option(
        "--optimize-parts", help="Parts searched by --optimize: a comma list of r1,norm,vo,qk,mlp "
                                 "(default: all), or awq (the diagonal balances only).")] = None,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the random parts.")] = 0,
    force: Annotated[bool, typer.Option("--force", help="Replace a non-empty OUT_DIR.")] = False,
    json_out: Json = False,
) -> None:
    """Function-preserving rewrites of a checkpoint (QuaRot's R1 and R2, FPTQuant's Q/K planes,
    SmoothQuant-style MLP scaling, merging tools' permutations), certified by `attnid diff`
    against the input before anything is written."""

    from attnid.allocator import streamed

    streamed()  # before torch is imported (`attnid.allocator`)
    from attnid.checkpoint.rewrite import Recipe, rewrite
    from attnid.errors import require_extras

    require_extras("hf", what="attnid rewrite")
    if optimize is not None or calibration is not None or optimize_parts is not None:
        _optimize(in_dir, out_dir, optimize, calibration, optimize_parts,
                  [fold_norms, rotate_residual, rotate_values, qk_planes, scale_mlp, permute_mlp,
                   permute_heads, untie], seed, force, json_out)
        return

    recipe = Recipe(fold_norms=fold_norms, rotate_residual=rotate_residual, rotate_values=rotate_values,
                    qk_planes=qk_planes, scale_mlp=scale_mlp, permute_mlp=permute_mlp,
                    permute_heads=permute_heads, untie=untie, seed=seed)
    r = rewrite(in_dir, out_dir, recipe, force=force, progress=sized_progress(in_dir, above=2**28))
    if json_out:
        emit_json(r)
        return
    done = ", ".join(k.replace("_", " ") + (f" ({v})" if isinstance(v, str) else "")
                     for k, v in r["operations"].items() if v and k != "untie")
    e2e = r["end_to_end_rel_diff"]
    if r["untied"]:
        typer.echo(f"untied: {r['untied']} written as a tensor of its own (the token table's copy, "
                   f"tie_word_embeddings false)")
    typer.echo(f"{r['architecture']}: {r['layers']} layers -> {out_dir}\n"
               f"  {done} (seed {r['seed']})\n"
               f"  certified by attnid diff: every residual <= {r['max_residual']:.2e} "
               f"(rounding level {r['tolerance']:.1e})\n  end to end: "
               + ("skipped (large checkpoint)" if e2e is None else f"{e2e:.2e}") + f"; {r['seconds']:.1f}s")


def _optimize(in_dir: str, out_dir: str, scheme: str | None, calibration: str | None, parts: str | None,
              others: list, seed: int, force: bool, json_out: bool) -> None:
    from attnid.checkpoint.optimize import optimize
    from attnid.errors import AttnidError

    if scheme is None:
        raise AttnidError("--calibration and --optimize-parts go with --optimize SCHEME")
    if calibration is None:
        raise AttnidError("--optimize needs --calibration FILE (the text its activations come from)")
    if any(others):
        raise AttnidError("--optimize chooses the whole element itself: give it without --fold-norms, "
                          "--rotate-residual, --rotate-values, --qk-planes, --scale-mlp, --permute-mlp, "
                          "--permute-heads, --untie")
    r = optimize(in_dir, out_dir, scheme, calibration, parts=parts, seed=seed, force=force,
                 progress=sized_progress(in_dir, above=2**22))
    if json_out:
        emit_json(r)
        return
    o = r["objective"]
    parts = r["parts"] if isinstance(r["parts"], str) else ",".join(r["parts"])
    folded = f", folded {o['folded']:.4g}" if "folded" in o else ""
    typer.echo(f"{r['architecture']}: {r['layers']} layers -> {out_dir}\n"
               f"  optimized for {r['scheme']} ({parts}; {r['calibration_tokens']} calibration tokens)\n"
               f"  objective: input {o['input']:.4g}{folded} -> {o['found']:.4g}\n"
               + "".join(f"  {k}: {v['before']:.4g} -> {v['after']:.4g} ({v['seconds']:.1f}s)\n"
                         for k, v in r["parts_objective"].items())
               + f"  certified by attnid diff: every residual <= {r['max_residual']:.2e} "
               f"(rounding level {r['tolerance']:.1e}); {r['seconds']:.1f}s")
