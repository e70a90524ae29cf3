"""Closed-form counts: which parameters the function identifies (docs/theory.md §2-§8)."""

from attnid.theory.attention import Component, Count, count

__all__ = ["Component", "Count", "count"]
