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


def plane_parts(S: torch.Tensor, spec: AttentionSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """Per rotated plane of ``S [..., dk, dk]``: ``(S11 + S22, S12 - S21)`` ``[..., r / 2]``, its
    inner products with ``I`` and ``J`` (``<S, a I + b J> = a (S11 + S22) + b (S12 - S21)``)."""
    i1, i2 = plane_dims(spec)
    return S[..., i1, i1] + S[..., i2, i2], S[..., i1, i2] - S[..., i2, i1]


def in_commutant(k: int, block: torch.Tensor | None, a: torch.Tensor, b: torch.Tensor,
                 spec: AttentionSpec) -> torch.Tensor:
    """The ``[..., k, k]`` matrix commuting with every RoPE rotation whose pass-through block is
    ``block`` (None: zero) and whose plane ``p`` is ``a_p I + b_p J`` (``a, b [..., r / 2]``)."""
    r = spec.rope_dims
    out = torch.zeros(*a.shape[:-1], k, k, dtype=a.dtype, device=a.device)
    if block is not None:
        out[..., r:, r:] = block
    i1, i2 = plane_dims(spec)
    out[..., i1, i1] = a
    out[..., i2, i2] = a
    out[..., i1, i2] = b
    out[..., i2, i1] = -b
    return out


def project_commutant(M: torch.Tensor, spec: AttentionSpec) -> torch.Tensor:
    """Orthogonal projection of ``[..., dk, dk]`` onto the matrices commuting with every RoPE rotation.

    Pass-through block: free. Each rotated plane: ``a I + b J``. Everything else: 0.
    """
    r = spec.rope_dims
    if r == 0:
        return M
    a, b = plane_parts(M, spec)
    return in_commutant(M.shape[-1], M[..., r:, r:], 0.5 * a, 0.5 * b, spec)


def project_tied(t: torch.Tensor, spec: AttentionSpec) -> torch.Tensor:
    """Orthogonal projection of ``[..., dk]`` onto vectors equal on both dims of each plane."""
    if spec.rope_dims == 0:
        return t
    i1, i2 = plane_dims(spec)
    out = t.clone()
    mean = 0.5 * (t[..., i1] + t[..., i2])
    out[..., i1] = mean
    out[..., i2] = mean
    return out
