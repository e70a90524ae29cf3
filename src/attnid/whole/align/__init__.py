"""Align and merge modulo the whole-model symmetry group (`attnid align`, `attnid merge`,
`attnid barrier`; docs/theory.md §13.20): ``aligner`` (the group element that brings B closest
to A within a subgroup of the group), ``gauges`` (the continuous gauges' least squares),
``additive`` (the translations)."""

from attnid.whole.align.aligner import GROUPS, PARTS, SUBGROUPS, Alignment, Group, Subgroup, align

# GROUPS and Group: the old names of SUBGROUPS and Subgroup (deprecated; go in the next release)
__all__ = ["GROUPS", "PARTS", "SUBGROUPS", "Alignment", "Group", "Subgroup", "align"]
