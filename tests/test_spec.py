from __future__ import annotations

import pytest

from attnid import AttentionSpec, AttnidError


@pytest.mark.parametrize("kwargs, message", [
    (dict(d_model=10, n_heads=3), "does not divide d_model"),
    (dict(d_model=12, n_heads=4, n_kv_heads=3), "does not divide n_heads"),
    (dict(d_model=12, n_heads=4, rope=0.5), "even whole number"),  # head_dim 3
    (dict(d_model=12, n_heads=2, rope=1.5), "between 0 and 1"),
    (dict(d_model=0, n_heads=2), "positive integer"),
    (dict(d_model=8, n_heads=2, head_dim=-1), "positive integer"),
    (dict(d_model=8, n_heads=2, bias="qx"), "unknown bias"),
    (dict(d_model=8, n_heads=2, qk_norm="layer"), "qk_norm"),
    (dict(d_model=8, n_heads=2, rope=1.0, rope_pairing="zigzag"), "rope_pairing"),
    (dict(d_model=8, n_heads=2, qk_norm="head", qk_norm_eps=-1.0), "qk_norm_eps"),
])
def test_impossible_specs_are_refused(kwargs, message):
    with pytest.raises(AttnidError, match=message):
        AttentionSpec(**kwargs)


def test_defaults_and_round_trip():
    spec = AttentionSpec(d_model=64, n_heads=8, n_kv_heads=2, bias="vq", rope=0.25)
    assert (spec.head_dim, spec.v_head_dim, spec.kv_group_size) == (8, 8, 4)
    assert (spec.rope_dims, spec.pass_dims) == (2, 6)
    assert spec.bias == frozenset("qv")
    assert AttentionSpec.from_dict(spec.to_dict()) == spec
