"""mlx-scheduler: serve many concurrent generation requests on one MLX model."""

from scheduler.api import Scheduler
from scheduler.config import SchedulerConfig
from scheduler.params import SamplingParams
from scheduler.types import Chunk, Completion, SchedulerStats, Timings

__all__ = [
    "Chunk",
    "Completion",
    "SamplingParams",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerStats",
    "Timings",
]
