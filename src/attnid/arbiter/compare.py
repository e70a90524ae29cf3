"""Closed form against the arbiter, for one spec: what ``attnid verify`` runs.

A second look (another random point, twice the sequences) is taken only when the first
can be doubted (docs/theory.md §12.3-§12.4): the arbiter disagrees with the closed form, or a
spectral gap is under :data:`CLEAR_GAP`. The arbiter's errors are one-sided: at a random
point with enough rows the computed nullity can only exceed the generic one (an unlucky
point or too few rows lose rank, never add it), and a wide gap rules out a threshold
error; so a count that matches the closed form's symmetries with a wide gap cannot move.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any

import torch

from attnid.arbiter.rank import ArbiterResult, EpsFreeFn, jacobian_rank, randomize_
from attnid.attention import Attention
from attnid.spec import AttentionSpec
from attnid.theory import Count, count

CLEAR_GAP = 1e6  # kept / dropped singular values: below this a count gets a second look


@dataclass(frozen=True)
class Verification:
    """A closed-form count next to the arbiter's, at one or two random points."""

    label: str
    theory: Count
    arbiter: ArbiterResult
    confirm: ArbiterResult | None  # another seed and twice the sequences, when taken
    seconds: float

    @property
    def stable(self) -> bool:
        c = self.confirm
        return c is None or (c.nullity, c.near_nullity) == (
            self.arbiter.nullity, self.arbiter.near_nullity)

    @property
    def agree(self) -> bool:
        return self.stable and _matches(self.arbiter, self.theory)

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
            "confirmed": self.confirm is not None,
            "spectral_gap": a.spectral_gap,
            "rank": a.rank,
            "n_sequences": a.n_sequences,
            "n_rows": a.n_rows,
            "seconds": self.seconds,
            "spec": self.theory.spec.to_dict(),
        }


def _matches(found: ArbiterResult, theory: Count) -> bool:
    return (found.nullity, found.near_nullity) == (theory.unidentified, theory.near_unidentified)


def needs_second_look(found: ArbiterResult, theory: Count) -> bool:
    """Whether a count could still change at another point: it disagrees, or its gap is narrow."""
    gap = found.spectral_gap
    return not _matches(found, theory) or (gap is not None and gap < CLEAR_GAP)


def verify_module(module: torch.nn.Module, theory: Count, *, label: str, seed: int = 0,
                  confirm: bool | None = None, without_eps: EpsFreeFn | None = None,
                  **arbiter_kwargs: Any) -> Verification:
    """Randomize ``module`` (it must be the arbiter's own copy), count numerically, compare.

    ``confirm``: ``None`` (default) takes the second look only when
    :func:`needs_second_look`; ``True`` always, ``False`` never. Near-unidentified
    directions are counted by their definition (``without_eps``, see
    :func:`attnid.arbiter.rank.near_unidentified`); without it there are none.
    """
    start = time.perf_counter()

    def one(s: int, **kw: Any) -> ArbiterResult:
        randomize_(module, s)
        return jacobian_rank(module, seed=s, without_eps=without_eps, **kw)

    first = one(seed, **arbiter_kwargs)
    second = None
    if confirm or (confirm is None and needs_second_look(first, theory)):
        second = one(seed + 1, **dict(arbiter_kwargs, n_sequences=2 * first.n_sequences))
    return Verification(label, theory, first, second, time.perf_counter() - start)


def verify(spec: AttentionSpec, *, seed: int = 0, confirm: bool | None = None) -> Verification:
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
