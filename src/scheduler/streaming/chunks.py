"""One request's chunk channel, from the admission actor to its caller.

Lighter than an anyio memory-object stream for the one hot use: a chunk per request per step. A
chunk already there is taken without a checkpoint, and a wait costs one wake-up (an anyio Event,
so it works on asyncio and trio alike). One sender (the actor), one receiver (the caller); the
sender never blocks, so the actor bounds what it sends (`max_tokens + 2` chunks at most).
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Protocol

import anyio

if TYPE_CHECKING:
    from scheduler.types import Chunk


class ChunkOut(Protocol):
    """Where the admission actor sends one request's chunks (a `ChunkSender`). `send_nowait`
    never blocks, and raises `anyio.BrokenResourceError` once the receiver has gone."""

    def send_nowait(self, chunk: Chunk) -> None: ...

    def close(self) -> None: ...


class _State:
    __slots__ = ("buffer", "closed", "gone", "waiter")

    def __init__(self) -> None:
        self.buffer: deque[Chunk] = deque()
        self.waiter: anyio.Event | None = None
        self.closed = False
        """The sender closed: the receiver gets what is buffered, then EndOfStream."""
        self.gone = False
        """The receiver closed: sending raises BrokenResourceError."""

    def wake(self) -> None:
        waiter, self.waiter = self.waiter, None
        if waiter is not None:
            waiter.set()


class ChunkSender:
    """The actor's end (the subset of MemoryObjectSendStream it uses)."""

    __slots__ = ("_s",)

    def __init__(self, state: _State) -> None:
        self._s = state

    def send_nowait(self, chunk: Chunk) -> None:
        s = self._s
        if s.gone:
            raise anyio.BrokenResourceError
        if s.closed:
            raise anyio.ClosedResourceError
        s.buffer.append(chunk)
        s.wake()

    def close(self) -> None:
        self._s.closed = True
        self._s.wake()


class ChunkReceiver:
    """The caller's end (the subset of MemoryObjectReceiveStream it uses)."""

    __slots__ = ("_s",)

    def __init__(self, state: _State) -> None:
        self._s = state

    async def receive(self) -> Chunk:
        s = self._s
        while not s.buffer:
            if s.gone:
                raise anyio.ClosedResourceError
            if s.closed:
                raise anyio.EndOfStream
            s.waiter = waiter = anyio.Event()
            await waiter.wait()
        return s.buffer.popleft()

    def receive_nowait(self) -> Chunk:
        """A chunk already delivered; WouldBlock when there is none yet, EndOfStream at the end."""
        s = self._s
        if s.buffer:
            return s.buffer.popleft()
        if s.gone:
            raise anyio.ClosedResourceError
        if s.closed:
            raise anyio.EndOfStream
        raise anyio.WouldBlock

    def close(self) -> None:
        self._s.gone = True
        self._s.buffer.clear()


def chunk_channel() -> tuple[ChunkSender, ChunkReceiver]:
    state = _State()
    return ChunkSender(state), ChunkReceiver(state)
