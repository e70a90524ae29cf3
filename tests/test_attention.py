"""The reference module: fused path against the slow oracle, and the bias facts."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnid import Attention, AttentionSpec, randomize_
from attnid.rope import inv_freq
from attnid.testing import (
    TOLERANCE,
    assert_function_preserved,
    assert_rope_relative,
    attention_reference,
    relative_error,
    rope_relative_error,
)

SPECS = [
    AttentionSpec(d_model=16, n_heads=4),
    AttentionSpec(d_model=16, n_heads=4, n_kv_heads=2, bias="qkvo", rope=1.0),
    AttentionSpec(d_model=16, n_heads=4, n_kv_heads=1, rope=0.5, rope_pairing="interleaved"),
    AttentionSpec(d_model=12, n_heads=3, head_dim=8, v_head_dim=6, qk_norm="head", rope=1.0),
    AttentionSpec(d_model=12, n_heads=4, n_kv_heads=2, head_dim=8, bias="qk", qk_norm="head",
                  qk_norm_eps=1e-3, rope=0.5, rope_pairing="interleaved"),
    AttentionSpec(d_model=10, n_heads=2, head_dim=6, v_head_dim=3, bias="kv", rope=2 / 3),
]


# Two float64 computations of one function, with no transform between them and no depth:
# they agree to ~1e-15, so these tests ask for 1e-12, tighter than TOLERANCE[float64]
# (1e-10, which leaves room for the transforms' ill-conditioning and a model's depth).
EXACT = 1e-12
assert TOLERANCE[torch.float64] > EXACT


def _x(spec: AttentionSpec, seed: int = 0, batch: int = 3, length: int = 7) -> torch.Tensor:
    return torch.randn(batch, length, spec.d_model, dtype=torch.float64,
                       generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.describe())
def test_fused_matches_reference(spec: AttentionSpec, causal: bool):
    layer = randomize_(Attention(spec).double(), 0)
    assert_function_preserved(lambda x: attention_reference(layer, x, causal=causal),
                              lambda x: layer(x, causal=causal), _x(spec), rtol=EXACT)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.describe())
def test_reference_sees_a_wrong_mask(spec: AttentionSpec):
    # the comparison above can fail: the other mask is far from the reference
    layer = randomize_(Attention(spec).double(), 0)
    x = _x(spec)
    err = relative_error(layer(x, causal=False), attention_reference(layer, x, causal=True))
    assert err > 1e-2, f"causal and full masks agree to {err:.2e}: the check would be vacuous"


@pytest.mark.parametrize("spec", [s for s in SPECS if s.rope_dims >= 4], ids=lambda s: s.describe())
def test_reference_sees_a_wrong_rope_pairing(spec: AttentionSpec):
    # (with one plane both pairings are the same map)
    other = replace(spec, rope_pairing="half" if spec.rope_pairing == "interleaved" else "interleaved")
    layer = randomize_(Attention(spec).double(), 0)
    wrong = Attention(other).double()
    wrong.load_state_dict(layer.state_dict())
    x = _x(spec)
    err = relative_error(wrong(x), attention_reference(layer, x))
    assert err > 1e-3, f"RoPE pairings agree to {err:.2e}: the reference would not tell them apart"


@settings(max_examples=40, deadline=None)
@given(half_planes=st.integers(1, 4), extra=st.integers(0, 3),
       pairing=st.sampled_from(["half", "interleaved"]),
       base=st.sampled_from([100.0, 10_000.0, 500_000.0]), seed=st.integers(0, 10_000))
def test_property_rope_scores_depend_only_on_relative_position(half_planes, extra, pairing, base, seed):
    dk = 2 * half_planes + 2 * extra
    spec = AttentionSpec(d_model=4, n_heads=1, head_dim=dk, rope=2 * half_planes / dk,
                         rope_pairing=pairing, rope_base=base)
    assert_rope_relative(spec, seed=seed)


def test_rope_check_can_fail(monkeypatch):
    # angles growing like position^2 are not a rotation group: the check must say so
    spec = AttentionSpec(d_model=4, n_heads=1, head_dim=4, rope=1.0)
    assert rope_relative_error(spec) < EXACT

    def quadratic(spec, positions, dtype):
        angles = positions.to(torch.float64)[:, None] ** 2 * inv_freq(spec)[None, :]
        return angles.cos().to(dtype), angles.sin().to(dtype)

    monkeypatch.setattr("attnid.testing.rope_tables", quadratic)
    with pytest.raises(AssertionError, match="absolute position"):
        assert_rope_relative(spec)


@pytest.mark.parametrize("spec", [
    AttentionSpec(d_model=16, n_heads=4, bias="qkvo"),
    AttentionSpec(d_model=16, n_heads=4, n_kv_heads=2, bias="k", rope=0.5),
], ids=lambda s: s.describe())
def test_key_bias_has_no_effect_without_full_rope(spec: AttentionSpec):
    layer = randomize_(Attention(spec).double(), 0)
    before = copy.deepcopy(layer)
    with torch.no_grad():
        r = spec.rope_dims  # only the pass-through part of b_K is free under partial RoPE
        layer.b_K[:, r:] += 100.0 * torch.randn_like(layer.b_K[:, r:])
    assert_function_preserved(before, layer, _x(spec, batch=4, length=9), rtol=EXACT)


def test_key_bias_matters_under_full_rope():
    spec = AttentionSpec(d_model=16, n_heads=4, bias="k", rope=1.0)
    layer = randomize_(Attention(spec).double(), 0)
    x = _x(spec, batch=4, length=9)
    before = layer(x)
    with torch.no_grad():
        layer.b_K += torch.randn_like(layer.b_K)
    assert relative_error(layer(x), before) > 1e-3


def test_value_bias_folds_into_output_bias():
    spec = AttentionSpec(d_model=16, n_heads=4, n_kv_heads=2, bias="vo")
    layer = randomize_(Attention(spec).double(), 0)
    before = copy.deepcopy(layer)
    with torch.no_grad():
        kv_group = torch.arange(spec.n_heads) // spec.kv_group_size
        layer.b_O += torch.einsum("hv,hvd->d", layer.b_V[kv_group], layer.W_O)
        layer.b_V.zero_()
    assert_function_preserved(before, layer, _x(spec, batch=4, length=9), rtol=EXACT)


def test_canonical_layout_shapes():
    spec = AttentionSpec(d_model=16, n_heads=4, n_kv_heads=2, head_dim=3, v_head_dim=5,
                         bias="qkvo", qk_norm="head")
    layer = Attention(spec)
    assert {n: tuple(p.shape) for n, p in layer.named_parameters()} == spec.param_shapes()
    assert layer.W_Q.shape == (4, 16, 3) and layer.W_O.shape == (4, 5, 16)
