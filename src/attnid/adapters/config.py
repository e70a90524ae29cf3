"""Find and read a model config: a config.json path, a model directory, a bundled name, or a
Hugging Face model id (``org/name``) in the local Hugging Face cache.

A config read here remembers where it came from (:class:`FileConfig`), so that every refusal
about one of its fields, wherever it is raised, names the file (:func:`source_of`).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping
from importlib import resources
from pathlib import Path
from typing import Any

from attnid.errors import AttnidError, require


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
    """``(display name, config dict)``. A path comes first, then a bundled name, then a
    Hugging Face model id in the local cache (:func:`hub_snapshot`). The dict is a
    :class:`FileConfig` (a JSON object, checked here; its fields are checked where they are
    read, `attnid.adapters.base.cfg_int`)."""
    path = Path(model)
    if not path.exists() and model.lower() not in {n.lower() for n in bundled()} and is_hub_id(model):
        return model, load_config(str(hub_snapshot(model)))[1]
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


def with_head(config: Mapping[str, Any], tensor_names: Iterable[str]) -> Mapping[str, Any]:
    """A config without ``architectures`` (``null``: what a GGUF conversion writes) given the
    causal-LM class of its ``model_type`` when the checkpoint has a language-model head: an
    ``lm_head.weight`` (GPT-NeoX: ``embed_out.weight``) among its tensors, or
    ``tie_word_embeddings: true``. Any other config is returned as it is (a bare model stays one).

    >>> with_head({"model_type": "llama"}, ["lm_head.weight"])["architectures"]
    ['LlamaForCausalLM']
    >>> "architectures" in with_head({"model_type": "llama"}, ["embed_tokens.weight"])
    False
    """
    if config.get("architectures") or not isinstance(config.get("model_type"), str):
        return config
    head = config.get("tie_word_embeddings") is True or any(
        n.split(".")[-2:-1] in (["lm_head"], ["embed_out"]) for n in tensor_names)
    if not head:
        return config
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError:  # without transformers nothing builds the class anyway
        return config
    cls = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config["model_type"])
    if cls is None:
        return config
    return FileConfig({**config, "architectures": [cls]}, source_of(config))


def _object(data: Any, source: str) -> FileConfig:
    if not isinstance(data, dict):
        raise AttnidError(f"{source}: the config is a JSON {type(data).__name__}, not an object of fields")
    return FileConfig(data, source)


def model_path(model: str | Path) -> Path:
    """Where ``model`` is on disk: the path as given, or, when there is no such path and it reads
    as a Hugging Face id (``org/name``), its snapshot in the local cache (:func:`hub_snapshot`)."""
    path = Path(model)
    return hub_snapshot(str(model)) if not path.exists() and is_hub_id(str(model)) else path


def is_hub_id(model: str) -> bool:
    """Whether ``model`` reads as a Hugging Face model id: ``org/name`` (one slash)."""
    return re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]*[A-Za-z0-9]", model) is not None and ".." not in model


def hub_snapshot(repo_id: str) -> Path:
    """The local snapshot (``refs/main``) of a Hugging Face model in the local cache
    (``HF_HUB_CACHE``, else ``HF_HOME/hub``, else huggingface_hub's default). Nothing is ever
    downloaded, whatever ``HF_HUB_OFFLINE`` says; a model not cached raises `AttnidError`
    saying how to fetch it."""
    require("huggingface_hub", "hf")
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    cache = os.environ.get("HF_HUB_CACHE") or (
        os.path.join(os.environ["HF_HOME"], "hub") if os.environ.get("HF_HOME") else constants.HF_HUB_CACHE)
    try:
        return Path(snapshot_download(repo_id, cache_dir=cache, local_files_only=True))
    except (LocalEntryNotFoundError, HFValidationError, FileNotFoundError):
        raise AttnidError(f"{repo_id} is neither a path nor in the local Hugging Face cache ({cache}); "
                          f"attnid never downloads: fetch it with `hf download {repo_id}` (older "
                          f"huggingface_hub: `huggingface-cli download {repo_id}`), or its config "
                          f"alone with `hf download {repo_id} config.json`") from None
