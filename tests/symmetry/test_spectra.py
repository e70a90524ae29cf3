"""Cached Gram spectra: mu from the preconditioner's eigendecomposition, and its reuse."""

from __future__ import annotations

import pytest
import torch

from attnid import Attention, AttentionSpec, randomize_
from attnid.symmetry import AttentionWeights, metrics, project
from attnid.symmetry.spectra import (
    freed_bias,
    gauge_eigh,
    gauge_grams,
    smallest_after_rank_one,
    smallest_eigenvalues,
)
from attnid.testing.specs import VARIANT_IDS as IDS
from attnid.testing.specs import VARIANTS
from attnid.weights import grams

TOL = {torch.float64: 1e-11, torch.float32: 2e-6}


def point(spec: AttentionSpec, dtype: torch.dtype, seed: int = 0) -> AttentionWeights:
    """Random weights with biases three times larger than the weights' rows, so that adding
    a freed bias row back changes the smallest eigenvalue by much more than the tolerance."""
    w = AttentionWeights.from_module(randomize_(Attention(spec).double(), seed))
    w = w.replace(**{n: 3 * t for n, t in w.items() if n.startswith("b_")})
    return w.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("spec", VARIANTS, ids=IDS)
def test_smallest_eigenvalues_are_those_of_the_full_grams(spec: AttentionSpec, dtype: torch.dtype):
    w = point(spec, dtype)
    for side in ("qk", "vo"):
        full = [torch.linalg.eigvalsh(g.double()) for g in grams(w.to(torch.float64), side)]
        got = smallest_eigenvalues(w, side)
        for i in range(2):
            scale = float(full[i][..., -1].max())
            err = float((got[i] - full[i][..., 0]).abs().max()) / scale
            assert err < TOL[dtype], f"{side} {['left', 'right'][i]}: relative error {err:.1e}"


@pytest.mark.parametrize("spec", [s for s in VARIANTS if freed_bias(point(s, torch.float64), "vo")
                                  or freed_bias(point(s, torch.float64), "qk")], ids=AttentionSpec.describe)
def test_the_rank_one_correction_is_not_vacuous(spec: AttentionSpec):
    """Where a bias row is freed, the gauge Gram's smallest eigenvalue is not the answer."""
    w = point(spec, torch.float64)
    for side in ("qk", "vo"):
        freed = freed_bias(w, side)
        if freed is None:
            continue
        which = freed[0]
        gauge_min = torch.linalg.eigvalsh(gauge_grams(w, side)[which])[..., 0]
        full_min = smallest_eigenvalues(w, side)[which]
        assert float((full_min - gauge_min).abs().max()) > 1e-4, side


def test_rank_one_update_edge_cases():
    gen = torch.Generator().manual_seed(3)
    for k in (1, 2, 5, 16):
        la = torch.rand(200, k, generator=gen, dtype=torch.float64).sort(-1).values
        z = torch.randn(200, k, generator=gen, dtype=torch.float64)
        z[:20, 0] = 0.0  # no weight on the smallest eigenvector: la_1 stays
        if k > 1:
            la[20:40, 1] = la[20:40, 0]  # a repeated smallest eigenvalue
        ref = torch.linalg.eigvalsh(torch.diag_embed(la) + z.unsqueeze(-1) * z.unsqueeze(-2))[..., 0]
        got = smallest_after_rank_one(la, z)
        err = float((got - ref).abs().max())
        assert err < 1e-13, f"k={k}: error {err:.1e}"
        assert torch.equal(got[:20], la[:20, 0]), "z_1 = 0 must give la_1 exactly"


@pytest.mark.parametrize("spec", VARIANTS, ids=IDS)
def test_gauge_grams_leave_out_exactly_the_freed_bias_rows(spec: AttentionSpec):
    """Against an independent formula: the Gram matrices of weights whose freed bias rows are
    set to what stays (b_K's rotated dims for kappa; nothing of b_V for nu with b_O)."""
    w = point(spec, torch.float64)
    expected = {"qk": grams(w, "qk"), "vo": grams(w, "vo")}
    if w.b_K is not None and spec.qk_norm == "none" and spec.pass_dims:
        stays = torch.zeros(spec.head_dim, dtype=w.b_K.dtype)
        stays[: spec.rope_dims] = 1.0
        expected["qk"] = grams(w.replace(b_K=w.b_K * stays), "qk")
    if w.b_V is not None and w.b_O is not None:
        expected["vo"] = grams(w.replace(b_V=torch.zeros_like(w.b_V)), "vo")
    for side in ("qk", "vo"):
        for got, want in zip(gauge_grams(w, side), expected[side], strict=True):
            err = float((got - want).abs().max() / want.abs().max())
            assert err < 1e-13, f"{side}: {err:.1e}"


@pytest.mark.parametrize("spec", VARIANTS, ids=IDS)
def test_gauge_eigh_decomposes_the_gauge_grams(spec: AttentionSpec):
    w = point(spec, torch.float64)
    for side in ("qk", "vo"):
        la, U, mu, V = gauge_eigh(w, side)
        for (vals, vecs), G in zip(((la, U), (mu, V)), gauge_grams(w, side), strict=True):
            rebuilt = vecs @ torch.diag_embed(vals) @ vecs.transpose(-1, -2)
            err = float((rebuilt - G).abs().max() / G.abs().max())
            assert err < 1e-12, f"{side}: {err:.1e}"


@pytest.mark.parametrize("spec", [AttentionSpec(d_model=12, n_heads=3, bias="qkvo"),
                                  AttentionSpec(d_model=12, n_heads=4, n_kv_heads=2, bias="qk")],
                         ids=AttentionSpec.describe)
def test_exact_preconditioner_needs_one_iteration(spec: AttentionSpec):
    """Without RoPE and without nu's b_O coupling the preconditioner is the exact inverse
    (docs/theory.md §10.5) only if the gauge Grams leave out exactly the freed rows."""
    w = point(spec, torch.float64)
    delta = w.map(lambda t: torch.randn(t.shape, generator=torch.Generator().manual_seed(1),
                                        dtype=t.dtype))
    assert project(w, delta, "qk").iterations == 1


def test_mu_and_the_next_projection_share_one_eigendecomposition(monkeypatch: pytest.MonkeyPatch):
    spec = AttentionSpec(d_model=12, n_heads=3, bias="qkvo")
    w0, w1 = point(spec, torch.float32, 0), point(spec, torch.float32, 1)
    calls = []
    eigh = torch.linalg.eigh
    monkeypatch.setattr(torch.linalg, "eigh", lambda G: calls.append(G.shape) or eigh(G))
    m = metrics(w0, w1)  # mu at w1: the eigendecompositions are computed once, here
    assert len(calls) == 4, calls
    for side in ("qk", "vo"):
        project(w1, w0 - w1, side)  # the next step starts at w1: nothing recomputed
    assert len(calls) == 4, calls
    with torch.no_grad():
        w1.W_V.mul_(2.0)  # an in-place change invalidates the cache
    project(w1, w0 - w1, "vo")
    assert len(calls) == 6, calls
    assert torch.isfinite(m.qk.mu).all()


def test_metrics_and_projection_work_under_inference_mode():
    """Inference tensors have no version counter: computed without the cache, same values."""
    spec = AttentionSpec(d_model=12, n_heads=3, bias="qkvo")
    w = point(spec, torch.float64)
    delta = point(spec, torch.float64, 1)
    want = metrics(w.clone()).vo.mu, project(w.clone(), delta, "vo").rho
    with torch.inference_mode():
        w_inf = w.clone()
        got = metrics(w_inf).vo.mu, project(w_inf, delta, "vo").rho
    for a, b in zip(got, want, strict=True):
        assert torch.allclose(a, b, rtol=1e-12, atol=0), (a, b)
