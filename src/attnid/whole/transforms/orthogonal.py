"""Orthogonal matrices for residual-stream rotations (QuaRot's and SpinQuant's R1) and their
relatives: Hadamard matrices, Haar-random rotations, rotations fixing all-ones (the only ones
a LayerNorm commutes with, docs/theory.md §13.6), random elements of the RoPE commutant and
random head permutations that keep key/value groups whole.

Hadamard sizes: ``n = 2^k b`` with ``b`` = 1 (Sylvester), ``p + 1`` for a prime ``p = 3 mod 4``
(Paley I: 4, 8, 12, 20, 24, 32, 44, 48, 60, 68, 72, 80, 84, ...) or ``2 (p + 1)`` for a prime
``p = 1 mod 4`` (Paley II: 12, 28, 36, 60, 76, ...), built as a Kronecker product with a
Sylvester matrix. That covers the widths of the usual models (4096, 5120 = 20 * 256, 3584 = 28 *
128, 896 = 28 * 32, 1536 = 12 * 128, 768 = 12 * 64, 2560 = 20 * 128); :func:`hadamard` names the
nearest sizes it supports when it cannot build one.
"""

from __future__ import annotations

import torch

from attnid.errors import AttnidError
from attnid.rope import plane_dims
from attnid.spec import AttentionSpec


def _prime(n: int) -> bool:
    return n > 1 and all(n % k for k in range(2, int(n**0.5) + 1))


def _legendre(p: int) -> torch.Tensor:
    """The Jacobsthal matrix ``Q[i, j] = chi(j - i)`` of the prime field ``p`` (``[p, p]``)."""
    squares = {(k * k) % p for k in range(1, p)}
    chi = torch.tensor([0.0] + [1.0 if k in squares else -1.0 for k in range(1, p)],
                       dtype=torch.float64)
    idx = (torch.arange(p)[None, :] - torch.arange(p)[:, None]) % p
    return chi[idx]


def _paley(b: int) -> torch.Tensor | None:
    """A Hadamard matrix of order ``b`` from Paley's constructions (None when neither applies)."""
    if b == 1:
        return torch.ones(1, 1, dtype=torch.float64)
    if b == 2:
        return torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
    p = b - 1
    if _prime(p) and p % 4 == 3:  # Paley I: I + S with S = [[0, 1^T], [-1, Q]] skew
        S = torch.zeros(b, b, dtype=torch.float64)
        S[0, 1:], S[1:, 0], S[1:, 1:] = 1.0, -1.0, _legendre(p)
        return torch.eye(b, dtype=torch.float64) + S
    if b % 2 == 0:
        p = b // 2 - 1
        if _prime(p) and p % 4 == 1:  # Paley II: S = [[0, 1^T], [1, Q]] symmetric
            S = torch.zeros(p + 1, p + 1, dtype=torch.float64)
            S[0, 1:], S[1:, 0], S[1:, 1:] = 1.0, 1.0, _legendre(p)
            A = torch.tensor([[1.0, -1.0], [-1.0, -1.0]], dtype=torch.float64)
            B = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
            return torch.kron(S, A) + torch.kron(torch.eye(p + 1, dtype=torch.float64), B)
    return None


def hadamard_supported(n: int) -> bool:
    return hadamard_factors(n) is not None


SYLVESTER_BLOCK = 6  # a Kronecker factor of 2^6 = 64: small products, few passes over the rows


def hadamard_factors(n: int) -> list[torch.Tensor] | None:
    """Small ``+-1`` matrices whose Kronecker product is ``sqrt(n)`` times `hadamard` ``(n)`` (the
    Paley base, then Sylvester blocks of at most 64), or None when no order ``n`` is built here."""
    for k in range(n.bit_length()):
        if n % (1 << k) == 0 and (base := _paley(n >> k)) is not None:
            out = [base] if n >> k > 1 else []
            S2 = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
            while k:
                j = min(k, SYLVESTER_BLOCK)
                S = torch.ones(1, 1, dtype=torch.float64)
                for _ in range(j):
                    S = torch.kron(S, S2)
                out.append(S)
                k -= j
            return out or [base]
    return None


def hadamard(n: int) -> torch.Tensor:
    """An orthogonal Hadamard matrix ``H / sqrt(n)`` of order ``n`` (float64, ``[n, n]``)."""
    factors = hadamard_factors(n)
    if factors is not None:
        H = factors[0]
        for F in factors[1:]:
            H = torch.kron(H, F)
        return H / n**0.5
    near = sorted((m for m in range(max(1, n - 64), n + 65) if hadamard_supported(m)),
                  key=lambda m: abs(m - n))
    raise AttnidError(f"no Hadamard matrix of order {n} here (orders 2^k b with b = 1, p + 1 for a "
                      f"prime p = 3 mod 4, or 2 (p + 1) for a prime p = 1 mod 4; near {n}: "
                      f"{', '.join(map(str, sorted(near[:4])))}); use a random rotation")


def kron_right(X: torch.Tensor, factors: list[torch.Tensor], scale: float = 1.0) -> torch.Tensor:
    """``X [..., n] @ (scale * kron(F_1, ..., F_r))`` without forming the ``[n, n]`` product:
    the last axis split as ``F``'s sizes (``F_1`` the slowest), each factor applied on its
    axis (for `hadamard` at 4096: two ``64 x 64`` products per row instead of one ``4096 x
    4096``, and the same values up to rounding)."""
    sizes = [F.shape[0] for F in factors]
    Y = X.reshape(-1, *sizes)
    for axis, F in enumerate(factors, start=1):
        F = (F * scale if axis == 1 else F).to(X.dtype)
        Y = torch.movedim(torch.movedim(Y, axis, -1) @ F, -1, axis)
    return Y.reshape(X.shape)


def skew(X: torch.Tensor) -> torch.Tensor:
    """The skew part ``(X - X^T) / 2`` of ``X [..., n, n]``."""
    return 0.5 * (X - X.transpose(-1, -2))


def cayley(S: torch.Tensor) -> torch.Tensor:
    """``(I - S)^{-1} (I + S)``: orthogonal for skew ``S [n, n]`` (``I - S`` is then invertible),
    the identity at ``S = 0``."""
    eye = torch.eye(S.shape[-1], dtype=S.dtype, device=S.device)
    return torch.linalg.solve(eye - S, eye + S)


def random_orthogonal(n: int, gen: torch.Generator) -> torch.Tensor:
    """A Haar-random orthogonal ``[n, n]`` (float64)."""
    A = torch.randn(n, n, generator=gen, dtype=torch.float64)
    Q, R = torch.linalg.qr(A)
    return Q * torch.sign(torch.diagonal(R))[None, :]


def ones_complement(n: int) -> torch.Tensor:
    """An orthonormal basis ``[n, n - 1]`` of the vectors orthogonal to all-ones."""
    ones = torch.ones(n, 1, dtype=torch.float64)
    return torch.linalg.qr(torch.cat([ones, torch.eye(n, dtype=torch.float64)], 1))[0][:, 1:n]


def random_rotation_fixing_ones(n: int, gen: torch.Generator) -> torch.Tensor:
    """A Haar-random orthogonal ``Q`` with ``Q 1 = 1``: ``U R U^T + 1 1^T / n``."""
    U = ones_complement(n)
    return U @ random_orthogonal(n - 1, gen) @ U.T + torch.full((n, n), 1.0 / n, dtype=torch.float64)


def fixing_ones(Q: torch.Tensor) -> torch.Tensor:
    """``Q S`` with ``S`` the reflection that swaps ``1`` and ``Q^T 1``: an orthogonal matrix
    fixing all-ones that keeps ``Q``'s spread (a Hadamard stays incoherent)."""
    n = Q.shape[0]
    u = torch.full((n,), n**-0.5, dtype=Q.dtype)
    v = Q.T @ u
    w = u - v
    if float(w.norm()) < 1e-12:
        return Q
    w = w / w.norm()
    return Q - 2 * (Q @ w)[:, None] * w[None, :]


def random_commutant(spec: AttentionSpec, gen: torch.Generator, scale: float = 0.5) -> torch.Tensor:
    """A random well-conditioned element of the RoPE commutant per key/value group
    (``[G, dk, dk]``): each rotated plane a scaled rotation ``r (cos t I + sin t J)``, the
    pass-through block a rotation times positive scales (any invertible matrix is allowed
    there)."""
    G, dk, r = spec.n_kv_heads, spec.head_dim, spec.rope_dims
    M = torch.zeros(G, dk, dk, dtype=torch.float64)
    if r:
        i1, i2 = plane_dims(spec)
        size = torch.exp(scale * torch.randn(G, r // 2, generator=gen, dtype=torch.float64))
        t = 2 * torch.pi * torch.rand(G, r // 2, generator=gen, dtype=torch.float64)
        a, b = size * torch.cos(t), size * torch.sin(t)
        M[:, i1, i1], M[:, i2, i2], M[:, i1, i2], M[:, i2, i1] = a, a, b, -b
    if dk > r:
        for g in range(G):
            s = torch.exp(scale * torch.randn(dk - r, generator=gen, dtype=torch.float64))
            M[g, r:, r:] = random_orthogonal(dk - r, gen) * s[None, :]
    return M


def random_head_permutation(spec: AttentionSpec, gen: torch.Generator) -> torch.Tensor:
    """A random permutation of the query heads (``[H]``, new head ``h`` is old ``perm[h]``) that
    moves key/value groups as wholes and heads within each group."""
    G, m = spec.n_kv_heads, spec.kv_group_size
    kv_groups = torch.randperm(G, generator=gen)
    return torch.cat([kv_groups[g] * m + torch.randperm(m, generator=gen) for g in range(G)])
