"""`attnid.Attention`: the reference attention layer for every variant of `AttentionSpec`.

Weights are held per head in the canonical layout (paper names)::

    W_Q [H, d, d_k]   W_K [G, d, d_k]   W_V [G, d, d_v]   W_O [H, d_v, d]
    b_Q [H, d_k]      b_K [G, d_k]      b_V [G, d_v]      b_O [d]
    g_Q [d_k]         g_K [d_k]         (QK-norm gains, shared across heads)

Query head ``h`` reads key/value group ``h // (H / G)``. The forward pass takes the
fused ``scaled_dot_product_attention`` kernel; :func:`attnid.testing.attention_reference`
is the slow, obviously correct version it is tested against.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from attnid.rope import apply_rope, rope_tables
from attnid.spec import AttentionSpec


class Attention(nn.Module):
    """Multi-head / grouped-query self-attention with optional biases, RoPE and QK-norm.

    >>> layer = Attention(AttentionSpec(d_model=16, n_heads=4, n_kv_heads=2, rope=1.0))
    >>> layer(torch.randn(2, 5, 16)).shape
    torch.Size([2, 5, 16])
    """

    def __init__(self, spec: AttentionSpec, *, causal: bool = False) -> None:
        super().__init__()
        self.spec = spec
        self.causal = causal
        for name, shape in spec.param_shapes().items():
            self.register_parameter(name, nn.Parameter(torch.empty(shape)))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """nn.Linear-like init: weights U(+-1/sqrt(fan_in)), biases 0, norm gains 1."""
        s = self.spec
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.startswith("W_"):
                    fan_in = s.d_model if name != "W_O" else s.n_heads * s.v_head_dim
                    bound = 1.0 / math.sqrt(fan_in)
                    p.uniform_(-bound, bound)
                elif name.startswith("b_"):
                    p.zero_()
                else:
                    p.fill_(1.0)

    def forward(self, x: torch.Tensor, *, causal: bool | None = None) -> torch.Tensor:
        q, k, v = self.project_qkv(x)  # (B, H, T, dk), (B, G, T, dk), (B, G, T, dv)
        is_causal = self.causal if causal is None else causal
        m = self.spec.kv_group_size
        if m > 1:
            k = k.repeat_interleave(m, dim=1)  # (B, H, T, dk)
            v = v.repeat_interleave(m, dim=1)  # (B, H, T, dv)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)  # (B, H, T, dv)
        return self.project_out(y)

    def project_qkv(
        self, x: torch.Tensor, positions: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per-head queries, keys and values after biases, QK-norm and RoPE."""
        s = self.spec
        q = torch.einsum("btd,hdk->bhtk", x, self.W_Q)  # (B, H, T, dk)
        k = torch.einsum("btd,gdk->bgtk", x, self.W_K)  # (B, G, T, dk)
        v = torch.einsum("btd,gdv->bgtv", x, self.W_V)  # (B, G, T, dv)
        if "q" in s.bias:
            q = q + self.b_Q[:, None, :]
        if "k" in s.bias:
            k = k + self.b_K[:, None, :]
        if "v" in s.bias:
            v = v + self.b_V[:, None, :]
        if s.qk_norm == "head":
            q = rms_norm(q, self.g_Q, s.qk_norm_eps)
            k = rms_norm(k, self.g_K, s.qk_norm_eps)
        if s.rope_dims:
            if positions is None:
                positions = torch.arange(x.shape[1], device=x.device)
            cos, sin = rope_tables(s, positions, x.dtype)
            cos, sin = cos.to(x.device), sin.to(x.device)
            q, k = apply_rope(q, s, cos, sin), apply_rope(k, s, cos, sin)
        return q, k, v

    def project_out(self, y: torch.Tensor) -> torch.Tensor:
        out = torch.einsum("bhtv,hvd->btd", y, self.W_O)  # (B, T, d)
        if "o" in self.spec.bias:
            out = out + self.b_O
        return out

    def extra_repr(self) -> str:
        return self.spec.describe() + (" causal" if self.causal else "")


def rms_norm(z: torch.Tensor, gain: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim with a learned gain (QK-norm)."""
    return z * torch.rsqrt(z.pow(2).mean(-1, keepdim=True) + eps) * gain
