"""`AttentionSpec`: a frozen, validated description of one attention layer.

Notation follows docs/theory.md §1.1: ``d`` = ``d_model``, ``H`` query heads, ``G`` key/value
groups (``n_kv_heads``), ``d_k`` = ``head_dim``, ``d_v`` = ``v_head_dim``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from attnid.errors import AttnidError

RopePairing = Literal["half", "interleaved"]
QKNorm = Literal["none", "head"]
BIAS_LETTERS = "qkvo"


def parse_bias(bias: str | frozenset[str] | set[str] | tuple[str, ...] | None) -> frozenset[str]:
    """Turn ``"qkv"``, ``{"q", "k"}`` or ``None`` into a frozenset of bias letters."""
    if bias is None or bias == "none":
        return frozenset()
    letters = frozenset(bias)
    unknown = sorted(letters - set(BIAS_LETTERS))
    if unknown:
        raise AttnidError(f"unknown bias letter(s) {''.join(unknown)!r}: use a subset of 'qkvo'")
    return letters


@dataclass(frozen=True)
class AttentionSpec:
    """One scaled dot-product attention layer.

    >>> AttentionSpec(d_model=64, n_heads=4).head_dim
    16
    >>> AttentionSpec(d_model=64, n_heads=8, n_kv_heads=2, rope=0.5).rope_dims
    4
    """

    d_model: int  # d: width of the residual stream
    n_heads: int  # H: query heads
    n_kv_heads: int | None = None  # G: key/value groups; None -> n_heads (MHA); 1 -> MQA
    head_dim: int | None = None  # d_k; None -> d_model // n_heads (must divide)
    v_head_dim: int | None = None  # d_v; None -> head_dim
    bias: frozenset[str] = field(default_factory=frozenset)  # subset of {"q","k","v","o"}
    rope: float = 0.0  # fraction of each head's q/k dims that rotate (0 = no RoPE)
    rope_pairing: RopePairing = "half"  # "half": (i, i + r/2) as HF rotate_half; "interleaved": (2i, 2i+1)
    rope_base: float = 10000.0  # RoPE frequency base (theta)
    qk_norm: QKNorm = "none"  # "head": RMSNorm with a gain of size head_dim on each head's q and k
    qk_norm_eps: float = 1e-6  # the norm's epsilon; 0 makes the scale symmetry exact

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen: fill in derived defaults once, here
        set_(self, "bias", parse_bias(self.bias))
        for name in ("d_model", "n_heads"):
            _check_positive_int(name, getattr(self, name))
        if self.n_kv_heads is None:
            set_(self, "n_kv_heads", self.n_heads)
        _check_positive_int("n_kv_heads", self.n_kv_heads)
        if self.n_heads % self.n_kv_heads:
            raise AttnidError(
                f"n_kv_heads={self.n_kv_heads} does not divide n_heads={self.n_heads}"
            )
        if self.head_dim is None:
            if self.d_model % self.n_heads:
                raise AttnidError(
                    f"n_heads={self.n_heads} does not divide d_model={self.d_model}; "
                    "give head_dim explicitly"
                )
            set_(self, "head_dim", self.d_model // self.n_heads)
        _check_positive_int("head_dim", self.head_dim)
        if self.v_head_dim is None:
            set_(self, "v_head_dim", self.head_dim)
        _check_positive_int("v_head_dim", self.v_head_dim)
        if not (isinstance(self.rope, (int, float)) and 0.0 <= self.rope <= 1.0):
            raise AttnidError(f"rope fraction must be between 0 and 1, got {self.rope!r}")
        rotated = self.rope * self.head_dim
        if abs(rotated - round(rotated)) > 1e-9 or round(rotated) % 2:
            raise AttnidError(
                f"rope fraction {self.rope} of head_dim {self.head_dim} gives {rotated:g} "
                "rotated dims; it must be an even whole number"
            )
        if self.rope_pairing not in ("half", "interleaved"):
            raise AttnidError(f"rope_pairing must be 'half' or 'interleaved', got {self.rope_pairing!r}")
        if not (math.isfinite(self.rope_base) and self.rope_base > 1.0):
            raise AttnidError(f"rope_base must be a finite number above 1, got {self.rope_base!r}")
        if self.qk_norm not in ("none", "head"):
            raise AttnidError(f"qk_norm must be 'none' or 'head', got {self.qk_norm!r}")
        if not (math.isfinite(self.qk_norm_eps) and self.qk_norm_eps >= 0.0):
            raise AttnidError(f"qk_norm_eps must be a finite number >= 0, got {self.qk_norm_eps!r}")

    # ---- derived sizes -------------------------------------------------------------
    @property
    def kv_group_size(self) -> int:
        """Query heads per key/value group, H / G."""
        return self.n_heads // self.n_kv_heads  # type: ignore[operator]

    group_size = kv_group_size  # deprecated alias (one release): the old name of kv_group_size

    @property
    def rope_dims(self) -> int:
        """r: rotated dims per head (even)."""
        return round(self.rope * self.head_dim)  # type: ignore[operator]

    @property
    def pass_dims(self) -> int:
        """p = d_k - r: dims per head that RoPE leaves alone."""
        return self.head_dim - self.rope_dims  # type: ignore[operator]

    def has_bias(self, letter: str) -> bool:
        return letter in self.bias

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        """Canonical per-head parameter shapes, paper names (the layout of `attnid.Attention`)."""
        d, H, G = self.d_model, self.n_heads, self.n_kv_heads
        dk, dv = self.head_dim, self.v_head_dim
        shapes: dict[str, tuple[int, ...]] = {
            "W_Q": (H, d, dk),
            "W_K": (G, d, dk),
            "W_V": (G, d, dv),
            "W_O": (H, dv, d),
        }
        for letter, shape in (("q", (H, dk)), ("k", (G, dk)), ("v", (G, dv)), ("o", (d,))):
            if letter in self.bias:
                shapes[f"b_{letter.upper()}"] = shape  # type: ignore[assignment]
        if self.qk_norm == "head":
            shapes["g_Q"] = (dk,)
            shapes["g_K"] = (dk,)
        return shapes  # type: ignore[return-value]

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["bias"] = "".join(c for c in BIAS_LETTERS if c in self.bias)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> AttentionSpec:
        return cls(**data)

    def describe(self) -> str:
        """A short human label, e.g. ``d=64 H=8 G=2 dk=8 bias=qk rope=1.0/half``."""
        parts = [f"d={self.d_model}", f"H={self.n_heads}"]
        if self.n_kv_heads != self.n_heads:
            parts.append(f"G={self.n_kv_heads}")
        parts.append(f"dk={self.head_dim}")
        if self.v_head_dim != self.head_dim:
            parts.append(f"dv={self.v_head_dim}")
        if self.bias:
            parts.append("bias=" + "".join(c for c in BIAS_LETTERS if c in self.bias))
        if self.rope:
            parts.append(f"rope={self.rope:g}/{self.rope_pairing}")
        if self.qk_norm != "none":
            parts.append(f"qknorm(eps={self.qk_norm_eps:g})")
        return " ".join(parts)


def _check_positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise AttnidError(f"{name} must be a positive integer, got {value!r}")
