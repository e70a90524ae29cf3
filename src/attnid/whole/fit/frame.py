"""Where B's residual stream sits relative to A's, and the probes everything is compared on.

B is compared with A in A's coordinates: a row vector ``x`` of B's stream is ``x Q`` in A's
(``Q`` the fitted rotation, identity when none). Every tensor with the stream on its right
(a reader's ``[out, d]`` weight, an embedding table, ``W_O [H, dv, d]``) is taken to
``X Q``, every tensor with the stream on its left (a writer's ``[d, in]`` weight, ``W_Q
[H, d, dk]``) to ``Q^T X``.

Probes: for a width ``d`` above ``EXACT_WIDTH`` the stream side is not kept whole but seen
through ``k`` fixed Gaussian directions ``Z [d, k]`` (``E[Z Z^T] = I``): ``X Z`` and ``Z^T X``,
so B costs ``X (Q Z)`` and ``(Q Z)^T X``, never ``X Q`` (``d`` times the weights' size). Every
invariant compared is then the same invariant of the probed weights: exact for a group
element (``(X Q Z)`` of B equals ``X Z`` of A), and a broken one stays broken for almost every
``Z``; distances are Johnson-Lindenstrauss estimates. Up to ``EXACT_WIDTH`` the probes are the
identity and everything is exact.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

EXACT_WIDTH = 512
NARROW = 64  # probes for rows compared one by one (tables, neurons)


def probe_count(d: int, head_dims: int) -> int:
    """How many probes a width ``d`` gets: all of it up to ``EXACT_WIDTH``, else enough for the
    per-kv-group least squares of heads ``head_dims`` wide (twice, at least 64)."""
    return d if d <= EXACT_WIDTH else min(d, max(64, 2 * head_dims))


def accept_bound(k: int, factor: float) -> float:
    """At most the probability that the probes accept a piece broken by ``factor`` times the
    tolerance (`docs/theory.md` §13.19, probes): a Chernoff bound on the lower tail of
    ``chi^2_k / k`` at ``t``, ``exp(k/2 (1 - t + ln t))``, for the pieces probed on both sides
    (``Z^T D Z``, the attention invariants, ``t = 1 / factor``, twice: either side may shrink)
    and on one (``D Z``, rows and neurons, ``t = 1 / factor^2``); ``k`` is the narrowest probe
    count in use (``min(k, NARROW)``)."""
    if factor <= 1:
        return 1.0
    k = min(k, NARROW)
    chernoff = lambda t: math.exp(k / 2 * (1 - t + math.log(t)))  # noqa: E731
    return min(1.0, max(2 * chernoff(1 / factor), chernoff(1 / factor**2)))


def stored_product(X: torch.Tensor, R: torch.Tensor) -> torch.Tensor:
    """``X @ R`` (``X [n, d]``, ``R [d, k]``, float32) for ``X`` holding bfloat16 values (stored
    weights): the product taken by the CPU's bfloat16 units, two to six times faster than
    float32's, and as exact. Those units round both operands to bfloat16 and sum in float32.
    ``X`` loses nothing by it. ``R`` is split as ``R_hi + R_lo``, each exactly a bfloat16
    value, so ``R`` loses about ``2^-16`` of itself, and ``X @ R = X @ [R_hi, R_lo]`` summed
    half to half (one product, twice as wide). An ``X`` not stored in bfloat16 is rounded to
    it, an error within bfloat16's rounding, which is then the level the comparison works to
    (docs/theory.md §13.19). On a CPU without bfloat16 units, or with torch lacking oneDNN,
    the plain float32 product."""
    if not bf16_units():
        return X @ R
    hi = R.to(torch.bfloat16).to(R.dtype)
    R2 = torch.cat([hi, (R - hi).to(torch.bfloat16).to(R.dtype)], 1)  # [d, 2k]
    with _bf16_products():
        Y = X @ R2
    k = R.shape[1]
    return Y[:, :k] + Y[:, k:]


def stored_gram(X: torch.Tensor) -> torch.Tensor:
    """``X^T X`` (``X [n, d]`` float32 holding bfloat16 values): on the CPU's bfloat16 units,
    whose products of two bfloat16 values are exact and summed in float32, as the float32
    product is, in about a third of its time (`stored_product`); float32 without the units."""
    if not bf16_units():
        return X.T @ X
    with _bf16_products():
        return X.T @ X


_PRECISION = threading.Lock()


@contextlib.contextmanager
def _bf16_products() -> Iterator[None]:
    """float32 products taken on the bfloat16 units inside: oneDNN's precision setting, set
    and restored under a lock. The setting is the process's, not the thread's: a float32
    product another thread takes meanwhile runs at that precision too (attnid's commands take
    none; a program running `attnid diff` beside its own float32 work in threads can set
    ``ATTNID_BF16=0``)."""
    mm = torch.backends.mkldnn.matmul
    with _PRECISION:
        before = mm.fp32_precision
        mm.fp32_precision = "bf16"
        try:
            yield
        finally:
            mm.fp32_precision = before


@functools.cache
def bf16_units() -> bool:
    """Whether float32 products may run on the CPU's bfloat16 units (AVX512-BF16 or AMX, on
    Linux's ``/proc/cpuinfo``, with torch built with oneDNN); ``ATTNID_BF16=0`` says no."""
    if os.environ.get("ATTNID_BF16", "1") == "0":
        return False
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.backends.mkldnn, "matmul"):
        return False
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " avx512_bf16" in flags or " amx_bf16" in flags


def probes(d: int, k: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor | None:
    """``Z [d, k]`` with ``E[Z Z^T] = I`` (None: the identity, when ``k >= d``)."""
    if k >= d:
        return None
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(d, k, generator=gen, dtype=torch.float64) / k**0.5).to(dtype)


class Rotation:
    """B's residual rotation into A's frame as the frames use it: the matrix ``Q [d, d]``, or
    only its probed image ``Q Z [d, k]`` (fitted through the probes,
    `attnid.whole.fit.rotation.probed_least_squares`), with ``defect`` its orthogonality
    residual and ``Q`` itself fitted by ``full`` when first asked (the diagnosis of a break,
    the element a fit returns)."""

    def __init__(self, Q: torch.Tensor | None = None, *, QZ: torch.Tensor | None = None,
                 full: Callable[[], torch.Tensor] | None = None, defect: float = 0.0) -> None:
        if Q is None and (QZ is None or full is None):
            raise ValueError("a Rotation needs Q, or QZ with a way to fit Q")
        self._Q, self.QZ, self._full, self.defect = Q, QZ, full, defect

    def matrix(self) -> torch.Tensor:
        """``Q [d, d]`` (fitted once, when first asked, if only ``Q Z`` is held)."""
        if self._Q is None:
            assert self._full is not None
            self._Q = self._full()
        return self._Q

    def frame(self, Z: torch.Tensor | None, dtype: torch.dtype, bf16: bool = False) -> Frame:
        """B's frame: ``Q Z`` as held when ``Z`` is the probes it was fitted through."""
        if Z is not None and self.QZ is not None and self.QZ.shape == Z.shape:
            return Frame(Z, None, dtype, self.QZ.to(dtype), bf16)
        return Frame(Z, self.matrix(), dtype, bf16=bf16)


@dataclass(frozen=True)
class Frame:
    """One model's view: ``Z`` probes (None: exact), ``Q`` B's rotation into A's frame (None:
    identity), ``dtype`` of the arithmetic; ``R`` (derived once) is what multiplies a
    stream-on-the-right tensor: ``Q Z``, ``Q``, ``Z`` or nothing."""

    Z: torch.Tensor | None
    Q: torch.Tensor | None
    dtype: torch.dtype
    R: torch.Tensor | None = field(default=None, compare=False)
    bf16: bool = False  # products at bfloat16 storage precision (`stored_product`)

    def __post_init__(self) -> None:
        if self.R is None and (self.Z is not None or self.Q is not None):
            Q = None if self.Q is None else self.Q.to(self.dtype)
            object.__setattr__(self, "R", self.Z if Q is None else Q if self.Z is None else Q @ self.Z)

    def folded(self, gain: torch.Tensor | None = None, centre: bool = False) -> torch.Tensor | None:
        """``diag(g) P R [d, k]`` (``P = I - 1 1^T / d`` when ``centre``): what a gain and a
        centring along the stream fold into, so that ``X diag(g) P R`` is one product with the
        stored ``X`` and never a gained or centred copy of it (None: exact frame)."""
        if self.R is None:
            return None
        R = self.R - self.R.mean(0, keepdim=True) if centre else self.R
        return R if gain is None else gain.to(self.dtype)[:, None] * R

    def right(self, X: torch.Tensor, gain: torch.Tensor | None = None, centre: bool = False
              ) -> torch.Tensor:
        """``X [..., d] -> X diag(g) P R [..., k]`` (stream on the right; ``g`` and ``P`` only
        when given)."""
        X = X.to(self.dtype)
        if self.R is None:
            X = X if gain is None else X * gain.to(self.dtype)
            return X - X.mean(-1, keepdim=True) if centre else X
        F = self.folded(gain, centre)
        if not self.bf16:
            return X @ F
        return stored_product(X.reshape(-1, X.shape[-1]), F).reshape(*X.shape[:-1], -1)

    def left(self, X: torch.Tensor, gain: torch.Tensor | None = None, centre: bool = False
             ) -> torch.Tensor:
        """``X [..., d, n] -> R^T P diag(g) X [..., k, n]`` (stream on the left)."""
        X = X.to(self.dtype)
        if self.R is None:
            X = X if gain is None else X * gain.to(self.dtype)[:, None]
            return X - X.mean(-2, keepdim=True) if centre else X
        F = self.folded(gain, centre)
        if not self.bf16:
            return F.T @ X
        Xt = X.transpose(-1, -2)  # [..., n, d]: for a stored [out, d] weight, a view of it
        Y = stored_product(Xt.reshape(-1, X.shape[-2]), F)  # [... n, k]
        return Y.reshape(*Xt.shape[:-1], -1).transpose(-1, -2)

    def vector(self, x: torch.Tensor) -> torch.Tensor:
        """A stream vector ``[d] -> [k]``."""
        return self.right(x[None, :])[0]

    def narrow(self, k: int = NARROW) -> Frame:
        """The same frame through its first ``k`` probes: enough for rows compared one by one
        (tables, MLP neurons), which need no room for a per-kv-group least-squares fit. Rescaled
        by ``sqrt(K / k)`` so that ``E[Z Z^T] = I`` still holds and distances measured through
        the narrowed frame add up with the others."""
        if self.Z is None or self.Z.shape[1] <= k:
            return self
        scale = (self.Z.shape[1] / k) ** 0.5
        # (Q Z)[:, :k] = Q Z[:, :k]
        return Frame(self.Z[:, :k] * scale, self.Q, self.dtype, self.R[:, :k] * scale, self.bf16)
