"""The one exception type for user mistakes.

The CLI turns an :class:`AttnidError` into a single ``error: ...`` line on stderr
and exit code 2; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations


class AttnidError(ValueError):
    """A user-facing error: an impossible spec, a bad file, an unsupported model."""
