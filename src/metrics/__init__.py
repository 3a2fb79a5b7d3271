"""Measurements: Prometheus metrics, latency summaries and logging setup. Imports nothing from
`scheduler`."""

from metrics.logging import configure_logging
from metrics.observer import NullObserver, Observer
from metrics.prometheus import SchedulerMetrics
from metrics.summary import LatencySummary, percentile, summarize

__all__ = [
    "LatencySummary",
    "NullObserver",
    "Observer",
    "SchedulerMetrics",
    "configure_logging",
    "percentile",
    "summarize",
]
