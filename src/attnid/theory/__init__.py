"""Closed-form counts: which parameters the function identifies (docs/theory.md §2-§8)."""

from attnid.theory.attention import Component, ComponentTotals, Count, count

__all__ = ["Component", "ComponentTotals", "Count", "count"]
