"""Linear assignment above `DENSE` rows runs on a sparse graph of each row's and column's
cheapest candidates (`attnid.whole.fit.match`): on near-permutation costs (a rewrite plus noise,
nearest neighbours clashing) and on unrelated ones it finds the dense solver's optimum; when the
candidates admit no perfect matching it falls back to the dense solver; the neuron matching's
chunked candidate passes come within 0.1% of the full cost matrix's optimum when the noise is as
large as the features (the optimum then uses a pair outside the candidates: 0.03% here)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("scipy")

from attnid.whole.fit import match
from attnid.whole.fit.canonical import MLP


def total(cost: torch.Tensor, perm: torch.Tensor) -> float:
    return float(cost[torch.arange(len(perm)), perm].sum())


def is_permutation(perm: torch.Tensor) -> bool:
    return torch.equal(perm.sort().values, torch.arange(len(perm)))


def near_permutation(n: int, noise: float, seed: int) -> torch.Tensor:
    """Squared distances between rows of X and a permuted, noisy copy: [n, n]."""
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, 8, generator=g, dtype=torch.float64)
    Y = X[torch.randperm(n, generator=g)] + noise * torch.randn(n, 8, generator=g, dtype=torch.float64)
    return torch.cdist(X, Y) ** 2


@pytest.mark.parametrize("case", ["near-permutation", "unrelated"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sparse_candidates_find_the_dense_optimum(case, seed, monkeypatch):
    n = 400
    cost = near_permutation(n, 0.3, seed) if case == "near-permutation" else \
        torch.rand(n, n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    nearest = cost.argmin(1)
    assert not is_permutation(nearest), "nearest neighbours should clash here"
    want = match.dense_assignment(cost)
    monkeypatch.setattr(match, "DENSE", 16)
    called = []
    sparse = match.sparse_assignment
    monkeypatch.setattr(match, "sparse_assignment", lambda *a: called.append(1) or sparse(*a))
    got = match.assignment(cost)
    assert called and is_permutation(got)
    assert abs(total(cost, got) - total(cost, want)) <= 1e-9 * total(cost, want), \
        f"{case} seed {seed}: sparse {total(cost, got)!r} vs dense {total(cost, want)!r}"


def test_candidates_without_a_perfect_matching_fall_back_to_the_dense_solver(monkeypatch):
    """Every row prefers the first columns and every column the first rows: the candidate graph
    leaves most columns with the same few rows, so no perfect matching; the dense solver runs."""
    n = 64
    i, j = torch.arange(n, dtype=torch.float64)[:, None], torch.arange(n, dtype=torch.float64)[None, :]
    cost = i + j + 0.001 * (i - j) ** 2  # nearest: column 0 for every row
    monkeypatch.setattr(match, "DENSE", 8)
    monkeypatch.setattr(match, "CANDIDATES", 2)
    k = 2
    rows, cols = cost.topk(k, 1, largest=False), cost.topk(k, 0, largest=False)
    assert match.sparse_assignment(rows.indices, rows.values, cols.indices.T, cols.values.T) is None
    got, want = match.assignment(cost), match.dense_assignment(cost)
    assert is_permutation(got) and abs(total(cost, got) - total(cost, want)) <= 1e-9 * total(cost, want)


@pytest.mark.parametrize("kind", ["gated", "other"])
def test_neuron_matching_from_chunked_candidates(kind, monkeypatch):
    """B's neurons a permutation of A's with noise as large as the features: the chunked candidate
    passes (rows, then columns) and the sparse graph come within 0.1% of the full cost matrix's
    optimum (docs/theory.md §13.19: a restricted optimum)."""
    f, k = 300, 12
    g = torch.Generator().manual_seed(0)
    up, down, gate = (torch.randn(f, k, generator=g, dtype=torch.float64) for _ in range(3))
    perm = torch.randperm(f, generator=g)

    def noisy(t: torch.Tensor) -> torch.Tensor:
        return t[perm] + 1.0 * torch.randn(t.shape, generator=g, dtype=torch.float64)

    A = MLP(up, down, gate, None, None, kind, {})
    B = MLP(noisy(up), noisy(down), noisy(gate), None, None, kind, {})
    fa, fb = match._neuron_features(A), match._neuron_features(B)
    cost = sum(match._pair_cost(x, y, slice(None)) for x, y in zip(fa, fb, strict=True))
    assert not is_permutation(cost.argmin(1)), "nearest neighbours should clash here"
    want = match.dense_assignment(cost)
    monkeypatch.setattr(match, "DENSE", 16)
    got = match.match_neurons(A, B, chunk=64)
    assert is_permutation(got)
    gap = (total(cost, got) - total(cost, want)) / total(cost, want)
    assert -1e-12 <= gap <= 1e-3, f"{kind}: sparse {total(cost, got)!r} vs dense {total(cost, want)!r}"
    true = (got == perm.argsort()).float().mean()
    assert true > 0.5, f"{kind}: {true:.2f} of the neurons with their true partner"


@pytest.mark.parametrize("signed", [True, False])
def test_neuron_matching_on_activations_in_blocks(signed, monkeypatch):
    """`attnid align --calibration`'s neuron matching takes the ``[f, f]`` correlations a block
    of rows at a time (never whole at 7B widths: 0.97 GB) and comes within 0.1% of the whole
    cost matrix's optimum (0.003% and 0.03% here): B's neurons A's, permuted, scaled
    (negatively too where unsigned) and noisy."""
    from attnid.whole.align import activations as act

    N, f = 40, 300
    g = torch.Generator().manual_seed(0)
    XA = torch.randn(N, f, generator=g, dtype=torch.float64)
    perm = torch.randperm(f, generator=g)
    scale = torch.rand(f, generator=g, dtype=torch.float64) + 0.5
    if not signed:
        scale = scale * torch.where(torch.rand(f, generator=g) < 0.5, -1.0, 1.0).double()
    XB = XA[:, perm] * scale + 1.5 * torch.randn(N, f, generator=g, dtype=torch.float64)
    a, b = (act.Activations(torch.zeros(1, 1), [], [x]) for x in (XA, XB))
    corr = act._standard(XA).T @ act._standard(XB)
    cost = -(corr if signed else corr.abs())
    assert not is_permutation(cost.argmin(1)), "nearest neighbours should clash here"
    want = match.dense_assignment(cost)
    monkeypatch.setattr(match, "DENSE", 16)
    monkeypatch.setattr(match, "dense_assignment", lambda cost: pytest.fail("the whole matrix was made"))
    made = []
    real = match._cheapest
    monkeypatch.setattr(match, "_cheapest", lambda rows_of, n, k, chunk: made.append(chunk) or real(
        rows_of, n, k, 64))
    got = act.neuron_matching(a, b, 0, signed)
    assert made and is_permutation(got)
    gap = (total(cost, got) - total(cost, want)) / abs(total(cost, want))
    assert -1e-12 <= gap <= 1e-3, f"signed={signed}: blocks {total(cost, got)!r}, whole {total(cost, want)!r}"
