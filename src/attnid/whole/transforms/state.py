"""`ModelTensors`: a model's tensors by the names of its transformers class's ``state_dict``,
with the layout that says where each symmetry acts. Every whole-model transform is written
once against it and serves both worlds:

* checkpoints: the tensors a checkpoint holds (any subset closed under what one transform
  touches: a layer's norm with its readers, a layer's attention, ...), the layout read from
  the architecture's class built on the meta device (:func:`layout_for`);
* modules: :func:`on_modules` makes a transform accept an ``nn.Module`` too, returning a new
  model (a deep copy loaded with the transformed ``state_dict``; ties kept).

Tensors are never modified: a transform returns a new `ModelTensors` sharing the tensors it did
not change. The mathematics is float64 in, the input's dtype out.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Concatenate, ParamSpec, TypeVar

import torch
from torch import nn

from attnid.adapters.base import Adapter
from attnid.adapters.registry import adapter_for
from attnid.errors import AttnidError
from attnid.spec import AttentionSpec
from attnid.weights import AttentionWeights
from attnid.whole.transforms.layout import Layout, Lin, Norm, layout_for, layout_of


def module_config(model: nn.Module) -> dict[str, Any]:
    """A transformers module's config as a dict, with ``architectures`` naming the class the
    module is: a model built from a config object (``LlamaForCausalLM(LlamaConfig(...))``)
    names none, and a bare model taken from a causal LM (``lm.model``) shares a config that
    names the head's class, so that a model rebuilt from the config (`attnid.whole.layerwise`)
    or counted from it would be another one. For a subclass, the nearest class transformers
    (or attnid: `adapters.base.own_classes`) defines, not a ``...PreTrainedModel`` base; the
    config's own ``architectures`` where none is found. A name counts when the one resolver
    of names to classes (`adapters.base.hf_model_class`) gives this very class back."""
    from attnid.adapters.base import hf_model_class

    config = model.config.to_dict()
    for c in type(model).__mro__:
        if c.__name__.endswith("PreTrainedModel"):
            break
        named = {**config, "architectures": [c.__name__]}
        if hf_model_class(named) is c:
            return named
    return config


@dataclass(frozen=True)
class ModelTensors:
    """Tensors by ``state_dict`` name, the layout, and the config (for the attention adapter)."""

    layout: Layout
    tensors: Mapping[str, torch.Tensor]
    config: dict[str, Any] = field(default_factory=dict, compare=False)

    @classmethod
    def of(cls, model: nn.Module) -> ModelTensors:
        """A module's tensors (detached; nothing is copied), its config with the class it is
        (`module_config`)."""
        return cls(layout_of(model), {k: v.detach() for k, v in model.state_dict().items()},
                   module_config(model))

    @classmethod
    def from_config(cls, config: dict[str, Any], tensors: Mapping[str, torch.Tensor]) -> ModelTensors:
        return cls(layout_for(config), tensors, config)

    # ---- reading -------------------------------------------------------------------------
    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def has(self, lin: Lin) -> bool:
        return f"{lin.path}.weight" in self.tensors

    def weight(self, lin: Lin) -> torch.Tensor:
        """``[out, in]`` whatever the storage (GPT-2's Conv1D keeps ``[in, out]``)."""
        w = self._get(f"{lin.path}.weight")
        return w.T if lin.conv1d else w

    def bias(self, lin: Lin) -> torch.Tensor | None:
        return self.tensors.get(f"{lin.path}.bias")

    def gain(self, norm: Norm) -> torch.Tensor:
        """The gain the norm applies (Gemma stores ``w`` for ``1 + w``)."""
        return self._get(f"{norm.path}.weight") + norm.offset

    def norm_bias(self, norm: Norm) -> torch.Tensor | None:
        return self.tensors.get(f"{norm.path}.bias")

    def complete(self, names: list[str], what: str) -> bool:
        """True when every name is here, False when none is; a part of them is refused (a
        transform never acts on half of what it must change together)."""
        here = [n in self.tensors for n in names]
        if all(here):
            return True
        if any(here):
            missing = next(n for n, h in zip(names, here, strict=True) if not h)
            raise AttnidError(f"{what}: {missing} is missing (it changes together with "
                              f"{next(n for n, h in zip(names, here, strict=True) if h)})")
        return False

    def _get(self, name: str) -> torch.Tensor:
        if name not in self.tensors:
            raise AttnidError(f"no tensor {name} here")
        return self.tensors[name]

    # ---- writing -------------------------------------------------------------------------
    def replace(self, changes: Mapping[str, torch.Tensor]) -> ModelTensors:
        """A new `ModelTensors` with ``changes`` (a tied unembedding follows its token table)."""
        out = dict(self.tensors)
        out.update(changes)
        lay = self.layout
        if lay.tied and lay.unembed is not None:
            head, table = f"{lay.unembed.path}.weight", f"{lay.tables[0]}.weight"
            if head in out and table in out:
                src = head if head in changes and table not in changes else table
                out[head] = out[table] = out[src]
        return ModelTensors(lay, out, self.config)

    # ---- attention through the family adapter ---------------------------------------------
    def adapter(self) -> Adapter:
        return adapter_for(self.config)

    def attention_prefix(self, layer: int) -> str:
        """The outer prefix before the adapter's names (``model.``), from the layer's prefix."""
        inner = self.adapter().layer_prefix.format(i=layer)
        outer = self.layout.layers[layer]
        if not outer.endswith(inner):
            raise AttnidError(f"layer {layer}: {outer!r} does not end with the adapter's {inner!r}")
        return outer[: len(outer) - len(inner)]

    def attention_names(self, layer: int) -> list[str]:
        a = self.adapter()
        p = self.attention_prefix(layer)
        return [p + n for n in a.names(layer, a.specs(self.config)[layer])]

    def attention(self, layer: int) -> AttentionWeights | None:
        """Layer ``layer``'s attention as `AttentionWeights` (None when its tensors are not here)."""
        names = self.attention_names(layer)
        if not self.complete(names, f"layer {layer}'s attention"):
            return None
        a, p = self.adapter(), self.attention_prefix(layer)
        spec = self.spec(layer)
        return a.read({n[len(p):]: self.tensors[n] for n in names}, layer, spec)

    def spec(self, layer: int) -> AttentionSpec:
        return self.adapter().specs(self.config)[layer]

    def attention_changes(self, layer: int, w: AttentionWeights) -> dict[str, torch.Tensor]:
        """The tensors that store ``w`` as layer ``layer``'s attention, in the stored dtype."""
        p = self.attention_prefix(layer)
        return {p + k: v.to(self.tensors[p + k].dtype)
                for k, v in self.adapter().write(w, layer).items()}


def weight_change(lin: Lin, w: torch.Tensor) -> dict[str, torch.Tensor]:
    """The stored form of an ``[out, in]`` weight."""
    return {f"{lin.path}.weight": w.T if lin.conv1d else w}


def gain_change(norm: Norm, g: torch.Tensor) -> dict[str, torch.Tensor]:
    return {f"{norm.path}.weight": g - norm.offset}


M = TypeVar("M", ModelTensors, nn.Module)
P = ParamSpec("P")


def on_modules(fn: Callable[Concatenate[ModelTensors, P], ModelTensors]
               ) -> Callable[Concatenate[M, P], M]:
    """Let a `ModelTensors` transform take a Hugging Face model as well: it then returns a new
    model (a deep copy loaded with the transformed ``state_dict``); the input is untouched."""

    @functools.wraps(fn)
    def wrapper(x, *args, **kwargs):
        if isinstance(x, ModelTensors):
            return fn(x, *args, **kwargs)
        before = ModelTensors.of(x)
        after = fn(before, *args, **kwargs)
        out = copy.deepcopy(x)
        out.load_state_dict(_tied(x, before.tensors, dict(after.tensors)))
        return out

    return wrapper


def _tied(model: nn.Module, before: Mapping[str, torch.Tensor], after: dict[str, torch.Tensor]
          ) -> dict[str, torch.Tensor]:
    """``after`` with every name of one shared tensor (tied embeddings, RoBERTa's two decoder
    biases) set to the value the transform gave any of them (loading goes name by name)."""
    shared: dict[tuple[int, int], list[str]] = {}
    for name, t in before.items():
        shared.setdefault((t.data_ptr(), t.numel()), []).append(name)
    for names in shared.values():
        changed = [n for n in names if after[n] is not before[n]]
        for n in names:
            if changed:
                after[n] = after[changed[0]]
    return after
