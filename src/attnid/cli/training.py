"""``attnid train`` and ``attnid experiment``: the small GPT and the paper's experiments."""

from __future__ import annotations

from typing import Annotated, Literal

import typer

from attnid.cli.app import NKVHeads, QKNormOpt, Rope, app


@app.command("train")
def train_cmd(
    out: Annotated[str, typer.Option("--out", help="Output directory.")] = "runs/train",
    preset: Annotated[Literal["tiny", "small", "paper"], typer.Option(
        "--preset", help="Model size (layers, heads, width, context).")] = "tiny",
    n_layers: Annotated[int | None, typer.Option(
        "--n-layers", "--layers", help="Override: transformer blocks.")] = None,
    n_heads: Annotated[int | None, typer.Option(
        "--n-heads", "--heads", help="Override: query heads.")] = None,
    n_kv_heads: NKVHeads = None,
    d_model: Annotated[int | None, typer.Option("--d-model", help="Override: width.")] = None,
    bias: Annotated[str, typer.Option("--bias", help="Attention biases (subset of qkvo).")] = "qk",
    rope: Rope = 0.0,
    qk_norm: QKNormOpt = "none",
    optimizer: Annotated[Literal["sgd", "adam", "adamw"], typer.Option("--optimizer")] = "adamw",
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

    overrides = {k: v for k, v in dict(n_layers=n_layers, n_heads=n_heads, d_model=d_model,
                                       block_size=seq_len).items() if v is not None}
    model = GPTConfig(**{**PRESETS[preset], **overrides}, n_kv_heads=n_kv_heads, attn_bias=bias,
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
    scale: Annotated[Literal["quick", "cpu", "paper"], typer.Option(
        "--scale", help="Run length and model size.")] = "cpu",
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
