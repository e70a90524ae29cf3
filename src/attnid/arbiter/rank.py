"""The arbiter: rank and nullity of the Jacobian of a module's outputs w.r.t. its parameters.

It works on any ``torch.nn.Module`` (attnid's own, Hugging Face's, yours): it only
uses ``named_parameters()`` and a forward callable. The module is copied and cast to
float64; the caller's module is never touched.

Method. Rows of the Jacobian ``J`` (``N x P``, ``N >= 3P`` outputs over many
independent sequences) are never stored. Instead ``S = Omega J`` with a Gaussian
``Omega`` of ``P + oversample`` rows is built by batched vector-Jacobian products
(``torch.func.vjp`` under ``vmap``, chunked so memory stays bounded), and the singular
values of ``S`` are computed once. ``rank(S) = rank(J)`` with probability one, and
``S`` is barely larger than the ``P x P`` floor of any exact dense rank decision.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.func import functional_call, vjp, vmap
from torch.nn.attention import SDPBackend, sdpa_kernel

from attnid.errors import AttnidError

ForwardFn = Callable[[nn.Module, torch.Tensor], torch.Tensor]

# Relative singular-value thresholds (sigma / sigma_max), by working precision.
# float64 kernels put exact symmetries near 1e-15; kernels that compute softmax or
# rotary tables in float32 put them near 1e-8 (THEORY.md).
EXACT_RTOL = {"float64": 1e-10, "float32": 1e-6}
NEAR_RTOL = 1e-4  # near-null directions start below this ...
NEAR_GAP = 20.0  # ... under a gap of at least this ratio


@dataclass(frozen=True)
class ArbiterResult:
    """What the arbiter found at one point."""

    n_params: int
    rank: int
    nullity: int  # singular values below rtol * sigma_max: exactly unidentified
    near_nullity: int  # between rtol and near_rtol: identified only barely (a norm's eps)
    spectral_gap: float | None  # smallest kept / largest dropped singular value
    singular_values: torch.Tensor  # all of them, descending, float64
    rtol: float
    near_rtol: float
    n_sequences: int
    seq_len: int
    n_rows: int
    seconds: float
    null_space: torch.Tensor | None = None  # [P, nullity] orthonormal, when asked for

    def summary(self) -> dict[str, float | int | None]:
        return {
            "n_params": self.n_params,
            "rank": self.rank,
            "nullity": self.nullity,
            "near_nullity": self.near_nullity,
            "spectral_gap": self.spectral_gap,
            "n_sequences": self.n_sequences,
            "n_rows": self.n_rows,
            "seconds": self.seconds,
        }


def default_forward(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = module(x)
    return out[0] if isinstance(out, (tuple, list)) else out


def randomize_(module: nn.Module, seed: int = 0) -> nn.Module:
    """Move every parameter to a generic random point, in place (for modules the arbiter owns).

    Matrices get N(0, 1/fan_in); vectors (biases, norm gains) get magnitudes in
    [0.5, 1.5] with random signs, so no bias sits at zero and no gain near it.
    """
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(module.named_parameters()):
            if p.ndim >= 2:
                fan_in = p.shape[-2] if p.ndim == 3 else p.shape[-1]
                new = torch.randn(p.shape, generator=gen, dtype=torch.float64) / math.sqrt(fan_in)
            else:
                mag = 0.5 + torch.rand(p.shape, generator=gen, dtype=torch.float64)
                sign = torch.randint(0, 2, p.shape, generator=gen).to(torch.float64) * 2 - 1
                new = mag * sign
            p.copy_(new.to(p.dtype))
    return module


def sequences_needed(n_params: int, seq_len: int, width: int, *, min_sequences: int = 32,
                     row_factor: float = 3.0) -> int:
    """Independent sequences so that there are >= 32 of them and >= 3P output rows."""
    return max(min_sequences, math.ceil(row_factor * n_params / (seq_len * width)))


def jacobian_rank(
    module: nn.Module,
    inputs: torch.Tensor | None = None,
    *,
    forward: ForwardFn = default_forward,
    d_model: int | None = None,
    seq_len: int = 8,
    n_sequences: int | None = None,
    seed: int = 0,
    rtol: float | None = None,
    near_rtol: float = NEAR_RTOL,
    oversample: int = 16,
    chunk_rows: int | None = None,
    return_null_space: bool = False,
) -> ArbiterResult:
    """Rank, nullity and spectrum of ``d outputs / d parameters`` at the module's current point.

    ``inputs`` default to Gaussian ``[n_sequences, seq_len, d_model]`` with enough
    sequences (:func:`sequences_needed`); ``d_model`` is read from ``module.spec`` when
    not given. ``rtol`` defaults to the float64 threshold; pass ``EXACT_RTOL["float32"]``
    for modules that compute internally in float32.

    >>> from attnid import Attention, AttentionSpec
    >>> layer = randomize_(Attention(AttentionSpec(d_model=8, n_heads=2)))
    >>> jacobian_rank(layer).nullity   # 2 heads * 4^2 (QK) + 2 * 4^2 (VO)
    64
    """
    start = time.perf_counter()
    work = copy.deepcopy(module).to(torch.float64)
    named = [(n, p.detach()) for n, p in work.named_parameters() if p.requires_grad]
    if not named:
        raise AttnidError("the module has no trainable parameters")
    names, tensors = zip(*named, strict=True)
    shapes = [t.shape for t in tensors]
    sizes = [t.numel() for t in tensors]
    flat0 = torch.cat([t.reshape(-1) for t in tensors])
    P = flat0.numel()
    if not torch.isfinite(flat0).all():
        raise AttnidError("the module has NaN or Inf parameters; the arbiter needs a finite point")

    if inputs is None:
        width = d_model if d_model is not None else getattr(getattr(module, "spec", None), "d_model", None)
        if width is None:
            raise AttnidError("give inputs or d_model: the module has no .spec to read the width from")
        n_seq = n_sequences or sequences_needed(P, seq_len, width)
        gen = torch.Generator().manual_seed(10_000 + seed)
        inputs = torch.randn(n_seq, seq_len, width, generator=gen, dtype=torch.float64)
    x = inputs.to(torch.float64)

    def f(flat: torch.Tensor) -> torch.Tensor:
        params = {n: t.view(s) for n, t, s in zip(names, flat.split(sizes), shapes, strict=False)}
        return forward_call(work, params, x, forward).reshape(-1)

    with sdpa_kernel([SDPBackend.MATH]):  # decomposed SDPA: every op has a batching rule
        out, pullback = vjp(f, flat0)
    N = out.numel()
    if chunk_rows is None:  # small batches of cotangents run fastest (memory bandwidth);
        chunk_rows = max(16, min(128, 2**24 // max(N, 1)))  # and at most ~128 MB of them
    sketch = _sketch(pullback, N, P, oversample, chunk_rows, seed)
    null_space = None
    if return_null_space:
        _, sv, Vh = torch.linalg.svd(sketch, full_matrices=True)
    else:
        sv = torch.linalg.svdvals(sketch)  # descending
    tol = EXACT_RTOL["float64"] if rtol is None else rtol
    rank, nullity, near, gap = classify(sv, P, tol, near_rtol)
    if return_null_space:
        null_space = Vh[P - nullity :].T
    return ArbiterResult(
        n_params=P, rank=rank, nullity=nullity, near_nullity=near, spectral_gap=gap,
        singular_values=sv, rtol=tol, near_rtol=near_rtol, n_sequences=x.shape[0],
        seq_len=x.shape[1], n_rows=N, seconds=time.perf_counter() - start, null_space=null_space,
    )


def forward_call(module: nn.Module, params: dict[str, torch.Tensor], x: torch.Tensor,
                 forward: ForwardFn) -> torch.Tensor:
    """Run ``forward(module, x)`` with ``params`` swapped in (functionally)."""
    return functional_call(module, params, (x,), strict=False) if forward is default_forward \
        else _call_with(module, params, x, forward)


def _call_with(module: nn.Module, params: dict[str, torch.Tensor], x: torch.Tensor,
               forward: ForwardFn) -> torch.Tensor:
    from torch.nn.utils.stateless import _reparametrize_module

    with _reparametrize_module(module, params):
        return forward(module, x)


def _sketch(pullback: Callable, n_rows: int, n_params: int, oversample: int,
            chunk_rows: int, seed: int) -> torch.Tensor:
    """``Omega J`` (``min(N, P + oversample) x P``) by batched vector-Jacobian products."""
    k = min(n_rows, n_params + oversample)
    gen = torch.Generator().manual_seed(20_000 + seed)
    exact = k == n_rows  # few outputs: take J itself (Omega = identity)
    sketch = torch.empty(k, n_params, dtype=torch.float64)
    batched = vmap(lambda w: pullback(w)[0])
    for lo in range(0, k, chunk_rows):
        hi = min(k, lo + chunk_rows)
        if exact:
            omega = torch.eye(n_rows, dtype=torch.float64)[lo:hi]
        else:
            # Gaussian drawn in float32 (3x cheaper to generate than float64, which is a
            # quarter of the whole call at P ~ 1,000); any such draw keeps rank(Omega J).
            omega = torch.randn(hi - lo, n_rows, generator=gen, dtype=torch.float32).double()
        try:
            sketch[lo:hi] = batched(omega)
        except RuntimeError:  # ops without a batching rule: one row at a time
            for i in range(hi - lo):
                sketch[lo + i] = pullback(omega[i])[0]
    return sketch


def classify(sv: torch.Tensor, n_params: int, rtol: float, near_rtol: float,
             near_gap: float = NEAR_GAP) -> tuple[int, int, int, float | None]:
    """Split singular values into kept, near-null and null; return rank, nullity, near, gap.

    Null: below ``rtol * sigma_max``. Near-null: the values under the widest gap
    (at least ``near_gap`` wide) that opens below ``near_rtol * sigma_max``; a norm's
    epsilon puts such directions a few decades under every genuine direction.
    """
    full = torch.zeros(n_params, dtype=torch.float64)
    full[: min(n_params, sv.numel())] = sv[:n_params]  # a short sketch has implicit zeros
    top = float(full[0]) if n_params else 0.0
    if top == 0.0:
        return 0, n_params, 0, None
    rel = full / top
    nullity = int((rel < rtol).sum())
    live = rel[: n_params - nullity]  # descending, all >= rtol
    near = 0
    below = (live < near_rtol).nonzero()
    if below.numel():
        first = max(int(below[0]), 1)  # first index under the ceiling (keep sigma_max)
        ratios = live[first - 1 : -1] / live[first:]  # gap between i-1 and i, for i >= first
        best = int(torch.argmax(ratios))
        if float(ratios[best]) >= near_gap:
            near = live.numel() - (first + best)
    rank = n_params - nullity - near
    gap = None
    if nullity:
        smallest_kept = float(full[n_params - nullity - 1])
        largest_dropped = float(full[n_params - nullity])
        gap = math.inf if largest_dropped == 0.0 else smallest_kept / largest_dropped
    return rank, nullity, near, gap
