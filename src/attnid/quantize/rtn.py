"""Fake round-to-nearest (RTN) weight quantization, asymmetric min-max: each output row of a
linear layer's weight ``[out, in]`` (or each group of ``group`` input columns of a row) is put
on the grid of ``2^bits`` levels spanning its own minimum and maximum, and stored back in
float ("fake": the weight keeps its dtype, only its values are rounded).

For a row (or group) ``w`` with ``lo = min w``, ``hi = max w`` and ``n = 2^bits - 1``::

    scale = (hi - lo) / n
    zero  = round(-lo / scale)                  # an integer zero point
    q     = clamp(round(w / scale) + zero, 0, n)
    w'    = (q - zero) * scale

The grid's end points ``-zero * scale`` and ``(n - zero) * scale`` lie within ``scale / 2`` of
``lo`` and ``hi``, so every ``w`` in ``[lo, hi]`` is within ``scale / 2`` of ``w'`` and at most
``2^bits`` distinct values remain. A constant row (``hi == lo``) is already on every grid and is
kept as it is. This is the quantizer of AWQ's and llm-compressor's RTN baselines.

Schemes are written ``w<bits>`` (per output channel) or ``w<bits>:<group>`` (groups of
``group`` input columns; a last, shorter group takes the remaining columns).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Collection, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from attnid.errors import AttnidError

__all__ = ["Scheme", "fake_quantize", "parse_scheme", "quantizable", "quantize_linears"]

MIN_BITS, MAX_BITS = 2, 8
_SCHEME = re.compile(r"w([0-9]+)(?::([0-9]+))?")


@dataclass(frozen=True)
class Scheme:
    """RTN of weights: ``bits`` per value, one scale and zero point per output row
    (``group=None``) or per ``group`` input columns of a row."""

    bits: int
    group: int | None = None  # input columns sharing a scale; None: the whole row

    def __post_init__(self) -> None:
        if not MIN_BITS <= self.bits <= MAX_BITS:
            raise AttnidError(f"quantization scheme {self}: bits between {MIN_BITS} and {MAX_BITS}")
        if self.group is not None and self.group < 2:
            raise AttnidError(f"quantization scheme {self}: a group holds at least 2 columns")

    @property
    def levels(self) -> int:
        return 2**self.bits

    def __str__(self) -> str:
        return f"w{self.bits}" + (f":{self.group}" if self.group is not None else "")


def parse_scheme(text: str) -> Scheme:
    """``"w4"`` -> 4 bits per output channel; ``"w3:64"`` -> 3 bits in groups of 64 columns.

    >>> parse_scheme("w4:64")
    Scheme(bits=4, group=64)
    >>> str(parse_scheme("w8"))
    'w8'
    """
    m = _SCHEME.fullmatch(text)
    if m is None:
        raise AttnidError(f"--quantize {text!r}: write w<bits> or w<bits>:<group>, e.g. w4, w4:64, w3:64, w8")
    try:
        return Scheme(int(m[1]), int(m[2]) if m[2] is not None else None)
    except AttnidError as e:
        raise AttnidError(f"--quantize {text}: {str(e).split(': ', 1)[1]}") from None


def fake_quantize(weight: torch.Tensor, scheme: Scheme) -> torch.Tensor:
    """``weight [out, in]`` rounded to its RTN grid (a new tensor, same dtype and shape).
    Computed in float64 for float64 weights and in float32 otherwise (bfloat16 and float16
    weights are rounded back to their dtype at the end)."""
    if weight.ndim != 2:
        raise AttnidError(f"internal: fake_quantize takes a matrix [out, in], not {tuple(weight.shape)}")
    w = weight.detach().to(torch.float64 if weight.dtype == torch.float64 else torch.float32)
    cols = w.shape[1]
    g = cols if scheme.group is None else min(scheme.group, cols)
    full = cols - cols % g
    parts = [_rtn(w[:, :full].reshape(w.shape[0], full // g, g), scheme.levels - 1).reshape(w.shape[0], full)]
    if full < cols:  # the last, shorter group
        parts.append(_rtn(w[:, full:].unsqueeze(1), scheme.levels - 1).squeeze(1))
    return torch.cat(parts, dim=1).to(weight.dtype)


def _rtn(w: torch.Tensor, n: int) -> torch.Tensor:
    """Each ``w[r, k, :]`` on its own grid of ``n + 1`` levels."""
    lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)  # [out, groups, 1]
    flat = hi == lo
    scale = torch.where(flat, torch.ones_like(hi), (hi - lo) / n)
    zero = torch.round(-lo / scale)
    q = torch.clamp(torch.round(w / scale) + zero, 0, n)
    return torch.where(flat, w, (q - zero) * scale)


def quantizable(model: nn.Module, skip: Collection[str] | None = None) -> Iterator[tuple[str, nn.Module]]:
    """The linear layers of ``model`` RTN applies to, by name: every ``nn.Linear`` (and
    transformers' ``Conv1D``, GPT-2's transposed linear) except those named in ``skip`` (by
    default the model's output head, ``get_output_embeddings()``, and whatever shares its
    weight)."""
    head = model.get_output_embeddings() if skip is None and hasattr(model, "get_output_embeddings") else None
    head_weight = getattr(head, "weight", None)
    for name, mod in model.named_modules():
        if not (isinstance(mod, nn.Linear) or _is_conv1d(mod)):
            continue
        if (skip is not None and name in skip) or mod is head or (
                head_weight is not None and mod.weight is head_weight):
            continue
        yield name, mod


def quantize_linears(model: nn.Module, scheme: Scheme, skip: Collection[str] | None = None) -> nn.Module:
    """A copy of ``model`` with the weight of every layer `quantizable` yields replaced by its
    `fake_quantize` (biases, norms, embeddings and the head kept); ``model`` is not changed."""
    out = copy.deepcopy(model)
    with torch.no_grad():
        for _, mod in quantizable(out, skip):
            w = mod.weight  # Conv1D: [in, out]
            w.copy_(fake_quantize(w.T, scheme).T if _is_conv1d(mod) else fake_quantize(w, scheme))
    return out


def _is_conv1d(mod: nn.Module) -> bool:
    # transformers' Conv1D (GPT-2): a linear layer whose weight is stored [in, out]; matched by
    # its module path so that transformers is not imported here
    return type(mod).__name__ == "Conv1D" and type(mod).__module__.startswith("transformers")
