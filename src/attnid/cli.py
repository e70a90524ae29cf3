"""The ``attnid`` command line. Thin: parse, call the library, print, exit.

User mistakes (:class:`attnid.AttnidError`, bad flags) print one ``error:`` line on
stderr and exit 2; ``verify`` exits 1 when theory and arbiter disagree.
"""

from __future__ import annotations

import json
import sys
from typing import Annotated, Any

import typer
from typer._click import exceptions as click_exceptions

from attnid.errors import AttnidError
from attnid.spec import AttentionSpec
from attnid.theory import Count, count

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    help="Measure and exploit the parameter symmetries of transformer attention.",
)

DModel = Annotated[int, typer.Option("--d-model", help="Model width d.")]
Heads = Annotated[int, typer.Option("--heads", help="Query heads H.")]
KVHeads = Annotated[int | None, typer.Option("--kv-heads", help="Key/value groups G (GQA; 1 = MQA).")]
HeadDim = Annotated[int | None, typer.Option("--head-dim", help="Query/key head size d_k.")]
VHeadDim = Annotated[int | None, typer.Option("--v-head-dim", help="Value head size d_v.")]
Bias = Annotated[str, typer.Option("--bias", help="Which biases exist: a subset of 'qkvo'.")]
Rope = Annotated[float, typer.Option("--rope", help="Fraction of each head's dims that RoPE rotates.")]
RopePairing = Annotated[str, typer.Option("--rope-pairing", help="half | interleaved")]
QKNormOpt = Annotated[str, typer.Option("--qk-norm", help="none | head")]
QKNormEps = Annotated[float, typer.Option("--qk-norm-eps", help="QK-norm epsilon.")]
Json = Annotated[bool, typer.Option("--json", help="Print one JSON object.")]


def make_spec(d_model: int, heads: int, kv_heads: int | None, head_dim: int | None,
              v_head_dim: int | None, bias: str, rope: float, rope_pairing: str,
              qk_norm: str, qk_norm_eps: float) -> AttentionSpec:
    return AttentionSpec(
        d_model=d_model, n_heads=heads, n_kv_heads=kv_heads, head_dim=head_dim,
        v_head_dim=v_head_dim, bias=bias, rope=rope, rope_pairing=rope_pairing,  # type: ignore[arg-type]
        qk_norm=qk_norm, qk_norm_eps=qk_norm_eps,  # type: ignore[arg-type]
    )


@app.command("count")
def count_cmd(
    d_model: DModel, heads: Heads, kv_heads: KVHeads = None, head_dim: HeadDim = None,
    v_head_dim: VHeadDim = None, bias: Bias = "", rope: Rope = 0.0,
    rope_pairing: RopePairing = "half", qk_norm: QKNormOpt = "none",
    qk_norm_eps: QKNormEps = 1e-6, json_out: Json = False,
) -> None:
    """Closed-form counts of identified and unidentified parameters of one layer."""
    spec = make_spec(d_model, heads, kv_heads, head_dim, v_head_dim, bias, rope,
                     rope_pairing, qk_norm, qk_norm_eps)
    result = count(spec)
    if json_out:
        emit_json(result.to_dict())
    else:
        print_count(result)


@app.command("verify")
def verify_cmd(
    d_model: Annotated[int | None, typer.Option("--d-model", help="Model width d.")] = None,
    heads: Annotated[int | None, typer.Option("--heads", help="Query heads H.")] = None,
    kv_heads: KVHeads = None, head_dim: HeadDim = None,
    v_head_dim: VHeadDim = None, bias: Bias = "", rope: Rope = 0.0,
    rope_pairing: RopePairing = "half", qk_norm: QKNormOpt = "none",
    qk_norm_eps: QKNormEps = 1e-6,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the random point.")] = 0,
    confirm: Annotated[bool, typer.Option(
        "--confirm/--no-confirm", help="Recount at a second seed with twice the sequences.")] = True,
    hf_config: Annotated[str | None, typer.Option(
        "--hf-config", help="Check a Hugging Face attention class, reduced from this config.")] = None,
    json_out: Json = False,
) -> None:
    """Arbiter (Jacobian rank, float64) against the closed form; exit 1 on disagreement."""
    if hf_config is not None:
        from attnid.adapters.verify import verify_hf_config

        result = verify_hf_config(hf_config, seed=seed, confirm=confirm)
    else:
        if d_model is None or heads is None:
            raise AttnidError("verify needs --d-model and --heads (or --hf-config)")
        from attnid.verify import verify

        spec = make_spec(d_model, heads, kv_heads, head_dim, v_head_dim, bias, rope,
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


@app.command("train")
def train_cmd(
    out: Annotated[str, typer.Option("--out", help="Output directory.")] = "runs/train",
    preset: Annotated[str, typer.Option("--preset", help="Model size: tiny | small | paper.")] = "tiny",
    layers: Annotated[int | None, typer.Option("--layers", help="Override: transformer blocks.")] = None,
    heads: Annotated[int | None, typer.Option("--heads", help="Override: query heads.")] = None,
    kv_heads: KVHeads = None,
    d_model: Annotated[int | None, typer.Option("--d-model", help="Override: width.")] = None,
    bias: Annotated[str, typer.Option("--bias", help="Attention biases (subset of qkvo).")] = "qk",
    rope: Rope = 0.0,
    qk_norm: QKNormOpt = "none",
    optimizer: Annotated[str, typer.Option("--optimizer", help="sgd | adam | adamw")] = "adamw",
    lr: Annotated[float, typer.Option("--lr")] = 1e-3,
    weight_decay: Annotated[float, typer.Option("--weight-decay")] = 0.0,
    steps: Annotated[int, typer.Option("--steps")] = 200,
    batch_size: Annotated[int, typer.Option("--batch-size")] = 16,
    seq_len: Annotated[int | None, typer.Option("--seq-len", help="Context length.")] = None,
    seed: Annotated[int, typer.Option("--seed")] = 0,
    log_every: Annotated[int, typer.Option("--log-every")] = 10,
    eval_every: Annotated[int, typer.Option("--eval-every")] = 50,
    correct: Annotated[str, typer.Option("--correct", help="off | project | rebalance:N")] = "off",
    device: Annotated[str, typer.Option("--device")] = "cpu",
    resume: Annotated[bool, typer.Option("--resume", help="Continue the run in --out.")] = False,
    progress: Annotated[bool, typer.Option("--progress/--no-progress")] = True,
) -> None:
    """Train the small GPT on character-level Shakespeare, logging orbit metrics."""
    from pathlib import Path

    from attnid.train.loop import PRESETS, TrainConfig, train
    from attnid.train.model import GPTConfig

    if preset not in PRESETS:
        raise AttnidError(f"unknown preset {preset!r}: use one of {', '.join(PRESETS)}")
    overrides = {k: v for k, v in dict(n_layer=layers, n_head=heads, n_embd=d_model,
                                       block_size=seq_len).items() if v is not None}
    model = GPTConfig(**{**PRESETS[preset], **overrides}, n_kv_head=kv_heads, attn_bias=bias,
                      rope=rope, qk_norm=qk_norm)
    model.attention_spec()  # validate before any work
    cfg = TrainConfig(model=model, optimizer=optimizer, lr=lr, weight_decay=weight_decay,
                      steps=steps, batch_size=batch_size, seed=seed, log_every=log_every,
                      eval_every=eval_every, correct=correct, device=device)
    try:
        summary = train(cfg, Path(out), resume=resume, progress=progress)
    except KeyboardInterrupt:
        typer.echo(f"error: interrupted; the log in {out} is valid; continue with "
                   f"attnid train --resume --out {out}", err=True)
        raise typer.Exit(130) from None
    if summary["rank"] == 0:
        typer.echo(f"trained {summary['steps']} steps, final loss {summary['final_loss']:.4f}, "
                   f"{summary['seconds']:.1f}s -> {out}")


experiment_app = typer.Typer(help="Training experiments.", no_args_is_help=True)
app.add_typer(experiment_app, name="experiment")


@experiment_app.command("paper")
def experiment_paper(
    out: Annotated[str, typer.Option("--out", help="Output directory.")] = "attnid-experiment",
    scale: Annotated[str, typer.Option("--scale", help="quick | cpu | paper")] = "cpu",
    device: Annotated[str, typer.Option("--device")] = "cpu",
    seed: Annotated[int, typer.Option("--seed")] = 0,
    beyond: Annotated[bool, typer.Option("--beyond/--paper-only",
                                         help="Also RoPE, GQA and projection cases.")] = True,
) -> None:
    """The paper's four cases and SGD sweep (plus RoPE, GQA, projection): figures and tables."""
    from pathlib import Path

    from attnid.train.experiment import run_experiment

    result = run_experiment(Path(out), scale=scale, beyond=beyond, seed=seed, device=device,
                            progress=lambda msg: typer.echo(msg, err=True))
    for c in result["claims"]:
        typer.echo(f"{'HOLDS' if c['holds'] else 'FAILS'}  {c['claim']}  [{c['evidence']}]")
    typer.echo(f"figures and tables in {out}")


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


@app.command("report")
def report_cmd(
    model: Annotated[str | None, typer.Argument(
        help="config.json, model directory, or bundled name.")] = None,
    all_models: Annotated[bool, typer.Option("--all", help="Compare every bundled model.")] = False,
    json_out: Json = False,
) -> None:
    """Identification counts for a real model: per layer, in total, and the breakdown."""
    from attnid.report.models import all_reports, model_report, summary_row

    if all_models:
        rows = [summary_row(r) for r in all_reports()]
        if json_out:
            emit_json(rows)
        else:
            _print_rows(rows, "attention identification across model families")
        return
    if model is None:
        raise AttnidError("give a MODEL (config.json, model directory or bundled name) or --all")
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
        return
    from rich.console import Console

    console = Console(width=110)
    a = rep["attention"]
    mp = rep["model_params"]
    console.print(f"[bold]{rep['model']}[/bold]  ({rep['architecture']}, {rep['n_layers']} layers"
                  + (f", {mp:,} parameters in the model" if mp else "") + ")")
    print_count_dict(rep["layers"][0], f"one layer: {_describe(rep['spec'])}")
    console.print(f"all {rep['n_layers']} layers: attention parameters {a['total']:,}, unidentified "
                  f"{a['unidentified']:,} (ratio {a['ratio']:.5f}), near-unidentified "
                  f"{a['near_unidentified']:,}")
    console.print(f"QK-unidentified per layer: {rep['qk_unidentified_per_layer']:,} "
                  f"(with MHA instead: {rep['qk_unidentified_per_layer_if_mha']:,}); counted as in "
                  f"the paper, without RoPE: {rep['qk_unidentified_per_layer_without_rope']:,} "
                  f"(MHA: {rep['qk_unidentified_per_layer_without_rope_if_mha']:,})")


@app.command("canonicalize")
def canonicalize_cmd(
    in_dir: Annotated[str, typer.Argument(help="Model directory (config.json + safetensors).")],
    out_dir: Annotated[str, typer.Argument(help="Where the canonical checkpoint goes.")],
    drop_key_bias: Annotated[bool | None, typer.Option(
        "--drop-key-bias/--keep-key-bias", help="Zero the unidentified key bias.")] = None,
    fold_value_bias: Annotated[bool | None, typer.Option(
        "--fold-value-bias/--keep-value-bias", help="Fold b_V into b_O.")] = None,
    balance: Annotated[bool | None, typer.Option(
        "--balance/--no-balance", help="Balance QK and VO per head/group.")] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace a non-empty OUT_DIR.")] = False,
    json_out: Json = False,
) -> None:
    """Function-preserving surgery on a checkpoint, verified before anything is written.

    Default: every operation that applies to the architecture.
    """
    from attnid.surgery import canonicalize

    result = canonicalize(in_dir, out_dir, drop_key_bias_=drop_key_bias,
                          fold_value_bias_=fold_value_bias, balance=balance, force=force)
    if json_out:
        emit_json(result)
    else:
        e2e = result["end_to_end_rel_diff"]
        typer.echo(
            f"{result['architecture']}: {result['layers']} layers -> {out_dir}\n"
            f"  key bias dropped in {result['key_bias_dropped']} layers, value bias folded in "
            f"{result['value_bias_folded']}, {result['heads_balanced']} heads balanced\n"
            f"  per-layer check (float64): max abs diff {result['max_abs_diff']:.2e}, max rel diff "
            f"{result['max_rel_diff']:.2e}; end to end: "
            + ("skipped (large checkpoint)" if e2e is None else f"{e2e:.2e}")
            + f"; {result['seconds']:.1f}s")


def _describe(spec: dict) -> str:
    return AttentionSpec.from_dict(spec).describe()


def _print_rows(rows: list[dict], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    keys = list(rows[0])
    for k in keys:
        table.add_column(k, justify="left" if k in ("model", "family", "bias") else "right")
    for r in rows:
        table.add_row(*[f"{v:,}" if isinstance(v, int) and not isinstance(v, bool) else str(v)
                        for v in (r[k] for k in keys)])
    Console(width=250).print(table)


def print_count_dict(d: dict, title: str) -> None:
    from attnid.theory import Component, Count

    spec = AttentionSpec.from_dict(d["spec"])
    print_count(Count(spec, {k: Component(**v) for k, v in d["components"].items()}), title)


def emit_json(obj: Any) -> None:
    typer.echo(json.dumps(obj, indent=2, default=_json_default, allow_nan=False))


def _json_default(o: Any) -> Any:
    if isinstance(o, float):
        return None
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def print_count(result: Count, title: str | None = None) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title or f"attention layer: {result.spec.describe()}")
    table.add_column("component")
    table.add_column("params", justify="right")
    table.add_column("unidentified", justify="right")
    table.add_column("near-unidentified", justify="right")
    for name, c in result.components.items():
        table.add_row(name, f"{c.params:,}", f"{c.unidentified:,}", f"{c.near_unidentified:,}")
    table.add_section()
    table.add_row("total", f"{result.total:,}", f"{result.unidentified:,}",
                  f"{result.near_unidentified:,}")
    console = Console(width=100)
    console.print(table)
    console.print(f"identified {result.identified:,}   unidentified ratio {result.ratio:.4f}")


def main(argv: list[str] | None = None) -> int:
    """Entry point: runs the app and maps user errors to one ``error:`` line, exit 2."""
    try:
        code = app(args=argv, standalone_mode=False)  # click returns an Exit's code here
    except AttnidError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except typer.Exit as e:
        return e.exit_code
    except click_exceptions.UsageError as e:
        print(f"error: {e.format_message()}", file=sys.stderr)
        return 2
    except typer.Abort:
        print("error: aborted", file=sys.stderr)
        return 130
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    return code if isinstance(code, int) else 0


if __name__ == "__main__":
    sys.exit(main())
