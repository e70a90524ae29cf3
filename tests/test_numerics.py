"""attnid.numerics: the polar decomposition's two routes agree with the SVD's factor, the
2-eps rule and the tolerance table."""

from __future__ import annotations

import pytest
import torch

from attnid import numerics
from attnid.numerics import polar, relative_error, rounding_tolerance, tolerance


def _matrix(k: int, cond: float, dtype: torch.dtype, batch: tuple[int, ...] = ()) -> torch.Tensor:
    """``[*batch, k, k]`` with singular values from 1 down to ``1 / cond``."""
    gen = torch.Generator().manual_seed(0)
    U = torch.linalg.qr(torch.randn(*batch, k, k, generator=gen, dtype=torch.float64)).Q
    V = torch.linalg.qr(torch.randn(*batch, k, k, generator=gen, dtype=torch.float64)).Q
    s = torch.logspace(0, -torch.log10(torch.tensor(cond)).item(), k, dtype=torch.float64)
    return (U * s.unsqueeze(-2) @ V.transpose(-1, -2)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("cond", [3.0, 1e3, 1e6], ids=lambda c: f"cond{c:g}")
@pytest.mark.parametrize("batch", [(), (3,)], ids=lambda b: f"batch{len(b)}")
def test_polar_is_the_svd_factor(dtype, cond, batch):
    M = _matrix(12, cond, dtype, batch=batch)
    U, _, Vh = torch.linalg.svd(M.double())
    want = U @ Vh
    O = polar(M)
    eye = torch.eye(12, dtype=torch.float64).expand_as(want)
    tol = 50 * torch.finfo(dtype).eps * 12
    orth = relative_error(O.double().transpose(-1, -2) @ O.double(), eye)
    err = relative_error(O, want)
    assert O.dtype == dtype and O.shape == M.shape
    assert orth < tol, f"O^T O off the identity by {orth:.2e} (cond {cond:g}, {dtype})"
    # the factor itself is as well determined as M's smallest singular values allow
    assert err < tol * cond, f"polar off the SVD's factor by {err:.2e} (cond {cond:g}, {dtype})"


def test_the_cutoff_chooses_the_route(monkeypatch):
    calls = []
    real = numerics._svd_polar
    monkeypatch.setattr(numerics, "_svd_polar", lambda M: calls.append(M.shape) or real(M))
    M = _matrix(8, 1e3, torch.float64)  # cond^2 = 1e6
    polar(M, cutoff=1e-8)
    assert calls == []  # eigenvalue route
    polar(M, cutoff=1e-5)
    assert calls == [M.shape]  # too ill-conditioned for this cutoff: the SVD
    polar(_matrix(8, 2.0, torch.float64), svd_up_to=8)
    assert len(calls) == 2  # small enough for the SVD


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_storage_rounding_stays_within_the_two_eps_rule(dtype):
    # a product of two stored factors, relative to the product of their norms (how
    # attnid.whole.fit measures a residual), moves by at most ~eps when both are rounded
    gen = torch.Generator().manual_seed(0)
    A, B = (torch.randn(64, 16, generator=gen, dtype=torch.float64) for _ in range(2))
    Aq, Bq = A.to(dtype).double(), B.to(dtype).double()
    moved = float((Aq @ Bq.T - A @ B.T).norm() / (A.norm() * B.norm()))
    assert rounding_tolerance(dtype) == max(2 * torch.finfo(dtype).eps, 1e-13)
    assert moved <= rounding_tolerance(dtype), f"storage rounding moved the product by {moved:.2e}"
    assert tolerance(dtype) >= moved


def test_relative_error_never_passes_nan():
    assert relative_error(torch.tensor([float("nan")]), torch.tensor([1.0])) == float("inf")
    assert relative_error(torch.tensor([1.0, 0.0]), torch.tensor([1.0, 1e-3])) == pytest.approx(1e-3)


@pytest.mark.parametrize("layout", ["rows", "transposed"])
@pytest.mark.parametrize("dim", [0, 1])
def test_sums_of_products_in_blocks_along_the_stored_rows(layout, dim, monkeypatch):
    """`sums_of_products` equals ``(x * y).sum(dim)`` (float64, 1e-14) whichever way the rows are
    stored and however small the blocks, and a tensor with its copy gives its own sums exactly."""
    monkeypatch.setattr(numerics, "DISTANCE_CHUNK", 40)  # many blocks, one a partial one
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randn(37, 11, generator=g, dtype=torch.float64) for _ in range(2))
    if layout == "transposed":
        x, y = x.T.contiguous().T, y.T.contiguous().T
    got, want = numerics.sums_of_products(x, y, dim), (x * y).sum(dim)
    err = relative_error(got, want)
    assert err < 1e-14, f"{layout}, dim {dim}: relative error {err:.1e}"
    assert torch.equal(numerics.sums_of_products(x, x.clone(), dim), numerics.sums_of_products(x, x, dim))


@pytest.mark.parametrize("layout", ["contiguous", "transposed", "head slice"])
def test_sq_distance_of_strided_views_copies_no_whole(layout, monkeypatch):
    """`sq_distance` equals ``||x - y||^2`` (float64, 1e-14) for a contiguous tensor, a transposed
    view and a head's slice of a ``[H, d, k]`` view, with blocks of 40 numbers; on the views no
    copy of the whole input is made (counted through ``Tensor.reshape``, which copies a strided
    tensor whole when it flattens it)."""
    monkeypatch.setattr(numerics, "DISTANCE_CHUNK", 40)
    g = torch.Generator().manual_seed(0)
    W, V = (torch.randn(6 * 5, 37, generator=g, dtype=torch.float64) for _ in range(2))
    if layout == "contiguous":
        x, y = W, V
    elif layout == "transposed":
        x, y = W.T, V.T  # [37, 30], strided
    else:
        x, y = (t.reshape(6, 5, 37).transpose(-1, -2)[2] for t in (W, V))  # [37, 5] of [6, 37, 5]
    want = float(((x - y) ** 2).sum())
    made = []
    real = torch.Tensor.reshape

    def reshape(t, *shape):
        out = real(t, *shape)
        if out.numel() == x.numel() and out.data_ptr() != t.data_ptr():
            made.append(shape)
        return out

    monkeypatch.setattr(torch.Tensor, "reshape", reshape)
    got = numerics.sq_distance(x, y)
    assert abs(got - want) <= 1e-14 * want, f"{layout}: {got} against {want}"
    assert not made, f"{layout}: a copy of the whole input was made ({made})"


def test_row_sq_distances_equal_the_direct_sums(monkeypatch):
    """`row_sq_distances` gives ``((x - y) ** 2).sum(1)`` bit for bit (the rows are summed alike
    in any block), and a row paired with its copy costs exactly 0."""
    monkeypatch.setattr(numerics, "DISTANCE_CHUNK", 40)
    g = torch.Generator().manual_seed(1)
    x, y = (torch.randn(37, 11, generator=g, dtype=torch.float32) for _ in range(2))
    assert torch.equal(numerics.row_sq_distances(x, y), ((x - y) ** 2).sum(1))
    assert torch.equal(numerics.row_sq_distances(x, x.clone()), torch.zeros(37))
