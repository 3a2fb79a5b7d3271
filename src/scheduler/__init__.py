"""mlx-scheduler: serve many concurrent generation requests on one MLX model."""

from scheduler.api import Scheduler
from scheduler.config import SchedulerConfig
from scheduler.engine import EngineClient
from scheduler.params import SamplingParams
from scheduler.request import Request
from scheduler.types import Chunk, Completion, SchedulerStats, Timings

__all__ = [
    "Chunk",
    "Completion",
    "EngineClient",
    "Request",
    "SamplingParams",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerStats",
    "Timings",
]
