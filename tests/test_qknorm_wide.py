"""QK-norm with head_dim > d_model: the count against two independent numerical checks.

1. The invariant map (what the normalised scores see, see ``attnid.theory.qknorm_wide``): the
   exact rank of its Jacobian at a random point gives the fibre dimension directly.
2. The arbiter on ``attnid.Attention`` itself, which needs no reduction at all.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from attnid import AttentionSpec, count
from attnid.arbiter.compare import verify
from attnid.testing import invariant_jacobian, numerical_rank
from attnid.theory.qknorm_wide import fibre, sym2_sum_dim


def _span_dim(n: int, dims: tuple[int, ...], seed: int = 0) -> int:
    """dim of sum_i Sym^2(R_i) for random subspaces R_i of R^n, by an SVD."""
    g = torch.Generator().manual_seed(seed)
    iu = torch.triu_indices(n, n).unbind()
    rows = []
    for k in dims:
        E = torch.randn(n, k, generator=g, dtype=torch.float64)
        for i, j in itertools.combinations_with_replacement(range(k), 2):
            M = torch.outer(E[:, i], E[:, j])
            rows.append((M + M.T)[iu])
    s = torch.linalg.svdvals(torch.stack(rows))
    return int((s > s[0] * 1e-10).sum())


SUBSPACES = [
    (3, (2, 2)), (3, (2, 2, 2)), (4, (3, 3)), (4, (3, 3, 3)), (4, (2, 2, 2, 2)), (5, (4, 4)),
    (5, (3, 3, 3)), (5, (4, 2, 2, 1)), (6, (4, 4, 4)), (6, (5, 5, 5, 5)), (6, (3, 3, 2, 1, 1)),
    (7, (5, 5, 5)), (7, (6, 4, 2, 2)), (8, (6, 6, 6)), (8, (5, 5, 5, 5, 5)), (8, (7, 3, 3, 3)),
    (4, (1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1)), (9, (5, 5, 5, 5)),
]


@pytest.mark.parametrize("n,dims", SUBSPACES, ids=str)
def test_sym2_sum_dim_matches_a_direct_span(n: int, dims: tuple[int, ...]):
    assert sym2_sum_dim(n, dims) == _span_dim(n, dims)


# (d, H, G, head_dim, rope, bias): RoPE full/partial/none, MHA/GQA/MQA, spare pass-through
# rows (p > d) or not, every q/k bias pair.
WIDE = [
    (3, 2, 1, 4, 0.0, ""), (3, 3, 1, 4, 0.0, "k"), (2, 2, 1, 3, 0.0, "k"), (4, 2, 1, 5, 0.0, "q"),
    (3, 4, 2, 5, 0.0, "qk"), (4, 1, 1, 6, 1.0, ""), (4, 2, 2, 6, 1.0, "q"), (4, 2, 1, 6, 1.0, "k"),
    (2, 1, 1, 4, 1.0, ""), (2, 2, 1, 6, 1.0, "qk"), (3, 2, 1, 8, 1.0, ""), (3, 4, 2, 6, 1.0, "q"),
    (4, 1, 1, 6, 1 / 3, ""), (3, 1, 1, 4, 0.5, ""), (4, 2, 1, 8, 0.25, "k"), (4, 3, 1, 8, 0.5, "q"),
    (3, 2, 2, 8, 0.75, "qk"), (5, 2, 1, 8, 0.25, ""), (4, 4, 2, 6, 2 / 3, "k"), (2, 3, 1, 6, 1 / 3, "qk"),
    (1, 2, 1, 4, 0.5, "k"), (5, 3, 3, 6, 1 / 3, "q"), (4, 2, 1, 10, 0.4, ""), (3, 3, 3, 5, 0.4, "qk"),
]


def _wide_spec(case, eps: float = 0.0, pairing: str = "half") -> AttentionSpec:
    d, H, G, dk, rope, bias = case
    return AttentionSpec(d_model=d, n_heads=H, n_kv_heads=G, head_dim=dk, rope=rope, bias=bias,
                         rope_pairing=pairing, qk_norm="head", qk_norm_eps=eps)


# every other case in the default run (RoPE full/partial/none and GQA/MQA are each still hit)
@pytest.mark.parametrize("case", [pytest.param(c, marks=() if i % 2 == 0 else pytest.mark.slow)
                                  for i, c in enumerate(WIDE)], ids=lambda c: _wide_spec(c).describe())
def test_fibre_equals_the_invariant_map_rank(case):
    spec = _wide_spec(case)
    J, q_last, k_last = invariant_jacobian(spec)
    n_params = J.shape[1]
    assert fibre(spec) == n_params - numerical_rank(J), spec.describe()
    # exact scales under eps > 0: bias directions of Q_h / K_g already reached by J
    cols = [i for i, on in ((q, spec.has_bias("q")) for q in q_last) if on]
    cols += [i for i, on in ((k, spec.has_bias("k")) for k in k_last) if on]
    if cols:
        E = torch.zeros(J.shape[0], len(cols), dtype=J.dtype)
        E[cols, range(len(cols))] = 1.0
        reached = len(cols) - (numerical_rank(torch.cat([J, E], 1)) - numerical_rank(J))
        assert fibre(spec, free_q=spec.has_bias("q"), free_k=spec.has_bias("k")) - fibre(spec) == reached


# eps = 0 (exact scales) and eps = 1e-3: some scale directions are broken only at second
# order in eps, so eps = 1e-6 would push them under the arbiter's float64 threshold.
# Counts do not depend on the RoPE pairing; the arbiter sees both.
ARBITER = [(c, 0.0, "half") for c in WIDE[::4]] + [(c, 0.0, "interleaved") for c in WIDE[2::4]]
ARBITER += [(c, 1e-3, "half") for c in WIDE[1::4]] + [(c, 1e-3, "interleaved") for c in WIDE[3::4]]


@pytest.mark.parametrize("case,eps,pairing", [pytest.param(*a, marks=() if i % 2 == 0 else pytest.mark.slow)
                                               for i, a in enumerate(ARBITER)], ids=lambda c: str(c))
def test_wide_qk_norm_count_equals_arbiter(case, eps: float, pairing: str):
    spec = _wide_spec(case, eps, pairing)
    result = verify(spec, seed=2, confirm=False)
    theory, found = result.theory, result.arbiter
    assert (found.nullity, found.near_nullity) == (theory.unidentified, theory.near_unidentified), (
        f"{spec.describe()}: arbiter null {found.nullity} near {found.near_nullity}, theory "
        f"{theory.unidentified} near {theory.near_unidentified}, gap {found.spectral_gap}")
    assert found.spectral_gap is None or found.spectral_gap > 1e6, found.spectral_gap


def test_mha_without_rope_keeps_the_earlier_closed_form():
    # seen = a b + a(a+1)/2 + b(b+1)/2 per head; the wide count must reproduce it
    for d, H, dk, bias in [(3, 1, 4, ""), (3, 2, 5, "q"), (4, 2, 6, "qk"), (2, 3, 5, "k")]:
        spec = AttentionSpec(d_model=d, n_heads=H, head_dim=dk, bias=bias, qk_norm="head",
                             qk_norm_eps=0.0)
        a, b = d + spec.has_bias("q"), d + spec.has_bias("k")
        params = H * a * dk + H * b * dk + 2 * dk
        seen = H * (a * b + a * (a + 1) // 2 + b * (b + 1) // 2)
        c = count(spec)
        qk = c.components["qk_gauge"].unidentified + c.components["qk_norm_gain_transfer"].unidentified
        assert qk == params - seen + 2 * H, spec.describe()
