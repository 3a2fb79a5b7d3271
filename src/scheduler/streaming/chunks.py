"""One request's chunk channel, from the admission actor to its caller.

Lighter than an anyio memory-object stream for the one hot use: a chunk per request per step. A
chunk already there is taken without a checkpoint, and a wait costs one wake-up: on asyncio a bare
future of the running loop, elsewhere (trio) an anyio Event. An anyio Event costs about 2 µs more a
wait (it finds the backend, then wraps an asyncio.Event), and with a streaming caller per request
every request waits once a step. One sender (the actor), one receiver (the caller); the sender
never blocks, so the actor bounds what it sends (`max_tokens + 2` chunks at most).
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import TYPE_CHECKING, Any, Protocol

import anyio

from workers.bridge import trio_token

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from scheduler.types import Chunk


class ChunkOut(Protocol):
    """Where the admission actor sends one request's chunks (a `ChunkSender`). `send_nowait`
    never blocks, and raises `anyio.BrokenResourceError` once the receiver has gone."""

    def send_nowait(self, chunk: Chunk) -> None: ...

    def close(self) -> None: ...


def _running_asyncio_loop() -> asyncio.AbstractEventLoop | None:
    """The asyncio loop this task runs on; None on trio."""
    if trio_token() is not None:
        return None
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


class _State:
    __slots__ = ("buffer", "closed", "final_waiter", "finals", "gone", "listener", "loop", "waiter")

    def __init__(self) -> None:
        self.buffer: deque[Chunk] = deque()
        self.waiter: Any = None
        """The receiver's wait: a future of `loop`, or an anyio Event when `loop` is None."""
        self.loop: asyncio.AbstractEventLoop | None | bool = False
        """The asyncio loop the receiver waits on; None on another backend; False: not known yet
        (learnt at the first wait, on the receiver's loop)."""
        self.finals = 0
        """Final chunks in `buffer`."""
        self.final_waiter: Any = None
        self.closed = False
        """The sender closed: the receiver gets what is buffered, then EndOfStream."""
        self.gone = False
        """The receiver closed: sending raises BrokenResourceError."""
        self.listener: Callable[[], None] | None = None
        """Called on every chunk and at the close, for a caller that reads many channels in one task."""

    def wake(self) -> None:
        waiter, self.waiter = self.waiter, None
        if waiter is not None:
            _release(waiter)
        if self.listener is not None:
            self.listener()

    def wake_final(self) -> None:
        waiter, self.final_waiter = self.final_waiter, None
        if waiter is not None:
            _release(waiter)

    def new_waiter(self) -> Any:
        if self.loop is False:
            self.loop = _running_asyncio_loop()
        loop = self.loop
        return loop.create_future() if isinstance(loop, asyncio.AbstractEventLoop) else anyio.Event()

    def took(self, chunk: Chunk) -> Chunk:
        if chunk.finish_reason is not None:
            self.finals -= 1
        return chunk


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
        if chunk.finish_reason is not None:
            s.finals += 1
            s.wake_final()

    def close(self) -> None:
        self._s.closed = True
        self._s.wake()
        self._s.wake_final()


class ChunkReceiver:
    """The caller's end (the subset of MemoryObjectReceiveStream it uses)."""

    __slots__ = ("_s",)
    extra_rids: tuple[int, ...] = ()
    """Other requests whose chunks come here too (none: one request, one channel)."""

    def __init__(self, state: _State) -> None:
        self._s = state

    async def receive(self) -> Chunk:
        s = self._s
        while not s.buffer:
            if s.gone:
                raise anyio.ClosedResourceError
            if s.closed:
                raise anyio.EndOfStream
            s.waiter = waiter = s.new_waiter()
            await _wait(waiter)
        return s.took(s.buffer.popleft())

    async def wait_final(self) -> None:
        """Return once a final chunk is here or the channel has ended; takes nothing. Chunks that
        are not final do not wake it: a caller gathering chunks until a deadline waits once, not
        once per chunk."""
        s = self._s
        while not (s.finals or s.closed or s.gone):
            s.final_waiter = waiter = s.new_waiter()
            await _wait(waiter)

    def listen(self, listener: Callable[[], None] | None) -> None:
        """Have the sender call `listener` on every chunk and at its close (None: no more)."""
        self._s.listener = listener

    @property
    def ended(self) -> bool:
        """Nothing more will come: the sender closed and every chunk was taken, or this end closed."""
        s = self._s
        return s.gone or (s.closed and not s.buffer)

    def receive_nowait(self) -> Chunk:
        """A chunk already delivered; WouldBlock when there is none yet, EndOfStream at the end."""
        s = self._s
        if s.buffer:
            return s.took(s.buffer.popleft())
        if s.gone:
            raise anyio.ClosedResourceError
        if s.closed:
            raise anyio.EndOfStream
        raise anyio.WouldBlock

    def close(self) -> None:
        self._s.gone = True
        self._s.buffer.clear()
        self._s.finals = 0


def _release(waiter: Any) -> None:
    if isinstance(waiter, asyncio.Future):
        if not waiter.done():  # done: its receiver was cancelled while waiting
            waiter.set_result(None)
    else:
        waiter.set()


async def _wait(waiter: Any) -> None:
    if isinstance(waiter, asyncio.Future):
        await waiter
    else:
        await waiter.wait()


def chunk_channel() -> tuple[ChunkSender, ChunkReceiver]:
    state = _State()
    return ChunkSender(state), ChunkReceiver(state)


class SharedSender:
    """One channel for the n choices of one request: each choice's admission sends through its
    own `part`, and the channel closes when every part has closed (each part closes once)."""

    def __init__(self, sender: ChunkSender, parts: int) -> None:
        self._sender = sender
        self._open = parts

    def part(self) -> ChunkOut:
        return _Part(self)

    def _closed_one(self) -> None:
        self._open -= 1
        if self._open == 0:
            self._sender.close()


class _Part:
    __slots__ = ("_closed", "_shared")

    def __init__(self, shared: SharedSender) -> None:
        self._shared = shared
        self._closed = False

    def send_nowait(self, chunk: Chunk) -> None:
        self._shared._sender.send_nowait(chunk)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._shared._closed_one()


class SiblingReceiver:
    """The caller's end of a shared channel. Choice 0 is submitted first; the first chunk to
    arrive (its prompt is prefilled and its blocks stored) submits the other choices, which then
    find the prompt in the prefix cache."""

    def __init__(self, recv: ChunkReceiver, submit_rest: Callable[[], Awaitable[list[int]]]) -> None:
        self._recv = recv
        self._rest: Callable[[], Awaitable[list[int]]] | None = submit_rest
        self.extra_rids: list[int] = []
        """The other choices' request ids, once submitted (for cancelling them all)."""

    async def receive(self) -> Chunk:
        chunk = await self._recv.receive()
        if self._rest is not None:
            rest, self._rest = self._rest, None
            self.extra_rids = await rest()
        return chunk

    def receive_nowait(self) -> Chunk:
        if self._rest is not None:
            raise anyio.WouldBlock  # the next `receive` submits the rest first
        return self._recv.receive_nowait()

    async def wait_final(self) -> None:
        await self._recv.wait_final()

    def listen(self, listener: Callable[[], None] | None) -> None:
        self._recv.listen(listener)

    @property
    def ended(self) -> bool:
        return self._recv.ended

    def close(self) -> None:
        self._recv.close()
