"""``attnid train``: the small GPT on attnid's attention."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Literal

import typer

from attnid.cli.app import Json, NKVHeads, QKNormOpt, app, emit_json

if TYPE_CHECKING:
    from attnid.train.loop import TrainSummary


@app.command("train")
def train_cmd(
    out: Annotated[str, typer.Argument(
        help="Output directory: metrics.jsonl, summary.json, checkpoint.pt.")] = "runs/train",
    scale: Annotated[Literal["tiny", "small", "paper"], typer.Option(
        "--scale", help="Model size (layers, heads, width, context).")] = "tiny",
    arch: Annotated[Literal["nanogpt", "gpt2", "llama"], typer.Option(
        "--arch", help="nanogpt: LayerNorm, GELU, learned positions, tied, q/k biases; gpt2: the "
        "same with all biases; llama: RMSNorm, SwiGLU, RoPE, untied, no biases.")] = "nanogpt",
    n_layers: Annotated[int | None, typer.Option(
        "--n-layers", "--layers", help="Override: transformer blocks.")] = None,
    n_heads: Annotated[int | None, typer.Option(
        "--n-heads", "--heads", help="Override: query heads.")] = None,
    n_kv_heads: NKVHeads = None,
    d_model: Annotated[int | None, typer.Option("--d-model", help="Override: width.")] = None,
    bias: Annotated[str | None, typer.Option(
        "--bias", help="Override: attention biases (subset of qkvo, or none).")] = None,
    rope: Annotated[float | None, typer.Option(
        "--rope", help="Override: fraction of each head's dims that RoPE rotates.")] = None,
    positions: Annotated[Literal["learned", "none"], typer.Option(
        "--positions", help="Without RoPE (--rope 0): learned absolute positions, or none (NoPE); "
        "a Llama-style model is then exported as attnid's PositionsLlamaForCausalLM.")] = "learned",
    qk_norm: QKNormOpt = "none",
    norm: Annotated[Literal["layernorm", "rmsnorm"] | None, typer.Option(
        "--norm", help="Override: the residual-stream norm.")] = None,
    mlp: Annotated[Literal["gelu", "swiglu"] | None, typer.Option(
        "--mlp", help="Override: the MLP.")] = None,
    d_ff: Annotated[int | None, typer.Option(
        "--d-ff", help="MLP hidden width (default 4 d; swiglu 8 d / 3 up to a multiple of 32).")] = None,
    tie: Annotated[bool | None, typer.Option(
        "--tie/--untie", help="Override: the head shares the token embedding.")] = None,
    optimizer: Annotated[Literal["sgd", "adam", "adamw"], typer.Option("--optimizer")] = "adamw",
    lr: Annotated[float, typer.Option("--lr")] = 1e-3,
    schedule: Annotated[Literal["constant", "cosine"], typer.Option(
        "--schedule", help="Learning rate: constant, or a cosine to lr/10 at the last step.")
    ] = "constant",
    warmup: Annotated[int, typer.Option("--warmup", help="Steps of linear warmup.")] = 0,
    weight_decay: Annotated[float, typer.Option("--weight-decay")] = 0.0,
    steps: Annotated[int, typer.Option("--steps")] = 200,
    batch_size: Annotated[int, typer.Option("--batch-size")] = 16,
    seq_len: Annotated[int | None, typer.Option("--seq-len", help="Context length.")] = None,
    seed: Annotated[int, typer.Option("--seed")] = 0,
    log_every: Annotated[int, typer.Option("--log-every")] = 10,
    eval_every: Annotated[int, typer.Option("--eval-every")] = 50,
    correct: Annotated[str, typer.Option("--correct", help="off | project | rebalance:N")] = "off",
    device: Annotated[str, typer.Option("--device")] = "cpu",
    resume: Annotated[bool, typer.Option("--resume", help="Continue the run in OUT.")] = False,
    progress: Annotated[bool, typer.Option("--progress/--no-progress")] = True,
    checkpoint: Annotated[bool, typer.Option(
        "--checkpoint/--no-checkpoint", help="Write OUT/checkpoint.pt (needed for --resume).")] = True,
    hf: Annotated[bool, typer.Option(
        "--hf/--no-hf", help="Also write OUT/hf, a Hugging Face checkpoint with a character "
        "tokenizer (--arch gpt2 or llama; needs attnid[hf]).")] = False,
    json_out: Json = False,
) -> None:
    """Train the small GPT on character-level Shakespeare, logging orbit metrics."""
    from pathlib import Path

    from attnid.train.loop import ARCHS, PRESETS, TrainConfig, train
    from attnid.train.model import GPTConfig

    overrides = {k: v for k, v in dict(n_layers=n_layers, n_heads=n_heads, d_model=d_model,
                                       block_size=seq_len, attn_bias=bias, rope=rope, norm=norm, mlp=mlp,
                                       d_ff=d_ff, tie_weights=tie).items() if v is not None}
    model = GPTConfig(**{**PRESETS[scale], **ARCHS[arch], **overrides}, n_kv_heads=n_kv_heads,
                      qk_norm=qk_norm, positions=positions)
    model.attention_spec()  # validate before any work
    cfg = TrainConfig(model=model, optimizer=optimizer, lr=lr, weight_decay=weight_decay,
                      steps=steps, batch_size=batch_size, seed=seed, log_every=log_every,
                      eval_every=eval_every, correct=correct, device=device, schedule=schedule,
                      warmup=warmup)
    try:
        summary = train(cfg, Path(out), resume=resume, progress=progress, checkpoint=checkpoint, hf=hf)
    except KeyboardInterrupt:
        hint = (f"continue with attnid train --resume {out}" if checkpoint
                else "no checkpoint was written (--no-checkpoint)")
        typer.echo(f"error: interrupted; the log in {out} is valid; {hint}", err=True)
        raise typer.Exit(130) from None
    if summary.rank == 0 and json_out:
        emit_json(summary.to_dict())
    elif summary.rank == 0:
        _print_train_summary(summary, out)


def _print_train_summary(s: TrainSummary, out: str) -> None:
    """Final loss, then what the optimizer did along the orbits (rho) and to the conserved
    quantities (beta), then where the files are."""
    typer.echo(f"trained {s.steps} steps in {s.seconds:.1f}s, final loss {s.final_loss:.4f}")
    for side, o in s.orbit.items():
        b0, b1 = o.beta_first, o.beta_last
        change = f" ({100 * (b1 - b0) / b0:+.1f}%)" if b0 else ""
        typer.echo(f"  {side.upper()}: median rho {o.median_rho:.3g} (tangent share of the "
                   f"updates), mean beta {b0:.4g} -> {b1:.4g}{change}")
    size = f", checkpoint {s.checkpoint_bytes / 1e6:.1f} MB" if s.checkpoint_bytes is not None else ""
    typer.echo(f"  metrics in {out}/metrics.jsonl{size}")
    if s.hf is not None:
        typer.echo(f"  Hugging Face checkpoint in {out}/hf ({s.hf.architecture}; its logits "
                   f"match to {s.hf.error:.1e})")
