"""Adapters: a Hugging Face config -> per-layer `AttentionSpec`s, and a checkpoint's tensors
<-> the canonical per-head layout (`AttentionWeights`).

One small file per model family subclasses `Adapter` and registers itself under the
Hugging Face architecture names it serves (`attnid.adapters.registry`). That file owns every
part of its family (:data:`PARTS`): config -> spec, tensor names, the structure, the
whole-model layout and the layer finder. The defaults here are Llama's (separate ``q/k/v/o``
Linear projections, pre-LN RMSNorm, gated MLP), written once; a family without a part says
why in ``lacks``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from attnid.adapters.config import source_of
from attnid.adapters.layout import Layout, llama_layout
from attnid.adapters.own import MODEL_TYPE
from attnid.errors import AttnidError
from attnid.layers import LayerAccessor
from attnid.sharding import clean_name
from attnid.spec import AttentionSpec
from attnid.structure import Structure, function_kind
from attnid.weights import AttentionWeights

Config = dict[str, Any]
HFForward = Callable[[nn.Module, torch.Tensor], torch.Tensor]

# the parts a family's file owns, by the methods that give them (tests/adapters/test_families.py
# checks that every registered family has each one, or says in ``Adapter.lacks`` why not)
PARTS: dict[str, str] = {
    "spec": "config -> per-layer AttentionSpec (spec, specs)",
    "names": "checkpoint tensor names <-> the canonical layout (names, read, write)",
    "structure": "the whole model's Structure, what the whole-model count reads (whole)",
    "layout": "where the whole-model symmetries act in a built model (layout)",
    "layers": "the layer finder: accessors for a built model's attention layers (layers)",
}


def cfg(config: Config, *keys: str, default: Any = None) -> Any:
    """First present key (configs name the same number differently across families/versions)."""
    for k in keys:
        if k in config and config[k] is not None:
            return config[k]
    return default


_MISSING: Any = object()


def _present(config: Config, keys: tuple[str, ...]) -> tuple[str, Any] | None:
    for k in keys:
        if config.get(k) is not None:
            return k, config[k]
    return None


def _named(keys: tuple[str, ...]) -> str:
    return repr(keys[0]) + (f" (or {', '.join(map(repr, keys[1:]))})" if len(keys) > 1 else "")


def cfg_int(config: Config, *keys: str, default: Any = _MISSING, positive: bool = True) -> Any:
    """The first present key as an integer (``> 0``, or ``>= 0`` with ``positive=False``);
    ``default`` when none is present, a refusal naming the config file and the field when
    none is and no default is given, or when the value is not such an integer (a string,
    a bool, a fraction, NaN: configs are JSON, and a size is a JSON integer).

    >>> cfg_int({"n_embd": 64}, "hidden_size", "n_embd")
    64
    >>> cfg_int({"hidden_size": "64"}, "hidden_size")
    Traceback (most recent call last):
    attnid.errors.AttnidError: the config: 'hidden_size' must be a positive integer, got '64'
    """
    found = _present(config, keys)
    if found is None:
        if default is _MISSING:
            raise AttnidError(f"{source_of(config)}: no {_named(keys)} field")
        return default
    key, value = found
    number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not (number and value == int(value) and (value > 0 if positive else value >= 0)):
        kind = "positive" if positive else "non-negative"
        raise AttnidError(f"{source_of(config)}: {key!r} must be a {kind} integer, got {value!r}")
    return int(value)


MAX_LAYERS = 2**16  # the deepest published transformers have a few hundred


def cfg_layers(config: Config, *keys: str) -> int:
    """A layer count (`cfg_int`), refused above `MAX_LAYERS` before any per-layer list is made
    (the random config fuzz found a count near 10^9: its list of specs took 22 GB)."""
    n = cfg_int(config, *keys)
    if n > MAX_LAYERS:
        key = _present(config, keys)[0]  # type: ignore[index]
        raise AttnidError(f"{source_of(config)}: {key!r} is {n:,}: more layers than attnid reads "
                          f"(at most {MAX_LAYERS:,})")
    return n


def cfg_float(config: Config, *keys: str, default: Any = _MISSING, minimum: float = -math.inf,
              value: Any = _MISSING) -> Any:
    """The first present key as a finite number ``>= minimum`` (``default`` when absent);
    otherwise a refusal naming the config file and the field. ``value``: check this value
    (found elsewhere, e.g. in ``rope_parameters``) under the name ``keys[0]``."""
    found = _present(config, keys) if value is _MISSING else (keys[0], value)
    if found is None or found[1] is None:
        if default is _MISSING:
            raise AttnidError(f"{source_of(config)}: no {_named(keys)} field")
        return default
    key, v = found
    if not (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= minimum):
        bound = "" if minimum == -math.inf else f" >= {minimum:g}"
        raise AttnidError(f"{source_of(config)}: {key!r} must be a finite number{bound}, got {v!r}")
    return float(v)


def cfg_bool(config: Config, *keys: str, default: bool = False) -> bool:
    """The first present key as a flag (JSON true/false; 0 and 1 accepted), else ``default``."""
    found = _present(config, keys)
    if found is None:
        return default
    key, value = found
    if isinstance(value, bool) or (isinstance(value, int) and value in (0, 1)):
        return bool(value)
    raise AttnidError(f"{source_of(config)}: {key!r} must be true or false, got {value!r}")


def rope_param(config: Config, key: str, default: Any = None) -> Any:
    """A RoPE setting from transformers 5's ``rope_parameters`` or the older top-level keys."""
    rp = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if isinstance(rp, dict) and rp.get(key) is not None:
        return rp[key]
    return config.get(key, default)


def rope_float(config: Config, key: str, default: float, minimum: float = -math.inf) -> float:
    """:func:`rope_param` as a checked number (see :func:`cfg_float`)."""
    return cfg_float(config, key, value=rope_param(config, key), default=default, minimum=minimum)


# config keys of the attention's sizes, named when a spec built from them is refused
SIZE_KEYS = ("hidden_size", "n_embd", "d_model", "num_attention_heads", "n_head", "num_key_value_heads",
             "num_kv_heads", "head_dim", "partial_rotary_factor", "rotary_pct")


def config_spec(c: Config, **fields: Any) -> AttentionSpec:
    """``AttentionSpec(**fields)``; its refusal names the config file and the config's size
    fields (the spec's own names, ``d_model``, are not what the user wrote)."""
    try:
        return AttentionSpec(**fields)
    except AttnidError as e:
        given = ", ".join(f"{k}={c[k]!r}" for k in SIZE_KEYS if c.get(k) is not None)
        raise AttnidError(f"{source_of(c)}: {e} (from {given or 'its defaults'})") from None


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
    closed_form: ClassVar[bool] = True  # False: counted numerically on a reduced config only
    missing: ClassVar[str] = ""  # what attnid lacks for such a family (said in every refusal)
    lacks: ClassVar[dict[str, str]] = {}  # part (a PARTS key) -> why this family has none

    # ---- config -> specs ------------------------------------------------------------
    def n_layers(self, c: Config) -> int:
        return cfg_layers(c, "num_hidden_layers", "n_layer", "num_layers")

    def spec(self, c: Config) -> AttentionSpec:
        d = cfg_int(c, "hidden_size", "n_embd", "d_model")
        H = cfg_int(c, "num_attention_heads", "n_head")
        return config_spec(
            c, d_model=d, n_heads=H, n_kv_heads=cfg_int(c, "num_key_value_heads", default=H),
            head_dim=cfg_int(c, "head_dim", default=None), bias=self.bias(c), rope=self.rope(c),
            rope_base=rope_float(c, "rope_theta", 10000.0), qk_norm=self.qk_norm(c),
            qk_norm_eps=cfg_float(c, "rms_norm_eps", default=1e-6, minimum=0.0),
        )

    def specs(self, c: Config) -> list[AttentionSpec]:
        s = self.spec(c)
        return [s] * self.n_layers(c)

    def bias(self, c: Config) -> str:
        return "qkvo" if cfg_bool(c, "attention_bias") else ""

    def rope(self, c: Config) -> float:
        return rope_float(c, "partial_rotary_factor", 1.0, minimum=0.0)

    def qk_norm(self, c: Config) -> str:
        return "none"

    # ---- reduced config for the arbiter on Hugging Face's own class -------------------
    def reduce(self, c: Config) -> Config:
        """Same structure, small sizes: few heads (same grouping), small head size."""
        s = self.spec(c)
        G = 1 if s.n_kv_heads == 1 else 2
        H = G * (1 if s.kv_group_size == 1 else 2)
        dk = 8 if s.rope_dims and s.pass_dims else 4
        explicit = s.head_dim * s.n_heads != s.d_model
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
            family=self.family, function=function_kind(c), d_model=cfg_int(c, "hidden_size", "n_embd"),
            vocab=cfg_int(c, "vocab_size"), specs=tuple(self.specs(c)), norm="rms", norm_bias=False,
            eps=cfg_float(c, "rms_norm_eps", "layer_norm_eps", default=1e-6, minimum=0.0), layout="pre",
            shared_norm=False, mlp="gated", d_ff=self.d_ff(c),
            mlp_bias=cfg_bool(c, "mlp_bias"), tied=self.tied(c), positions=0,
            token_types=0, mlm_head=False, pooler=False)

    def d_ff(self, c: Config) -> int:
        d = cfg_int(c, "hidden_size", "n_embd")
        return cfg_int(c, "intermediate_size", "n_inner", "ffn_hidden_size", default=4 * d)

    def unsupported_whole(self, c: Config) -> str | None:
        """Why the whole model cannot be counted (None when it can)."""
        return None

    def tied(self, c: Config) -> bool:
        return cfg_bool(c, "tie_word_embeddings", default=self.tie_default)

    def unsupported(self, c: Config) -> str | None:
        """Why this config cannot be handled (None when it can)."""
        return None

    # ---- the whole-model layout (attnid.whole.transforms.layout_of) ---------------------
    def layout(self, model: nn.Module) -> Layout:
        """Where the whole-model symmetries act in a built model of this family (Llama's
        by default; a pure function of the module, which works on the meta device)."""
        if "layout" in self.lacks:
            raise AttnidError(f"no whole-model transforms for {self.model_type!r}: attnid lacks "
                              f"{self.lacks['layout']}")
        return llama_layout(model)

    # ---- the layer finder (attnid.layers.find_layers, through attnid.adapters.hooks) ----
    def layers(self, model: nn.Module) -> list[LayerAccessor]:
        """One accessor per attention layer of a built model of this family (empty when its
        tensors are not found: another model, or a family that lacks a finder).

        Tensors are named as the model names them without wrapper parts (FSDP1's
        ``_fsdp_wrapped_module``, ``torch.compile``'s ``_orig_mod``), so the accessors find them
        again however the model is wrapped or sharded later."""
        if "layers" in self.lacks:
            return []
        config = model.config
        names = [clean_name(n) for n, _ in model.named_parameters()]
        specs = self.specs(config.to_dict())
        first = self.names(0, specs[0])[0]
        prefix = next((n[: -len(first)] for n in names if n.endswith(first)), None)
        if prefix is None:
            return []
        return [LayerAccessor(
            name=f"{prefix}{self.layer_prefix.format(i=i)}", spec=spec, root=model,
            paths={n: prefix + n for n in self.names(i, spec)}, shapes=stored_shapes(self, spec, i),
            read=lambda t, i=i, spec=spec: self.read(t, i, spec), write=lambda w, i=i: self.write(w, i),
        ) for i, spec in enumerate(specs)]


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
    """A transformers config object from a config dict (its ``model_type`` picks the class);
    a config transformers refuses is refused naming its file."""
    from transformers import AutoConfig

    if not c.get("model_type"):
        raise AttnidError(f"{source_of(c)} has no 'model_type'; transformers cannot build it")
    own_classes(c)
    fields = {k: v for k, v in c.items() if k != "model_type"}
    try:
        return AutoConfig.for_model(c["model_type"], **{**fields, **_tokens_outside_vocab(c)})
    except Exception as e:  # transformers refusing a user's fields (see read_hf_config)
        raise AttnidError(f"{source_of(c)}: transformers refuses it ({type(e).__name__}: {e})") from None


def _tokens_outside_vocab(c: Config) -> dict[str, None]:
    """Special token ids (``bos_token_id``, ``eos_token_id``, ...; given or the class's default)
    that lie outside a config's vocabulary, as None: a tiny or reduced config keeps GPT-2's
    50256 with 32 tokens, transformers warns about each, and attnid never generates text.
    ``pad_token_id`` stays: it is the embedding's padding row, part of the structure."""
    import dataclasses

    from transformers import CONFIG_MAPPING

    vocab = c.get("vocab_size")
    # (not .get: transformers' lazy mapping answers None there for classes not yet loaded)
    cls = CONFIG_MAPPING[c["model_type"]] if c["model_type"] in CONFIG_MAPPING else None  # noqa: SIM401
    if not isinstance(vocab, int) or cls is None or not dataclasses.is_dataclass(cls):
        return {}
    out: dict[str, None] = {}
    for f in dataclasses.fields(cls):
        if f.name.endswith("_token_id") and f.name != "pad_token_id":
            value = c.get(f.name, f.default)
            if isinstance(value, int) and not 0 <= value < vocab:
                out[f.name] = None
    return out


def read_hf_config(root: str | Path, c: Config) -> Any:
    """transformers' own reading of the model directory ``root``'s config.json (through the
    class its architecture names, as ``from_pretrained`` reads it); a refusal names the file."""
    import transformers

    cls = getattr(hf_model_class(c), "config_class", None) or transformers.AutoConfig
    try:
        return cls.from_pretrained(root)
    except Exception as e:  # transformers validates a user's fields with whatever
        # fails first (its strict dataclasses, then AttributeError, IndexError, ... deeper in):
        # every exception here is its refusal of the file, and is said as such
        raise AttnidError(f"{source_of(c)}: transformers refuses it ({type(e).__name__}: {e})") from None


def hf_model_class(c: Config, *, head: bool = True) -> Any:
    """The transformers class of a config: the one place an architecture name becomes a class.

    ``head=True``: the first name in ``architectures`` that transformers defines (the model
    with its head); otherwise, or with ``head=False``, ``AutoModel`` (the bare model).
    """
    import transformers

    own = own_classes(c)
    if head:
        for arch in c.get("architectures") or []:
            cls = own.get(arch, getattr(transformers, arch, None))
            if isinstance(cls, type):
                return cls
    return transformers.AutoModel


def own_classes(c: Config) -> dict[str, type]:
    """The transformers classes attnid itself defines for a config's ``model_type`` (registered
    with the Auto classes on first use): `attnid.adapters.positions_llama` for Llama without
    RoPE; empty for every other model type."""
    if c.get("model_type") != MODEL_TYPE:
        return {}
    from attnid.adapters.positions_llama import CLASSES

    return CLASSES


def new_hf_model(c: Config, *, head: bool = True, eager: bool = False) -> nn.Module:
    """The architecture's transformers model built from a config dict (random weights; on the
    current default device, so ``torch.device("meta")`` builds it without memory)."""
    conf = hf_config(c)
    if eager:
        conf._attn_implementation = "eager"
    return build_from(hf_model_class(c, head=head), conf, c)


def build_from(cls: Any, conf: Any, c: Config) -> nn.Module:
    """``cls`` (a transformers class, or ``AutoModel``) built from the config object ``conf``
    made from ``c``; transformers' refusal in one line naming ``c``'s file."""
    try:
        return cls(conf) if cls.__name__ != "AutoModel" else cls.from_config(conf)
    except Exception as e:  # transformers building a user's config: its refusal (see read_hf_config)
        raise AttnidError(f"{source_of(c)}: transformers cannot build {cls.__name__} from it "
                          f"({type(e).__name__}: {e})") from None


def load_weights(model: nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Put ``state`` into ``model``, every parameter accounted for: a key the model does not
    have, or a parameter neither in ``state`` nor tied to one that is (a tied head shares the
    table's storage), is an internal error, never a weight silently kept from before."""
    missing, unexpected = model.load_state_dict(state, strict=False)
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded = {params[k].data_ptr() for k in state if k in params}
    untied = [k for k in missing if k in params and params[k].data_ptr() not in loaded]
    if unexpected or untied:
        raise AttnidError(f"internal: {type(model).__name__} " + (
            f"has no tensor {unexpected[0]}" if unexpected else f"got no value for {untied[0]}"))


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
