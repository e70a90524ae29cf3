"""Deprecated name: the training hooks now live in `attnid.monitor` (kept so old imports work)."""

from attnid.monitor import Corrector, Monitor

__all__ = ["Corrector", "Monitor"]
