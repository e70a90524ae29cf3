"""Test tools that ship with attnid, for its own tests, its scripts and adapter authors.

In the manner of ``e3nn.util.test``: the tolerances, relative error and polar decomposition of
`attnid.numerics` (re-exported), an assertion that a
transform preserved a function (reporting the measured error), one that a random element of
a layer's symmetry group leaves its function alone (``assert_gauge_invariant``), the invariant-map oracle
behind the wide QK-norm count (docs/theory.md §7.1) and a check that RoPE scores
depend only on the relative position ``m - n`` (docs/theory.md §5.1).

    from attnid.testing import assert_function_preserved
    assert_function_preserved(old_layer, new_layer, x)   # raises AssertionError with the error

The shared pieces of the test suite live here too, loaded when first named (so that
``import attnid.testing`` loads no transformers): the tiny Hugging Face models
(`attnid.testing.models`: ``tiny_model``, ``random_hf_model``, ``save_random``,
``model_function``, ``random_element``), the catalogue of tiny configs and transforms
(`attnid.testing.catalogue`: ``WHOLE_CASES``, ``TRANSFORM_FAMILIES``, ``TRANSFORM_CASES``,
``TINY_LLAMA``) and
the checks on files and refusals (`attnid.testing.files`: ``fingerprint``,
``assert_one_error``); the attention variants the counts and the symmetry toolkit are checked
on are in `attnid.testing.specs` (``grid``, ``VARIANTS``, ``ORBIT_GRID``). Test modules import
these, never each other.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

import torch
from torch import nn

from attnid.attention import Attention
from attnid.errors import AttnidError
from attnid.numerics import TOLERANCE as TOLERANCE
from attnid.numerics import polar as polar
from attnid.numerics import relative_error as relative_error
from attnid.numerics import rounding_tolerance as rounding_tolerance
from attnid.numerics import tolerance as tolerance
from attnid.rope import apply_rope, rope_tables
from attnid.spec import AttentionSpec
from attnid.symmetry.gauge import Gauge, apply_gauge, random_gauge
from attnid.weights import AttentionWeights


def _output(out: torch.Tensor | tuple | list) -> torch.Tensor:
    return out[0] if isinstance(out, (tuple, list)) else out


def assert_function_preserved(before: Callable[..., torch.Tensor], after: Callable[..., torch.Tensor],
                              inputs: torch.Tensor | tuple, *, rtol: float | None = None) -> float:
    """Assert ``after(*inputs)`` equals ``before(*inputs)`` to the dtype's tolerance; return the error.

    ``before``/``after`` are modules or callables (a tuple output counts by its first
    element); ``rtol`` defaults to :func:`tolerance` of the output dtype.

    >>> from attnid import Attention, AttentionSpec, randomize_
    >>> layer = randomize_(Attention(AttentionSpec(d_model=8, n_heads=2)).double(), 0)
    >>> x = torch.randn(2, 5, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    >>> assert_function_preserved(layer, layer, x)
    0.0
    """
    args = inputs if isinstance(inputs, tuple) else (inputs,)
    with torch.no_grad():
        want, got = _output(before(*args)), _output(after(*args))
    if got.shape != want.shape:
        raise AssertionError(f"output shape changed: {tuple(want.shape)} -> {tuple(got.shape)}")
    tol = tolerance(want.dtype) if rtol is None else rtol
    err = relative_error(got, want)
    if not err <= tol:
        raise AssertionError(f"function changed: relative error {err:.3e} > {tol:.0e} ({want.dtype})")
    return err


def assert_gauge_invariant(module: Attention | AttentionWeights, gauge: Gauge | None = None, *,
                           inputs: torch.Tensor | None = None, rtol: float | None = None,
                           seed: int = 0) -> float:
    """Assert a layer computes the same function after an element of its symmetry group; return
    the measured relative error (the counterpart of e3nn's ``assert_equivariant``).

    ``module``: an `attnid.Attention` or an (unbatched) `AttentionWeights`. ``gauge``: the group
    element (`attnid.symmetry.Gauge`); None draws one with `attnid.symmetry.random_gauge`
    (``seed``): the QK gauge in the commutant of RoPE, the key-bias shift on pass-through
    dims, the VO gauge, the value-bias shift into the output bias, and under QK-norm the gain
    transfer (and the per-head scales when eps = 0); docs/theory.md §3-§7 derive why each
    leaves the function unchanged. Both layers run in float64, causal and not, on ``inputs``
    (default: seeded ``[2, 7, d_model]`` normal); ``rtol`` defaults to float64's tolerance.
    A gauge that moves no weight is refused (it would test nothing).

    >>> from attnid import Attention, AttentionSpec, randomize_
    >>> spec = AttentionSpec(d_model=16, n_heads=4, n_kv_heads=2, bias="qkvo", rope=0.5)
    >>> layer = randomize_(Attention(spec), seed=0)
    >>> assert_gauge_invariant(layer) < 1e-12
    True
    """
    w = (module if isinstance(module, AttentionWeights) else AttentionWeights.from_module(module))
    if w.batch_shape:
        raise AttnidError(f"one layer at a time: these weights have batch shape {w.batch_shape}")
    w = w.to(torch.float64)
    g = random_gauge(w, seed=seed) if gauge is None else gauge
    moved = apply_gauge(w, g)
    change = relative_error(moved.flat(), w.flat())
    if not change > 1e-6:
        raise AssertionError(f"the gauge element moves the weights by {change:.1e} only: nothing is tested")
    if inputs is None:
        gen = torch.Generator().manual_seed(seed)
        inputs = torch.randn(2, 7, w.spec.d_model, generator=gen, dtype=torch.float64)
    x = inputs.double()
    before, after = w.to_module(copy=False), moved.to_module(copy=False)
    errors = [assert_function_preserved(lambda x, c=c: before(x, causal=c), lambda x, c=c: after(x, causal=c),
                                        x, rtol=TOLERANCE[torch.float64] if rtol is None else rtol)
              for c in (True, False)]
    return max(errors)


# The slow reference for attnid.Attention -------------------------------------------------
def rope_rotation(spec: AttentionSpec, position: int) -> torch.Tensor:
    """The ``[dk, dk]`` float64 matrix RoPE applies at ``position``, built from the formula.

    Plane ``i`` (``i < r/2``) is dims ``(i, i + r/2)`` (``half``) or ``(2i, 2i + 1)``
    (``interleaved``) and turns by ``position * base**(-2i/r)``; pass-through dims are fixed.
    """
    r, dk = spec.rope_dims, spec.head_dim
    R = torch.eye(dk, dtype=torch.float64)
    for i in range(r // 2):
        u, v = (i, i + r // 2) if spec.rope_pairing == "half" else (2 * i, 2 * i + 1)
        angle = position * spec.rope_base ** (-2 * i / r)
        c, s = math.cos(angle), math.sin(angle)
        R[u, u], R[u, v], R[v, u], R[v, v] = c, -s, s, c
    return R


def attention_reference(layer: nn.Module, x: torch.Tensor, causal: bool = False) -> torch.Tensor:
    """Slow, explicit attention in float64 from the canonical weights, sharing no code with
    ``attnid.Attention``'s forward: per head and position, biases, RMS QK-norm and a RoPE
    rotation matrix from their formulas, then scores, mask and softmax written out."""
    s = layer.spec
    W = {n: p.detach().double() for n, p in layer.named_parameters()}
    x = x.detach().double()
    B, T, _ = x.shape
    zero_k = torch.zeros(s.head_dim, dtype=torch.float64)
    zero_v = torch.zeros(s.v_head_dim, dtype=torch.float64)
    R = torch.stack([rope_rotation(s, t) for t in range(T)])  # [T, dk, dk]

    def prepare(z: torch.Tensor, gain: str) -> torch.Tensor:  # [B, T, dk] -> [B, T, dk]
        if s.qk_norm == "head":
            z = z / torch.sqrt((z * z).sum(-1, keepdim=True) / s.head_dim + s.qk_norm_eps) * W[gain]
        return torch.einsum("tij,btj->bti", R, z)

    out = torch.zeros(B, T, s.d_model, dtype=torch.float64)
    for h in range(s.n_heads):
        g = h // s.kv_group_size
        q = prepare(x @ W["W_Q"][h] + W.get("b_Q", {h: zero_k})[h], "g_Q")
        k = prepare(x @ W["W_K"][g] + W.get("b_K", {g: zero_k})[g], "g_K")
        v = x @ W["W_V"][g] + W.get("b_V", {g: zero_v})[g]  # [B, T, dv]
        scores = q @ k.transpose(-1, -2) / math.sqrt(s.head_dim)  # [B, T, T]
        if causal:
            allowed = torch.tensor([[n <= m for n in range(T)] for m in range(T)])
            scores = scores.masked_fill(~allowed, -math.inf)
        weights = torch.exp(scores - scores.amax(-1, keepdim=True))
        weights = weights / weights.sum(-1, keepdim=True)
        out = out + (weights @ v) @ W["W_O"][h]
    return out + W["b_O"] if "b_O" in W else out


# The invariant-map oracle (wide QK-norm) -------------------------------------------------
def invariant_jacobian(spec: AttentionSpec, seed: int = 0) -> tuple[torch.Tensor, list[int], list[int]]:
    """Jacobian of what QK-normalised scores see at eps = 0, at seeded random weights.

    The invariants per head: the pass-through bilinear form, per rotated plane its cosine
    and sine forms, the query rows' Gram ``Q_h = A_h A_h^T``; per kv group ``K_g``
    (docs/theory.md §7.1). Parameters: ``A [H, a, dk]``, ``B [G, b, dk]`` (bias rows
    appended) and both gains. Also returns the row of each ``Q_h``'s and ``K_g``'s last
    diagonal entry (the bias direction, which an epsilon absorbed by a bias moves).
    """
    d, H, G, dk = spec.d_model, spec.n_heads, spec.n_kv_heads, spec.head_dim
    a, b = d + spec.has_bias("q"), d + spec.has_bias("k")
    p, m = spec.pass_dims, spec.kv_group_size
    nA, nB = H * a * dk, G * b * dk
    iu, ju = torch.triu_indices(a, a).unbind(), torch.triu_indices(b, b).unbind()
    x0 = torch.randn(nA + nB + 2 * dk, generator=torch.Generator().manual_seed(seed),
                     dtype=torch.float64)

    def invariants(x: torch.Tensor) -> torch.Tensor:
        A, B = x[:nA].view(H, a, dk), x[nA:nA + nB].view(G, b, dk)
        gq, gk = x[nA + nB:nA + nB + dk], x[nA + nB + dk:]
        out = []
        for h in range(H):
            q, k = A[h] * gq, B[h // m] * gk
            out.append(q[:, :p] @ k[:, :p].T)
            for c in range(p, dk, 2):  # a plane (c, c + 1): cosine and sine parts
                out.append(q[:, c:c + 1] @ k[:, c:c + 1].T + q[:, c + 1:c + 2] @ k[:, c + 1:c + 2].T)
                out.append(q[:, c + 1:c + 2] @ k[:, c:c + 1].T - q[:, c:c + 1] @ k[:, c + 1:c + 2].T)
            out.append((A[h] @ A[h].T)[iu])
        out += [(B[g] @ B[g].T)[ju] for g in range(G)]
        return torch.cat([o.reshape(-1) for o in out])

    J = torch.autograd.functional.jacobian(invariants, x0)
    per_head = a * b * (1 + (dk - p)) + len(iu[0])
    q_last = [h * per_head + a * b * (1 + (dk - p)) + len(iu[0]) - 1 for h in range(H)]
    k_last = [H * per_head + (g + 1) * len(ju[0]) - 1 for g in range(G)]
    return J, q_last, k_last


def numerical_rank(J: torch.Tensor, rtol: float = 1e-10) -> int:
    """Singular values above ``rtol * sigma_max`` (a small dense matrix, float64)."""
    s = torch.linalg.svdvals(J)
    return int((s > s[0] * rtol).sum()) if s.numel() and s[0] > 0 else 0


# RoPE relative position ------------------------------------------------------------------
def rope_relative_error(spec: AttentionSpec, *, length: int = 12, seed: int = 0) -> float:
    """Largest change of a RoPE score ``<R_m q, R_n k>`` when both positions shift together.

    Zero (to rounding) exactly when scores depend only on ``m - n``; computed in float64
    from :func:`attnid.rope.apply_rope` on seeded random queries and keys.
    """
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(spec.head_dim, generator=gen, dtype=torch.float64)
    k = torch.randn(spec.head_dim, generator=gen, dtype=torch.float64)
    pos = torch.arange(2 * length)
    cos, sin = rope_tables(spec, pos, torch.float64)
    rq = apply_rope(q.expand(2 * length, -1), spec, cos, sin)  # [2T, dk]: q at every position
    rk = apply_rope(k.expand(2 * length, -1), spec, cos, sin)
    scores = rq @ rk.T  # [2T, 2T]: scores[m, n]
    worst = 0.0
    for m, n, shift in itertools.product(range(length), range(length), (1, length)):
        worst = max(worst, abs(float(scores[m + shift, n + shift] - scores[m, n])))
    return worst / float(q.norm() * k.norm())


def assert_rope_relative(spec: AttentionSpec, *, rtol: float = 1e-12, seed: int = 0) -> float:
    """Assert RoPE scores depend only on ``m - n``; return the measured relative error."""
    err = rope_relative_error(spec, seed=seed)
    if not err <= rtol:
        raise AssertionError(f"RoPE scores depend on absolute position: error {err:.3e} > {rtol:.0e} "
                             f"({spec.describe()})")
    return err


_LAZY = {"attnid.testing.models": ("tiny_model", "random_hf_model", "save_random", "model_function",
                                   "random_element"),
         "attnid.testing.catalogue": ("WHOLE_CASES", "TRANSFORM_FAMILIES", "TRANSFORM_CASES",
                                      "TINY_LLAMA"),
         "attnid.testing.files": ("fingerprint", "assert_one_error")}


def __getattr__(name: str) -> object:
    import importlib

    for module, names in _LAZY.items():
        if name in names:
            return getattr(importlib.import_module(module), name)
    raise AttributeError(f"module 'attnid.testing' has no attribute {name!r}")
