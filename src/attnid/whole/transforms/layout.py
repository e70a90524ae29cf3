"""Where the whole-model symmetries act in a Hugging Face model: each residual norm and the
linear maps reading it, the maps writing into the residual stream, the embedding tables, the
MLPs, the unembedding. Everything here is family-independent.

Each family builds its own :class:`Layout` in its file (``Adapter.layout``, over the vocabulary
of `attnid.adapters.layout`, which this module re-exports); :func:`layout_of` looks the builder
up in the family registry by the model's ``model_type`` (:data:`FAMILIES`). The dependency runs
from ``whole/`` to ``adapters/``, never back: a family file needs nothing from here.

Linear maps are handled as ``[out, in]`` matrices whatever their storage (GPT-2's Conv1D keeps
``[in, out]``): :func:`get_w` / :func:`set_w_`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from attnid.adapters.base import new_hf_model
from attnid.adapters.config import FileConfig, source_of
from attnid.adapters.layout import Layout, Lin, Norm
from attnid.adapters.registry import LAYOUTS
from attnid.errors import AttnidError
from attnid.whole.transforms.layout_store import load as load_stored
from attnid.whole.transforms.layout_store import save as save_stored

__all__ = ["FAMILIES", "Layout", "Lin", "Norm", "ParamsBySuffix", "gain_offset", "get_b", "get_w",
           "layout_for", "layout_of", "norm_by_path", "norm_params", "set_b_", "set_gain_", "set_w_",
           "state_names"]


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


# model_type -> its family's layout builder (`attnid.adapters.registry.LAYOUTS`, live)
FAMILIES = LAYOUTS


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


_BUILT: dict[str, tuple[Layout, tuple[str, ...]]] = {}  # by config: two files of one config build once


def _meta(config_json: str, source: str) -> tuple[Layout, tuple[str, ...]]:
    if config_json not in _BUILT:
        # kept on disk for attnid's own families only: a family registered from outside
        # (a user's adapter) is code the store's key does not hash
        config = json.loads(config_json)
        builder = FAMILIES.get(config.get("model_type"))
        home = type(builder.__self__) if hasattr(builder, "__self__") else builder  # an adapter's method
        own = builder is not None and getattr(home, "__module__", "").startswith("attnid.")
        stored = load_stored(config_json) if own else None  # built by an earlier run
        if stored is None:
            with torch.device("meta"):  # the config keeps its file's name for transformers' refusals
                model = new_hf_model(FileConfig(config, source), head=True)
            stored = layout_of(model), tuple(model.state_dict())
            if own:
                save_stored(config_json, stored)
        _BUILT[config_json] = stored
    return _BUILT[config_json]


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
