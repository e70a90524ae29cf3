"""Moved: `attnid canonicalize`'s library code lives in :mod:`attnid.checkpoint.canonicalize`.

``from attnid.surgery import canonicalize`` keeps working (this module re-exports it).
"""

from attnid.checkpoint.canonicalize import Operations, canonicalize

__all__ = ["Operations", "canonicalize"]
