"""The reference module: fused path against the slow oracle, and the bias facts."""

from __future__ import annotations

import pytest
import torch

from attnid import Attention, AttentionSpec, randomize_
from attnid.attention import attend_reference

SPECS = [
    AttentionSpec(d_model=16, n_heads=4),
    AttentionSpec(d_model=16, n_heads=4, n_kv_heads=2, bias="qkvo", rope=1.0),
    AttentionSpec(d_model=16, n_heads=4, n_kv_heads=1, rope=0.5, rope_pairing="interleaved"),
    AttentionSpec(d_model=12, n_heads=3, head_dim=8, v_head_dim=6, qk_norm="head", rope=1.0),
]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).detach().norm() / b.detach().norm())


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.describe())
def test_fused_matches_reference(spec: AttentionSpec, causal: bool):
    layer = randomize_(Attention(spec).double(), 0)
    x = torch.randn(3, 7, spec.d_model, dtype=torch.float64)
    err = rel_err(layer(x, causal=causal), attend_reference(layer, x, causal=causal))
    assert err < 1e-12, f"fused vs reference: relative error {err:.2e}"


@pytest.mark.parametrize("spec", [
    AttentionSpec(d_model=16, n_heads=4, bias="qkvo"),
    AttentionSpec(d_model=16, n_heads=4, n_kv_heads=2, bias="k", rope=0.5),
], ids=lambda s: s.describe())
def test_key_bias_has_no_effect_without_full_rope(spec: AttentionSpec):
    layer = randomize_(Attention(spec).double(), 0)
    x = torch.randn(4, 9, spec.d_model, dtype=torch.float64)
    before = layer(x)
    with torch.no_grad():
        r = spec.rope_dims  # only the pass-through part of b_K is free under partial RoPE
        layer.b_K[:, r:] += 100.0 * torch.randn_like(layer.b_K[:, r:])
    err = rel_err(layer(x), before)
    assert err < 1e-12, f"key bias changed the output: relative error {err:.2e}"


def test_key_bias_matters_under_full_rope():
    spec = AttentionSpec(d_model=16, n_heads=4, bias="k", rope=1.0)
    layer = randomize_(Attention(spec).double(), 0)
    x = torch.randn(4, 9, spec.d_model, dtype=torch.float64)
    before = layer(x)
    with torch.no_grad():
        layer.b_K += torch.randn_like(layer.b_K)
    assert rel_err(layer(x), before) > 1e-3


def test_value_bias_folds_into_output_bias():
    spec = AttentionSpec(d_model=16, n_heads=4, n_kv_heads=2, bias="vo")
    layer = randomize_(Attention(spec).double(), 0)
    x = torch.randn(4, 9, spec.d_model, dtype=torch.float64)
    before = layer(x)
    with torch.no_grad():
        group = torch.arange(spec.n_heads) // spec.group_size
        layer.b_O += torch.einsum("hv,hvd->d", layer.b_V[group], layer.W_O)
        layer.b_V.zero_()
    err = rel_err(layer(x), before)
    assert err < 1e-12, f"folding b_V into b_O changed the output: {err:.2e}"


def test_canonical_layout_shapes():
    spec = AttentionSpec(d_model=16, n_heads=4, n_kv_heads=2, head_dim=3, v_head_dim=5,
                         bias="qkvo", qk_norm="head")
    layer = Attention(spec)
    assert {n: tuple(p.shape) for n, p in layer.named_parameters()} == spec.param_shapes()
    assert layer.W_Q.shape == (4, 16, 3) and layer.W_O.shape == (4, 5, 16)
