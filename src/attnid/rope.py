"""Rotary position embeddings (RoPE), full or partial, in both pairing conventions.

A head's first ``r = spec.rope_dims`` dims rotate in ``r/2`` planes; the other
``p = d_k - r`` pass through. Plane ``i`` turns by angle ``pos * base**(-2i/r)`` and
is made of dims ``(i, i + r/2)`` under the ``half`` convention (Hugging Face's
``rotate_half``) or ``(2i, 2i + 1)`` under ``interleaved`` (the original RoPE).
"""

from __future__ import annotations

import torch

from attnid.spec import AttentionSpec


def plane_dims(spec: AttentionSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices (within a head) of the two dims of each rotated plane, each ``[r/2]``."""
    half = spec.rope_dims // 2
    idx = torch.arange(half)
    if spec.rope_pairing == "half":
        return idx, idx + half
    return 2 * idx, 2 * idx + 1


def inv_freq(spec: AttentionSpec, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Angular frequency of each plane, ``[r/2]``."""
    r = spec.rope_dims
    return spec.rope_base ** (-torch.arange(0, r, 2, dtype=torch.float64) / r).to(dtype)


def rope_tables(
    spec: AttentionSpec, positions: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of every plane's angle at each position: each ``[T, r/2]``."""
    angles = positions.to(torch.float64)[:, None] * inv_freq(spec)[None, :]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(
    x: torch.Tensor, spec: AttentionSpec, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """Rotate the planes of ``x`` (``[..., T, d_k]``); pass-through dims are left as they are."""
    r = spec.rope_dims
    if r == 0:
        return x
    rot, rest = x[..., :r], x[..., r:]
    if spec.rope_pairing == "half":
        x1, x2 = rot[..., : r // 2], rot[..., r // 2 :]
        rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    else:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        rotated = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    return torch.cat((rotated, rest), dim=-1)
