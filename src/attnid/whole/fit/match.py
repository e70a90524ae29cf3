"""Which head of B is which head of A, and which MLP neuron: linear assignment on features the
continuous gauges cannot change (docs/theory.md §13.19).

* heads: per query head the V/O product ``W_V^g W_O^h`` (every V/O gauge leaves it) and the Q/K
  scores ``W~_Q^h W~_K^gT`` split as RoPE splits them (pass-through block, each plane's cos and
  sin parts, here summed with fixed random weights; QK-norm: ``W_Q``, ``W_K`` themselves), all
  on the probed stream; heads match within key/value groups, groups as wholes (two levels of
  assignment);
* neurons: the gate row (gated MLPs: no symmetry changes it) and the rank-one product of the
  neuron's input row and output column (a scaling leaves it); GELU/SiLU MLPs: the rows
  themselves.

An exact rewrite is matched by nearest neighbours (each row's cheapest column; when these form
a bijection they are also the optimal assignment, the sum of row minima being a lower bound);
otherwise `scipy.optimize.linear_sum_assignment` solves it, up to :data:`DENSE` rows. Larger
problems (a 7B MLP's 11,008 neurons, its 4,096 stream coordinates) are solved on a sparse
graph: each row's and each column's :data:`CANDIDATES` cheapest partners
(`scipy.sparse.csgraph.min_weight_full_bipartite_matching`), which is the optimal assignment
whenever the optimum pairs every row with one of them (docs/theory.md §13.19); the dense
solver only when the candidates admit no perfect matching.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from attnid.errors import require
from attnid.numerics import row_sq_distances, sums_of_products
from attnid.rope import plane_dims
from attnid.weights import AttentionWeights
from attnid.whole.fit.canonical import MLP

DENSE = 2048  # assignments of more rows go to the sparse solver first
CANDIDATES = 16  # per row and per column: the cheapest partners the sparse solver may pick


def assignment(cost: torch.Tensor) -> torch.Tensor:
    """``perm [n]`` minimising ``sum_i cost[i, perm[i]]`` (``cost [n, n]``; above ``DENSE``
    rows, over each row's and column's cheapest candidates: see the module)."""
    n = cost.shape[0]
    nearest = cost.argmin(1)
    if torch.equal(nearest.sort().values, torch.arange(n)):
        return nearest
    if n > DENSE:
        k = min(CANDIDATES, n)
        rows, cols = cost.topk(k, 1, largest=False), cost.topk(k, 0, largest=False)
        perm = sparse_assignment(rows.indices, rows.values, cols.indices.T, cols.values.T)
        if perm is not None:
            return perm
    return dense_assignment(cost)


def dense_assignment(cost: torch.Tensor) -> torch.Tensor:
    """``perm [n]`` minimising ``sum_i cost[i, perm[i]]`` over every pairing (scipy's solver)."""
    require("scipy", "hf")
    from scipy.optimize import linear_sum_assignment  # optional dependency, only when needed

    rows, cols = linear_sum_assignment(cost.double().numpy())
    return torch.as_tensor(cols[rows.argsort()], dtype=torch.long)


def sparse_assignment(row_to: torch.Tensor, row_cost: torch.Tensor, col_from: torch.Tensor,
                      col_cost: torch.Tensor) -> torch.Tensor | None:
    """``perm [n]`` minimising the total cost over the candidate pairs only: row ``i``'s
    ``row_to[i] [k]`` at ``row_cost[i]``, and column ``j``'s ``col_from[j] [k]`` (rows) at
    ``col_cost[j]``; None when they admit no perfect matching."""
    require("scipy", "hf")
    import numpy as np
    from scipy.sparse import csr_matrix
    from scipy.sparse.csgraph import min_weight_full_bipartite_matching

    n, k = row_to.shape
    i = torch.cat([torch.arange(n).repeat_interleave(k), col_from.reshape(-1)])
    j = torch.cat([row_to.reshape(-1), torch.arange(n).repeat_interleave(col_from.shape[1])])
    c = torch.cat([row_cost.reshape(-1), col_cost.reshape(-1)]).double()
    key, first = torch.unique(i * n + j, return_inverse=True)  # a pair found both ways: once
    w = torch.empty(len(key), dtype=torch.float64).scatter_(0, first, c)
    lo = float(w.min())  # the same shift on every edge moves every perfect matching's cost alike;
    w = w - lo + 1.0  # weights at least 1 (a stored zero would be no edge)
    graph = csr_matrix((w.numpy(), ((key // n).numpy(), (key % n).numpy())), shape=(n, n))
    try:
        r, col = min_weight_full_bipartite_matching(graph)
    except ValueError:  # no perfect matching among the candidates
        return None
    return torch.as_tensor(np.asarray(col)[np.argsort(r)], dtype=torch.long)


def _sqdist(X: torch.Tensor, Y: torch.Tensor) -> torch.Tensor:
    """``[n, m]`` relative squared distances between rows of ``X [n, p]`` and ``Y [m, p]``."""
    nx, ny = (X**2).sum(1), (Y**2).sum(1)
    return _relative(X @ Y.T, nx[:, None] + ny[None, :])


def _relative(cross: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """``(total - 2 cross) / total``, clamped at 0, in place (both ``[n, m]``, both overwritten:
    an ``[11008, 2048]`` temporary is 90 MB, and each new one costs page faults)."""
    return cross.mul_(-2).add_(total).clamp_min_(0).div_(total.clamp_min_(1e-300))


SKETCH = 256  # wider streams: each head's [k, k] products are taken times a random [k, SKETCH]


def _head_features(w: AttentionWeights, seed: int = 0) -> list[torch.Tensor]:
    """Per query head, gauge-invariant features ``[H, p]``: the products ``W_V^h W_O^h`` and
    ``W_Q^h W_K^h^T`` ``[k, k]``, or, for a stream wider than ``SKETCH``, each times one random
    Gaussian ``Z [k, SKETCH]`` (the same for both models, whose streams are already aligned: a
    sketch keeps every relative distance to about ``1 / sqrt(SKETCH)``, ample to tell a head's
    match, at distance 0, from the others; and never forms the ``[H, k, k]`` products, 4 GB a
    layer at 7B widths)."""
    s = w.spec
    m = s.kv_group_size
    k = w.W_O.shape[-1]
    gen = torch.Generator().manual_seed(seed)
    Z = None
    if k > SKETCH:
        Z = torch.randn(k, SKETCH, generator=gen, dtype=torch.float64).to(w.W_O.dtype) / SKETCH**0.5

    def times(X: torch.Tensor, Yt: torch.Tensor) -> torch.Tensor:  # X @ Yt (@ Z)
        return X @ Yt if Z is None else X @ (Yt @ Z)

    vo = times(w.W_V.repeat_interleave(m, dim=0), w.W_O).flatten(1)  # [H, k*k] or [H, k*p]
    K = w.W_K.repeat_interleave(m, dim=0)  # [H, k, dk]
    if s.qk_norm != "none":
        return [vo, w.W_Q.flatten(1), K.flatten(1)]
    q, kk = w.W_Q, K
    r = s.rope_dims
    qk = times(q[..., r:], kk[..., r:].mT)  # [H, k, k] or [H, k, p]
    if r:
        i1, i2 = plane_dims(s)
        a, b = (torch.randn(r // 2, generator=gen, dtype=torch.float64).to(q.dtype) for _ in range(2))
        q1, q2, k1, k2 = q[..., i1], q[..., i2], kk[..., i1], kk[..., i2]
        qk = (qk + times(q1 * a, k1.mT) + times(q2 * a, k2.mT) + times(q1 * b, k2.mT)
              - times(q2 * b, k1.mT))
    return [vo, qk.flatten(1)]


def match_heads(A: AttentionWeights, B: AttentionWeights) -> torch.Tensor:
    """``perm [H]``: A's head ``h`` is B's head ``perm[h]`` (kv groups kept whole)."""
    s = A.spec
    cost = sum(_sqdist(fa, fb) for fa, fb in zip(_head_features(A), _head_features(B), strict=True))
    return assign_heads(cost, s.n_kv_heads)


def assign_heads(cost: torch.Tensor, G: int) -> torch.Tensor:
    """``perm [H]`` from a cost ``[H, H]`` (A's heads by B's): heads within each pair of
    key/value groups, then the groups as wholes."""
    m = cost.shape[0] // G
    blocks = cost.reshape(G, m, G, m).permute(0, 2, 1, 3)  # [gA, gB, m, m]
    inner = [[assignment(blocks[i, j]) for j in range(G)] for i in range(G)]
    gcost = torch.tensor([[float(blocks[i, j][torch.arange(m), inner[i][j]].sum()) for j in range(G)]
                          for i in range(G)], dtype=torch.float64)
    kv_groups = assignment(gcost)
    return torch.cat([int(kv_groups[i]) * m + inner[i][int(kv_groups[i])] for i in range(G)])


Features = list[tuple[torch.Tensor, torch.Tensor | None]]  # per neuron: rows, and a rank-one second factor


def _neuron_features(x: MLP) -> Features:
    """Per neuron: (row features, second factor of a rank-one product or None)."""
    up = x.up if x.up_bias is None else torch.cat([x.up, x.up_bias[:, None]], 1)
    if x.kind == "other":
        return [(up, None), (x.down, None)] + ([(x.gate, None)] if x.gate is not None else [])
    out: list[tuple[torch.Tensor, torch.Tensor | None]] = [(up, x.down)]
    if x.gate is not None:
        gate = x.gate if x.gate_bias is None else torch.cat([x.gate, x.gate_bias[:, None]], 1)
        out.append((gate, None))
    return out


def _pair_cost(fa: tuple[torch.Tensor, torch.Tensor | None], fb: tuple[torch.Tensor, torch.Tensor | None],
               rows: slice) -> torch.Tensor:
    (a, a2), (b, b2) = fa, fb
    a = a[rows]
    if a2 is None:
        return _sqdist(a, b)
    a2 = a2[rows]
    na = (a**2).sum(1) * (a2**2).sum(1)  # |u d^T|^2 = |u|^2 |d|^2
    nb = (b**2).sum(1) * (b2**2).sum(1)
    return _relative((a @ b.T).mul_(a2 @ b2.T), na[:, None] + nb[None, :])


def _dot(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Row-wise ``<x_j, y_j>`` ``[n]`` (`attnid.numerics.sums_of_products`: in blocks, along the
    stored rows, ``x`` with its copy exactly ``_dot(x, x)``)."""
    return sums_of_products(x, y, 1)


def _diagonal(fa: tuple[torch.Tensor, torch.Tensor | None], fb: tuple[torch.Tensor, torch.Tensor | None]
              ) -> torch.Tensor:
    """The cost of pairing neuron ``j`` with neuron ``j`` (``[f]``)."""
    (a, a2), (b, b2) = fa, fb
    if a2 is None:
        return row_sq_distances(a, b) / (_dot(a, a) + _dot(b, b)).clamp_min(1e-300)
    na, nb = _dot(a, a) * _dot(a2, a2), _dot(b, b) * _dot(b2, b2)  # a neuron paired with its copy: cost 0
    cross = _dot(a, b) * _dot(a2, b2)
    return (na + nb - 2 * cross).clamp_min(0) / (na + nb).clamp_min(1e-300)


def _sketched(fs: list[tuple[torch.Tensor, torch.Tensor | None]], seed: int = 0
              ) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Each feature wider than ``SKETCH`` taken times one random Gaussian ``[p, SKETCH]`` (the
    same for both models; see `_head_features`): the ``[f, f]`` costs then take ``f^2 SKETCH``
    products instead of ``f^2 d`` (3 TFLOP a layer at 7B widths)."""
    out = []
    for k, (x, y) in enumerate(fs):
        pair = []
        for t in (x, y):
            if t is None or t.shape[1] <= SKETCH:
                pair.append(t)
                continue
            gen = torch.Generator().manual_seed(seed + 7919 * k + t.shape[1])
            Z = torch.randn(t.shape[1], SKETCH, generator=gen, dtype=torch.float64).to(t.dtype)
            pair.append(t @ (Z / SKETCH**0.5))
        out.append((pair[0], pair[1]))
    return out


FEW = 32  # probes enough to find a rewrite's neurons (`nearest_neurons`; checked by `neurons_within`)


def _direction(x: MLP) -> torch.Tensor:
    """Per neuron ``[f, k]``, a row its symmetries only scale, at unit length: the gate's (gated
    MLPs), else the up projection's (ReLU: a positive scale), each with its bias."""
    w, c = (x.gate, x.gate_bias) if x.gate is not None else (x.up, x.up_bias)
    return torch.nn.functional.normalize(w if c is None else torch.cat([w, c[:, None]], 1), dim=1)


def nearest_neurons(A: MLP, B: MLP, chunk: int = 2048) -> torch.Tensor | None:
    """``perm [f]``: the neuron of B nearest each of A's in direction (`_direction`), when these
    form a bijection (else None). A candidate and not an optimum: a rewrite's neuron points as
    its match does and, through a few probes (`FEW`), well apart from every other; one
    product and an argmax a block, where the costs of `match_neurons` take a dozen passes over
    each ``[chunk, f]`` block. `neurons_within` checks it on the stored rows."""
    da, db = _direction(A), _direction(B)
    near = torch.cat([(da[s:s + chunk] @ db.T).argmax(1) for s in range(0, da.shape[0], chunk)])
    return near if torch.equal(near.sort().values, torch.arange(near.numel())) else None


def neurons_within(A: MLP, B: MLP, tol: float, chunk: int = 256) -> bool:
    """Whether every neuron ``j`` of A is within ``tol`` of B's neuron ``j`` (the relative cost
    of `match_neurons`, `_diagonal`, at most ``tol^2``), ``chunk`` neurons at a time (a
    difference of a 7B layer's gate rows whole is 180 MB) and ending at the first that is not.
    Costs are never negative, so no pairing's total is below this one's by more than
    ``f tol^2``: with ``tol`` a storage rounding, pairing each neuron with its namesake is the
    optimum to that rounding (docs/theory.md §13.19)."""
    fa, fb = _neuron_features(A), _neuron_features(B)

    def rows(feature: tuple[torch.Tensor, torch.Tensor | None], r: slice
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
        x, x2 = feature
        return x[r], None if x2 is None else x2[r]

    for s in range(0, A.up.shape[0], chunk):
        r = slice(s, s + chunk)
        cost = sum(_diagonal(rows(x, r), rows(y, r)) for x, y in zip(fa, fb, strict=True))
        if float(cost.max()) > tol**2:  # type: ignore[union-attr]
            return False
    return True


def match_neurons(A: MLP, B: MLP, tol: float = 0.0, chunk: int = 2048) -> torch.Tensor:
    """``perm [f]``: A's neuron ``j`` is B's neuron ``perm[j]``. The identity when every neuron
    already matches its namesake to rounding (``tol``; costs are never negative, so that is the
    optimum); else `blocked_assignment` on the costs ``chunk`` rows at a time."""
    f = A.up.shape[0]
    if neurons_within(A, B, tol):
        return torch.arange(f)
    fa, fb = _sketched(_neuron_features(A)), _sketched(_neuron_features(B))

    def cost(x: Features, y: Features) -> Callable[[slice], torch.Tensor]:  # cost(fb, fa): the transpose
        return lambda rows: sum(_pair_cost(p, q, rows) for p, q in zip(x, y, strict=True))  # type: ignore[return-value]

    return blocked_assignment(cost(fa, fb), cost(fb, fa), f, chunk)


def blocked_assignment(rows_of: Callable[[slice], torch.Tensor], cols_of: Callable[[slice], torch.Tensor],
                       n: int, chunk: int = 2048) -> torch.Tensor:
    """``perm [n]`` minimising the total of a cost ``[n, n]`` held ``chunk`` rows at a time:
    ``rows_of(s)`` is ``cost[s]``, ``cols_of(s)`` is ``cost[:, s].T`` (an ``[11008, 11008]``
    float64 cost is 0.97 GB). Nearest neighbours when they form a bijection; above
    :data:`DENSE` rows the sparse graph of each row's and each column's :data:`CANDIDATES`
    cheapest partners; the whole cost and the dense solver only when those fail."""
    k = min(CANDIDATES, n) if n > DENSE else 1
    row_cost, row_to = _cheapest(rows_of, n, k, chunk)  # each row's cheapest columns [n, k]
    nearest = row_to[:, 0]
    if torch.equal(nearest.sort().values, torch.arange(n)):
        return nearest
    if n > DENSE:
        col_cost, col_from = _cheapest(cols_of, n, k, chunk)
        perm = sparse_assignment(row_to, row_cost, col_from, col_cost)
        if perm is not None:
            return perm
    return dense_assignment(torch.cat([rows_of(slice(i, i + chunk)) for i in range(0, n, chunk)]))


def _cheapest(rows_of: Callable[[slice], torch.Tensor], n: int, k: int, chunk: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's ``k`` cheapest columns: ``(costs, indices)`` ``[n, k]``, cheapest first."""
    parts = [rows_of(slice(i, i + chunk)).topk(k, 1, largest=False) for i in range(0, n, chunk)]
    return torch.cat([p.values for p in parts]), torch.cat([p.indices for p in parts])
