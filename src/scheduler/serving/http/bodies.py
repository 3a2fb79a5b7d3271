"""Reading a request body under bounds: its media type, its size and how long it may take.

Nothing here logs the body: a prompt is the user's data. Errors name sizes and types only."""

from __future__ import annotations

from typing import TYPE_CHECKING

import anyio
from starlette.requests import ClientDisconnect

from scheduler.serving.http.errors import ApiError, invalid
from scheduler.serving.http.sse import ClientGone

if TYPE_CHECKING:
    from starlette.requests import Request

MAX_BODY_BYTES = 16 * 2**20


def check_media_type(request: Request) -> None:
    """JSON or no content-type at all (as FastAPI/vLLM); `text/plain` and forms are refused."""
    value = request.headers.get("content-type")
    if value is None:
        return
    media = value.split(";", 1)[0].strip().lower()
    if media == "application/json" or (media.startswith("application/") and media.endswith("+json")):
        return
    raise invalid(f"content-type must be application/json, got {media[:64]!r}")


async def read_body(request: Request, timeout_s: float, limit: int = MAX_BODY_BYTES) -> bytes:
    """The whole body: 413 past `limit` bytes, 408 when it takes longer than `timeout_s`."""
    check_media_type(request)
    body = bytearray()
    try:
        with anyio.fail_after(timeout_s):
            async for part in request.stream():
                body += part
                if len(body) > limit:
                    raise ApiError(413, f"the request body is larger than {limit} bytes",
                                   type="invalid_request_error")
    except TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {timeout_s:g} s "
                       f"({len(body)} bytes came)", type="invalid_request_error",
                       code="body_timeout", headers={"connection": "close"}) from None
    except ClientDisconnect:
        raise ClientGone from None
    return bytes(body)
