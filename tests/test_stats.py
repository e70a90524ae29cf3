"""The one median every table, log and report uses."""

from __future__ import annotations

import statistics

import numpy as np
import pytest
import torch

from attnid.stats import flat, median


@pytest.mark.parametrize("values, want", [
    ([3.0], 3.0),
    ([5.0, 1.0, 3.0], 3.0),  # odd: the middle value
    ([4.0, 1.0, 3.0, 2.0], 2.5),  # even: the mean of the two middle values, not 2 (lower) or 3 (upper)
    ([0.1, 0.9], 0.5),
    ([[0.5, 3.0], [1.0, 2.0]], 1.5),  # [layer][head], flattened
    ([[1.0, 2.0], 7.0], 2.0),  # mixed nesting (a QK-norm layer holds one value)
], ids=["one", "odd", "even", "two", "nested-even", "mixed"])
def test_median_of_lists(values, want):
    assert median(values) == want


@pytest.mark.parametrize("n", [1, 2, 5, 12, 72])
def test_median_agrees_with_numpy_and_statistics_not_with_torch_median(n):
    xs = torch.rand(n, dtype=torch.float64, generator=torch.Generator().manual_seed(n))
    want = float(np.median(xs.numpy()))
    assert median(xs) == pytest.approx(want, rel=1e-15)
    assert median(xs.numpy()) == pytest.approx(want, rel=1e-15)
    assert median(xs.reshape(1, -1).tolist()) == pytest.approx(statistics.median(xs.tolist()), rel=1e-15)
    if n % 2 == 0:  # torch.median takes the lower middle value: a different number
        assert median(xs) > float(xs.median())


def test_flat_keeps_order_and_reads_generators():
    assert flat([[1, 2], (3,), torch.tensor([[4.0, 5.0]]), np.array([6.0])]) == [1, 2, 3, 4, 5, 6]
    assert median(x for x in (1.0, 2.0, 10.0, 20.0)) == 6.0
    with pytest.raises(ValueError, match="no numbers"):
        median([])
