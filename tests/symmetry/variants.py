"""Variants the symmetry toolkit is checked on (head sizes <= d_model: the orbit is the null space)."""

from __future__ import annotations

from attnid import AttentionSpec
from grid import grid

VARIANTS = [
    AttentionSpec(d_model=12, n_heads=3),
    AttentionSpec(d_model=12, n_heads=3, bias="qkvo"),
    AttentionSpec(d_model=12, n_heads=4, n_kv_heads=2, bias="qkv"),
    AttentionSpec(d_model=12, n_heads=4, n_kv_heads=1, bias="kvo"),
    AttentionSpec(d_model=12, n_heads=3, rope=1.0, bias="qk"),
    AttentionSpec(d_model=12, n_heads=3, rope=0.5, rope_pairing="interleaved", bias="qkvo"),
    AttentionSpec(d_model=16, n_heads=4, n_kv_heads=2, rope=0.5, bias="kv"),
    AttentionSpec(d_model=12, n_heads=2, head_dim=4, v_head_dim=3, bias="v"),
    AttentionSpec(d_model=12, n_heads=4, n_kv_heads=2, qk_norm="head", bias="qk"),
    AttentionSpec(d_model=12, n_heads=3, rope=1.0, qk_norm="head", qk_norm_eps=0.0, bias="qkvo"),
    AttentionSpec(d_model=16, n_heads=4, n_kv_heads=2, rope=1.0, qk_norm="head", bias="o"),
]
IDS = [s.describe() for s in VARIANTS]

ORBIT_GRID = [s for s in grid() if s.head_dim <= s.d_model and s.v_head_dim <= s.d_model][::3]
