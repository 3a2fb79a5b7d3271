"""uvicorn, bounded and with a shutdown that keeps its promise (`shutdown.Gate`). Connection
limits, as uvicorn has no header timeout and only a request-time cap:
a connection must finish its request head within `header_timeout_s` (slowloris), and one past
`max_connections` is answered 503 at once and closed, before it can hold a file descriptor idle.

Only `uvicorn.protocols.http.h11_impl.H11Protocol`'s stable surface is used: `connection_made`,
`data_received`, `on_response_complete`, `conn` (h11), `connections`, `transport`, `loop`."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import h11
import msgspec
import structlog
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from scheduler.serving.http.errors import ApiError, ErrorEnvelope
from scheduler.serving.http.shutdown import raise_again

if TYPE_CHECKING:
    import socket
    from types import FrameType

    from scheduler.config import ServerSection
    from scheduler.serving.http.shutdown import Gate

log = structlog.get_logger("scheduler.http")

FLUSH_S = 1.0  # after the grace period: time for the final events to reach the clients
SERVER_MARGIN_S = 3.0  # uvicorn's own timeout comes this long after ours, as a backstop


def raw_response(status: int, reason: str, error: ApiError) -> bytes:
    """A whole HTTP/1.1 response with an OpenAI-shaped error body and `connection: close`."""
    body = msgspec.json.encode(ErrorEnvelope(error.body))
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n")
    head += "".join(f"{k}: {v}\r\n" for k, v in error.headers.items())
    return head.encode("ascii") + b"\r\n" + body


def too_many_connections(limit: int) -> bytes:
    return raw_response(503, "Service Unavailable", ApiError(
        503, f"the server already holds its limit of {limit} open connections; retry later",
        type="service_unavailable", code="too_many_connections", headers={"retry-after": "1"}))


def header_timeout(seconds: float) -> bytes:
    return raw_response(408, "Request Timeout", ApiError(
        408, f"the request line and headers did not arrive within {seconds:g} s",
        type="invalid_request_error", code="header_timeout"))


def protocol_for(limits: ServerSection) -> type[H11Protocol]:
    """An H11Protocol class bound to `limits`, for `uvicorn.Config(http=...)`."""

    class LimitedH11(H11Protocol):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > limits.max_connections:
                log.info("connection_refused", reason="too_many_connections",
                            limit=limits.max_connections)
                transport.write(too_many_connections(limits.max_connections))
                transport.close()
                return
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self._head_timer is not None and self.conn.their_state is not h11.IDLE:
                self._head_timer.cancel()  # the head is in: the app bounds the body itself
                self._head_timer = None

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()  # the next request's head has the same bound (keep-alive covers idle)

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._head_timer = self.loop.call_later(limits.header_timeout_s, self._head_expired)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_expired(self) -> None:
            self._head_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                log.debug("connection_closed", reason="header_timeout", after_s=limits.header_timeout_s)
                self.transport.write(header_timeout(limits.header_timeout_s))
                self.transport.close()

    return LimitedH11


class GracefulServer(uvicorn.Server):
    """uvicorn, with the grace period ended by the app (`Gate.expire`) rather than by uvicorn's
    task cancellation."""

    def __init__(self, config: uvicorn.Config, gate: Gate, grace_s: float) -> None:
        super().__init__(config)
        self._gate = gate
        self._grace_s = grace_s
        self._signals: list[int] = []

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self._signals.append(sig)
        super().handle_exit(sig, frame)

    def run(self, sockets: list[socket.socket] | None = None) -> None:
        super().run(sockets)
        # uvicorn raises the signal once more itself, under the disposition the process started
        # with: ignored in a shell script's background job, and then the exit status would be 0.
        raise_again(self._signals)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self._gate.begin()
        deadline = asyncio.ensure_future(self._deadline())
        try:
            await super().shutdown(sockets)
        finally:
            deadline.cancel()

    async def _deadline(self) -> None:
        await asyncio.sleep(self._grace_s)
        left = len(self.server_state.connections)
        if left:
            log.info("shutdown_grace_over", open_connections=left)
        await self._gate.expire()
        await asyncio.sleep(FLUSH_S)
        stuck = [c for c in self.server_state.connections if hasattr(c, "transport")]
        if stuck:
            log.info("shutdown_disconnecting", connections=len(stuck), reason="not reading")
        for conn in stuck:
            conn.transport.abort()  # close() would wait for a full socket buffer to drain
