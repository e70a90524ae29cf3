"""The whole-model layout's vocabulary: where the whole-model symmetries act in a built Hugging
Face model (each residual norm and the linear maps reading it, the maps writing into the
residual stream, the embedding tables, the MLPs, the unembedding).

Each family builds its own :class:`Layout` in its file (``Adapter.layout(model)``; Llama's,
the default, is :func:`llama_layout` here). The builders are pure functions of an
``nn.Module`` that use only what is here, so `attnid.adapters` never imports
`attnid.whole`: the dependency runs the other way, and `attnid.whole.transforms.layout`
looks a model's builder up in the family registry (``layout_of``) and adds the
family-independent parts (the norms' stored gain offsets, reading and writing the maps).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from torch import nn


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


# ---- helpers the families' builders share ---------------------------------------------
def base_prefix(model: nn.Module, attr: str) -> str:
    """``"attr."`` when the model wraps its body in ``attr`` (a head model), else ``""``."""
    return f"{attr}." if hasattr(model, attr) else ""


def lm_head(model: nn.Module, name: str, token: str) -> tuple[Lin | None, bool]:
    """(the head ``name`` if the model has one, whether it is the token table ``token``)."""
    if not hasattr(model, name):
        return None, False
    tied = getattr(model, name).weight is model.get_submodule(token).weight
    return Lin(name), tied


def activation(model: nn.Module) -> str:
    c = model.config
    act = str(getattr(c, "hidden_act", None) or getattr(c, "activation_function", None)
              or getattr(c, "activation", ""))
    return "relu" if act == "relu" else "other"


def final_norm(path: str, unembed: Lin | None, tied: bool) -> Norm:
    """The last norm: read by the head (a tied head cannot absorb its gain), or by nothing
    (a bare model returns its output)."""
    return Norm(path, () if unembed is None else (unembed,), gain=unembed is not None and not tied)


def llama_layout(model: nn.Module) -> Layout:
    """Llama and every family shaped like it (Mistral, Qwen2, Qwen3, Gemma): the default
    ``Adapter.layout``."""
    b = base_prefix(model, "model")
    L = [f"{b}layers.{i}." for i in range(model.config.num_hidden_layers)]
    unembed, tied = lm_head(model, "lm_head", f"{b}embed_tokens")
    norms = [x for p in L for x in (
        Norm(f"{p}input_layernorm", tuple(Lin(f"{p}self_attn.{x}_proj") for x in "qkv")),
        Norm(f"{p}post_attention_layernorm", (Lin(f"{p}mlp.gate_proj"), Lin(f"{p}mlp.up_proj"))))]
    if unembed is not None and not tied:  # a tied head cannot absorb the final gain
        norms.append(Norm(f"{b}norm", (unembed,)))
    return Layout("rms", tuple(norms),
                  tuple((Lin(f"{p}self_attn.o_proj"), Lin(f"{p}mlp.down_proj")) for p in L),
                  False, (f"{b}embed_tokens",),
                  tuple((Lin(f"{p}mlp.up_proj"), Lin(f"{p}mlp.down_proj")) for p in L),
                  "gated", unembed, tied, final=final_norm(f"{b}norm", unembed, tied),
                  gates=tuple(Lin(f"{p}mlp.gate_proj") for p in L), layers=tuple(L))
