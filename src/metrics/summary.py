"""Latency percentiles the way benchmark tables report them."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    from collections.abc import Sequence


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation; NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


class LatencySummary(msgspec.Struct, frozen=True):
    count: int
    mean: float
    p50: float
    p90: float
    p99: float
    max: float


def summarize(values: Sequence[float]) -> LatencySummary:
    if not values:
        return LatencySummary(0, math.nan, math.nan, math.nan, math.nan, math.nan)
    return LatencySummary(
        count=len(values),
        mean=sum(values) / len(values),
        p50=percentile(values, 50),
        p90=percentile(values, 90),
        p99=percentile(values, 99),
        max=max(values),
    )
