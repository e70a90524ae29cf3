"""attnid: which attention parameters are identified, and what optimizers do with the rest.

The names below load on first use (PEP 562), so ``attnid count`` and ``attnid --help``
never import torch: the closed forms are plain Python.
"""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from attnid.arbiter import ArbiterResult, Verification, jacobian_rank, randomize_, verify
    from attnid.attention import Attention
    from attnid.errors import AttnidError
    from attnid.spec import AttentionSpec
    from attnid.theory import Component, Count, count
    from attnid.theory.whole import WholeCount
    from attnid.whole.model import count_model

_HOME = {
    "ArbiterResult": "attnid.arbiter",
    "Verification": "attnid.arbiter",
    "jacobian_rank": "attnid.arbiter",
    "randomize_": "attnid.arbiter",
    "verify": "attnid.arbiter",
    "Attention": "attnid.attention",
    "AttnidError": "attnid.errors",
    "AttentionSpec": "attnid.spec",
    "Component": "attnid.theory",
    "Count": "attnid.theory",
    "count": "attnid.theory",
    "WholeCount": "attnid.theory.whole",
    "count_model": "attnid.whole.model",
}
__all__ = [
    "ArbiterResult",
    "Attention",
    "AttentionSpec",
    "AttnidError",
    "Component",
    "Count",
    "Verification",
    "WholeCount",
    "count",
    "count_model",
    "jacobian_rank",
    "randomize_",
    "verify",
]

try:
    __version__ = version("attnid")
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module 'attnid' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOME[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOME])
