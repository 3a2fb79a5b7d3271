"""mlx-scheduler: serve many concurrent generation requests on one MLX model."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# OpenBLAS binds to MLX only if it is loaded before MLX: `import scheduler` does it first
# (`workers` loads no MLX itself).
import workers  # noqa: F401

if TYPE_CHECKING:
    from scheduler.api import Scheduler
    from scheduler.config import SchedulerConfig
    from scheduler.engine import EngineClient
    from scheduler.params import SamplingParams
    from scheduler.request import Request
    from scheduler.types import Chunk, Completion, SchedulerStats, Timings

# The public names load on first use: a process that imports one light module of this package
# (Ray Serve's proxy loads our router to pick a frontend) does not load MLX, which on CUDA
# opens a context of about 0.5 GiB on every GPU.
_WHERE = {
    "Chunk": "types", "Completion": "types", "SchedulerStats": "types", "Timings": "types",
    "EngineClient": "engine", "Request": "request", "SamplingParams": "params",
    "Scheduler": "api", "SchedulerConfig": "config",
}
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


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'scheduler' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"scheduler.{_WHERE[name]}"), name)
    globals()[name] = value
    return value
