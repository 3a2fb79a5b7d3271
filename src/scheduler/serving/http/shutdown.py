"""A shutdown that keeps its promise at any `--shutdown-timeout`.

On SIGINT/SIGTERM the listening socket closes (new connections are refused) and requests on
open connections get 503. When the grace period ends the app closes the scheduler itself, before
the server would cancel its tasks: every open stream gets an error event then `[DONE]`, every
waiting request a 503 in OpenAI's shape. A client that cannot take even that (its socket is full)
is disconnected a moment later, so the server's own cancellation, which answers plain-text 500s
and logs tracebacks, never runs."""

from __future__ import annotations

import signal
from typing import TYPE_CHECKING

import anyio
import structlog

if TYPE_CHECKING:
    from scheduler.engine import EngineClient

log = structlog.get_logger("scheduler.http")


def raise_again(signals: list[int]) -> None:
    """Raise the signals that stopped the server once more, after it shut down, so that the exit
    status says why (130 for SIGINT). Under their default dispositions: a process started with a
    signal ignored (a background job of a shell script) would otherwise exit 0."""
    for sig in reversed(signals):
        signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
        signal.raise_signal(sig)


class Gate:
    """Whether the app still takes requests, and the one way it stops the scheduler."""

    def __init__(self) -> None:
        self.closing = False
        self.scheduler: EngineClient | None = None
        self._expired: anyio.Event | None = None

    def begin(self) -> None:
        """Refuse new requests with 503; in-flight ones go on."""
        if not self.closing:
            log.info("shutdown_started")
        self.closing = True

    async def expire(self) -> None:
        """End every request now: the scheduler closes, so each stream and waiting request gets
        its `shutting_down` answer. Idempotent; a second caller waits for the first."""
        self.closing = True
        if self._expired is not None:
            await self._expired.wait()
            return
        self._expired = anyio.Event()
        try:
            if self.scheduler is not None:
                await self.scheduler.aclose()
        finally:
            self._expired.set()
