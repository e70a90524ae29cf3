"""The attention variants the tests run on:

- :func:`grid`: every shape x positional variant, a few bias subsets each, on which every
  closed-form count is checked against the arbiter;
- :data:`VARIANTS` (named by :data:`VARIANT_IDS`): the variants the symmetry toolkit is checked
  on, head sizes <= d_model (the orbit is then the null space); :data:`ORBIT_GRID`: a third of
  the grid with that property.
"""

from __future__ import annotations

import itertools

from attnid.errors import AttnidError
from attnid.spec import AttentionSpec
from attnid.theory import count

# (d_model, n_heads, n_kv_heads, head_dim, v_head_dim): MHA, GQA, MQA, one head,
# head_dim != d/H, head_dim > d_model, d_v != d_k.
SHAPES = [
    (8, 2, 2, 4, 4),
    (8, 4, 2, 2, 2),
    (8, 4, 1, 2, 2),
    (6, 3, 3, 2, 2),
    (4, 1, 1, 4, 4),
    (8, 4, 4, 3, 3),
    (6, 2, 2, 4, 3),
    (4, 2, 2, 6, 6),
    (3, 2, 1, 4, 5),
    (8, 2, 1, 6, 2),
]
BIASES = ["", "q", "k", "v", "o", "qk", "qv", "qo", "kv", "ko", "vo", "qkv", "qko", "qvo", "kvo", "qkvo"]
# (rope fraction, pairing, qk_norm, eps)
POSITIONAL = [
    (0.0, "half", "none", 1e-6),
    (1.0, "half", "none", 1e-6),
    (1.0, "interleaved", "none", 1e-6),
    (0.5, "half", "none", 1e-6),
    (0.5, "interleaved", "none", 1e-6),
    (0.0, "half", "head", 1e-6),
    (1.0, "half", "head", 1e-6),
    (0.5, "interleaved", "head", 0.0),
    (0.0, "half", "head", 0.0),
]


def _spec(shape: tuple[int, int, int, int, int], bias: str, pos: tuple[float, str, str, float]
          ) -> AttentionSpec | None:
    d, H, G, dk, dv = shape
    rope, pairing, norm, eps = pos
    try:
        spec = AttentionSpec(d_model=d, n_heads=H, n_kv_heads=G, head_dim=dk, v_head_dim=dv,
                             bias=bias, rope=rope, rope_pairing=pairing, qk_norm=norm,
                             qk_norm_eps=eps)
        count(spec)
    except AttnidError:  # odd rotated dims, or the documented gap in the closed form
        return None
    return spec


def grid() -> list[AttentionSpec]:
    """Every shape x positional variant, each with a few bias subsets in rotation."""
    out: list[AttentionSpec] = []
    rotation = itertools.cycle(BIASES)
    for shape, pos in itertools.product(SHAPES, POSITIONAL):
        for bias in [next(rotation) for _ in range(4)]:
            spec = _spec(shape, bias, pos)
            if spec is not None and spec not in out:
                out.append(spec)
    return out


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
VARIANT_IDS = [s.describe() for s in VARIANTS]

ORBIT_GRID = [s for s in grid() if s.head_dim <= s.d_model and s.v_head_dim <= s.d_model][::3]
