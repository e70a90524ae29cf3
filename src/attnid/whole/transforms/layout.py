"""Where the whole-model symmetries act in a Hugging Face model: each residual norm and the
linear maps reading it, the maps writing into the residual stream, the embedding tables, the
MLPs, the unembedding. One function per family; everything else is family-independent.

Linear maps are handled as ``[out, in]`` matrices whatever their storage (GPT-2's Conv1D keeps
``[in, out]``): :func:`get_w` / :func:`set_w_`.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

import torch
from torch import nn

from attnid.adapters.base import new_hf_model
from attnid.adapters.config import FileConfig, source_of
from attnid.errors import AttnidError


@dataclass(frozen=True)
class Lin:
    """A linear map by module path; ``conv1d``: weight stored ``[in, out]``; ``rows``: the
    output rows that belong to it in a fused map (Phi-3's ``gate_up_proj``: the up half)."""

    path: str
    conv1d: bool = False
    rows: tuple[int, int] | None = None


@dataclass(frozen=True)
class Norm:
    """A norm and the linear maps reading its output. Pre-LN: nothing else sees it. Post-LN:
    its output is also the residual stream, whose next sum adds ``absorb``'s output (that
    bias takes the norm's bias; the gain cannot move). ``gain``: the readers can absorb the
    gain (not a tied unembedding)."""

    path: str
    readers: tuple[Lin, ...]
    absorb: Lin | None = None
    gain: bool = True
    offset: float = 0.0  # 1 where the gain is stored as ``1 + w`` (Gemma's RMSNorm)


@dataclass(frozen=True)
class Layout:
    """Where one model's tensors sit: its norms and their readers, each layer's writers, the
    embedding tables, the MLPs, the head; what every whole-model transform reads. The residual
    layout (pre-LN, parallel, post-LN: `attnid.structure.ResidualLayout`) is one part of it
    (``parallel``, ``post``)."""

    norm: Literal["layer", "rms"]
    norms: tuple[Norm, ...]  # every residual norm with readers, the final one last
    writers: tuple[tuple[Lin, ...], ...]  # per layer: (attention output, MLP output)
    parallel: bool  # attention and MLP of a layer add to one stream (GPT-NeoX)
    tables: tuple[str, ...]  # embedding tables summed into the stream, the token table first
    mlps: tuple[tuple[Lin, Lin], ...]  # per layer: (up projection, down projection)
    mlp: Literal["gated", "relu", "other"]
    unembed: Lin | None  # the LM head (None: a bare model)
    tied: bool  # the unembedding is the token table
    post: bool = False  # post-LN (BERT): the stream itself is a norm's output
    padding_idx: int | None = None  # RoBERTa: position rows start after it
    attn_norms: tuple[str, ...] = ()  # per layer: the norm attention reads (default norms[2 i])
    final: Norm | None = None  # the last norm, tied or bare included (readers: the head, if any)
    gates: tuple[Lin | None, ...] = ()  # per layer: a gated MLP's gate (fused: its rows)
    layers: tuple[str, ...] = ()  # per layer: the prefix of its tensor names ("model.layers.3.")

    def attn_norm(self, layer: int) -> str:
        return self.attn_norms[layer] if self.attn_norms else self.norms[2 * layer].path


def get_w(model: nn.Module, lin: Lin) -> torch.Tensor:
    """``[out, in]`` weight of ``lin`` (a view: detached)."""
    w = model.get_submodule(lin.path).weight.detach()
    return w.T if lin.conv1d else w


def set_w_(model: nn.Module, lin: Lin, w: torch.Tensor) -> None:
    p = model.get_submodule(lin.path).weight
    with torch.no_grad():
        p.copy_(w.T if lin.conv1d else w)


def get_b(model: nn.Module, lin: Lin) -> torch.Tensor | None:
    b = getattr(model.get_submodule(lin.path), "bias", None)
    return None if b is None else b.detach()


def set_b_(model: nn.Module, lin: Lin, b: torch.Tensor) -> None:
    with torch.no_grad():
        model.get_submodule(lin.path).bias.copy_(b)


def gain_offset(model: nn.Module, path: str) -> float:
    """1 for a norm whose gain is stored as ``1 + w`` (Gemma's RMSNorm), else 0."""
    return 1.0 if "Gemma" in type(model.get_submodule(path)).__name__ else 0.0


def norm_params(model: nn.Module, path: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(the gain the norm applies ``[d]``, its bias or None; a detached view)."""
    n = model.get_submodule(path)
    b = getattr(n, "bias", None)
    return n.weight.detach() + gain_offset(model, path), None if b is None else b.detach()


def set_gain_(model: nn.Module, path: str, g: torch.Tensor) -> None:
    with torch.no_grad():
        model.get_submodule(path).weight.copy_(g - gain_offset(model, path))


def _base(model: nn.Module, attr: str) -> str:
    return f"{attr}." if hasattr(model, attr) else ""


def _head(model: nn.Module, name: str, token: str) -> tuple[Lin | None, bool]:
    if not hasattr(model, name):
        return None, False
    tied = getattr(model, name).weight is model.get_submodule(token).weight
    return Lin(name), tied


def _act(model: nn.Module) -> str:
    c = model.config
    act = str(getattr(c, "hidden_act", None) or getattr(c, "activation_function", None)
              or getattr(c, "activation", ""))
    return "relu" if act == "relu" else "other"


def _final(path: str, unembed: Lin | None, tied: bool) -> Norm:
    """The last norm: read by the head (a tied head cannot absorb its gain), or by nothing
    (a bare model returns its output)."""
    return Norm(path, () if unembed is None else (unembed,), gain=unembed is not None and not tied)


def _gpt2(model: nn.Module) -> Layout:
    b = _base(model, "transformer")
    n = model.config.n_layer
    L = [f"{b}h.{i}." for i in range(n)]
    unembed, tied = _head(model, "lm_head", f"{b}wte")
    norms = [Norm(f"{p}ln_1", (Lin(f"{p}attn.c_attn", True),)) for p in L]
    norms = [x for i, p in enumerate(L) for x in (norms[i], Norm(f"{p}ln_2", (Lin(f"{p}mlp.c_fc", True),)))]
    if unembed is not None and not tied:  # a tied head cannot absorb the final gain
        norms.append(Norm(f"{b}ln_f", (unembed,)))
    return Layout("layer", tuple(norms),
                  tuple((Lin(f"{p}attn.c_proj", True), Lin(f"{p}mlp.c_proj", True)) for p in L),
                  False, (f"{b}wte", f"{b}wpe"),
                  tuple((Lin(f"{p}mlp.c_fc", True), Lin(f"{p}mlp.c_proj", True)) for p in L),
                  _act(model), unembed, tied, final=_final(f"{b}ln_f", unembed, tied),
                  layers=tuple(L))


def _neox(model: nn.Module) -> Layout:
    b = _base(model, "gpt_neox")
    L = [f"{b}layers.{i}." for i in range(model.config.num_hidden_layers)]
    unembed, tied = _head(model, "lm_head" if hasattr(model, "lm_head") else "embed_out",
                          f"{b}embed_in")
    norms = [x for p in L for x in (Norm(f"{p}input_layernorm", (Lin(f"{p}attention.query_key_value"),)),
                                    Norm(f"{p}post_attention_layernorm", (Lin(f"{p}mlp.dense_h_to_4h"),)))]
    if unembed is not None and not tied:  # a tied head cannot absorb the final gain
        norms.append(Norm(f"{b}final_layer_norm", (unembed,)))
    return Layout("layer", tuple(norms),
                  tuple((Lin(f"{p}attention.dense"), Lin(f"{p}mlp.dense_4h_to_h")) for p in L),
                  bool(model.config.use_parallel_residual), (f"{b}embed_in",),
                  tuple((Lin(f"{p}mlp.dense_h_to_4h"), Lin(f"{p}mlp.dense_4h_to_h")) for p in L),
                  _act(model), unembed, tied, final=_final(f"{b}final_layer_norm", unembed, tied),
                  layers=tuple(L))


def _llama(model: nn.Module) -> Layout:
    b = _base(model, "model")
    L = [f"{b}layers.{i}." for i in range(model.config.num_hidden_layers)]
    unembed, tied = _head(model, "lm_head", f"{b}embed_tokens")
    norms = [x for p in L for x in (
        Norm(f"{p}input_layernorm", tuple(Lin(f"{p}self_attn.{x}_proj") for x in "qkv")),
        Norm(f"{p}post_attention_layernorm", (Lin(f"{p}mlp.gate_proj"), Lin(f"{p}mlp.up_proj"))))]
    if unembed is not None and not tied:  # a tied head cannot absorb the final gain
        norms.append(Norm(f"{b}norm", (unembed,)))
    return Layout("rms", tuple(norms),
                  tuple((Lin(f"{p}self_attn.o_proj"), Lin(f"{p}mlp.down_proj")) for p in L),
                  False, (f"{b}embed_tokens",),
                  tuple((Lin(f"{p}mlp.up_proj"), Lin(f"{p}mlp.down_proj")) for p in L),
                  "gated", unembed, tied, final=_final(f"{b}norm", unembed, tied),
                  gates=tuple(Lin(f"{p}mlp.gate_proj") for p in L), layers=tuple(L))


def _falcon(model: nn.Module) -> Layout:
    """Falcon: one shared norm (parallel), ln_attn + ln_mlp (new decoder), or sequential."""
    b = _base(model, "transformer")
    L = [f"{b}h.{i}." for i in range(model.config.num_hidden_layers)]
    unembed, tied = _head(model, "lm_head", f"{b}word_embeddings")
    norms, attn = [], []
    for p in L:
        qkv, up = Lin(f"{p}self_attention.query_key_value"), Lin(f"{p}mlp.dense_h_to_4h")
        layer = model.get_submodule(p.rstrip("."))
        if hasattr(layer, "ln_attn"):
            pair = (Norm(f"{p}ln_attn", (qkv,)), Norm(f"{p}ln_mlp", (up,)))
        elif hasattr(layer, "post_attention_layernorm"):
            pair = (Norm(f"{p}input_layernorm", (qkv,)), Norm(f"{p}post_attention_layernorm", (up,)))
        else:
            pair = (Norm(f"{p}input_layernorm", (qkv, up)),)
        norms += pair
        attn.append(pair[0].path)
    if unembed is not None and not tied:
        norms.append(Norm(f"{b}ln_f", (unembed,)))
    c = model.config
    return Layout("layer", tuple(norms),
                  tuple((Lin(f"{p}self_attention.dense"), Lin(f"{p}mlp.dense_4h_to_h")) for p in L),
                  bool(c.parallel_attn or c.new_decoder_architecture), (f"{b}word_embeddings",),
                  tuple((Lin(f"{p}mlp.dense_h_to_4h"), Lin(f"{p}mlp.dense_4h_to_h")) for p in L),
                  _act(model), unembed, tied, attn_norms=tuple(attn),
                  final=_final(f"{b}ln_f", unembed, tied), layers=tuple(L))


def _phi3(model: nn.Module) -> Layout:
    """Phi-3: Llama's layout with fused ``qkv_proj`` and ``gate_up_proj`` (gate rows first)."""
    b = _base(model, "model")
    L = [f"{b}layers.{i}." for i in range(model.config.num_hidden_layers)]
    f = model.config.intermediate_size
    unembed, tied = _head(model, "lm_head", f"{b}embed_tokens")
    norms = [x for p in L for x in (Norm(f"{p}input_layernorm", (Lin(f"{p}self_attn.qkv_proj"),)),
                                    Norm(f"{p}post_attention_layernorm", (Lin(f"{p}mlp.gate_up_proj"),)))]
    if unembed is not None and not tied:
        norms.append(Norm(f"{b}norm", (unembed,)))
    return Layout("rms", tuple(norms),
                  tuple((Lin(f"{p}self_attn.o_proj"), Lin(f"{p}mlp.down_proj")) for p in L),
                  False, (f"{b}embed_tokens",),
                  tuple((Lin(f"{p}mlp.gate_up_proj", rows=(f, 2 * f)), Lin(f"{p}mlp.down_proj"))
                        for p in L),
                  "gated", unembed, tied, final=_final(f"{b}norm", unembed, tied),
                  gates=tuple(Lin(f"{p}mlp.gate_up_proj", rows=(0, f)) for p in L), layers=tuple(L))


def _bert(model: nn.Module, base: str = "bert", head: tuple[str, str, str] = (
        "cls", "cls.predictions.transform.", "cls.predictions.")) -> Layout:
    """Post-LN: ``x -> LN(x + sublayer(x))``. Each norm feeds the next sublayer's readers and
    its residual sum; the last one feeds the masked-LM transform (a pre-LN reader), whose own
    LayerNorm feeds the decoder. ``head``: (attribute, transform prefix, decoder prefix)."""
    b = _base(model, base)
    L = [f"{b}encoder.layer.{i}." for i in range(model.config.num_hidden_layers)]
    e = f"{b}embeddings."
    qkv = lambda p: tuple(Lin(f"{p}attention.self.{x}") for x in ("query", "key", "value"))  # noqa: E731
    norms, before = [], f"{e}LayerNorm"
    for p in L:
        norms.append(Norm(before, qkv(p), Lin(f"{p}attention.output.dense")))
        norms.append(Norm(f"{p}attention.output.LayerNorm", (Lin(f"{p}intermediate.dense"),),
                          Lin(f"{p}output.dense")))
        before = f"{p}output.LayerNorm"
    unembed, tied = None, False
    attr, tr, dec = head
    if hasattr(model, attr):
        unembed = Lin(f"{dec}decoder")
        tied = model.get_submodule(unembed.path).weight is model.get_submodule(
            f"{e}word_embeddings").weight
        norms.append(Norm(before, (Lin(f"{tr}dense"),)))
        ln = "LayerNorm" if attr == "cls" else "layer_norm"
        norms.append(Norm(f"{tr}{ln}", (unembed,), gain=not tied))
    tables = (f"{e}word_embeddings", f"{e}position_embeddings", f"{e}token_type_embeddings")
    pad = model.config.pad_token_id if base == "roberta" else None
    return Layout("layer", tuple(norms),
                  tuple((Lin(f"{p}attention.output.dense"), Lin(f"{p}output.dense")) for p in L),
                  False, tables,
                  tuple((Lin(f"{p}intermediate.dense"), Lin(f"{p}output.dense")) for p in L),
                  _act(model), unembed, tied, post=True, padding_idx=pad,
                  final=norms[-1] if unembed is not None else Norm(before, (), gain=False), layers=tuple(L))


def _roberta(model: nn.Module) -> Layout:
    return _bert(model, "roberta", ("lm_head", "lm_head.", "lm_head."))


FAMILIES = {"gpt2": _gpt2, "gpt_neox": _neox, "llama": _llama, "mistral": _llama,
            "qwen2": _llama, "qwen3": _llama, "gemma": _llama, "falcon": _falcon, "phi3": _phi3,
            "bert": _bert,
            "roberta": _roberta}


def layout_of(model: nn.Module) -> Layout:
    """The layout of a Hugging Face model (GPT-2, GPT-NeoX, Llama/Mistral/Qwen2/Qwen3/Gemma,
    Falcon, Phi-3, BERT, RoBERTa); works on a model built on the meta device."""
    kind = model.config.model_type
    if kind not in FAMILIES:
        raise AttnidError(f"no whole-model transforms for {kind!r} (have: {', '.join(FAMILIES)})")
    lay = FAMILIES[kind](model)
    off = lambda n: replace(n, offset=gain_offset(model, n.path))  # noqa: E731
    return replace(lay, norms=tuple(off(n) for n in lay.norms),
                   final=None if lay.final is None else off(lay.final))


@functools.cache
def _meta(config_json: str, source: str) -> tuple[Layout, tuple[str, ...]]:
    with torch.device("meta"):  # the config keeps its file's name for transformers' refusals
        model = new_hf_model(FileConfig(json.loads(config_json), source), head=True)
    return layout_of(model), tuple(model.state_dict())


def layout_for(config: dict[str, Any]) -> Layout:
    """The layout of the architecture a config names (its class built on the meta device: no
    memory, no weights), for tensors named as that class's ``state_dict``."""
    return _meta(json.dumps(config, sort_keys=True, default=str), source_of(config))[0]


def state_names(config: dict[str, Any]) -> tuple[str, ...]:
    """The ``state_dict`` names of the architecture a config names (tied names included)."""
    return _meta(json.dumps(config, sort_keys=True, default=str), source_of(config))[1]


def norm_by_path(lay: Layout, path: str) -> Norm:
    for n in lay.norms:
        if n.path == path:
            return n
    raise AttnidError(f"{path!r} is not a residual norm with readers here "
                     f"(have: {', '.join(n.path for n in lay.norms)})")


class ParamsBySuffix(Mapping):
    """A model's parameters by their names without the outer prefix (``h.0.attn...``)."""

    def __init__(self, model: nn.Module) -> None:
        self.p = dict(model.named_parameters())

    def full(self, key: str) -> str:
        hits = [n for n in self.p if n == key or n.endswith("." + key)]
        if len(hits) != 1:
            raise KeyError(key)
        return hits[0]

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.p[self.full(key)].detach()

    def __iter__(self) -> Iterator[str]:
        return iter(self.p)

    def __len__(self) -> int:
        return len(self.p)
