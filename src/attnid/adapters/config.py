"""Find and read a model config: a config.json path, a model directory, or a bundled name."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

from attnid.errors import AttnidError


def bundled() -> list[str]:
    """Names of the bundled configs (public config numbers, no weights)."""
    root = resources.files("attnid.configs")
    return sorted(p.name[:-5] for p in root.iterdir() if p.name.endswith(".json"))


def load_config(model: str) -> tuple[str, dict[str, Any]]:
    """``(display name, config dict)``."""
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
        if not path.exists():
            raise AttnidError(f"{model} has no config.json")
    if path.suffix == ".json" and path.exists():
        try:
            return str(model), json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise AttnidError(f"{path} is not valid JSON: {e}") from None
    names = {n.lower(): n for n in bundled()}
    if model.lower() in names:
        name = names[model.lower()]
        text = resources.files("attnid.configs").joinpath(f"{name}.json").read_text()
        return name, json.loads(text)
    raise AttnidError(f"no config at {model!r} and no bundled model of that name "
                      f"(bundled: {', '.join(bundled())})")
