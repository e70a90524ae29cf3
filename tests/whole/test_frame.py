"""Probe products at bfloat16 storage precision (`attnid.whole.fit.frame.stored_product`): for
weights holding bfloat16 values they equal the float32 products to about 2^-16 (the split
probes), on the CPU's bfloat16 units where it has them and in plain float32 where it has not;
a frame taking them gives what the plain frame gives, for stream-on-the-right and
stream-on-the-left tensors, 2-D and 3-D, views of a stored weight included."""

from __future__ import annotations

import pytest
import torch

from attnid.numerics import relative_error
from attnid.whole.fit import frame as F


def _bf16_values(*shape: int, seed: int = 0, shift: float = 0.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) + shift).to(torch.bfloat16).to(torch.float32)


@pytest.mark.parametrize("units", [True, False])
def test_stored_product(units, monkeypatch):
    monkeypatch.setattr(F, "bf16_units", lambda: units)
    X, R = _bf16_values(300, 96), _bf16_values(96, 40, seed=1) + 1e-3 * _bf16_values(96, 40, seed=2)
    want = X.double() @ R.double()
    err = relative_error(F.stored_product(X, R), want)
    assert err < 3e-5, f"stored product off by {err:.2e} (units {units})"
    assert torch.backends.mkldnn.matmul.fp32_precision != "bf16"  # the setting restored


def test_rounding_a_value_not_stored_is_bounded():
    """An X not holding bfloat16 values is rounded to it: within bfloat16's rounding."""
    X, R = torch.randn(200, 64, generator=torch.Generator().manual_seed(3)), _bf16_values(64, 16)
    err = relative_error(F.stored_product(X, R), X.double() @ R.double())
    assert err < 2**-8, f"{err:.2e}"


def test_frame_products_agree():
    d, k = 64, 24
    Z, Q = F.probes(d, k, torch.float32), torch.linalg.qr(torch.randn(d, d, dtype=torch.float64))[0]
    g = 1 + 0.1 * torch.randn(d)
    plain = F.Frame(Z, Q, torch.float32)
    fast = F.Frame(Z, Q, torch.float32, bf16=True)
    W = _bf16_values(48, d)  # [out, d]: stream on the right
    Wq = _bf16_values(4 * 8, d).reshape(4, 8, d).transpose(1, 2)  # [H, d, dk]: a view, stream left
    Wd = _bf16_values(d, 30)  # [d, f]: stream on the left
    Wo = _bf16_values(4, 8, d)  # [H, dv, d]
    cases = {"right 2-D": (fast.right(W, g, True), plain.right(W, g, True)),
             "right 3-D": (fast.right(Wo), plain.right(Wo)),
             "left 3-D view": (fast.left(Wq, g), plain.left(Wq, g)),
             "left 2-D": (fast.left(Wd, centre=True), plain.left(Wd, centre=True)),
             "narrow": (fast.narrow(8).right(W), plain.narrow(8).right(W))}
    for name, (got, want) in cases.items():
        assert got.shape == want.shape, name
        err = relative_error(got, want)
        assert err < 3e-5, f"{name}: {err:.2e}"
    if F.bf16_units():  # the other path was taken: not the float32 product's bits
        assert not torch.equal(*cases["right 2-D"])


def test_switch_off(monkeypatch):
    monkeypatch.setenv("ATTNID_BF16", "0")
    F.bf16_units.cache_clear()
    try:
        assert not F.bf16_units()
        X, R = _bf16_values(50, 32), torch.randn(32, 8)
        assert torch.equal(F.stored_product(X, R), X @ R)
    finally:
        monkeypatch.delenv("ATTNID_BF16")
        F.bf16_units.cache_clear()


@pytest.mark.parametrize("layer_norm", [False, True])
def test_table_gram(layer_norm):
    """The rotation's Gram matrix from the stored rows (mean rows and gains moved out of the
    product) is the Gram matrix of the prepared rows, to float32's summation."""
    from attnid.whole.fit.fitter import prepared, table_gram

    g = 1 + 0.3 * torch.rand(64, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    blocks = [(_bf16_values(300, 64, seed=6, shift=0.25), None), (_bf16_values(200, 64, seed=7), g)]
    X = torch.cat([prepared(b, torch.float32, layer_norm) for b in blocks]).double()
    G = table_gram(blocks, torch.float32, layer_norm)
    err = relative_error(G, X.T @ X)
    assert err < 1e-6, f"{err:.2e}"
    shifted = [(_bf16_values(300, 64, seed=6, shift=8.0), None)]  # the mean row carries the products
    assert table_gram(shifted, torch.float32, layer_norm) is None
    err = relative_error(F.stored_gram(blocks[0][0]), blocks[0][0].double().T @ blocks[0][0].double())
    assert err < 1e-6, f"stored_gram {err:.2e}"
