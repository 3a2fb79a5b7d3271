"""`RequestStream`: what `Scheduler.generate` returns. Iterating it submits the request; leaving
early (break, exception, cancellation, garbage collection) cancels it."""

from __future__ import annotations

import sys
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import anyio

from scheduler.errors import InvalidRequest, SchedulerClosed
from scheduler.streaming.chunks import ChunkReceiver, SiblingReceiver

if TYPE_CHECKING:
    from types import TracebackType

    from scheduler.request import Request
    from scheduler.types import Chunk

THREAD_TOKENIZE_CHARS = 2048
"""Tokenizing a long prompt takes milliseconds; past this many characters it leaves the loop."""


async def prompt_tokens(prompt: str | list[int], encode: Callable[[str], list[int]]) -> list[int]:
    """The token ids of `prompt`: a text encoded (on a thread when long), a list copied."""
    if not isinstance(prompt, str):
        return list(prompt)
    if len(prompt) > THREAD_TOKENIZE_CHARS:
        tokens = await anyio.to_thread.run_sync(encode, prompt)
    else:
        tokens = encode(prompt)
    if not tokens:
        raise InvalidRequest("prompt encodes to no tokens")
    return tokens


Receiver = ChunkReceiver | SiblingReceiver
SubmitFn = Callable[["Request"], Awaitable[tuple[int, Receiver]]]


class RequestStream:
    """An async iterator of one request's chunks; the last one has a `finish_reason`. With
    `n` choices, their chunks interleave (`Chunk.index`) and each choice has its final chunk."""

    def __init__(
        self,
        submit: SubmitFn,
        cancel: Callable[[int], None],
        request: Request,
    ) -> None:
        self._submit = submit
        self._cancel = cancel
        self.request = request
        self._rid: int | None = None
        self._recv: Receiver | None = None
        self._done = False
        self._finals_left = request.params.n

    @property
    def request_id(self) -> int | None:
        """The scheduler's id for this request, once iteration has submitted it."""
        return self._rid

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> Chunk:
        if self._done:
            raise StopAsyncIteration
        if self._recv is None:
            try:
                self._rid, self._recv = await self._submit(self.request)
            except BaseException:
                self._done = True
                raise
        try:
            chunk = await self._recv.receive()
        except anyio.EndOfStream:
            self._done = True
            raise SchedulerClosed("the scheduler stopped before this request ended") from None
        except BaseException:
            self._abandon()
            raise
        return self._took(chunk)

    def _took(self, chunk: Chunk) -> Chunk:
        """A chunk taken from the channel: a final one counts towards the stream's end."""
        if chunk.finish_reason is not None:
            self._final()
        return chunk

    def _final(self) -> None:
        self._finals_left -= 1
        if self._finals_left == 0:
            self._done = True
            assert self._recv is not None
            self._recv.close()

    def ready(self) -> list[Chunk]:
        """The chunks already delivered, without waiting: none before the first `__anext__`, and
        none after the last one. A server that fell behind sends them as one event, so a slow
        client costs one write per step, not one per token."""
        out: list[Chunk] = []
        recv = self._recv
        while recv is not None and not self._done:
            try:
                chunk = recv.receive_nowait()
            except (anyio.WouldBlock, anyio.EndOfStream):
                break  # EndOfStream: the next __anext__ says so
            out.append(self._took(chunk))
        return out

    async def ready_by(self, deadline: float) -> list[Chunk]:
        """The chunks that arrive until `deadline` (`anyio.current_time()`'s clock), or until a
        final one does, whichever is first; call it after the first chunk. For a transport that
        pays per message rather than per token: the stream goes on intact after the deadline
        (nothing is lost or cancelled by it)."""
        out = self.ready()
        recv = self._recv
        if recv is not None and not self._done and all(c.finish_reason is None for c in out):
            # One wait for the whole window: chunks that are not final do not wake it.
            with anyio.CancelScope(deadline=deadline):
                await recv.wait_final()
            out += self.ready()
        return out

    def listen(self, listener: Callable[[], None] | None) -> None:
        """Call `listener` (on the event loop, with nothing) whenever a chunk arrives or the
        stream ends: for a caller that reads many streams' `ready()` in one task, woken once per
        step rather than once per stream. Call it after the first `__anext__`; None stops it."""
        if self._recv is None:
            raise RuntimeError("listen() before the first chunk: the request is not submitted yet")
        self._recv.listen(listener)

    @property
    def complete(self) -> bool:
        """Every choice's final chunk was taken: the request ran to its end (rather than its
        channel closing first, or the stream being left)."""
        return self._finals_left == 0

    @property
    def ended(self) -> bool:
        """No chunk will come: every choice's final chunk was taken, or the stream closed (the
        next `__anext__` says how)."""
        return self._done or (self._recv is not None and self._recv.ended)

    def _abandon(self) -> None:
        if self._done:
            return
        self._done = True
        if self._recv is not None:
            self._recv.close()
        if self._rid is not None:
            self._cancel(self._rid)
            for rid in self._recv.extra_rids if self._recv is not None else ():
                self._cancel(rid)

    async def aclose(self) -> None:
        """Cancel the request if it has not ended. Safe to call more than once."""
        self._abandon()

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._abandon()

    def __del__(self) -> None:
        # `break` out of `async for` drops the iterator without a call; this is that call. Not
        # while the interpreter shuts down (a caller's error can keep the stream alive until
        # then): the scheduler is gone by then, and the cancel's imports would fail, printing a
        # second traceback under the caller's own.
        if not self._done and self._rid is not None and not sys.is_finalizing():
            self._abandon()
