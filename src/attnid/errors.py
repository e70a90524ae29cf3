"""The one exception type for user mistakes, the check for optional dependencies, and the
warning for a renamed keyword.

The CLI turns an :class:`AttnidError` into a single ``error: ...`` line on stderr
and exit code 2; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import importlib.util
import sys
import warnings
from typing import TypeVar

T = TypeVar("T")

# What each extra installs that attnid imports (import names; see pyproject.toml).
EXTRAS: dict[str, tuple[str, ...]] = {
    "hf": ("transformers", "safetensors"),
    "report": ("matplotlib", "markdown_it"),
}
_PACKAGE = {"markdown_it": "markdown-it-py"}  # where the package's name differs from the module's


class AttnidError(ValueError):
    """A user-facing error: an impossible spec, a bad file, an unsupported model."""


def installed(module: str) -> bool:
    """Whether ``module`` can be imported (without importing it; a module set to None in
    ``sys.modules`` counts as missing, as ``import`` treats it)."""
    if module in sys.modules:
        return sys.modules[module] is not None
    return importlib.util.find_spec(module) is not None


def require(module: str, extra: str) -> None:
    """Fail with one clear line when an optional dependency is missing.

    ``require("transformers", "hf")`` before the first use of an optional package turns a
    bare ``ModuleNotFoundError`` into ``pip install 'attnid[hf]'``.
    """
    if not installed(module):
        raise AttnidError(f"this needs {_PACKAGE.get(module, module)}, which is not installed: "
                          f"pip install 'attnid[{extra}]'")


def require_extras(*extras: str, what: str) -> None:
    """Fail with one line naming every missing package of every extra ``what`` needs, so that
    a command checks all its optional dependencies before any work.

    >>> require_extras(what="attnid count")  # nothing needed, nothing missing
    """
    missing = {e: [_PACKAGE.get(m, m) for m in EXTRAS[e] if not installed(m)] for e in extras}
    missing = {e: names for e, names in missing.items() if names}
    if missing:
        names = [n for ns in missing.values() for n in ns]
        raise AttnidError(f"{what} needs {', '.join(names)}, which {'is' if len(names) == 1 else 'are'} "
                          f"not installed: pip install 'attnid[{','.join(missing)}]'")


def renamed_keyword(old: str, new: str, old_value: T | None, value: T) -> T:
    """``value`` of keyword ``new``, or ``old_value`` given under its old name ``old`` (then
    with a ``DeprecationWarning``: the old name goes in the next release)."""
    if old_value is None:
        return value
    warnings.warn(f"{old}= is deprecated: write {new}= (the old name goes in the next release)",
                  DeprecationWarning, stacklevel=3)
    return old_value
