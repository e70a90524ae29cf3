"""Architecture name -> adapter. Families register themselves; no if/elif chains on names.

The one registry of family knowledge: a config finds its family here by ``architectures``
(or ``model_type``), a built model finds its whole-model layout here by ``model_type``
(:data:`LAYOUTS`, which `attnid.whole.transforms.layout` reads), and the layer finder
(`attnid.adapters.hooks`) asks the family found here.
"""

from __future__ import annotations

from collections.abc import Callable
from types import MappingProxyType

from torch import nn

from attnid.adapters.base import Adapter, Config
from attnid.adapters.config import source_of
from attnid.adapters.layout import Layout
from attnid.errors import AttnidError

_REGISTRY: dict[str, type[Adapter]] = {}
_LAYOUTS: dict[str, Callable[[nn.Module], Layout]] = {}
# model_type -> its family's whole-model layout builder (families that have one), read-only
LAYOUTS = MappingProxyType(_LAYOUTS)


def register(cls: type[Adapter]) -> type[Adapter]:
    for arch in cls.architectures:
        _REGISTRY[arch] = cls
    _REGISTRY.setdefault(f"model_type:{cls.model_type}", cls)
    if "layout" not in cls.lacks:
        _LAYOUTS.setdefault(cls.model_type, cls().layout)
    return cls


def supported() -> list[str]:
    return sorted(k for k in _REGISTRY if not k.startswith("model_type:"))


def families() -> dict[str, type[Adapter]]:
    """Every registered family by its ``model_type``, in the order they registered."""
    return {k.split(":", 1)[1]: cls for k, cls in _REGISTRY.items() if k.startswith("model_type:")}


def adapter_for(config: Config) -> Adapter:
    """The adapter for a config, by its ``architectures`` (or, failing that, ``model_type``);
    every refusal names the config's file."""
    try:
        return _adapter_for(config)
    except AttnidError as e:
        source = source_of(config)
        raise AttnidError(str(e) if str(e).startswith(source) else f"{source}: {e}") from None


def _adapter_for(config: Config) -> Adapter:
    archs, model_type = config.get("architectures"), config.get("model_type")
    if archs is not None and not (isinstance(archs, list) and all(isinstance(a, str) for a in archs)):
        raise AttnidError(f"'architectures' must be a list of class names, got {archs!r}")
    if model_type is not None and not isinstance(model_type, str):
        raise AttnidError(f"'model_type' must be a string, got {model_type!r}")
    for arch in archs or []:
        if arch in _REGISTRY:
            adapter = _REGISTRY[arch]()
            break
    else:
        key = f"model_type:{config.get('model_type')}"
        if key not in _REGISTRY:
            types = ", ".join(sorted(k.split(":", 1)[1] for k in _REGISTRY if k.startswith("model_type:")))
            if not config.get("architectures"):
                raise AttnidError(
                    "the config has no 'architectures' field and its model_type "
                    f"{config.get('model_type')!r} is not known; known model_types: {types}")
            names = ", ".join(config["architectures"])
            raise AttnidError(f"unsupported architecture {names}; supported: {', '.join(supported())} "
                              f"(model_types: {types})")
        adapter = _REGISTRY[key]()
    why = adapter.unsupported(config)
    if why:
        raise AttnidError(why)
    return adapter
