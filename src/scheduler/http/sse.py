"""Server-sent events from a `RequestStream`, and cancellation when the client goes away.

A client that disconnects must free its batch slot within one engine step, so every wait on the
scheduler runs beside a task that watches the connection and cancels the wait when it closes."""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeVar

import anyio
import msgspec
import structlog
from starlette.responses import Response

from scheduler.errors import SchedulerClosed
from scheduler.http.errors import internal, shutting_down

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from starlette.types import Receive, Scope, Send

    from scheduler.stream import RequestStream
    from scheduler.types import Chunk

T = TypeVar("T")
log = structlog.get_logger("scheduler.http")


class ClientGone(Exception):
    """The client closed the connection before its answer was ready."""


async def _disconnected(receive: Receive) -> None:
    # The body has been read already, so the next message is the disconnect, whenever it comes.
    while (await receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(receive: Receive, fn: Callable[[], Awaitable[T]]) -> T:
    """`await fn()`, cancelled (raising `ClientGone`) if the client disconnects first."""
    result: list[T] = []
    failure: list[Exception] = []
    async with anyio.create_task_group() as tg:

        async def watch() -> None:
            await _disconnected(receive)
            tg.cancel_scope.cancel()

        tg.start_soon(watch)
        try:
            result.append(await fn())
        except Exception as exc:  # re-raised below, bare rather than inside an ExceptionGroup
            failure.append(exc)
        tg.cancel_scope.cancel()
    if failure:
        raise failure[0]
    if not result:
        raise ClientGone
    return result[0]


class EventStream(Response):
    """`text/event-stream` of one request: `first`, then the rest of `stream`, each chunk rendered
    by `render` into event payloads, then `data: [DONE]`. Failures after the 200 went out become
    an OpenAI-shaped error event. Closing the connection cancels the request at once."""

    media_type = "text/event-stream"

    def __init__(
        self,
        stream: RequestStream,
        first: Chunk,
        render: Callable[[Chunk], list[bytes]],
        request_id: str,
    ) -> None:
        self.status_code = 200
        self.background = None
        self.init_headers({"cache-control": "no-cache", "x-accel-buffering": "no",
                           "x-request-id": request_id})
        self._stream = stream
        self._first = first
        self._render = render
        self._request_id = request_id

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async with self._stream:  # leaving it cancels the request unless it has ended
            async with anyio.create_task_group() as tg:

                ended = False

                async def watch() -> None:
                    await _disconnected(receive)  # servers also say so once the response is complete
                    if not ended:
                        log.debug("client_disconnected", request_id=self._request_id)
                    tg.cancel_scope.cancel()

                tg.start_soon(watch)
                try:
                    await send({"type": "http.response.start", "status": 200,
                                "headers": self.raw_headers})
                    await self._pump(send)
                    ended = True
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
                except OSError:
                    pass  # the client went away; servers on ASGI spec 2.4 say so by raising
                tg.cancel_scope.cancel()

    async def _pump(self, send: Send) -> None:
        chunk = self._first
        while True:
            if chunk.finish_reason in ("cancelled", "error"):
                if chunk.text:
                    await _send(send, self._render(msgspec.structs.replace(chunk, finish_reason=None)))
                await _send(send, [self._failure(chunk)])
                break
            await _send(send, self._render(chunk))
            if chunk.finish_reason is not None:
                break
            try:
                chunk = await self._stream.__anext__()
            except SchedulerClosed:
                await _send(send, [shutting_down().event()])
                break
        await _send(send, [b"[DONE]"])

    def _failure(self, chunk: Chunk) -> bytes:
        if chunk.finish_reason == "cancelled":  # only the scheduler closing cancels a live stream
            return shutting_down().event()
        log.error("request_failed", request_id=self._request_id, error=chunk.error)
        return internal(self._request_id).event()


async def _send(send: Send, events: list[bytes]) -> None:
    if events:
        body = b"".join(b"data: " + e + b"\n\n" for e in events)
        await send({"type": "http.response.body", "body": body, "more_body": True})
