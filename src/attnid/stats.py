"""Summaries of many numbers, defined once for every table, log, JSON key and report attnid
writes (``audit``'s table, summary line and ``--json``, the report, training summaries,
Trainer logs): one definition of the median, so that one set of heads gives one number.

    >>> median([1, 2, 3, 4])       # an even count: the mean of the two middle values
    2.5
    >>> median([[0.5, 3.0], [1.0]])   # nested lists (per layer, per head) are flattened
    1.0
"""

from __future__ import annotations

import statistics
from typing import Any

import torch


def flat(values: Any) -> list[float]:
    """Every number in ``values`` (a number, a tensor, a numpy array or nested lists of them),
    flattened in order."""
    if isinstance(values, torch.Tensor):
        return values.detach().double().flatten().tolist()
    if hasattr(values, "ravel"):  # numpy arrays and scalars, without importing numpy
        return [float(v) for v in values.ravel().tolist()]
    if isinstance(values, (list, tuple)) or hasattr(values, "__next__"):
        return [x for v in values for x in flat(v)]
    return [float(values)]


def median(values: Any) -> float:
    """The median of every number in ``values`` (see :func:`flat`): the middle value of the
    sorted numbers, or for an even count the mean of the two middle values (the usual
    definition: `statistics.median`, numpy's ``median``; not ``torch.median``, which takes the
    lower one)."""
    xs = flat(values)
    if not xs:
        raise ValueError("the median of no numbers")
    return float(statistics.median(xs))


def medians(rows: Any) -> list[float]:
    """:func:`median` of each row (e.g. per step over heads: ``[S, H] -> [S]``)."""
    return [median(r) for r in rows]
