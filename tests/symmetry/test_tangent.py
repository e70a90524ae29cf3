"""The orbit's tangent space equals the arbiter's null space; projection is right."""

from __future__ import annotations

import pytest
import torch

from attnid import Attention, AttentionSpec, count, jacobian_rank, randomize_
from attnid.arbiter.rank import default_forward, forward_call
from attnid.symmetry import AttentionWeights, project, tangent_basis
from attnid.testing.specs import ORBIT_GRID, VARIANTS
from attnid.testing.specs import VARIANT_IDS as IDS


# every other spec of the orbit grid in the default run (the VARIANTS below are all checked too)
@pytest.mark.parametrize("spec", [pytest.param(s, id=s.describe(), marks=pytest.mark.slow if i % 2 else ())
                                  for i, s in enumerate(ORBIT_GRID)])
def test_tangent_span_equals_null_space(spec: AttentionSpec):
    layer = randomize_(Attention(spec).double(), 1)
    B = tangent_basis(AttentionWeights.from_module(layer))
    found = jacobian_rank(layer, seed=1, return_null_space=True)
    assert B.shape[1] == found.nullity == count(spec).unidentified
    if found.nullity:
        # sine of the largest principal angle between the two subspaces (same dimension)
        sine = float(torch.linalg.matrix_norm(found.null_space - B @ (B.T @ found.null_space), ord=2))
        assert sine < 1e-8, f"largest principal angle: sine {sine:.2e}"


def _weights(spec: AttentionSpec, seed: int = 0) -> AttentionWeights:
    return AttentionWeights.from_module(randomize_(Attention(spec).double(), seed))


def _full(p, w: AttentionWeights, part: str) -> AttentionWeights:
    t = getattr(p, part)
    return w.replace(**{n: t.get(n, torch.zeros_like(x)) for n, x in w.items()})


@pytest.mark.parametrize("spec", VARIANTS, ids=IDS)
def test_projection_matches_dense_reference_and_is_idempotent(spec: AttentionSpec):
    w = _weights(spec)
    delta = w.map(lambda t: torch.randn_like(t))
    B = tangent_basis(w)
    exact = spec.qk_norm == "none" or spec.qk_norm_eps == 0.0
    if not exact:
        pytest.skip("eps > 0: the scale directions are not in the exact tangent space")
    dense = B @ (B.T @ delta.flat())
    tangent = w.replace(**{**{n: torch.zeros_like(t) for n, t in w.items()},
                           **project(w, delta, "qk").tangent, **project(w, delta, "vo").tangent})
    err = float((tangent.flat() - dense).norm() / dense.norm())
    assert err < 1e-9, f"CG projection vs dense: {err:.2e}"
    again = {**project(w, tangent, "qk").tangent, **project(w, tangent, "vo").tangent}
    err2 = float((w.replace(**again).flat() - tangent.flat()).norm() / tangent.flat().norm())
    assert err2 < 1e-9, f"projection is not idempotent: {err2:.2e}"
    normal = delta.flat() - tangent.flat()
    assert abs(float(normal @ tangent.flat())) < 1e-9 * float(delta.flat().norm() ** 2)


@pytest.mark.parametrize("spec", VARIANTS, ids=IDS)
def test_rho_of_gradient_is_zero_and_of_tangent_is_one(spec: AttentionSpec):
    layer = randomize_(Attention(spec).double(), 2)
    w = AttentionWeights.from_module(layer)
    x = torch.randn(8, 6, spec.d_model, dtype=torch.float64)
    target = torch.randn(8, 6, spec.d_model, dtype=torch.float64)
    params = dict(layer.named_parameters())
    loss = ((forward_call(layer, params, x, default_forward) - target) ** 2).mean()
    grads = torch.autograd.grad(loss, list(params.values()))
    g = AttentionWeights.from_tensors(spec, dict(zip(params, grads, strict=True)))
    for side in ("qk", "vo"):
        rho = project(w, g, side).rho_layer
        assert float(rho.max()) < 1e-10, f"rho_{side} of a gradient = {float(rho.max()):.2e}"
        tangent = project(w, w.map(torch.randn_like), side).tangent
        t = w.replace(**{**{n: torch.zeros_like(v) for n, v in w.items()}, **tangent})
        rho_t = project(w, t, side).rho_layer
        assert abs(float(rho_t) - 1.0) < 1e-9, f"rho_{side} of a tangent step = {float(rho_t)}"


@pytest.mark.parametrize("spec", [
    AttentionSpec(d_model=24, n_heads=4),
    AttentionSpec(d_model=24, n_heads=6, n_kv_heads=2),
    AttentionSpec(d_model=24, n_heads=4, rope=1.0),
], ids=lambda s: s.describe())
def test_isotropic_updates_average_the_tangent_share(spec: AttentionSpec):
    w = _weights(spec)
    gen = torch.Generator().manual_seed(0)
    n = 200
    batch = AttentionWeights.stack([w] * n)
    delta = batch.map(lambda t: torch.randn(t.shape, generator=gen, dtype=t.dtype))
    c = count(spec)
    comps = c.components
    share = comps["qk_gauge"].unidentified / comps["qk_gauge"].params
    rho = project(batch, delta, "qk").rho_layer
    se = float(rho.std()) / n**0.5
    assert abs(float(rho.mean()) - share) < 4 * se + 1e-3, (float(rho.mean()), share, se)
    if spec.n_kv_heads == spec.n_heads and not spec.rope:
        assert share == pytest.approx(1 / (2 * spec.n_heads))


@pytest.mark.parametrize("spec", VARIANTS, ids=IDS)
def test_rho_from_grams_equals_rho_of_the_formed_tangent(spec: AttentionSpec):
    # rho is computed from generators and Gram matrices; forming the tangent must agree
    from attnid.symmetry.projection import _kv_group_sq

    w = _weights(spec, 3)
    gen = torch.Generator().manual_seed(3)
    delta = w.map(lambda t: torch.randn(t.shape, generator=gen, dtype=t.dtype))
    for side in ("qk", "vo"):
        p = project(w, delta, side)
        formed = _kv_group_sq(p.tangent, w, side) / _kv_group_sq(p.delta, w, side)
        err = float((p.rho - formed).abs().max())
        assert err < 1e-10, f"rho_{side} from Grams vs formed tangent: {err:.2e}"
        total = sum(float((t**2).sum()) for t in p.tangent.values())
        whole = sum(float((t**2).sum()) for t in p.delta.values())
        assert abs(float(p.rho_layer) - total / whole) < 1e-10, (float(p.rho_layer), total / whole)
