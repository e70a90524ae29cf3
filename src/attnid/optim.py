"""Deprecated name: the training hooks live in `attnid.monitor`. Importing this module warns
(``DeprecationWarning``); it will be removed in 0.4."""

import warnings

from attnid.monitor import Corrector, Monitor

warnings.warn("attnid.optim is deprecated: import Monitor and Corrector from attnid.monitor",
              DeprecationWarning, stacklevel=2)

__all__ = ["Corrector", "Monitor"]
