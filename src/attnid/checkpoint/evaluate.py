"""The loss of a causal language model on text, and `attnid eval`: its perplexity on a text
file with the model's own tokenizer, optionally after fake round-to-nearest quantization of
every linear layer but the head (`attnid.quantize`).

The one evaluator of the checkpoint tools: `batch_nll` is the summed next-token cross-entropy
of token chunks (`attnid.checkpoint.tokens.read_chunks`), `token_nll` its sum over batches,
`load_causal_lm` the transformers model it runs; `attnid barrier` measures each point of its
path with the same `batch_nll`, the model run a layer at a time (`attnid.whole.layerwise`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from attnid.checkpoint.load import Checkpoint
from attnid.checkpoint.tokens import Batches, read_chunks
from attnid.errors import AttnidError
from attnid.progress import Progress

__all__ = ["TokenLoss", "batch_nll", "check_causal", "evaluate", "load_causal_lm", "token_nll"]


@dataclass(frozen=True)
class TokenLoss:
    """The summed next-token negative log-likelihood (nats) of ``count`` predicted tokens."""

    total: float
    count: int

    @property
    def mean(self) -> float:
        """Nats per predicted token."""
        return self.total / self.count

    @property
    def perplexity(self) -> float:
        return math.exp(self.mean)


def check_causal(ck: Checkpoint) -> None:
    archs = ck.config.get("architectures") or []
    if not any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs):
        raise AttnidError(f"{ck.root}: the loss needs a causal language model "
                          f"(architectures {archs or 'not given'})")


def load_causal_lm(ck: Checkpoint, dtype: torch.dtype = torch.float32) -> nn.Module:
    """``ck``'s transformers model with its head, in ``dtype``, eval mode; transformers'
    refusals (an unknown class, a config it cannot build) in one line."""
    from attnid.adapters.base import hf_model_class

    try:
        return hf_model_class(ck.config).from_pretrained(str(ck.root), dtype=dtype).eval()
    except (OSError, ValueError, KeyError, TypeError, AttributeError, ImportError) as e:
        raise AttnidError(f"{ck.root}: transformers cannot load this model "
                          f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from e


def batch_nll(model: nn.Module, x: torch.Tensor) -> TokenLoss:
    """The summed cross-entropy of tokens 2..T of each chunk of ``x [b, T]`` given those before
    (the model's logits in float64, a chunk at a time)."""
    logits = model(input_ids=x, use_cache=False).logits[:, :-1]  # [b, T-1, V]
    target = x[:, 1:]  # [b, T-1]
    total = 0.0
    for row, want in zip(logits, target, strict=True):  # [T-1, V]
        total += float(torch.nn.functional.cross_entropy(row.to(torch.float64), want, reduction="sum"))
    return TokenLoss(total, target.numel())


def token_nll(model: nn.Module, data: Batches, bar: Callable[[int, float], None] | None = None) -> TokenLoss:
    """`batch_nll` summed over ``data``'s batches; ``bar(chunks done, mean loss so far)`` after
    each batch."""
    total, count = 0.0, 0
    n = data.ids.shape[0]
    with torch.no_grad():
        for i in range(0, n, data.batch):
            part = batch_nll(model, data.ids[i:i + data.batch])
            total, count = total + part.total, count + part.count
            if bar is not None:
                bar(min(i + data.batch, n), total / count)
    return TokenLoss(total, count)


def evaluate(model: str | Path, calibration: str | Path, *, quantize: str | None = None,
             context: int | None = None, max_tokens: int = 65536,
             progress: Progress | None = None) -> dict[str, Any]:
    """The perplexity of ``model`` (a directory, its config.json, a cached hub id) on the text
    of ``calibration``, in chunks of ``context`` tokens, at most ``max_tokens``; with
    ``quantize`` (a scheme, `attnid.quantize.parse_scheme`) after fake RTN of every linear
    layer but the head. The scheme and the text are checked before the model is loaded."""
    from attnid.checkpoint.load import open_checkpoint
    from attnid.quantize import parse_scheme, quantizable, quantize_linears

    start = time.perf_counter()
    scheme = parse_scheme(quantize) if quantize is not None else None
    if max_tokens < 2:
        raise AttnidError(f"--max-tokens {max_tokens}: at least one chunk of 2 tokens")
    ck = open_checkpoint(model, purpose="evaluate")
    check_causal(ck)
    chunks = read_chunks(ck, calibration, context=context, max_tokens=max_tokens, option="--calibration")
    shown = progress if progress is not None else Progress(enabled=False)
    shown.stage(f"load {ck.path}")
    lm = load_causal_lm(ck)
    layers = 0
    if scheme is not None:
        shown.stage(f"quantize {scheme} (round to nearest, every linear layer but the head)")
        layers = sum(1 for _ in quantizable(lm))
        lm = quantize_linears(lm, scheme)
    shown.stage(f"evaluate {chunks.tokens:,} tokens")
    bar = shown.steps(int(chunks.ids.shape[0]), "chunks")
    try:
        loss = token_nll(lm, chunks, bar)
    finally:
        bar.close()  # type: ignore[attr-defined]
        shown.close()
    return {"model": str(ck.path), "calibration": str(calibration),
            "quantize": str(scheme) if scheme else None,
            "quantized_layers": layers, "tokens": chunks.tokens, "context": int(chunks.ids.shape[1]),
            "chunks": int(chunks.ids.shape[0]), "predicted": loss.count, "loss": loss.mean,
            "perplexity": loss.perplexity, "seconds": time.perf_counter() - start}
