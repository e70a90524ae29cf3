"""`attnid.count_model`: whole-model counts of a config, in closed form where one exists."""

from __future__ import annotations

from typing import Any

from attnid.adapters.config import load_config
from attnid.adapters.registry import adapter_for
from attnid.errors import AttnidError, require
from attnid.theory.whole import WholeCount, count_structure


def count_model(config: dict[str, Any] | str) -> WholeCount:
    """Whole-model counts of a config (a dict, a config.json path, a model directory or a
    bundled name), at its own sizes.

    Families with a closed form (GPT-2, BERT, RoBERTa, Llama/Mistral, Qwen2/Qwen3, Gemma, GPT-NeoX,
    Falcon, Phi-3) are counted exactly; the others (OLMo2, DeepSeek) are counted
    by the whole-model arbiter on a reduced config of the same structure (this needs
    transformers), and ``method`` says so.

    >>> c = count_model("Llama-2-7b")
    >>> c.total, c.unidentified
    (6738415616, 25917440)
    """
    if isinstance(config, str):
        _, config = load_config(config)
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
