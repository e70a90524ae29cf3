"""Closed-form identification counts (docs/theory.md §2-§8), for every variant of `AttentionSpec`.

The counts rest on one fact about matrix products: the map ``(A, B) -> A B^T`` with
``A`` of shape ``n1 x k`` and ``B`` of shape ``n2 x k`` has, at a generic point, an
image of dimension ``rho (n1 + n2 - rho)`` with ``rho = min(k, n1, n2)`` (matrices of
rank at most ``rho``), so its fibre has dimension ``(n1 + n2) k - rho (n1 + n2 - rho)``.
That is ``k^2`` (the GL(k) gauge) when ``k <= n1, n2``, and it is also the right number
in the edge cases ``head_dim > d_model``.

Every count here is checked against the Jacobian-rank arbiter in ``tests/``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from attnid.spec import AttentionSpec
from attnid.theory.qknorm_wide import qk_nullity


def product_fibre_dim(n1: int, n2: int, k: int) -> int:
    """Dimension of the set of ``(A, B)`` with the same generic product ``A B^T``.

    >>> product_fibre_dim(16, 16, 4)   # GL(4) gauge
    16
    >>> product_fibre_dim(3, 3, 5)     # head_dim 5 > width 3: 2*3*5 - (2*3*3 - 9)
    21
    """
    rho = min(k, n1, n2)
    return (n1 + n2) * k - rho * (n1 + n2 - rho)


@dataclass(frozen=True)
class Component:
    """One block of parameters and the unidentified directions that live in it."""

    params: int
    unidentified: int
    near_unidentified: int = 0

    def to_dict(self) -> dict[str, int]:
        return {
            "params": self.params,
            "unidentified": self.unidentified,
            "near_unidentified": self.near_unidentified,
        }


class ComponentTotals:
    """Totals over ``self.components`` (name -> `Component`): one layer, or a whole model."""

    components: dict[str, Component]

    @property
    def total(self) -> int:
        return sum(c.params for c in self.components.values())

    @property
    def unidentified(self) -> int:
        """Exactly unidentified directions (the Jacobian's nullity)."""
        return sum(c.unidentified for c in self.components.values())

    @property
    def near_unidentified(self) -> int:
        """Null when the norms' epsilon is 0 but not at the given epsilon (docs/theory.md §1.2)."""
        return sum(c.near_unidentified for c in self.components.values())

    @property
    def identified(self) -> int:
        return self.total - self.unidentified

    @property
    def ratio(self) -> float:
        return self.unidentified / self.total

    def totals_dict(self) -> dict[str, Any]:
        return {
            "total": self.total,
            "identified": self.identified,
            "unidentified": self.unidentified,
            "ratio": self.ratio,
            "near_unidentified": self.near_unidentified,
            "components": {k: v.to_dict() for k, v in self.components.items()},
        }


@dataclass(frozen=True)
class Count(ComponentTotals):
    """Result of :func:`count`: totals and the breakdown by symmetry component."""

    spec: AttentionSpec
    components: dict[str, Component] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {**self.totals_dict(), "spec": self.spec.to_dict()}


def count(spec: AttentionSpec) -> Count:
    """Closed-form parameter counts of one attention layer.

    >>> c = count(AttentionSpec(d_model=64, n_heads=4))
    >>> c.total, c.unidentified, c.ratio
    (16384, 2048, 0.125)
    >>> count(AttentionSpec(d_model=8192, n_heads=64, n_kv_heads=8)).components["qk_gauge"].unidentified
    131072
    """
    return Count(spec=spec, components={**_qk_components(spec), **_vo_components(spec)})


def _qk_components(spec: AttentionSpec) -> dict[str, Component]:
    d, H, G, m = spec.d_model, spec.n_heads, spec.n_kv_heads, spec.kv_group_size
    dk, r, p = spec.head_dim, spec.rope_dims, spec.pass_dims
    assert G is not None and dk is not None
    has_q, has_k = spec.has_bias("q"), spec.has_bias("k")
    weights = d * H * dk + d * G * dk + (H * dk if has_q else 0)
    key_bias = G * dk if has_k else 0
    out: dict[str, Component] = {}
    if spec.qk_norm == "none":
        # Per kv group, scores are products of (query rows, augmented by b_Q) with W_K:
        # pass-through dims give a real product fibre, each rotated plane a complex
        # scalar (2 real dims) that commutes with every rotation.
        rows = m * (d + (1 if has_q else 0))
        gauge = G * (product_fibre_dim(rows, d, p) + r)
        out["qk_gauge"] = Component(weights, gauge)
        if has_k:
            # q . b_K is constant along a softmax row unless RoPE rotates it.
            out["key_bias_translation"] = Component(key_bias, G * p)
        return out
    # QK-norm: RMSNorm removes the scale of each query head and kv group (exactly
    # only when eps == 0) and the key bias passes through the norm, so it is seen.
    scales = H + G
    exact_scales = spec.qk_norm_eps == 0.0
    gains = 2 * dk
    if has_k:
        out["key_bias_translation"] = Component(key_bias, 0)
    if dk <= d:
        # The gains can be traded between q and k elementwise (within a plane under
        # RoPE); nothing else survives the norm.
        out["qk_gauge"] = Component(
            weights, scales if exact_scales else 0, 0 if exact_scales else scales
        )
        out["qk_norm_gain_transfer"] = Component(gains, p + r // 2)
        return _reorder(out)
    # head_dim > d_model: the norm sees only the bias-augmented quadratic forms and the
    # bilinear forms, which are no longer free; qknorm_wide counts their fibre.
    exact, near = qk_nullity(spec)
    transfer = p + r // 2
    out["qk_gauge"] = Component(weights, exact - transfer, near)
    out["qk_norm_gain_transfer"] = Component(gains, transfer)
    return _reorder(out)


def _reorder(out: dict[str, Component]) -> dict[str, Component]:
    order = ("qk_gauge", "key_bias_translation", "qk_norm_gain_transfer")
    return {k: out[k] for k in order if k in out}


def _vo_components(spec: AttentionSpec) -> dict[str, Component]:
    d, H, G, m = spec.d_model, spec.n_heads, spec.n_kv_heads, spec.kv_group_size
    dv = spec.v_head_dim
    assert G is not None and dv is not None
    weights = d * G * dv + H * dv * d
    out = {"vo_gauge": Component(weights, G * product_fibre_dim(d, m * d, dv))}
    has_v, has_o = spec.has_bias("v"), spec.has_bias("o")
    if has_v or has_o:
        # Rows of A sum to 1: biases act only through b_O + sum_h b_V^{g(h)} W_O^h.
        params = (G * dv if has_v else 0) + (d if has_o else 0)
        seen = d if has_o else (min(G * dv, d) if has_v else 0)
        out["value_bias_translation"] = Component(params, params - seen)
    return out


