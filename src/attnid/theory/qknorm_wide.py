"""QK-norm with ``head_dim > d_model``: the count, under RoPE, GQA and biases.

With the norm's epsilon at 0 a head's scores see only four things (docs/theory.md §7;
notation of §1.1; ``a = d + [b_Q]`` and ``b = d + [b_K]`` are the bias-augmented widths):

* ``Q_h = A_h A_h^T`` and ``K_g = B_g B_g^T`` up to one scale each (the norms), where
  ``A_h`` (``a x d_k``) and ``B_g`` (``b x d_k``) are the bias-augmented projections;
* the pass-through bilinear form ``A_h^p diag(g_Q g_K) B_g^{pT}``;
* per rotated plane, one complex rank-one ``a x b`` matrix (its cosine and sine parts).

So the nullity is ``F + H + G``, where ``F`` is the fibre dimension of the polynomial
map from the parameters to those invariants and ``H + G`` are the norm scales. When
``d_k > d`` the invariants are far from free and ``F`` is not a group dimension. We
count it by fixing the key side and asking which changes of ``B_g`` and of the gains
the query side can follow: the bilinear data then fix each query head's rows up to
``n0 = max(0, p - b)`` spare pass-through directions, the spare directions give
``Q_h`` a free term of rank ``n0``, and what remains is a linear system whose blocks
act on ``Q_h`` and ``K_g`` through symmetric squares of generic subspaces (a 2-dim
plane per rotated pair, a line per ``s``/``t`` direction, the pass-through span).

Three generic-position facts carry the count; each was checked against the exact
rank of the invariant map's Jacobian on 1,834 random layers (d 1..6, d_k up to
2d + 4, every RoPE width, G 1..4, m 1..4, every q/k bias pair) with no disagreement,
and the whole count is checked against the Jacobian-rank arbiter in ``tests/``:

1. :func:`sym2_sum_dim` -- the span of ``Sym^2(R_i)`` for generic subspaces is given by
   adding the subspaces largest first, each bringing its own ``Sym^2`` less the part
   already spanned on its generic intersections with the earlier ones (a recursion);
2. heads of one kv group that share coefficients reach ``min(m * one head, sum over blocks
   of what the m heads reach in that block)`` (:func:`_joint_rank`);
3. subspaces that depend on a kv group's random weights meet in generic position inside the
   coordinate subspaces that do not (:func:`_meet`: ranks of a random instance of an
   explicit configuration of at most ``2 d_k`` coordinates, the generic rank).

With epsilon > 0 a norm's scale stays exact only where a bias lets ``Q_h`` (or ``K_g``)
absorb the epsilon in its constant entry; that is one more free rank-one term per head
(or kv group) in the same system, so the exact scales are a difference of two fibres.
"""

from __future__ import annotations

from functools import cache

import numpy as np

from attnid.spec import AttentionSpec

_RTOL = 1e-9  # relative singular-value threshold for the generic-position ranks


@cache
def sym2_sum_dim(n: int, dims: tuple[int, ...]) -> int:
    """Dimension of ``Sym^2(R_1) + ... + Sym^2(R_k)`` for generic subspaces ``R_i`` of ``R^n``.

    Equivalently ``n(n+1)/2`` minus the quadrics vanishing on a generic arrangement of
    linear spaces of the given dimensions.

    >>> sym2_sum_dim(3, (2, 2))   # two planes in R^3 share a line: 3 + 3 - 1
    5
    >>> sym2_sum_dim(3, (2, 2, 2))
    6
    >>> sym2_sum_dim(4, (1, 1, 1))  # lines impose independent conditions
    3
    """
    order = sorted((min(k, n) for k in dims if k > 0), reverse=True)
    full = n * (n + 1) // 2
    if not order:
        return 0
    if order[0] >= n:
        return full
    missing = full
    for j, r in enumerate(order):
        meets = tuple(max(0, r + order[i] - n) for i in range(j))
        missing = max(0, missing - (r * (r + 1) // 2 - sym2_sum_dim(r, meets)))
    return full - missing


def _joint_rank(width: int, m: int, per_head: list[int], blocks: int) -> int:
    """Rank of shared coefficients seen by m heads, each through ``Sym^2`` of ``per_head``."""
    if width <= 0:
        return 0
    return min(m * sym2_sum_dim(width, tuple(per_head)), blocks)


def _orth(rows: np.ndarray) -> np.ndarray:
    """Orthonormal basis (as rows) of the row space; random generic data, relative 1e-9."""
    if rows.shape[0] == 0:
        return rows
    _, sv, vh = np.linalg.svd(rows, full_matrices=False)
    return vh[: int((sv > _RTOL * sv[0]).sum())] if sv[0] > 0 else rows[:0]


def _meet_rows(u: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Orthonormal basis of the intersection of two row spaces (orthonormal inputs)."""
    if u.shape[0] == 0 or v.shape[0] == 0:
        return u[:0]
    # (alpha, beta) with alpha u = beta v: the right singular vectors of [u; -v]^T at 0
    _, sv, vh = np.linalg.svd(np.concatenate([u, -v]).T, full_matrices=True)
    rank = int((sv > _RTOL * sv[0]).sum())
    return _orth(vh[rank:, : u.shape[0]] @ u)


def _meet(planes: int, pass_dims: int, yq: int, yk: int, kv_groups: int, q_pass: int,
          q_planes: int, k_planes: int) -> tuple[int, int]:
    """The shared-unknown stage for ``p <= b``: returns ``(D, x)``.

    Coordinates: per rotated plane ``(u_Q, u_K, mix, tie)``, then ``pass_dims`` pass-through
    coordinates. The query side reaches ``{u_K = 0}``, the key side ``{u_Q = 0}``, the
    shared gains ``{tie = 0}``. Each kv group's admissible set is a generic ``yq``-dim subspace
    of the query side (containing a ``q_pass``-dim part in the pass coordinates and a
    ``q_planes``-dim part in the plane coordinates) plus a generic ``yk``-dim subspace of
    the key side (``k_planes`` of it in the plane coordinates). ``x`` is the dimension one
    kv group's two parts share; ``D`` that of the shared set meeting every kv group's sum.

    Kv groups are independent draws, so once one leaves the running intersection
    unchanged every later one does too (it contains it for a generic draw, hence for all).
    """
    n = 4 * planes + pass_dims
    if n == 0:
        return 0, 0
    rng = np.random.default_rng(0x5EED)
    coords = np.arange(n)
    u_q, u_k, tie = coords[0:4 * planes:4], coords[1:4 * planes:4], coords[3:4 * planes:4]
    in_planes = coords < 4 * planes
    query_side, key_side = ~np.isin(coords, u_k), ~np.isin(coords, u_q)
    rest_q, rest_k = max(0, yq - q_pass - q_planes), max(0, yk - k_planes)

    def sample(mask: np.ndarray, k: int) -> np.ndarray:
        """k Gaussian vectors supported on the coordinates in mask."""
        return rng.standard_normal((max(0, k), n)) * mask[None, :]

    def draw() -> np.ndarray:
        return np.concatenate([sample(~in_planes, q_pass), sample(in_planes & query_side, q_planes),
                               sample(query_side, rest_q), sample(in_planes & key_side, k_planes),
                               sample(key_side, rest_k)])

    first = draw()
    basis = _orth(first)
    own = first.shape[0] - basis.shape[0]
    acc = _meet_rows(np.eye(n)[~np.isin(coords, tie)], basis)
    for _ in range(kv_groups - 1):
        if acc.shape[0] == 0:
            break
        nxt = _meet_rows(acc, _orth(draw()))
        if nxt.shape[0] == acc.shape[0]:
            break
        acc = nxt
    return acc.shape[0], own


def fibre(spec: AttentionSpec, *, free_q: bool = False, free_k: bool = False) -> int:
    """Fibre dimension of the QK invariants map (epsilon 0), for ``head_dim > d_model``.

    ``free_q`` / ``free_k`` add a free rank-one term in the bias direction to every
    ``Q_h`` / ``K_g`` equation (what an epsilon absorbed by a bias needs).
    """
    d, H, G, m = spec.d_model, spec.n_heads, spec.n_kv_heads, spec.kv_group_size
    assert G is not None and spec.head_dim is not None and spec.head_dim > d
    a, b = d + spec.has_bias("q"), d + spec.has_bias("k")
    p, planes = spec.pass_dims, spec.rope_dims // 2
    lq, lk = int(free_q), int(free_k)
    extra = [1] * lq
    s2 = sym2_sum_dim
    if p > b:
        # Spare pass-through rows: each head's Q_h gains a free rank-n0 term (stab: its
        # stabiliser), and the key side's pass block can follow any change of K_g and of the
        # metric it induces. Query heads see `free` = a - n0 dims; j_planes / j_lines: rank
        # of the kv group's query equations with full plane coefficients / with only the two
        # directions (s, t) per plane that the kv group's own unknowns move.
        n0 = p - b
        stab = n0 * (n0 - 1) // 2 if n0 <= a else a * n0 - a * (a + 1) // 2
        free = max(0, a - n0)
        seen = min(free, b)
        pass_block = s2(b, (seen,) * m) if free else 0
        j_planes = _joint_rank(free, m, [2] * planes + [seen] + extra,
                               planes * s2(2, (min(2, free),) * m) + pass_block + m * lq)
        j_lines = _joint_rank(free, m, [1] * (2 * planes) + [seen] + extra,
                              2 * planes + pass_block + m * lq)
        own = 2 * planes + b * (b + 1) // 2 + m * lq - j_lines + lk
        shared = max(0, planes - G * (j_planes - j_lines))
        return H * stab + 2 * p + G * (b * p - b * (b + 1)) + 3 * planes + shared + G * own
    # p <= b: every query row is fixed by the bilinear data; the key side's pass block
    # moves only inside its own span (B^p -> B^p X). Per kv group, the coefficients are 3 per
    # plane and Sym(p) on each side; k_q / k_k: coefficients the query heads / the key side
    # cannot see (side kernels), k_q_pass: the pass-only part of k_q, y_q: what of k_q the
    # group's own unknowns cannot absorb; _meet couples the kv groups through the shared gains.
    seen = min(a, p)
    plane_block = planes * s2(2, (min(2, a),) * m)
    j_q = _joint_rank(a, m, [2] * planes + [seen] + extra,
                      plane_block + s2(p, (seen,) * m) + m * lq)
    k_q = 3 * planes + p * (p + 1) // 2 + m * lq - j_q
    k_q_pass = p * (p + 1) // 2 + m * lq - _joint_rank(a, m, [seen, *extra],
                                                        s2(p, (seen,) * m) + m * lq)
    y_q = k_q - max(0, k_q_pass - p)
    k_k = 3 * planes + p * (p + 1) // 2 + lk - s2(b, tuple([2] * planes + [p] + [1] * lk))
    q_planes = 3 * planes - _joint_rank(a, m, [2] * planes, plane_block) if planes else 0
    k_planes = 3 * planes - s2(b, (2,) * planes) if planes else 0
    shared, own = _meet(planes, p, y_q, k_k, G, min(k_q_pass, p), q_planes, k_planes)
    return p + planes + G * (own + k_q - y_q) + shared


def qk_nullity(spec: AttentionSpec) -> tuple[int, int]:
    """``(exactly unidentified, near-unidentified)`` on the QK side, ``head_dim > d_model``."""
    H, G = spec.n_heads, spec.n_kv_heads
    assert G is not None
    base = fibre(spec)
    if spec.qk_norm_eps == 0.0:
        return base + H + G, 0
    has_q, has_k = spec.has_bias("q"), spec.has_bias("k")
    exact_scales = fibre(spec, free_q=has_q, free_k=has_k) - base if has_q or has_k else 0
    return base + exact_scales, H + G - exact_scales
