"""``attnid eval``: the perplexity of a causal language model on a text file, optionally after
fake round-to-nearest quantization of its linear layers."""

from __future__ import annotations

from typing import Annotated

import typer

from attnid.cli.app import Json, app, emit_json, sized_progress


@app.command("eval")
def eval_cmd(
    model: Annotated[str, typer.Argument(
        help="Causal language model: directory, its config.json, or a cached Hugging Face id.")],
    calibration: Annotated[str, typer.Option(
        "--calibration", help="Text file the perplexity is measured on (the model's own tokenizer).")],
    quantize: Annotated[str | None, typer.Option(
        "--quantize", help="First round every linear layer but the head to nearest, asymmetric min-max: "
                           "w<bits> per output channel (w4, w8) or w<bits>:<group> in groups of input "
                           "columns (w4:64, w3:64).")] = None,
    context: Annotated[int | None, typer.Option(
        "--context", help="Tokens per chunk (default: the model's context, at most 256).")] = None,
    max_tokens: Annotated[int, typer.Option(
        "--max-tokens", help="At most this many tokens of the text.")] = 65536,
    json_out: Json = False,
) -> None:
    """Perplexity (exp of the mean next-token cross-entropy) of MODEL on the text of
    --calibration, cut into chunks of --context tokens; with --quantize, of the model after
    fake round-to-nearest quantization of every linear layer but the head."""
    from attnid.checkpoint.evaluate import evaluate
    from attnid.errors import require_extras
    from attnid.quantize import parse_scheme

    if quantize is not None:
        parse_scheme(quantize)  # refused before anything is read
    require_extras("hf", what="attnid eval")
    r = evaluate(model, calibration, quantize=quantize, context=context, max_tokens=max_tokens,
                 progress=sized_progress(model, above=2**26))
    if json_out:
        emit_json(r)
        return
    how = f"after RTN {r['quantize']} of {r['quantized_layers']} linear layers" if r["quantize"] else "float"
    typer.echo(f"{r['model']} ({how}): perplexity {r['perplexity']:.4f}, loss {r['loss']:.4f} nats/token "
               f"on {r['predicted']:,} predicted tokens ({r['chunks']} chunks of {r['context']})")
