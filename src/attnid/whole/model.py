"""`attnid.count_model`: whole-model counts of a config, in closed form where one exists."""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any

from attnid.adapters.config import load_config
from attnid.adapters.registry import adapter_for
from attnid.errors import AttnidError, require
from attnid.theory.whole import WholeCount, count_structure

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel


def count_model(config: dict[str, Any] | str | os.PathLike[str] | PretrainedConfig | PreTrainedModel
                ) -> WholeCount:
    """Whole-model counts of a config (a dict, a config.json path, a model directory or a
    bundled name; or a transformers config object, or a transformers model: its config naming
    the class it is, `module_config`), at its own sizes.

    Families with a closed form (GPT-2, BERT, RoBERTa, Llama/Mistral, Qwen2/Qwen3, Gemma, GPT-NeoX,
    Falcon, Phi-3) are counted exactly; the others (OLMo2, DeepSeek) are counted
    by the whole-model arbiter on a reduced config of the same structure (this needs
    transformers), and ``method`` says so.

    >>> c = count_model("Llama-2-7b")
    >>> c.total, c.unidentified
    (6738415616, 25917440)
    """
    config = _as_dict(config)
    adapter = adapter_for(config)
    why = adapter.unsupported_whole(config)
    if why:
        raise AttnidError(why)
    st = adapter.whole(config)
    if adapter.closed_form:
        try:
            return count_structure(st)
        except AttnidError:  # a layout the closed form does not cover: counted numerically
            pass
    require("transformers", "hf")
    from attnid.whole.check import numeric_whole  # torch + transformers: only when needed

    return numeric_whole(adapter, config)


def _as_dict(config: Any) -> dict[str, Any]:
    """`count_model`'s argument as a config dict; anything else refused in one line."""
    if isinstance(config, (str, os.PathLike)):
        return load_config(os.fspath(config))[1]
    if isinstance(config, dict):
        return config
    torch = sys.modules.get("torch")  # a module given means torch is imported
    if torch is not None and isinstance(config, torch.nn.Module):
        if not callable(getattr(getattr(config, "config", None), "to_dict", None)):
            raise AttnidError(f"count_model: {type(config).__name__} is not a transformers model (no config)")
        from attnid.whole.transforms.state import module_config

        return module_config(config)
    if callable(getattr(config, "to_dict", None)):  # a transformers config object
        return config.to_dict()
    raise AttnidError(f"count_model: a config dict, a path or name, a transformers config or model; got "
                      f"{type(config).__name__}")
