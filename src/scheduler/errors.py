"""The errors a caller of the public API can see. All subclass `SchedulerError`."""

from __future__ import annotations


class SchedulerError(Exception):
    """Base class of every error the scheduler raises on purpose."""


class InvalidRequest(SchedulerError, ValueError):
    """The request is malformed; the message names the field or what is wrong with the prompt."""


class QueueFull(SchedulerError):
    """The waiting queue holds `max_queue` requests already; try again later."""


class SchedulerClosed(SchedulerError):
    """The scheduler is not running (not started yet, closing, closed, or its worker failed)."""


class ConfigError(SchedulerError, ValueError):
    """The configuration is invalid; the message names the key."""


class ModelLoadError(SchedulerError):
    """The model could not be loaded or the engine could not start; the cause is chained."""


def by_name(kind: str, message: str) -> SchedulerError:
    """The error of class `kind` (a name above) with `message`, as it crossed a process boundary;
    a name we do not know gives the base class."""
    cls = globals().get(kind)
    if isinstance(cls, type) and issubclass(cls, SchedulerError):
        return cls(message)
    return SchedulerError(message)
