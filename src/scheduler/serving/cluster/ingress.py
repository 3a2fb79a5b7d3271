"""A frontend's own HTTP port (`[cluster] ingress = "direct"`): uvicorn in the event loop Serve
runs the frontend's calls on, so that a request and each of its events go between the client
and the frontend with no Serve proxy in between: no actor call back to the proxy for the body,
no Serve item per event, and so no pacing of the events. Several frontends of one host bind the
same port (SO_REUSEPORT), and Linux spreads the connections over them."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from typing import TYPE_CHECKING, Any

import structlog

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from starlette.requests import Request
    from starlette.responses import Response

    from scheduler.config import ServerSection

log = structlog.get_logger("scheduler.cluster")
BACKLOG = 2048


def shared_socket(host: str, port: int) -> socket.socket:
    """A listening socket on `host:port` that the host's other frontends bind as well."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if hasattr(socket, "SO_REUSEPORT"):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        sock.listen(BACKLOG)
    except OSError as exc:
        sock.close()
        raise OSError(exc.errno, f"the frontend cannot listen on {host}:{port}: {exc.strerror}") from exc
    sock.setblocking(False)
    return sock


class DirectIngress:
    """uvicorn on `host:port`, answering every request with `handler` (the frontend's
    `__call__`, which Serve's proxy calls otherwise), under the server's connection limits."""

    def __init__(self, handler: Callable[[Request], Awaitable[Response]], limits: ServerSection,
                 host: str, port: int) -> None:
        import uvicorn
        from starlette.requests import Request

        from scheduler.serving.http.limits import protocol_for

        async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
            if scope["type"] != "http":  # lifespan is off; no websockets here
                return
            response = await handler(Request(scope, receive))
            await response(scope, receive, send)

        self.address = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
        self._socket = shared_socket(host, port)
        self._server = uvicorn.Server(uvicorn.Config(
            app, lifespan="off", access_log=False, log_level="warning",
            http=protocol_for(limits), timeout_keep_alive=limits.keep_alive_s,  # type: ignore[arg-type]
        ))
        self._task = asyncio.get_running_loop().create_task(self._serve())

    async def _serve(self) -> None:
        try:
            await self._server.serve(sockets=[self._socket])
        except Exception:  # a frontend without its port serves nothing: Serve's health check says so
            log.exception("ingress_failed", address=self.address)
            raise
        finally:
            with contextlib.suppress(OSError):
                self._socket.close()

    @property
    def failure(self) -> BaseException | None:
        """Why the server stopped, if it stopped by failing."""
        if not self._task.done() or self._task.cancelled():
            return None
        return self._task.exception()

    def close(self) -> None:
        """Stop accepting; requests in flight finish (uvicorn's own shutdown)."""
        self._server.should_exit = True
