"""Architecture name -> adapter. Families register themselves; no if/elif chains on names."""

from __future__ import annotations

from attnid.adapters.base import Adapter, Config
from attnid.errors import AttnidError

_REGISTRY: dict[str, type[Adapter]] = {}


def register(cls: type[Adapter]) -> type[Adapter]:
    for arch in cls.architectures:
        _REGISTRY[arch] = cls
    _REGISTRY.setdefault(f"model_type:{cls.model_type}", cls)
    return cls


def supported() -> list[str]:
    return sorted(k for k in _REGISTRY if not k.startswith("model_type:"))


def adapter_for(config: Config) -> Adapter:
    """The adapter for a config, by its ``architectures`` (or, failing that, ``model_type``)."""
    for arch in config.get("architectures") or []:
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
