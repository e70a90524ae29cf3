"""Gauge transforms and rebalancing preserve the function; inputs are never modified."""

from __future__ import annotations

import pytest
import torch
from variants import IDS, VARIANTS

from attnid import Attention, AttentionSpec, AttnidError, randomize_
from attnid.symmetry import AttentionWeights, apply_gauge, metrics, random_gauge, rebalance
from attnid.symmetry.rebalance import balance_pair
from attnid.testing import TOLERANCE as TOL
from attnid.testing import relative_error


def _setup(spec: AttentionSpec, dtype=torch.float64):
    layer = randomize_(Attention(spec).to(dtype), 0)
    w = AttentionWeights.from_module(layer)
    x = torch.randn(4, 9, spec.d_model, generator=torch.Generator().manual_seed(5)).to(dtype)
    with torch.no_grad():
        y = layer(x, causal=True)
    return w, x, y


def _rel(y2: torch.Tensor, y: torch.Tensor) -> float:
    return relative_error(y2, y)


def _out(w: AttentionWeights, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return w.to_module()(x, causal=True)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("spec", VARIANTS, ids=IDS)
def test_random_gauge_preserves_outputs(spec: AttentionSpec, dtype: torch.dtype):
    w, x, y = _setup(spec, dtype)
    saved = w.clone()
    g = random_gauge(w.to(torch.float64), seed=3)
    w2 = apply_gauge(w.to(torch.float64), g).to(dtype)
    err = _rel(_out(w2, x), y)
    assert err < TOL[dtype], f"gauge changed the output: relative error {err:.2e}"
    moved = max(float((w2[n] - w[n]).abs().max()) for n, _ in w.items())
    assert moved > 1e-2, "the gauge did not move the weights: the test would be vacuous"
    assert all(torch.equal(saved[n], w[n]) for n, _ in w.items()), "input weights were modified"


@pytest.mark.parametrize("spec", VARIANTS, ids=IDS)
def test_rebalance_preserves_outputs_and_zeroes_conserved(spec: AttentionSpec):
    w, x, y = _setup(spec)
    w = apply_gauge(w, random_gauge(w, seed=1))  # start far from balance
    saved = w.clone()
    before = metrics(w)
    w2 = rebalance(w)
    err = _rel(_out(w2, x), y)
    assert err < 1e-10, f"rebalancing changed the output: relative error {err:.2e}"
    after = metrics(w2)
    for side in ("qk", "vo"):
        b0, b1 = float(before.side(side).beta.max()), float(after.side(side).beta.max())
        assert b1 < 1e-10 * max(1.0, b0), f"beta_{side} {b0:.3g} -> {b1:.3g}"
    assert all(torch.equal(saved[n], w[n]) for n, _ in w.items()), "input weights were modified"


def test_rebalance_drops_unidentified_key_bias_and_folds_value_bias():
    spec = AttentionSpec(d_model=12, n_heads=3, bias="qkvo", rope=0.5)
    w, x, y = _setup(spec)
    w2 = rebalance(w)
    r = spec.rope_dims
    assert float(w2.b_K[..., r:].abs().max()) == 0.0
    assert float(w2.b_K[..., :r].abs().min()) > 0.0, "RoPE makes the rotated key bias identified"
    assert float(w2.b_V.abs().max()) == 0.0
    assert _rel(_out(w2, x), y) < 1e-10


def test_full_gl_rebalance_refused_under_rope():
    spec = AttentionSpec(d_model=12, n_heads=3, rope=1.0)
    w, _, _ = _setup(spec)
    with pytest.raises(AttnidError, match="RoPE"):
        rebalance(w, group="gl")


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
    err = relative_error(A2 @ B2.transpose(-1, -2), A @ B.transpose(-1, -2))
    assert err < 1e-12, f"product changed by {err:.2e}"
    gap = relative_error(A2.transpose(-1, -2) @ A2, B2.transpose(-1, -2) @ B2)
    assert gap < 1e-10, f"Grams differ by {gap:.2e} after balancing"
