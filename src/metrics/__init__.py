"""Measurements: latency summaries and logging setup. Imports nothing from `scheduler`."""

from metrics.logging import configure_logging
from metrics.observer import NullObserver, Observer
from metrics.summary import LatencySummary, percentile, summarize

__all__ = [
    "LatencySummary",
    "NullObserver",
    "Observer",
    "configure_logging",
    "percentile",
    "summarize",
]
