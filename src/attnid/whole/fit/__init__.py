"""The whole-model fit: the group element that maps one model onto another, and what it
leaves (`attnid diff`; docs/theory.md §13.19). ``frame`` (B in A's coordinates, the probes),
``canonical`` (gauge fixing), ``rotation`` (Procrustes), ``match`` (heads and neurons by
linear assignment), ``compare`` (one unit), ``fitter`` (every unit, streamed), ``source`` (where
units come from)."""

from attnid.whole.fit.fitter import Fit, fit, tolerance
from attnid.whole.fit.source import TensorSource, UnitSource

__all__ = ["Fit", "TensorSource", "UnitSource", "fit", "tolerance"]
