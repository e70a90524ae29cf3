"""`AttentionWeights`: the one canonical per-head container every symmetry op is written against.

Shapes (``...`` = optional leading layer dims, so one container can hold a whole model)::

    W_Q [..., H, d, d_k]   W_K [..., G, d, d_k]   W_V [..., G, d, d_v]   W_O [..., H, d_v, d]
    b_Q [..., H, d_k]      b_K [..., G, d_k]      b_V [..., G, d_v]      b_O [..., d]
    g_Q [..., d_k]         g_K [..., d_k]

Absent biases / gains are ``None``. Containers are immutable; transforms return new ones.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Literal, TypeVar

import torch

from attnid.attention import Attention
from attnid.errors import AttnidError
from attnid.spec import AttentionSpec

T = TypeVar("T")

NAMES = ("W_Q", "W_K", "W_V", "W_O", "b_Q", "b_K", "b_V", "b_O", "g_Q", "g_K")
Side = Literal["qk", "vo"]
"""One side of an attention layer: query/key (``"qk"``) or value/output (``"vo"``)."""
SIDES: tuple[Side, Side] = ("qk", "vo")


@dataclass(frozen=True)
class AttentionWeights:
    spec: AttentionSpec
    W_Q: torch.Tensor  # [..., H, d, dk]
    W_K: torch.Tensor  # [..., G, d, dk]
    W_V: torch.Tensor  # [..., G, d, dv]
    W_O: torch.Tensor  # [..., H, dv, d]
    b_Q: torch.Tensor | None = None  # [..., H, dk]
    b_K: torch.Tensor | None = None  # [..., G, dk]
    b_V: torch.Tensor | None = None  # [..., G, dv]
    b_O: torch.Tensor | None = None  # [..., d]
    g_Q: torch.Tensor | None = None  # [..., dk]
    g_K: torch.Tensor | None = None  # [..., dk]

    def __post_init__(self) -> None:
        expected = self.spec.param_shapes()
        batch = self.batch_shape
        for name in NAMES:
            t = getattr(self, name)
            if (t is None) != (name not in expected):
                state = "missing" if t is None else "present but the spec has none"
                raise AttnidError(f"{name} is {state} ({self.spec.describe()})")
            if t is not None and tuple(t.shape) != batch + expected[name]:
                raise AttnidError(
                    f"{name} has shape {tuple(t.shape)}, expected {batch + expected[name]}")

    # ---- construction ------------------------------------------------------------
    @classmethod
    def from_module(cls, layer: Attention) -> AttentionWeights:
        """Views of an `attnid.Attention`'s parameters (no copy; detached)."""
        params = dict(layer.named_parameters())
        return cls(layer.spec, **{n: params[n].detach() for n in layer.spec.param_shapes()})

    @classmethod
    def from_tensors(cls, spec: AttentionSpec, tensors: dict[str, torch.Tensor]) -> AttentionWeights:
        return cls(spec, **{n: tensors[n] for n in spec.param_shapes()})

    @classmethod
    def stack(cls, layers: Sequence[AttentionWeights]) -> AttentionWeights:
        """Stack same-spec layers along a new leading dim."""
        spec = layers[0].spec
        if any(w.spec != spec for w in layers):
            raise AttnidError("can only stack layers with the same AttentionSpec")
        return cls(spec, **{n: torch.stack([w[n] for w in layers]) for n in spec.param_shapes()})

    def unstack(self) -> list[AttentionWeights]:
        return [self.map(lambda t, i=i: t[i]) for i in range(self.batch_shape[0])]

    # ---- access ------------------------------------------------------------------
    @property
    def batch_shape(self) -> tuple[int, ...]:
        return tuple(self.W_Q.shape[:-3])

    def __getitem__(self, name: str) -> torch.Tensor:
        t = getattr(self, name)
        if t is None:
            raise KeyError(name)
        return t

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name in self.spec.param_shapes():
            yield name, getattr(self, name)

    def replace(self, **tensors: torch.Tensor | None) -> AttentionWeights:
        return dataclasses.replace(self, **tensors)

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> AttentionWeights:
        return self.replace(**{n: fn(t) for n, t in self.items()})

    def zip_map(self, other: AttentionWeights,
                fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> AttentionWeights:
        return self.replace(**{n: fn(t, other[n]) for n, t in self.items()})

    def __sub__(self, other: AttentionWeights) -> AttentionWeights:
        return self.zip_map(other, torch.sub)

    def __add__(self, other: AttentionWeights) -> AttentionWeights:
        return self.zip_map(other, torch.add)

    def scale(self, c: float) -> AttentionWeights:
        return self.map(lambda t: t * c)

    def clone(self) -> AttentionWeights:
        return self.map(torch.clone)

    def to(self, dtype: torch.dtype) -> AttentionWeights:
        return self.map(lambda t: t.to(dtype))

    def flat(self) -> torch.Tensor:
        """``[..., P]``: all parameters in `attnid.Attention`'s order."""
        b = self.batch_shape
        return torch.cat([t.reshape(*b, -1) for _, t in self.items()], dim=-1)

    @classmethod
    def from_flat(cls, spec: AttentionSpec, flat: torch.Tensor) -> AttentionWeights:
        shapes = spec.param_shapes()
        sizes = [int(torch.tensor(s).prod()) for s in shapes.values()]
        b = tuple(flat.shape[:-1])
        parts = flat.split(sizes, dim=-1)
        return cls(spec, **{n: p.reshape(*b, *s) for (n, s), p in zip(shapes.items(), parts, strict=True)})

    def dot(self, other: AttentionWeights) -> torch.Tensor:
        """Inner product per batch element, ``[...]``."""
        nb = len(self.batch_shape)
        total = torch.zeros(self.batch_shape, dtype=self.W_Q.dtype, device=self.W_Q.device)
        for n, t in self.items():
            total = total + (t * other[n]).sum(dim=tuple(range(nb, t.ndim)))
        return total

    # ---- to and from modules -----------------------------------------------------
    def to_module(self, *, causal: bool = False, copy: bool = True) -> Attention:
        """A new `attnid.Attention` holding these (unbatched) weights: copies, or the very
        tensors when ``copy=False``."""
        if self.batch_shape:
            raise AttnidError("to_module needs one layer; unstack() first")
        with torch.device("meta"):  # no allocation or random init for weights about to be replaced
            layer = Attention(self.spec, causal=causal)
        layer.load_state_dict({n: t.detach().clone() if copy else t.detach() for n, t in self.items()},
                              assign=True)
        return layer

    def load_into_(self, layer: Attention) -> None:
        """Copy these weights into ``layer``'s parameters, in place."""
        params = dict(layer.named_parameters())
        with torch.no_grad():
            for n, t in self.items():
                params[n].copy_(t)


def pass_mask(spec: AttentionSpec, like: torch.Tensor) -> torch.Tensor:
    """1 on the pass-through dims of a head, 0 on rotated ones: ``[dk]``."""
    m = torch.zeros(spec.head_dim, dtype=like.dtype, device=like.device)
    m[spec.rope_dims :] = 1.0
    return m


def kv_group_sum_out(w: AttentionWeights) -> torch.Tensor:
    """``Wsum_g = sum_{h in g} W_O^h``: ``[..., G, dv, d]``."""
    s = w.spec
    W = w.W_O
    if s.kv_group_size == 1:  # one head per kv group: W_O itself (a view, no copy)
        return W
    return W.reshape(*W.shape[:-3], s.n_kv_heads, s.kv_group_size, *W.shape[-2:]).sum(-3)


group_sum_out = kv_group_sum_out  # deprecated alias (one release)


def _kv_grouped(x: torch.Tensor, G: int) -> torch.Tensor:
    """``[..., H, a, b] -> [..., G, a, b]`` summed over each kv group's heads."""
    return x.reshape(*x.shape[:-3], G, x.shape[-3] // G, *x.shape[-2:]).sum(-3)


def memoised(w: AttentionWeights, key: object, compute: Callable[[], T]) -> T:
    """``compute()``, cached on the container ``w`` under ``key`` until one of its tensors is
    changed in place (the cache is keyed by the tensors' version counters, so views of
    parameters that were since updated are recomputed). Tensors made under
    ``torch.inference_mode`` have no version counter and are not cached."""
    if any(t.is_inference() for _, t in w.items()):
        return compute()  # made under torch.inference_mode: no version counter to key on
    cache = w.__dict__.setdefault("_memo", {})
    versions = tuple(t._version for _, t in w.items())
    if key not in cache or cache[key][0] != versions:
        cache[key] = (versions, compute())
    return cache[key][1]


def grams(w: AttentionWeights, side: Side) -> tuple[torch.Tensor, torch.Tensor]:
    """(left, right) Gram matrices per kv group: ``[..., G, k, k]`` each (cached on ``w``).

    QK: ``(sum_{h in g} W~_Q^hT W~_Q^h, W~_K^gT W~_K^g)``; VO: ``(W~_V^T W~_V, sum W_O W_O^T)``.
    """
    return memoised(w, ("grams", side), lambda: _grams(w, side))


def _grams(w: AttentionWeights, side: Side) -> tuple[torch.Tensor, torch.Tensor]:
    s = w.spec
    if side == "qk":
        a = w.W_Q.transpose(-1, -2) @ w.W_Q
        if w.b_Q is not None:
            a = a + w.b_Q.unsqueeze(-1) * w.b_Q.unsqueeze(-2)
        left = _kv_grouped(a, s.n_kv_heads)
        right = w.W_K.transpose(-1, -2) @ w.W_K
        if w.b_K is not None:
            right = right + w.b_K.unsqueeze(-1) * w.b_K.unsqueeze(-2)
        return left, right
    left = w.W_V.transpose(-1, -2) @ w.W_V
    if w.b_V is not None:
        left = left + w.b_V.unsqueeze(-1) * w.b_V.unsqueeze(-2)
    right = _kv_grouped(w.W_O @ w.W_O.transpose(-1, -2), s.n_kv_heads)
    return left, right
