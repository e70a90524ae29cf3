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
    a, b = (act.Activations(torch.zeros(1, 1), [], [act._standardise_(x.clone())]) for x in (XA, XB))
    corr = act._standardise_(XA.clone()).T @ act._standardise_(XB.clone())
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


def _rewrite_mlp(kind: str, f: int = 300, k: int = 48, seed: int = 0) -> tuple[MLP, MLP, torch.Tensor]:
    """A's MLP and B = its neurons permuted and scaled (gated: up times c, down over c), each
    number rounded to bfloat16 as stored; ``perm`` with A's neuron j at B's perm[j]."""
    g = torch.Generator().manual_seed(seed)
    up, down, gate = (torch.randn(f, k, generator=g).bfloat16().float() for _ in range(3))
    perm = torch.randperm(f, generator=g)
    c = torch.rand(f, 1, generator=g) + 0.5 if kind == "gated" else torch.ones(f, 1)
    inv = perm.argsort()  # B's neuron perm[j] is A's j
    B = MLP((up * c)[inv].bfloat16().float(), (down / c)[inv].bfloat16().float(), gate[inv], None, None,
            kind, {})
    return MLP(up, down, gate, None, None, kind, {}), B, perm


@pytest.mark.parametrize("kind", ["gated", "other"])
def test_a_rewrites_neurons_are_found_on_a_few_probes_and_checked_as_stored(kind):
    """`nearest_neurons` through 4 probes finds a stored rewrite's permutation (bfloat16 rounding
    and, gated, per-neuron scales), `neurons_within` accepts it at bfloat16's eps, and the full
    matching agrees; a neuron moved by 10 eps, or B unrelated, is not accepted (then the full
    matching runs)."""
    eps = torch.finfo(torch.bfloat16).eps
    A, B, perm = _rewrite_mlp(kind)
    Z = torch.randn(A.up.shape[1], 4, generator=torch.Generator().manual_seed(1))

    def probed(x: MLP) -> MLP:
        return MLP(x.up @ Z, x.down @ Z, x.gate @ Z, None, None, x.kind, {})

    def reordered(x: MLP, perm: torch.Tensor) -> MLP:  # neuron j of the result: x's perm[j]
        return MLP(x.up[perm], x.down[perm], x.gate[perm], None, None, x.kind, {})

    near = match.nearest_neurons(probed(A), probed(B), chunk=64)
    assert near is not None and torch.equal(near, perm), \
        f"{kind}: {int((near != perm).sum()) if near is not None else 'no bijection'} neurons wrong"
    assert match.neurons_within(A, reordered(B, near), eps)
    assert not match.neurons_within(A, B, eps), f"{kind}: B unpermuted accepted"
    assert torch.equal(match.match_neurons(A, B, chunk=64), perm)
    moved = reordered(B, near)
    moved.gate[7, 0] += 10 * eps * moved.gate[7].norm()  # one neuron moved by 10 eps of its norm
    assert not match.neurons_within(A, moved, eps), f"{kind}: a moved neuron accepted"
    assert match.neurons_within(A, moved, 20 * eps)
    other, _, _ = _rewrite_mlp(kind, seed=1)
    found = match.nearest_neurons(probed(A), probed(other), chunk=64)
    assert found is None or not match.neurons_within(A, reordered(other, found), eps)
    # the down columns as stored ([k, f], read along their stored rows: `numerics.sums_of_products`)
    def stored(x: MLP) -> MLP:
        return MLP(x.up, x.down.T.contiguous().T, x.gate, None, None, x.kind, {})

    assert match.neurons_within(stored(A), stored(reordered(B, near)), eps)
    assert not match.neurons_within(stored(A), stored(moved), eps)
    for lay in (lambda x: x, stored):  # a copy, stored alike, is at cost 0 exactly
        copy = MLP(A.up.clone(), A.down.clone(), A.gate.clone(), None, None, kind, {})
        assert match.neurons_within(lay(A), lay(copy), 1e-30), f"{kind}: a copy is not at cost 0"
