"""Closed-form counts: which parameters the function identifies (docs/theory.md §2-§8 for one
attention layer, §13 for a whole model). Pure Python: nothing here imports torch."""

from attnid.theory.attention import Component, ComponentTotals, Count, count
from attnid.theory.whole import WholeCount, count_structure

__all__ = ["Component", "ComponentTotals", "Count", "WholeCount", "count", "count_structure"]
