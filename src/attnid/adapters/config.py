"""Find and read a model config: a config.json path, a model directory, or a bundled name.

A config read here remembers where it came from (:class:`FileConfig`), so that every refusal
about one of its fields, wherever it is raised, names the file (:func:`source_of`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import Any

from attnid.errors import AttnidError


class FileConfig(dict[str, Any]):
    """A config dict that knows its file (or bundled name); otherwise a plain ``dict``.

    >>> c = FileConfig({"hidden_size": 8}, "m/config.json")
    >>> c["hidden_size"], source_of(c), source_of({"hidden_size": 8})
    (8, 'm/config.json', 'the config')
    """

    def __init__(self, data: Mapping[str, Any], source: str) -> None:
        super().__init__(data)
        self.source = source


def source_of(config: Mapping[str, Any]) -> str:
    """Where a config came from, for error messages (``"the config"`` when unknown)."""
    return getattr(config, "source", "the config")


def bundled() -> list[str]:
    """Names of the bundled configs (public config numbers, no weights)."""
    root = resources.files("attnid.configs")
    return sorted(p.name[:-5] for p in root.iterdir() if p.name.endswith(".json"))


def load_config(model: str) -> tuple[str, dict[str, Any]]:
    """``(display name, config dict)``; the dict is a :class:`FileConfig` (a JSON object,
    checked here; its fields are checked where they are read, `attnid.adapters.base.cfg_int`)."""
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
        if not path.exists():
            raise AttnidError(f"{model} has no config.json")
    if path.suffix == ".json" and path.exists():
        try:
            data = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise AttnidError(f"{path} is not valid JSON: {e}") from None
        except OSError as e:
            raise AttnidError(f"{path} cannot be read: {e.strerror or e}") from None
        return str(model), _object(data, str(path))
    names = {n.lower(): n for n in bundled()}
    if model.lower() in names:
        name = names[model.lower()]
        text = resources.files("attnid.configs").joinpath(f"{name}.json").read_text()
        return name, _object(json.loads(text), f"bundled config {name}")
    raise AttnidError(f"no config at {model!r} and no bundled model of that name "
                      f"(bundled: {', '.join(bundled())})")


def _object(data: Any, source: str) -> FileConfig:
    if not isinstance(data, dict):
        raise AttnidError(f"{source}: the config is a JSON {type(data).__name__}, not an object of fields")
    return FileConfig(data, source)
