"""structlog set-up, for applications (the CLI calls it; the library never does on import)."""

from __future__ import annotations

import logging
import os
import sys
from typing import TextIO

import structlog


def configure_logging(fmt: str = "console", level: str = "info", stream: TextIO | None = None) -> None:
    """Console or JSON lines at `level` and above, to `stream` (default stderr). Console lines
    are coloured on a terminal only (`NO_COLOR` and `FORCE_COLOR` say otherwise)."""
    out = stream or sys.stderr
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer() if fmt == "json"
        else structlog.dev.ConsoleRenderer(colors=_colors(out), exception_formatter=_traceback_formatter())
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=structlog.PrintLoggerFactory(out),
        cache_logger_on_first_use=False,
    )


def _colors(stream: TextIO) -> bool:
    # A log file or a service manager's journal would keep the escape codes as text.
    if os.environ.get("NO_COLOR"):
        return False
    if os.environ.get("FORCE_COLOR"):
        return True
    isatty = getattr(stream, "isatty", None)
    return bool(isatty is not None and isatty())


def _traceback_formatter() -> structlog.typing.ExceptionRenderer:
    # Never the frames' locals (rich's default shows them): they hold request bodies and prompts.
    try:
        import rich  # noqa: F401
    except ImportError:
        return structlog.dev.plain_traceback
    return structlog.dev.RichTracebackFormatter(show_locals=False)
