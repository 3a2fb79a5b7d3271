"""Who may call the server: API keys, and the browser origins allowed to (CORS).

The checks are plain functions of method, path and headers, so `serve`'s app runs them as ASGI
middleware and the cluster's frontend calls them from its own handler. Keys are compared in
constant time, every configured key each time, so a wrong key's timing says nothing about a
right one."""

from __future__ import annotations

import hmac
import os
from typing import TYPE_CHECKING

from starlette.responses import Response

from scheduler.serving.http.errors import ApiError

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, Sequence

    from starlette.types import ASGIApp, Message, Receive, Scope, Send

    from scheduler.config import ServerSection

KEY_ENV = "MLX_SCHEDULER_API_KEY"
"""A key from the environment (keeps it out of config files and `ps`), added to the configured ones."""
ALLOW_METHODS = "GET, POST, OPTIONS"
ALLOW_HEADERS = "authorization, content-type, x-api-key, anthropic-version, openai-organization"


class Access:
    """The server's API keys (none: no check) and CORS origins (none: no CORS headers)."""

    def __init__(self, keys: Sequence[str], open_paths: Sequence[str], origins: Sequence[str]) -> None:
        self._keys = [k.encode() for k in keys if k]
        self.open_paths = frozenset(open_paths)
        self._any_origin = "*" in origins
        self._origins = frozenset(origins)

    @classmethod
    def of(cls, server: ServerSection, extra_key: str | None = None) -> Access:
        """From `[server]`, plus `--api-key` and `$MLX_SCHEDULER_API_KEY` when given."""
        keys = [*server.api_keys, extra_key or "", os.environ.get(KEY_ENV, "")]
        return cls(keys, server.open_paths, server.cors_origins)

    @property
    def keys(self) -> bool:
        return bool(self._keys)

    def refusal(self, method: str, path: str, headers: Mapping[str, str]) -> ApiError | None:
        """A 401 for a request that needs a key and lacks a right one; None lets it through."""
        if not self._keys or path in self.open_paths or method == "OPTIONS":
            return None
        given = _key(headers)
        if given is not None:
            ok = False
            for key in self._keys:  # no early exit: each check costs the same
                ok |= hmac.compare_digest(given.encode(), key)
            if ok:
                return None
        message = ("Incorrect API key provided." if given is not None else
                   "Missing API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'.")
        return ApiError(401, message, type="invalid_request_error", code="invalid_api_key",
                        headers={"www-authenticate": "Bearer"})

    def cors(self, origin: str | None) -> dict[str, str]:
        """The CORS headers for a response to `origin` (none when it is not allowed)."""
        if origin is None or not (self._any_origin or origin in self._origins):
            return {}
        return {"access-control-allow-origin": "*" if self._any_origin else origin, "vary": "origin"}

    def preflight(self, method: str, headers: Mapping[str, str]) -> Response | None:
        """The answer to a browser's CORS preflight, or None when this is not one."""
        if method != "OPTIONS" or "access-control-request-method" not in headers or not self._origins:
            return None
        allowed = self.cors(headers.get("origin"))
        if not allowed:
            return Response("origin not allowed", status_code=400, media_type="text/plain")
        return Response(status_code=204, headers={
            **allowed, "access-control-allow-methods": ALLOW_METHODS,
            "access-control-allow-headers": headers.get("access-control-request-headers", ALLOW_HEADERS),
            "access-control-max-age": "600",
        })


def _key(headers: Mapping[str, str]) -> str | None:
    auth = headers.get("authorization")
    if auth is not None:
        scheme, _, token = auth.partition(" ")
        return token.strip() if scheme.lower() == "bearer" else auth.strip()
    return headers.get("x-api-key")


class AccessMiddleware:
    """`Access` in front of an ASGI app: preflights answered, 401s before the app sees the
    request, CORS headers added to what it answers."""

    def __init__(
        self, app: ASGIApp, access: Access,
        shapes: Mapping[str, Callable[[ApiError, dict[str, str]], Response]] | None = None,
    ) -> None:
        self.app = app
        self.access = access
        self.shapes = dict(shapes or {})
        """Path prefixes whose errors take another API's shape (Anthropic's under /v1/messages)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        access, method = self.access, scope["method"]
        answer = access.preflight(method, headers)
        extra = access.cors(headers.get("origin"))
        if answer is None:
            path = scope["path"]
            refusal = access.refusal(method, path, headers)
            if refusal is not None:
                shape = next((s for prefix, s in self.shapes.items() if path.startswith(prefix)), None)
                answer = shape(refusal, extra) if shape is not None else refusal.response(extra)
        if answer is not None:
            await answer(scope, receive, send)
            return
        if not extra:
            await self.app(scope, receive, send)
            return
        raw = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in extra.items()]

        async def send_with_cors(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), *raw]}
            await send(message)

        await self.app(scope, receive, send_with_cors)
