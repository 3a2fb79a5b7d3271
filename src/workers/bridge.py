"""Calling into the event loop from the worker thread without waiting for it.

anyio's portal calls block the calling thread until the loop ran them; the worker must never wait
on the loop, so this uses each backend's own thread-safe "call soon" directly.
"""

from __future__ import annotations

import asyncio
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable


class LoopClosed(RuntimeError):
    """The event loop has finished; nobody is left to call."""


class LoopCaller:
    """Create on the event loop's thread; call from any thread: `caller(fn, *args)` schedules
    `fn(*args)` on the loop and returns at once."""

    def __init__(self) -> None:
        token = trio_token()
        if token is not None:
            self._closed_errors: tuple[type[BaseException], ...] = (sys.modules["trio"].RunFinishedError,)
            self._soon: Callable[..., Any] = token.run_sync_soon
        else:
            self._closed_errors = (RuntimeError,)  # asyncio: "Event loop is closed"
            self._soon = asyncio.get_running_loop().call_soon_threadsafe

    def __call__(self, fn: Callable[..., object], *args: object) -> None:
        try:
            self._soon(fn, *args)
        except self._closed_errors as exc:
            raise LoopClosed(str(exc)) from exc


def trio_token() -> Any:
    """The running trio loop's token, or None when this is not a trio loop (asked first: under
    trio-asyncio an asyncio loop runs too)."""
    trio = sys.modules.get("trio")
    if trio is None:
        return None
    try:
        return trio.lowlevel.current_trio_token()
    except RuntimeError:
        return None
