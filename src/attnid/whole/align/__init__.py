"""Align and merge modulo the whole-model symmetry group (`attnid align`, `attnid merge`,
`attnid barrier`; docs/theory.md §13.20): ``aligner`` (the group element that brings B closest
to A, per variant of the group), ``gauges`` (the continuous gauges' least squares),
``additive`` (the translations)."""

from attnid.whole.align.aligner import GROUPS, PARTS, Alignment, Group, align

__all__ = ["GROUPS", "PARTS", "Alignment", "Group", "align"]
