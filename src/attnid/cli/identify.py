"""``attnid count``, ``verify`` and ``report``: closed-form counts and the arbiter."""

from __future__ import annotations

from typing import Annotated

import typer

from attnid.cli.app import (
    Bias,
    DModel,
    HeadDim,
    Json,
    NHeads,
    NKVHeads,
    QKNormEps,
    QKNormOpt,
    Rope,
    RopePairing,
    VHeadDim,
    _describe,
    _print_rows,
    app,
    console,
    emit_json,
    make_spec,
    print_count,
    print_count_dict,
)
from attnid.errors import AttnidError
from attnid.theory import count


@app.command("count")
def count_cmd(
    d_model: DModel, n_heads: NHeads, n_kv_heads: NKVHeads = None, head_dim: HeadDim = None,
    v_head_dim: VHeadDim = None, bias: Bias = "", rope: Rope = 0.0,
    rope_pairing: RopePairing = "half", qk_norm: QKNormOpt = "none",
    qk_norm_eps: QKNormEps = 1e-6, json_out: Json = False,
) -> None:
    """Closed-form counts of identified and unidentified parameters of one layer."""
    spec = make_spec(d_model, n_heads, n_kv_heads, head_dim, v_head_dim, bias, rope,
                     rope_pairing, qk_norm, qk_norm_eps)
    result = count(spec)
    if json_out:
        emit_json(result.to_dict())
    else:
        print_count(result)


@app.command("verify")
def verify_cmd(
    d_model: Annotated[int | None, typer.Option("--d-model", help="Model width d.")] = None,
    n_heads: Annotated[int | None, typer.Option("--n-heads", "--heads", help="Query heads H.")] = None,
    n_kv_heads: NKVHeads = None, head_dim: HeadDim = None,
    v_head_dim: VHeadDim = None, bias: Bias = "", rope: Rope = 0.0,
    rope_pairing: RopePairing = "half", qk_norm: QKNormOpt = "none",
    qk_norm_eps: QKNormEps = 1e-6,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the random point.")] = 0,
    confirm: Annotated[bool | None, typer.Option(
        "--confirm/--no-confirm", help="Recount at a second seed with twice the sequences "
        "(default: only when the first count disagrees or its spectral gap is narrow).")] = None,
    hf_config: Annotated[str | None, typer.Option(
        "--hf-config", help="Check a Hugging Face attention class, reduced from this config "
        "(config.json, model directory, bundled name, or org/name from the local Hugging Face "
        "cache).")] = None,
    whole: Annotated[bool, typer.Option(
        "--whole", help="With --hf-config: every parameter of the model, not only one attention "
        "layer; the config as given when it has at most 3,000 parameters, else reduced.")] = False,
    json_out: Json = False,
) -> None:
    """Arbiter (Jacobian rank, float64) against the closed form; exit 1 on disagreement."""
    spec_flags = dict(d_model=d_model, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim,
                      v_head_dim=v_head_dim, bias=bias or None, rope=rope or None,
                      rope_pairing=None if rope_pairing == "half" else rope_pairing,
                      qk_norm=None if qk_norm == "none" else qk_norm)
    given = [k for k, v in spec_flags.items() if v is not None]
    if hf_config is not None and given:
        raise AttnidError(f"--hf-config reads the spec from the config; drop {', '.join(given)}")
    if whole:
        if hf_config is None:
            raise AttnidError("--whole needs --hf-config MODEL")
        _verify_whole(hf_config, seed, confirm, json_out)
        return
    if hf_config is not None:
        from attnid.adapters.reduced import verify_hf_config
        from attnid.errors import require_extras

        require_extras("hf", what="attnid verify --hf-config")
        result = verify_hf_config(hf_config, seed=seed, confirm=confirm)
    else:
        if d_model is None or n_heads is None:
            raise AttnidError("verify needs --d-model and --n-heads (or --hf-config)")
        from attnid.arbiter.compare import verify

        spec = make_spec(d_model, n_heads, n_kv_heads, head_dim, v_head_dim, bias, rope,
                         rope_pairing, qk_norm, qk_norm_eps)
        count(spec)  # a spec without a closed form fails here, before any work
        result = verify(spec, seed=seed, confirm=confirm)
    if json_out:
        emit_json(result.to_dict())
    else:
        d = result.to_dict()
        gap = d["spectral_gap"]
        status = "AGREE" if result.agree else "DISAGREE"
        typer.echo(
            f"{status}  {d['model']}\n"
            f"  parameters {d['total']}   unidentified: theory {d['unidentified_theory']}, "
            f"arbiter {d['unidentified_numeric']}   near-unidentified: theory "
            f"{d['near_unidentified_theory']}, arbiter {d['near_unidentified_numeric']}\n"
            f"  spectral gap {'n/a' if gap is None else f'{gap:.2e}'}   stable across seeds: "
            f"{d['stable']}   {d['seconds']:.2f}s"
        )
    raise typer.Exit(0 if result.agree else 1)


def _verify_whole(hf_config: str, seed: int, confirm: bool, json_out: bool) -> None:
    from attnid.errors import require_extras

    require_extras("hf", what="attnid verify --hf-config --whole")
    from attnid.whole.check import verify_whole_hf_config

    result = verify_whole_hf_config(hf_config, seed=seed, confirm=confirm)
    d = result.to_dict()
    if json_out:
        emit_json(d)
    else:
        gap = d["spectral_gap"]
        bound = "" if d["exact"] else " (a lower bound)"
        typer.echo(
            f"{d['status']}  {d['model']}\n"
            f"  function: {d['function']}   parameters {d['total']} (theory {d['total_theory']})   "
            f"unidentified: theory {d['unidentified_theory']}{bound}, arbiter "
            f"{d['unidentified_numeric']}   near-unidentified: theory "
            f"{d['near_unidentified_theory']}, arbiter {d['near_unidentified_numeric']}\n"
            f"  spectral gap {'n/a' if gap is None else f'{gap:.2e}'}   stable across seeds: "
            f"{d['stable']}   {d['seconds']:.2f}s")
        for reason in d["reasons"]:
            typer.echo(f"  lower bound: {reason}")
        for k, v in d["components"].items():
            typer.echo(f"    {k:<21} params {v['params']:>8}  unidentified {v['unidentified']:>6}"
                       f"  near {v['near_unidentified']}")
    raise typer.Exit(0 if result.agree else 1)


@app.command("report")
def report_cmd(
    model: Annotated[str | None, typer.Argument(
        help="config.json, model directory, bundled name, or Hugging Face id (org/name) from "
             "the local cache.")] = None,
    all_models: Annotated[bool, typer.Option("--all", help="Compare every bundled model.")] = False,
    wide: Annotated[bool, typer.Option(
        "--wide", help="With --all: every column (the spec, the QK counts, the parameters).")] = False,
    json_out: Json = False,
) -> None:
    """Identification counts for a real model: per layer, in total, and the breakdown."""
    from attnid.errors import require_extras
    from attnid.progress import Progress
    from attnid.report.models import all_reports, model_report, narrow_row, summary_row

    if all_models and model is not None:
        raise AttnidError("give either a MODEL or --all, not both")
    if wide and not all_models:
        raise AttnidError("--wide is for the --all table")
    if not all_models and model is None:
        raise AttnidError("give a MODEL (config.json, model directory, bundled name or org/name) or --all")
    require_extras("hf", what="attnid report")  # parameter totals, numeric and whole-model counts
    if all_models:
        with Progress() as progress:  # a model with no closed form takes a numeric check,
            # 400 times a closed form's count: the runs are not alike, and an ETA would mislead
            progress.stage("every bundled model", alike=False)
            reports = all_reports(progress)
        if json_out:
            emit_json([summary_row(r) for r in reports])
        elif wide:
            _print_rows([summary_row(r) for r in reports],
                        "attention and whole-model identification across model families")
        else:
            _print_rows([narrow_row(r) for r in reports], "identification across model families "
                        "(--wide: every column)")
        return
    rep = model_report(model)
    if json_out:
        emit_json(rep)
        return
    if not rep["closed_form"]:
        nr = rep["numeric_reduced"]
        typer.echo(f"{rep['model']} ({rep['architecture']}, {rep['n_layers']} layers): attention "
                   f"parameters {rep['attention']['total']:,}\n  {rep['note']}\n  reduced layer "
                   f"{nr['reduced_config']}: {nr['unidentified']} of {nr['params']} parameters "
                   f"unidentified, {nr['near_unidentified']} near-unidentified")
        _echo_whole(rep)
        return
    out = console()
    a = rep["attention"]
    mp = rep["model_params"]
    out.print(f"[bold]{rep['model']}[/bold]  ({rep['architecture']}, {rep['n_layers']} layers"
              + (f", {mp:,} parameters in the model" if mp else "") + ")")
    print_count_dict(rep["layers"][0], f"one layer: {_describe(rep['spec'])}")
    out.print(f"all {rep['n_layers']} layers: attention parameters {a['total']:,}, unidentified "
              f"{a['unidentified']:,} (ratio {a['ratio']:.5f}), near-unidentified "
              f"{a['near_unidentified']:,}")
    comps = rep["layers"][0]["components"]
    qk_other = sum(v["unidentified"] for k, v in comps.items()
                   if k in ("key_bias_translation", "qk_norm_gain_transfer"))
    qk_near = sum(v["near_unidentified"] for k, v in comps.items()
                  if k in ("qk_gauge", "key_bias_translation", "qk_norm_gain_transfer"))
    out.print(f"QK gauge (query/key weights), exactly unidentified per layer: "
              f"{rep['qk_unidentified_per_layer']:,} (with MHA instead: "
              f"{rep['qk_unidentified_per_layer_if_mha']:,}); counted as in the paper, without "
              f"RoPE: {rep['qk_unidentified_per_layer_without_rope']:,} (MHA: "
              f"{rep['qk_unidentified_per_layer_without_rope_if_mha']:,}); the rest of the QK "
              f"side per layer: {qk_other:,} unidentified (key-bias translation, QK-norm gain "
              f"transfer), {qk_near:,} near-unidentified")
    if rep.get("layers_identical"):
        out.print(f"all {rep['n_layers']} layers are identical")
    _echo_whole(rep)


def _echo_whole(rep: dict) -> None:
    w = rep.get("whole_model")
    if not w:
        return
    if w["unidentified"] is None:
        typer.echo(f"whole model: {w['method']}")
        return
    exact = w.get("exact", True)
    typer.echo(f"whole model: {w['total']:,} parameters, unidentified "
               f"{'' if exact else 'at least '}{w['unidentified']:,} (ratio {w['ratio']:.3g}), "
               f"near-unidentified {w['near_unidentified']:,}; identified "
               f"{'' if exact else 'at most '}{w['identified']:,} [{w['method']}]")
    for reason in w.get("reasons", []):
        typer.echo(f"  lower bound: {reason}")
    for k, v in w["components"].items():
        typer.echo(f"  {k:<24} params {v['params']:>16,}  unidentified {v['unidentified']:>12,}"
                   f"  near {v['near_unidentified']:,}")
