"""The arbiter: rank and nullity of the Jacobian of a module's outputs w.r.t. its parameters.

It works on any ``torch.nn.Module`` (attnid's own, Hugging Face's, yours): it only
uses ``named_parameters()`` and a forward callable. The module is copied and cast to
float64; the caller's module is never touched.

Method. Rows of the Jacobian ``J`` (``N x P``, ``N >= 3P`` outputs over many
independent sequences) are never stored. Instead ``S = Omega J`` with a Gaussian
``Omega`` of ``P + oversample`` rows is built by batched vector-Jacobian products
(``torch.func.vjp`` under ``vmap``, chunked so memory stays bounded), and the singular
values of ``S`` are computed once. ``rank(S) = rank(J)`` with probability one (docs/theory.md
§12.2), and
``S`` is barely larger than the ``P x P`` floor of any exact dense rank decision.

Near-unidentified directions have one definition (docs/theory.md §12.5): null when the
norms' epsilon is 0 but not at the given epsilon. :func:`near_unidentified` is that
definition; :func:`jacobian_rank` applies it when given ``without_eps``; nothing reads
"near" off a singular-value band.
"""

from __future__ import annotations

import copy
import math
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.func import functional_call, vjp, vmap
from torch.nn.attention import SDPBackend, sdpa_kernel

from attnid.errors import AttnidError

ForwardFn = Callable[[nn.Module, torch.Tensor], torch.Tensor]
EpsFreeFn = Callable[[nn.Module], nn.Module]  # a copy of the module with every norm's eps = 0

# Relative singular-value thresholds (sigma / sigma_max), by working precision.
# float64 kernels put exact symmetries near 1e-15; kernels that compute softmax or
# rotary tables in float32 put them near 1e-8 (docs/theory.md §12.4, §12.6).
EXACT_RTOL = {"float64": 1e-10, "float32": 1e-6}


@dataclass(frozen=True)
class ArbiterResult:
    """What the arbiter found at one point."""

    n_params: int
    rank: int  # n_params - nullity - near_nullity
    nullity: int  # singular values below rtol * sigma_max: exactly unidentified
    near_nullity: int  # null at eps = 0 but not at the module's eps (0 unless without_eps given)
    spectral_gap: float | None  # smallest kept / largest dropped singular value (worst run)
    singular_values: torch.Tensor  # all of them, descending, float64 (at the module's eps)
    rtol: float
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


def near_unidentified(nullity_at_eps: int, nullity_at_zero: int) -> int:
    """The definition: directions exactly null at eps = 0 that the given eps identifies.

    Every symmetry at eps > 0 is one at eps = 0, so the difference is never negative at a
    generic point; a negative one (numerical noise) counts as none.

    >>> near_unidentified(64, 66)
    2
    """
    return max(nullity_at_zero - nullity_at_eps, 0)


def default_forward(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return _first(module(x))


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
    without_eps: EpsFreeFn | None = None,
    oversample: int = 16,
    chunk_rows: int | None = None,
    return_null_space: bool = False,
) -> ArbiterResult:
    """Rank, nullity and spectrum of ``d outputs / d parameters`` at the module's current point.

    ``inputs`` default to Gaussian ``[n_sequences, seq_len, d_model]`` with enough
    sequences (:func:`sequences_needed`); ``d_model`` is read from ``module.spec`` when
    not given. ``rtol`` defaults to the float64 threshold; pass ``EXACT_RTOL["float32"]``
    for modules that compute internally in float32. With ``without_eps`` (a function
    returning the module with every norm's epsilon at 0, same weights) the same inputs
    are decided again and the difference is the near-unidentified count
    (:func:`near_unidentified`).

    >>> from attnid import Attention, AttentionSpec
    >>> layer = randomize_(Attention(AttentionSpec(d_model=8, n_heads=2)))
    >>> jacobian_rank(layer).nullity   # 2 heads * 4^2 (QK) + 2 * 4^2 (VO)
    64
    """
    start = time.perf_counter()
    work = _float64_copy(module)
    P = sum(p.numel() for p in _trainable(work).values())
    x = (_default_inputs(module, P, d_model, seq_len, n_sequences, seed) if inputs is None
         else inputs).to(torch.float64)
    tol = EXACT_RTOL["float64"] if rtol is None else rtol
    sv, Vh, N = _spectrum(work, x, forward, seed, oversample, chunk_rows, return_null_space)
    nullity, gap = split_spectrum(sv, P, tol)
    near = 0
    if without_eps is not None:
        sv0, _, _ = _spectrum(without_eps(work).to(torch.float64), x, forward, seed, oversample,
                              chunk_rows, False)
        nullity0, gap0 = split_spectrum(sv0, P, tol)
        near = near_unidentified(nullity, nullity0)
        gap = min((g for g in (gap, gap0) if g is not None), default=None)
    return ArbiterResult(
        n_params=P, rank=P - nullity - near, nullity=nullity, near_nullity=near, spectral_gap=gap,
        singular_values=sv, rtol=tol, n_sequences=x.shape[0], seq_len=x.shape[1], n_rows=N,
        seconds=time.perf_counter() - start,
        null_space=None if Vh is None else Vh[P - nullity :].T,
    )


def _float64_copy(module: nn.Module) -> nn.Module:
    """The arbiter's own float64 copy, refused when it has no trainable or non-finite parameters."""
    work = copy.deepcopy(module).to(torch.float64)
    params = _trainable(work)
    if not params:
        raise AttnidError("the module has no trainable parameters")
    if not all(bool(torch.isfinite(p).all()) for p in params.values()):
        raise AttnidError("the module has NaN or Inf parameters; the arbiter needs a finite point")
    return work


def _trainable(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach() for n, p in module.named_parameters() if p.requires_grad}


def _default_inputs(module: nn.Module, n_params: int, d_model: int | None, seq_len: int,
                    n_sequences: int | None, seed: int) -> torch.Tensor:
    """Seeded Gaussian sequences ``[n_sequences, seq_len, d_model]``, enough of them for ``3P`` rows."""
    width = d_model if d_model is not None else getattr(getattr(module, "spec", None), "d_model", None)
    if width is None:
        raise AttnidError("give inputs or d_model: the module has no .spec to read the width from")
    n_seq = n_sequences or sequences_needed(n_params, seq_len, width)
    gen = torch.Generator().manual_seed(10_000 + seed)
    return torch.randn(n_seq, seq_len, width, generator=gen, dtype=torch.float64)


def _spectrum(work: nn.Module, x: torch.Tensor, forward: ForwardFn, seed: int, oversample: int,
              chunk_rows: int | None, with_vectors: bool
              ) -> tuple[torch.Tensor, torch.Tensor | None, int]:
    """Singular values of the sketch ``Omega J`` (descending), ``V^H`` when asked, and ``N``."""
    params = _trainable(work)
    names = list(params)
    shapes = [t.shape for t in params.values()]
    sizes = [t.numel() for t in params.values()]
    flat0 = torch.cat([t.reshape(-1) for t in params.values()])

    def f(flat: torch.Tensor) -> torch.Tensor:
        swapped = {n: t.view(s) for n, t, s in zip(names, flat.split(sizes), shapes, strict=True)}
        return forward_call(work, swapped, x, forward).reshape(-1)

    with sdpa_kernel([SDPBackend.MATH]):  # decomposed SDPA: every op has a batching rule
        out, pullback = vjp(f, flat0)
        N = out.numel()
        if chunk_rows is None:  # small batches of cotangents run fastest (memory bandwidth);
            chunk_rows = max(16, min(128, 2**24 // max(N, 1)))  # and at most ~128 MB of them
        sketch = _sketch(pullback, N, flat0.numel(), oversample, chunk_rows, seed)
    if with_vectors:
        _, sv, Vh = torch.linalg.svd(sketch, full_matrices=True)
        return sv, Vh, N
    return torch.linalg.svdvals(sketch), None, N


class _Forward(nn.Module):
    """Wraps ``forward(module, x)`` as a module so `torch.func.functional_call` can run it."""

    def __init__(self, inner: nn.Module, forward: ForwardFn) -> None:
        super().__init__()
        self.inner = inner
        self.fn = forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(self.inner, x)


def forward_call(module: nn.Module, params: dict[str, torch.Tensor], x: torch.Tensor,
                 forward: ForwardFn) -> torch.Tensor:
    """Run ``forward(module, x)`` with ``params`` swapped in (functionally, public API only)."""
    if forward is default_forward:
        return _first(functional_call(module, params, (x,), strict=False))
    wrapped = _Forward(module, forward)
    return functional_call(wrapped, {f"inner.{n}": t for n, t in params.items()}, (x,), strict=False)


def _first(out: torch.Tensor | tuple | list) -> torch.Tensor:
    return out[0] if isinstance(out, (tuple, list)) else out


def _sketch(pullback: Callable, n_rows: int, n_params: int, oversample: int,
            chunk_rows: int, seed: int) -> torch.Tensor:
    """``Omega J`` (``min(N, P + oversample) x P``) by batched vector-Jacobian products."""
    k = min(n_rows, n_params + oversample)
    gen = torch.Generator().manual_seed(20_000 + seed)
    exact = k == n_rows  # few outputs: take J itself (Omega = identity)
    sketch = torch.empty(k, n_params, dtype=torch.float64)
    batched = vmap(lambda w: pullback(w)[0])
    row_by_row = False
    for lo in range(0, k, chunk_rows):
        hi = min(k, lo + chunk_rows)
        if exact:
            omega = torch.eye(n_rows, dtype=torch.float64)[lo:hi]
        else:
            # Gaussian drawn in float32 (3x cheaper to generate than float64, which is a
            # quarter of the whole call at P ~ 1,000); any such draw keeps rank(Omega J).
            omega = torch.randn(hi - lo, n_rows, generator=gen, dtype=torch.float32).double()
        if not row_by_row:
            try:
                sketch[lo:hi] = batched(omega)
                continue
            except torch.OutOfMemoryError:
                raise AttnidError(f"out of memory in the arbiter with {hi - lo} cotangent rows at "
                                  f"once: pass a smaller chunk_rows (P = {n_params})") from None
            except RuntimeError as e:
                if not _is_vmap_limit(e):
                    raise
                warnings.warn(f"the forward cannot run under vmap ({str(e).splitlines()[0]}); "
                              "the arbiter falls back to one row at a time (slower)", stacklevel=3)
                row_by_row = True
        for i in range(hi - lo):
            sketch[lo + i] = pullback(omega[i])[0]
    return sketch


def _is_vmap_limit(e: RuntimeError) -> bool:
    """A forward that vmap cannot batch (data-dependent ``.item()``, in-place on a captured tensor,
    an op without a batching rule) raises RuntimeError naming vmap or batching; nothing else does."""
    text = str(e).lower()
    return "vmap" in text or "batching rule" in text or "batched tensor" in text


def split_spectrum(sv: torch.Tensor, n_params: int, rtol: float) -> tuple[int, float | None]:
    """``(nullity, spectral gap)``: singular values below ``rtol * sigma_max`` are null.

    A sketch shorter than ``P`` has implicit zeros. The gap is the smallest kept over the
    largest dropped value (``inf`` when the dropped ones are exactly 0; ``None`` without any).

    >>> split_spectrum(torch.tensor([2.0, 1.0, 2.0**-40]), 3, 1e-10)
    (1, 1099511627776.0)
    >>> split_spectrum(torch.tensor([2.0, 1.0]), 4, 1e-10)   # two implicit zeros
    (2, inf)
    """
    full = torch.zeros(n_params, dtype=torch.float64)
    full[: min(n_params, sv.numel())] = sv[:n_params]
    top = float(full[0]) if n_params else 0.0
    if top == 0.0:
        return n_params, None
    nullity = int((full / top < rtol).sum())
    if nullity == 0:
        return 0, None
    smallest_kept = float(full[n_params - nullity - 1])
    largest_dropped = float(full[n_params - nullity])
    return nullity, (math.inf if largest_dropped == 0.0 else smallest_kept / largest_dropped)


def set_norm_eps_(module: nn.Module, eps: float) -> nn.Module:
    """Set, in place, the epsilon of every normalisation inside ``module`` (the float ``eps`` or
    ``variance_epsilon`` of modules whose class name contains "Norm", as in Hugging Face's and
    torch's norms); returns ``module``."""
    for m in module.modules():
        if "Norm" in type(m).__name__:
            for attr in ("variance_epsilon", "eps"):
                if isinstance(getattr(m, attr, None), float):
                    setattr(m, attr, eps)
    return module


def norms_without_eps(module: nn.Module) -> nn.Module:
    """A copy of ``module`` with every norm's epsilon at 0: the ``without_eps`` argument of
    :func:`jacobian_rank` for modules built from such norms (docs/theory.md §12.5)."""
    return set_norm_eps_(copy.deepcopy(module), 0.0)
