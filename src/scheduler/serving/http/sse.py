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
from scheduler.serving.http.errors import ApiError, internal, shutting_down
from scheduler.streaming.gather import Gather

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from starlette.requests import Request
    from starlette.types import Receive, Scope, Send

    from scheduler.streaming.stream import RequestStream
    from scheduler.types import Chunk

T = TypeVar("T")
log = structlog.get_logger("scheduler.http")


# JSON leaves these in its strings as they are, and many clients' line readers (Python's
# `str.splitlines`, httpx's `iter_lines`) end a line at each: a token's text holding one would cut
# its event in two there. Escaped, the JSON reads the same and every reader sees one line.
_LINE_BREAKERS = ((b"\xc2\x85", b"\\u0085"), (b"\xe2\x80\xa8", b"\\u2028"), (b"\xe2\x80\xa9", b"\\u2029"))


def line_safe(frames: bytes) -> bytes:
    """`frames` with the line breaks that JSON does not escape escaped."""
    if b"\xc2\x85" not in frames and b"\xe2\x80" not in frames:
        return frames
    for raw, escaped in _LINE_BREAKERS:
        frames = frames.replace(raw, escaped)
    return frames


class Dialect:
    """How one API frames its events: OpenAI's `data: ...` lines ended by `[DONE]`."""

    def frames(self, events: list[bytes]) -> bytes:
        return line_safe(b"".join(b"data: " + e + b"\n\n" for e in events))

    def done(self) -> list[bytes]:
        return [b"[DONE]"]

    def error(self, error: ApiError) -> bytes:
        return error.event()


OPENAI = Dialect()


def named_event(name: str, data: bytes) -> bytes:
    """One `event: name` frame with its JSON `data`."""
    return b"event: " + name.encode() + b"\ndata: " + data + b"\n\n"


class NamedEvents(Dialect):
    """APIs whose renderers frame their own named events and send no `[DONE]` (Anthropic's
    Messages, OpenAI's Responses); each says how its error event reads."""

    def frames(self, events: list[bytes]) -> bytes:
        return line_safe(b"".join(events))

    def done(self) -> list[bytes]:
        return []


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
        choices: int = 1,
        dialect: Dialect = OPENAI,
    ) -> None:
        self.status_code = 200
        self.background = None
        self.init_headers({"cache-control": "no-cache", "x-accel-buffering": "no",
                           "x-request-id": request_id})
        self._stream = stream
        self._first = first
        self._render = render
        self._request_id = request_id
        self._choices = choices
        self._dialect = dialect

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
                    last = await self._pump(send)
                    ended = True
                    await send({"type": "http.response.body", "body": self._dialect.frames(last),
                                "more_body": False})
                except OSError:
                    pass  # the client went away; servers on ASGI spec 2.4 say so by raising
                tg.cancel_scope.cancel()

    async def _pump(self, send: Send) -> list[bytes]:
        """Send the stream's events up to its end; return the last ones (with `[DONE]`), for the
        caller to send with the end of the body in one write."""
        chunk, finals = self._first, 0
        while True:
            # What arrived while the last write went out goes as one event per choice: the last
            # token and the ending share a write, and a loop that fell behind (many streams, few
            # cores) catches up in fewer writes.
            events: list[bytes] = []
            for c in coalesce([chunk, *self._stream.ready()]):
                if c.finish_reason in ("cancelled", "error"):
                    text = self._render(msgspec.structs.replace(c, finish_reason=None)) if c.text else []
                    return [*events, *text, self._failure(c), *self._dialect.done()]
                events += self._render(c)
                finals += c.finish_reason is not None
            if finals == self._choices:
                return [*events, *self._dialect.done()]
            if events:
                await send({"type": "http.response.body", "body": self._dialect.frames(events),
                            "more_body": True})
            try:
                chunk = await self._stream.__anext__()
            except SchedulerClosed:
                return [self._dialect.error(shutting_down()), *self._dialect.done()]

    def _failure(self, chunk: Chunk) -> bytes:
        if chunk.finish_reason == "cancelled":  # only the scheduler closing cancels a live stream
            return self._dialect.error(shutting_down())
        log.error("request_failed", request_id=self._request_id, error=chunk.error)
        return self._dialect.error(internal(self._request_id))


def coalesce(chunks: list[Chunk]) -> list[Chunk]:
    """Each run of one choice's chunks as one: their text, tokens and log-probabilities, the
    last one's ending (a final chunk ends its run)."""
    out: list[Chunk] = []
    for c in chunks:
        prev = out[-1] if out else None
        if prev is None or prev.index != c.index or prev.finish_reason is not None:
            out.append(c)
            continue
        lps = None if prev.logprobs is None and c.logprobs is None else [
            *(prev.logprobs or ()), *(c.logprobs or ())]
        out[-1] = msgspec.structs.replace(c, text=prev.text + c.text,
                                          token_ids=prev.token_ids + c.token_ids, logprobs=lps)
    return out


async def event_stream(
    request: Request, rid: str, stream: RequestStream, render: Callable[[Chunk], list[bytes]],
    choices: int = 1, dialect: Dialect | None = None,
) -> Response:
    """The streamed answer: its first chunk awaited before the 200, so a refusal keeps its status."""
    # The first chunk comes before the 200: a full queue or a bad prompt still gets its status.
    try:
        first = await unless_disconnected(request.receive, stream.__anext__)
    except BaseException:
        await stream.aclose()
        raise
    return EventStream(stream, first, render, rid, choices, dialect or OPENAI)


async def whole(request: Request, rid: str, stream: RequestStream) -> Gather:
    """The whole answer, every choice to its end; a scheduler closing or failing raises."""
    async def collect() -> Gather:
        out = Gather()
        async for chunk in stream:  # to every choice's final chunk
            out.add(chunk)
        return out

    async with stream:
        gathered = await unless_disconnected(request.receive, collect)
    for last in gathered.finals():
        if last.finish_reason == "cancelled":
            raise shutting_down()
        if last.finish_reason == "error":
            log.error("request_failed", request_id=rid, error=last.error)
            raise internal(rid)
    return gathered
