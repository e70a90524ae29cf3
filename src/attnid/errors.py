"""The one exception type for user mistakes.

The CLI turns an :class:`AttnidError` into a single ``error: ...`` line on stderr
and exit code 2; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations


class AttnidError(ValueError):
    """A user-facing error: an impossible spec, a bad file, an unsupported model."""


def require(module: str, extra: str) -> None:
    """Fail with one clear line when an optional dependency is missing.

    ``require("transformers", "hf")`` before the first use of an optional package turns a
    bare ``ModuleNotFoundError`` into ``pip install 'attnid[hf]'``.
    """
    import importlib.util

    if importlib.util.find_spec(module) is None:
        raise AttnidError(f"this needs {module}, which is not installed: pip install 'attnid[{extra}]'")
