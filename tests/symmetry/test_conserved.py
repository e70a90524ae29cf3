"""Conserved quantities: constant under gradient flow, drift O(lr^2) for SGD."""

from __future__ import annotations

import pytest
import torch

from attnid import Attention, AttentionSpec, randomize_
from attnid.arbiter.rank import default_forward, forward_call
from attnid.symmetry import SIDES, AttentionWeights, Metrics, metrics
from attnid.testing.specs import VARIANT_IDS as IDS
from attnid.testing.specs import VARIANTS


def sgd_step(spec: AttentionSpec, lr: float) -> Metrics:
    layer = randomize_(Attention(spec).double(), 4)
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(8, 6, spec.d_model, generator=gen, dtype=torch.float64)
    target = torch.randn(8, 6, spec.d_model, generator=gen, dtype=torch.float64)
    params = dict(layer.named_parameters())
    loss = ((forward_call(layer, params, x, default_forward) - target) ** 2).mean()
    grads = torch.autograd.grad(loss, list(params.values()))
    w0 = AttentionWeights.from_module(layer)
    g = AttentionWeights.from_tensors(spec, dict(zip(params, grads, strict=True)))
    return metrics(w0, w0 - g.scale(lr))


@pytest.mark.parametrize("spec", VARIANTS, ids=IDS)
def test_halving_sgd_step_divides_drift_by_four(spec: AttentionSpec):
    for side in SIDES:
        d1 = sgd_step(spec, 1e-2).side(side).drift
        d2 = sgd_step(spec, 5e-3).side(side).drift
        mask = d1 > 1e-14
        assert bool(mask.any()), "no drift at all: vacuous"
        ratio = d1[mask] / d2[mask]
        assert torch.allclose(ratio, torch.full_like(ratio, 4.0), rtol=0.05), (side, ratio)


def test_metric_shapes_and_definitions():
    spec = AttentionSpec(d_model=12, n_heads=4, n_kv_heads=2)
    w = AttentionWeights.from_module(randomize_(Attention(spec).double(), 0))
    m = metrics(w)
    assert m.qk.beta.shape == (2,) and m.vo.tau.shape == (2,) and m.qk.drift is None
    Wq = w.W_Q.reshape(2, 2, 12, 3)
    C0 = sum(Wq[0, i].T @ Wq[0, i] for i in range(2)) - w.W_K[0].T @ w.W_K[0]
    assert float(m.qk.beta[0]) == pytest.approx(float(C0.norm()), rel=1e-12)
    assert float(m.qk.tau[0]) == pytest.approx(float(C0.trace()), rel=1e-12)


def test_metrics_of_a_view_follow_in_place_updates():
    spec = AttentionSpec(d_model=12, n_heads=3)
    layer = randomize_(Attention(spec).double(), 0)
    w = AttentionWeights.from_module(layer)  # views of the parameters
    first = metrics(w).qk.beta.clone()
    with torch.no_grad():
        layer.W_Q.mul_(2.0)
    second = metrics(w).qk.beta
    assert not torch.allclose(first, second), "stale Gram matrices after an in-place update"


@pytest.mark.parametrize("spec", [AttentionSpec(d_model=12, n_heads=4, n_kv_heads=2),
                                  AttentionSpec(d_model=12, n_heads=4, qk_norm="head")],
                         ids=["gqa", "qk-norm"])
def test_flat_names_are_the_field_names_per_side(spec: AttentionSpec):
    m = sgd_step(spec, 1e-2)
    flat = m.flat()
    assert list(flat) == [f"{q}_{s}" for s in ("qk", "vo") for q in ("beta", "tau", "mu", "drift")]
    for side in SIDES:
        for q in ("beta", "tau", "mu", "drift"):
            assert flat[f"{q}_{side}"] is getattr(m.side(side), q), (q, side)
    assert list(m.flat(("tau", "mu"))) == ["tau_qk", "mu_qk", "tau_vo", "mu_vo"]
    layers = [AttentionWeights.from_module(randomize_(Attention(spec).double(), s)) for s in (0, 1)]
    assert "drift_qk" not in metrics(layers[0]).flat()  # one point: no drift
    # one layer of a stack, as the Monitor slices it
    both, one = metrics(AttentionWeights.stack(layers)), metrics(layers[1])
    picked = both.map(lambda t: t[1])
    for key, t in one.flat().items():
        assert torch.allclose(picked.flat()[key], t, rtol=1e-12, atol=0), key
