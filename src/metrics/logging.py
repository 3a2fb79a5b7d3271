"""structlog set-up, for applications (the CLI calls it; the library never does on import)."""

from __future__ import annotations

import logging
import sys
from typing import TextIO

import structlog


def configure_logging(fmt: str = "console", level: str = "info", stream: TextIO | None = None) -> None:
    """Console or JSON lines at `level` and above, to `stream` (default stderr)."""
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer() if fmt == "json"
        else structlog.dev.ConsoleRenderer(exception_formatter=_traceback_formatter())
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=structlog.PrintLoggerFactory(stream or sys.stderr),
        cache_logger_on_first_use=False,
    )


def _traceback_formatter() -> structlog.typing.ExceptionRenderer:
    # Never the frames' locals (rich's default shows them): they hold request bodies and prompts.
    try:
        import rich  # noqa: F401
    except ImportError:
        return structlog.dev.plain_traceback
    return structlog.dev.RichTracebackFormatter(show_locals=False)
