"""Gauge transforms and rebalancing preserve the function; inputs are never modified."""

from __future__ import annotations

import copy

import pytest
import torch

from attnid import Attention, AttentionSpec, AttnidError, randomize_
from attnid.symmetry import AttentionWeights, Gauge, apply_gauge, metrics, random_gauge, rebalance
from attnid.symmetry.rebalance import balance_pair
from attnid.testing import assert_function_preserved, assert_gauge_invariant, relative_error
from attnid.testing.specs import ORBIT_GRID, VARIANTS
from attnid.testing.specs import VARIANT_IDS as IDS


def _setup(spec: AttentionSpec, dtype=torch.float64) -> tuple[AttentionWeights, torch.Tensor]:
    layer = randomize_(Attention(spec).to(dtype), 0)
    x = torch.randn(4, 9, spec.d_model, generator=torch.Generator().manual_seed(5)).to(dtype)
    return AttentionWeights.from_module(layer), x


def _module(w: AttentionWeights) -> Attention:
    return w.to_module(causal=True)


@pytest.mark.parametrize("spec", VARIANTS, ids=IDS)
def test_random_gauge_preserves_outputs(spec: AttentionSpec):
    layer = randomize_(Attention(spec).double(), 0)
    saved = copy.deepcopy(layer.state_dict())
    assert_gauge_invariant(layer, seed=3)  # float64, causal and not, 1e-10 relative
    assert all(torch.equal(saved[n], t) for n, t in layer.state_dict().items()), "the layer was modified"


@pytest.mark.parametrize("spec", VARIANTS, ids=IDS)
def test_random_gauge_in_float32(spec: AttentionSpec):
    """Weights stored in float32 (as checkpoints hold them): the gauged layer, rounded to
    float32, computes the same function to float32's tolerance."""
    w, x = _setup(spec, torch.float32)
    saved = w.clone()
    w2 = apply_gauge(w.to(torch.float64), random_gauge(w.to(torch.float64), seed=3)).to(torch.float32)
    assert_function_preserved(_module(w), _module(w2), x)  # float32 output: TOLERANCE[float32]
    moved = max(float((w2[n] - w[n]).abs().max()) for n, _ in w.items())
    assert moved > 1e-2, "the gauge did not move the weights: the test would be vacuous"
    assert all(torch.equal(saved[n], w[n]) for n, _ in w.items()), "input weights were modified"


def test_assert_gauge_invariant_can_fail():
    spec = AttentionSpec(d_model=12, n_heads=3, rope=1.0)
    layer = randomize_(Attention(spec).double(), 0)
    gen = torch.Generator().manual_seed(0)
    # a general linear map of each head's q/k space: not in the commutant of RoPE
    S = torch.eye(4, dtype=torch.float64) + 0.5 * torch.randn(3, 4, 4, generator=gen, dtype=torch.float64)
    with pytest.raises(AssertionError, match="function changed: relative error"):
        assert_gauge_invariant(layer, Gauge(qk=S))
    with pytest.raises(AssertionError, match="nothing is tested"):
        assert_gauge_invariant(layer, Gauge())
    # the same element through the weights container, and its measured error returned
    assert assert_gauge_invariant(AttentionWeights.from_module(layer), seed=1) < 1e-10


@pytest.mark.parametrize("spec", VARIANTS, ids=IDS)
def test_rebalance_preserves_outputs_and_zeroes_conserved(spec: AttentionSpec):
    w, x = _setup(spec)
    w = apply_gauge(w, random_gauge(w, seed=1))  # start far from balance
    saved = w.clone()
    before = metrics(w)
    w2 = rebalance(w)
    assert_function_preserved(_module(saved), _module(w2), x)  # float64: TOLERANCE 1e-10
    after = metrics(w2)
    for side in ("qk", "vo"):
        b0, b1 = float(before.side(side).beta.max()), float(after.side(side).beta.max())
        assert b1 < 1e-10 * max(1.0, b0), f"beta_{side} {b0:.3g} -> {b1:.3g}"
    assert all(torch.equal(saved[n], w[n]) for n, _ in w.items()), "input weights were modified"


def test_rebalance_drops_unidentified_key_bias_and_folds_value_bias():
    spec = AttentionSpec(d_model=12, n_heads=3, bias="qkvo", rope=0.5)
    w, x = _setup(spec)
    w2 = rebalance(w)
    r = spec.rope_dims
    assert float(w2.b_K[..., r:].abs().max()) == 0.0
    assert float(w2.b_K[..., :r].abs().min()) > 0.0, "RoPE makes the rotated key bias identified"
    assert float(w2.b_V.abs().max()) == 0.0
    assert_function_preserved(_module(w), _module(w2), x)


def test_full_gl_rebalance_refused_under_rope():
    spec = AttentionSpec(d_model=12, n_heads=3, rope=1.0)
    w, _ = _setup(spec)
    with pytest.raises(AttnidError, match="RoPE"):
        rebalance(w, subgroup="gl")


def test_batched_over_layers_matches_one_by_one():
    spec = AttentionSpec(d_model=16, n_heads=4, n_kv_heads=2, bias="qkvo", rope=0.5)
    layers = [AttentionWeights.from_module(randomize_(Attention(spec).double(), s)) for s in range(3)]
    stacked = rebalance(AttentionWeights.stack(layers))
    for i, w in enumerate(layers):
        one = rebalance(w)
        for n, t in one.items():
            assert torch.allclose(stacked.unstack()[i][n], t, atol=1e-12), n


@pytest.mark.parametrize("dead", [False, True], ids=["generic", "dead-head"])
def test_balance_pair_keeps_the_product_and_balances(dead: bool):
    # a dead head (zero columns) makes R singular: the pair is balanced through Q instead
    gen = torch.Generator().manual_seed(7)
    A = torch.randn(3, 20, 6, generator=gen, dtype=torch.float64)
    B = torch.randn(3, 17, 6, generator=gen, dtype=torch.float64)
    if dead:
        A[1, :, :2] = 0.0
    A2, B2 = balance_pair(A, B)
    # one product of two factors, no depth: ~1e-15, so 1e-12 (tighter than TOLERANCE[float64])
    err = relative_error(A2 @ B2.transpose(-1, -2), A @ B.transpose(-1, -2))
    assert err < 1e-12, f"product changed by {err:.2e}"
    gap = relative_error(A2.transpose(-1, -2) @ A2, B2.transpose(-1, -2) @ B2)
    assert gap < 1e-10, f"Grams differ by {gap:.2e} after balancing"


@pytest.mark.parametrize("spec", ORBIT_GRID, ids=lambda s: s.describe())
def test_grid_is_gauge_invariant(spec: AttentionSpec):
    """A random group element on every third spec of the arbiter grid (GQA, RoPE pairings,
    biases, QK-norm with and without eps)."""
    assert_gauge_invariant(randomize_(Attention(spec), 0), seed=2)
