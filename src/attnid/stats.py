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


def paired_interval(diffs: Any, level: float = 0.95, draws: int = 4000, seed: int = 0
                    ) -> tuple[float, float, float]:
    """Mean of a ``[seeds, items]`` table of paired differences and its bootstrap interval:
    ``(mean, low, high)``.

    Each row is one training seed, each column one held-out item, each cell the difference of
    two models on that item (e.g. 1 - 0 for a hit and a miss). Seeds and items are both
    samples, so both are resampled, independently (a crossed bootstrap, percentile interval);
    with one seed it reduces to the usual paired bootstrap over items.

    >>> mean, lo, hi = paired_interval([[1, 0, 0, 1], [0, 0, 1, 1]])
    >>> mean, lo <= mean <= hi
    (0.5, True)
    """
    import numpy as np

    d = np.asarray(flat_rows(diffs), dtype=float)  # [S, N]
    rng = np.random.default_rng(seed)
    s, n = d.shape
    means = np.empty(draws)
    for k in range(draws):
        rows = rng.integers(0, s, s)
        cols = rng.integers(0, n, n)
        means[k] = d[np.ix_(rows, cols)].mean()
    tail = 100 * (1 - level) / 2
    lo, hi = np.percentile(means, [tail, 100 - tail])
    return float(d.mean()), float(lo), float(hi)


def flat_rows(rows: Any) -> list[list[float]]:
    """A 2-D table (nested lists, a tensor or an array) as a list of float rows."""
    if isinstance(rows, torch.Tensor):
        return rows.detach().double().tolist()
    return [flat(r) for r in rows]


def log_slope(x: Any, y: Any) -> float:
    """The least-squares slope of ``log y`` against ``log x`` (2 for ``y ~ x^2``).

    >>> round(log_slope([1, 2, 4], [3, 12, 48]), 12)
    2.0
    """
    import numpy as np

    return float(np.polyfit(np.log(flat(x)), np.log(flat(y)), 1)[0])
