"""Closed form against the arbiter, for one spec: what ``attnid verify`` runs."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from attnid.arbiter.rank import ArbiterResult, jacobian_rank, randomize_
from attnid.attention import Attention
from attnid.spec import AttentionSpec
from attnid.theory import Count, count

EpsFreeFn = Callable[[torch.nn.Module], torch.nn.Module]


@dataclass(frozen=True)
class Verification:
    """A closed-form count next to the arbiter's, at one or two random points."""

    label: str
    theory: Count
    arbiter: ArbiterResult
    confirm: ArbiterResult | None  # another seed and twice the sequences
    seconds: float

    @property
    def stable(self) -> bool:
        c = self.confirm
        return c is None or (c.nullity, c.near_nullity) == (
            self.arbiter.nullity, self.arbiter.near_nullity)

    @property
    def agree(self) -> bool:
        return self.stable and (self.arbiter.nullity, self.arbiter.near_nullity) == (
            self.theory.unidentified, self.theory.near_unidentified)

    def to_dict(self) -> dict[str, Any]:
        a = self.arbiter
        return {
            "model": self.label,
            "total": a.n_params,
            "total_theory": self.theory.total,
            "unidentified_numeric": a.nullity,
            "unidentified_theory": self.theory.unidentified,
            "near_unidentified_numeric": a.near_nullity,
            "near_unidentified_theory": self.theory.near_unidentified,
            "agree": self.agree,
            "stable": self.stable,
            "spectral_gap": a.spectral_gap,
            "rank": a.rank,
            "n_sequences": a.n_sequences,
            "n_rows": a.n_rows,
            "seconds": self.seconds,
            "spec": self.theory.spec.to_dict(),
        }


def verify_module(module: torch.nn.Module, theory: Count, *, label: str, seed: int = 0,
                  confirm: bool = True, without_eps: EpsFreeFn | None = None,
                  **arbiter_kwargs: Any) -> Verification:
    """Randomize ``module`` (it must be the arbiter's own copy), count numerically, compare.

    Near-unidentified directions are counted only by their definition, never by a
    singular-value band (a small but genuine direction is not "near"): ``without_eps(module)``
    returns a copy whose norms have epsilon 0 (same weights), and the near directions are
    those exactly null without the epsilon but not with it; without it there are none.
    """
    start = time.perf_counter()

    def one(s: int, **kw: Any) -> ArbiterResult:
        randomize_(module, s)
        found = jacobian_rank(module, seed=s, near_rtol=0.0, **kw)
        if without_eps is None:
            return found
        exact = jacobian_rank(without_eps(module), seed=s, near_rtol=0.0, **kw).nullity
        near = max(exact - found.nullity, 0)
        return replace(found, near_nullity=near, rank=found.n_params - found.nullity - near)

    first = one(seed, **arbiter_kwargs)
    second = None
    if confirm:
        second = one(seed + 1, **dict(arbiter_kwargs, n_sequences=2 * first.n_sequences))
    return Verification(label, theory, first, second, time.perf_counter() - start)


def verify(spec: AttentionSpec, *, seed: int = 0, confirm: bool = True) -> Verification:
    """Build `attnid.Attention(spec)` at random weights and compare arbiter with theory.

    >>> verify(AttentionSpec(d_model=8, n_heads=2, bias="k")).agree
    True
    """
    eps_free = None
    if spec.qk_norm != "none" and spec.qk_norm_eps > 0:
        def eps_free(layer: torch.nn.Module) -> torch.nn.Module:
            copy = Attention(replace(spec, qk_norm_eps=0.0)).double()
            copy.load_state_dict(layer.state_dict())
            return copy
    return verify_module(Attention(spec).double(), count(spec), label=spec.describe(),
                         seed=seed, confirm=confirm, without_eps=eps_free,
                         d_model=spec.d_model)
