"""Adapters: a Hugging Face config -> per-layer `AttentionSpec`s, and a checkpoint's tensors
<-> the canonical per-head layout (`AttentionWeights`).

One small file per model family subclasses `Adapter` and registers itself under the
Hugging Face architecture names it serves (`attnid.adapters.registry`). Shared layouts
(separate ``q/k/v/o`` Linear projections) live here once.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import torch
from torch import nn

from attnid.errors import AttnidError
from attnid.spec import AttentionSpec
from attnid.structure import Structure, function_kind
from attnid.weights import AttentionWeights

Config = dict[str, Any]
HFForward = Callable[[nn.Module, torch.Tensor], torch.Tensor]


def cfg(config: Config, *keys: str, default: Any = None) -> Any:
    """First present key (configs name the same number differently across families/versions)."""
    for k in keys:
        if k in config and config[k] is not None:
            return config[k]
    return default


def rope_param(config: Config, key: str, default: Any = None) -> Any:
    """A RoPE setting from transformers 5's ``rope_parameters`` or the older top-level keys."""
    rp = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if isinstance(rp, dict) and rp.get(key) is not None:
        return rp[key]
    return config.get(key, default)


# ---- layout helpers: nn.Linear weights are [out, in] ----------------------------------
def split_heads_in(weight: torch.Tensor, n: int) -> torch.Tensor:
    """Linear ``[n*k, d]`` -> per-head ``[n, d, k]``."""
    out, d = weight.shape
    return weight.reshape(n, out // n, d).transpose(1, 2)


def merge_heads_in(w: torch.Tensor) -> torch.Tensor:
    """Per-head ``[n, d, k]`` -> Linear ``[n*k, d]``."""
    n, d, k = w.shape
    return w.transpose(1, 2).reshape(n * k, d)


def split_heads_out(weight: torch.Tensor, n: int) -> torch.Tensor:
    """Output Linear ``[d, n*k]`` -> per-head ``[n, k, d]``."""
    d, nk = weight.shape
    return weight.T.reshape(n, nk // n, d)


def merge_heads_out(w: torch.Tensor) -> torch.Tensor:
    n, k, d = w.shape
    return w.reshape(n * k, d).T


def fused_names(prefix: str, attn: str, with_bias: bool) -> list[str]:
    """Tensor names of a fused ``query_key_value`` + ``dense`` attention (GPT-NeoX, Falcon)."""
    out = [f"{prefix}{attn}.query_key_value.weight", f"{prefix}{attn}.dense.weight"]
    if with_bias:
        out += [f"{prefix}{attn}.query_key_value.bias", f"{prefix}{attn}.dense.bias"]
    return out


class Adapter:
    """Base adapter. Subclasses set ``architectures`` and override what differs."""

    architectures: ClassVar[tuple[str, ...]] = ()
    model_type: ClassVar[str] = ""
    family: ClassVar[str] = ""
    # tensor-name templates inside one layer, relative to ``layer_prefix``
    q: ClassVar[str] = "self_attn.q_proj"
    k: ClassVar[str] = "self_attn.k_proj"
    v: ClassVar[str] = "self_attn.v_proj"
    o: ClassVar[str] = "self_attn.o_proj"
    layer_prefix: ClassVar[str] = "layers.{i}."
    working_precision: ClassVar[str] = "float64"  # "float32" where kernels downcast
    closed_form: ClassVar[bool] = True  # False: counted numerically on a reduced config only
    missing: ClassVar[str] = ""  # what attnid lacks for such a family (said in every refusal)

    # ---- config -> specs ------------------------------------------------------------
    def n_layers(self, c: Config) -> int:
        return int(cfg(c, "num_hidden_layers", "n_layer", "num_layers"))

    def spec(self, c: Config) -> AttentionSpec:
        d = int(cfg(c, "hidden_size", "n_embd", "d_model"))
        H = int(cfg(c, "num_attention_heads", "n_head"))
        return AttentionSpec(
            d_model=d, n_heads=H, n_kv_heads=int(cfg(c, "num_key_value_heads", default=H)),
            head_dim=cfg(c, "head_dim"), bias=self.bias(c), rope=self.rope(c),
            rope_base=float(rope_param(c, "rope_theta", 10000.0)), qk_norm=self.qk_norm(c),
            qk_norm_eps=float(cfg(c, "rms_norm_eps", default=1e-6)),
        )

    def specs(self, c: Config) -> list[AttentionSpec]:
        s = self.spec(c)
        return [s] * self.n_layers(c)

    def bias(self, c: Config) -> str:
        return "qkvo" if cfg(c, "attention_bias", default=False) else ""

    def rope(self, c: Config) -> float:
        return float(rope_param(c, "partial_rotary_factor", 1.0))

    def qk_norm(self, c: Config) -> str:
        return "none"

    # ---- reduced config for the arbiter on Hugging Face's own class -------------------
    def reduce(self, c: Config) -> Config:
        """Same structure, small sizes: few heads (same grouping), small head size."""
        s = self.spec(c)
        G = 1 if s.n_kv_heads == 1 else 2
        H = G * (1 if s.group_size == 1 else 2)
        dk = 8 if s.rope_dims and s.pass_dims else 4
        explicit = cfg(c, "head_dim") is not None and int(cfg(c, "head_dim")) * s.n_heads != s.d_model
        d = H * dk + (2 if explicit else 0)
        small = dict(c, hidden_size=d, num_attention_heads=H, num_key_value_heads=G,
                     intermediate_size=2 * d, num_hidden_layers=1, vocab_size=32,
                     max_position_embeddings=64, pad_token_id=None, bos_token_id=None,
                     eos_token_id=None)
        if explicit or "head_dim" in c:
            small["head_dim"] = dk
        return small

    # ---- checkpoint tensors <-> canonical ----------------------------------------------
    def names(self, i: int, spec: AttentionSpec) -> list[str]:
        """Checkpoint tensor names (without any outer prefix) of layer ``i``'s attention."""
        p = self.layer_prefix.format(i=i)
        out = [f"{p}{self.q}.weight", f"{p}{self.k}.weight", f"{p}{self.v}.weight", f"{p}{self.o}.weight"]
        for letter, mod in (("q", self.q), ("k", self.k), ("v", self.v), ("o", self.o)):
            if letter in spec.bias:
                out.append(f"{p}{mod}.bias")
        return out

    def read(self, t: Mapping[str, torch.Tensor], i: int, spec: AttentionSpec) -> AttentionWeights:
        p = self.layer_prefix.format(i=i)
        G = spec.n_kv_heads
        w: dict[str, torch.Tensor] = {
            "W_Q": split_heads_in(t[f"{p}{self.q}.weight"], spec.n_heads),
            "W_K": split_heads_in(t[f"{p}{self.k}.weight"], G),
            "W_V": split_heads_in(t[f"{p}{self.v}.weight"], G),
            "W_O": split_heads_out(t[f"{p}{self.o}.weight"], spec.n_heads),
        }
        for letter, mod, n in (("q", self.q, spec.n_heads), ("k", self.k, G), ("v", self.v, G)):
            if letter in spec.bias:
                w[f"b_{letter.upper()}"] = t[f"{p}{mod}.bias"].reshape(n, -1)
        if "o" in spec.bias:
            w["b_O"] = t[f"{p}{self.o}.bias"]
        return AttentionWeights.from_tensors(spec, w)

    def write(self, w: AttentionWeights, i: int) -> dict[str, torch.Tensor]:
        p = self.layer_prefix.format(i=i)
        out = {f"{p}{self.q}.weight": merge_heads_in(w.W_Q), f"{p}{self.k}.weight": merge_heads_in(w.W_K),
               f"{p}{self.v}.weight": merge_heads_in(w.W_V), f"{p}{self.o}.weight": merge_heads_out(w.W_O)}
        for letter, mod in (("q", self.q), ("k", self.k), ("v", self.v)):
            if (w.b_Q is not None and letter == "q") or (w.b_K is not None and letter == "k") \
                    or (w.b_V is not None and letter == "v"):
                out[f"{p}{mod}.bias"] = w[f"b_{letter.upper()}"].reshape(-1)
        if w.b_O is not None:
            out[f"{p}{self.o}.bias"] = w.b_O
        return out

    # ---- Hugging Face's own attention module ------------------------------------------
    def hf_attention(self, c: Config) -> tuple[nn.Module, HFForward]:
        """(module holding exactly the attention parameters, forward(module, x) -> output)."""
        return self.attention_of(build_hf_model({**c, "model_type": self.model_type}))

    def attention_of(self, model: nn.Module) -> tuple[nn.Module, HFForward]:
        """The first layer's attention of a built transformers model, and how to call it."""
        return _Holder(find_first(model, "Attention"), find_rotary(model)), _rotary_forward

    # ---- the whole model (attnid.whole) ------------------------------------------------
    tie_default: ClassVar[bool] = False  # tie_word_embeddings when the config does not say

    def whole(self, c: Config) -> Structure:
        """The whole model's layout. Default: pre-LN RMSNorm, gated MLP, rotary (Llama)."""
        return Structure(
            family=self.family, function=function_kind(c), d_model=int(cfg(c, "hidden_size", "n_embd")),
            vocab=int(c["vocab_size"]), specs=tuple(self.specs(c)), norm="rms", norm_bias=False,
            eps=float(cfg(c, "rms_norm_eps", "layer_norm_eps", default=1e-6)), layout="pre",
            shared_norm=False, mlp="gated", d_ff=self.d_ff(c),
            mlp_bias=bool(cfg(c, "mlp_bias", default=False)), tied=self.tied(c), positions=0,
            token_types=0, mlm_head=False, pooler=False)

    def d_ff(self, c: Config) -> int:
        d = int(cfg(c, "hidden_size", "n_embd"))
        return int(cfg(c, "intermediate_size", "n_inner", "ffn_hidden_size", default=4 * d))

    def unsupported_whole(self, c: Config) -> str | None:
        """Why the whole model cannot be counted (None when it can)."""
        return None

    def tied(self, c: Config) -> bool:
        return bool(cfg(c, "tie_word_embeddings", default=self.tie_default))

    def unsupported(self, c: Config) -> str | None:
        """Why this config cannot be handled (None when it can)."""
        return None


def stored_shapes(adapter: Adapter, spec: AttentionSpec, i: int) -> dict[str, tuple[int, ...]]:
    """The shape of every tensor of layer ``i``'s attention as the adapter stores it (worked
    out on the meta device: no memory)."""
    with torch.device("meta"):
        w = AttentionWeights.from_tensors(spec, {n: torch.empty(s) for n, s in spec.param_shapes().items()})
        return {n: tuple(t.shape) for n, t in adapter.write(w, i).items()}


class _Holder(nn.Module):
    def __init__(self, attn: nn.Module, rotary: nn.Module | None) -> None:
        super().__init__()
        self.attn = attn
        self.rotary = [rotary]  # a list keeps its (buffer-only) module out of named_parameters


def _rotary_forward(h: nn.Module, x: torch.Tensor) -> torch.Tensor:
    pos = torch.arange(x.shape[1], device=x.device)[None].expand(x.shape[0], -1)
    rotary = h.rotary[0]
    pe = rotary(x, pos) if rotary is not None else None
    out = h.attn(x, position_embeddings=pe, attention_mask=None)
    return out[0] if isinstance(out, tuple) else out


def hf_config(c: Config) -> Any:
    """A transformers config object from a config dict (its ``model_type`` picks the class)."""
    from transformers import AutoConfig

    if not c.get("model_type"):
        raise AttnidError("the config has no 'model_type'; transformers cannot build it")
    return AutoConfig.for_model(c["model_type"], **{k: v for k, v in c.items() if k != "model_type"})


def hf_model_class(c: Config, *, head: bool = True) -> Any:
    """The transformers class of a config: the one place an architecture name becomes a class.

    ``head=True``: the first name in ``architectures`` that transformers defines (the model
    with its head); otherwise, or with ``head=False``, ``AutoModel`` (the bare model).
    """
    import transformers

    if head:
        for arch in c.get("architectures") or []:
            cls = getattr(transformers, arch, None)
            if isinstance(cls, type):
                return cls
    return transformers.AutoModel


def new_hf_model(c: Config, *, head: bool = True, eager: bool = False) -> nn.Module:
    """The architecture's transformers model built from a config dict (random weights; on the
    current default device, so ``torch.device("meta")`` builds it without memory)."""
    conf = hf_config(c)
    if eager:
        conf._attn_implementation = "eager"
    cls = hf_model_class(c, head=head)
    return cls(conf) if cls.__name__ != "AutoModel" else cls.from_config(conf)


def build_hf_model(c: Config, *, head: bool = False) -> nn.Module:
    """A transformers model from a config dict, random weights, eager attention, eval mode, float64."""
    return new_hf_model(c, head=head, eager=True).double().eval()


def find_first(model: nn.Module, suffix: str) -> nn.Module:
    for _, mod in model.named_modules():
        if type(mod).__name__.endswith(suffix) and any(True for _ in mod.parameters()):
            return mod
    raise AttnidError(f"no module whose class ends with {suffix!r} in {type(model).__name__}")


def find_rotary(model: nn.Module) -> nn.Module | None:
    for _, mod in model.named_modules():
        if "Rotary" in type(mod).__name__:
            return mod
    return None
