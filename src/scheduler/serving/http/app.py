"""The ASGI app: OpenAI's `/v1/completions`, `/v1/chat/completions`, `/v1/responses` and
`/v1/models`, Anthropic's `/v1/messages`, `/tokenize`, `/detokenize`, `/health` and `/metrics`
over one engine, behind its API keys."""

from __future__ import annotations

import time
import traceback
import uuid
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec
import structlog
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.responses import Response
from starlette.routing import Route

from scheduler.api import Scheduler
from scheduler.errors import SchedulerError
from scheduler.serving.heap import freeze_startup_heap
from scheduler.serving.http import anthropic, responses_api
from scheduler.serving.http import requests as rq
from scheduler.serving.http import responses as rs
from scheduler.serving.http import tokens as tk
from scheduler.serving.http.access import Access, AccessMiddleware
from scheduler.serving.http.bodies import read_body
from scheduler.serving.http.chat import plan_chat
from scheduler.serving.http.errors import (
    ApiError,
    from_scheduler,
    internal,
    json_response,
    shutting_down,
)
from scheduler.serving.http.logprobs import TokenTexts
from scheduler.serving.http.prompts import SchedulerPrompts, Tokenizing
from scheduler.serving.http.shutdown import Gate
from scheduler.serving.http.sse import ClientGone, event_stream, whole

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Awaitable, Callable
    from contextlib import AbstractAsyncContextManager

    from starlette.requests import Request

    from scheduler.config import SchedulerConfig, ServerSection
    from scheduler.engine import EngineClient
    from scheduler.types import SchedulerStats

    Handler = Callable[[Request, str], Awaitable[Response]]
    Shape = Callable[[ApiError, dict[str, str]], Response]

log = structlog.get_logger("scheduler.http")

DEFAULT_MAX_TOKENS = 16  # /v1/completions, as OpenAI
PROMETHEUS = "text/plain; version=0.0.4; charset=utf-8"


def _openai(error: ApiError, headers: dict[str, str]) -> Response:
    return error.response(headers)


class Health(msgspec.Struct, frozen=True):
    status: str
    model: str
    stats: SchedulerStats


def create_app(
    config: SchedulerConfig | None = None,
    *,
    scheduler: EngineClient | None = None,
    model_name: str | None = None,
    freeze_heap: bool = False,
) -> Starlette:
    """The app. With `config` its lifespan starts and closes a `Scheduler`; with a running
    `scheduler` (any `EngineClient`: embedding, tests) it serves that one and leaves its
    lifetime to the caller. `model_name` is the id `/v1/models` reports (default: the model's
    name). `app.state.gate` is its `shutdown.Gate`: `serve` ends the grace period through it.
    `freeze_heap`: once its scheduler has started, freeze the process's heap (`heap.py`; `serve`
    passes `[server] freeze_heap`, for the process is its own)."""
    if (config is None) == (scheduler is None):
        raise TypeError("create_app takes exactly one of config or scheduler")
    if freeze_heap and config is None:
        raise TypeError("freeze_heap needs config: the app then starts the scheduler, and freezes after it")
    owner = config if config is not None else scheduler.config  # type: ignore[union-attr]
    api = _OpenAI(scheduler, model_name, owner.server)
    routes = [
        Route("/v1/completions", api.endpoint(api.completions, "cmpl", "prompt"), methods=["POST"]),
        Route("/v1/chat/completions", api.endpoint(api.chat, "chatcmpl", "messages"), methods=["POST"]),
        Route("/v1/models", api.endpoint(api.models, "models"), methods=["GET"]),
        Route("/v1/messages", api.endpoint(api.messages, "msg", "messages", anthropic.error_response),
              methods=["POST"]),
        Route("/v1/messages/count_tokens",
              api.endpoint(api.count_tokens, "count", "messages", anthropic.error_response),
              methods=["POST"]),
        Route("/v1/responses", api.endpoint(api.responses, "resp", "input"), methods=["POST"]),
        Route("/tokenize", api.endpoint(api.tokenize, "tok", "prompt"), methods=["POST"]),
        Route("/detokenize", api.endpoint(api.detokenize, "detok", "tokens"), methods=["POST"]),
        Route("/health", api.endpoint(api.health, "health"), methods=["GET"]),
        Route("/metrics", api.endpoint(api.metrics, "metrics"), methods=["GET"]),
    ]
    lifespan = api.lifespan(config, freeze_heap) if config is not None else None
    access = Access.of(owner.server)
    if access.keys:
        log.info("api_keys_required", open_paths=sorted(access.open_paths))
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={HTTPException: _http_error},
                    middleware=[Middleware(AccessMiddleware, access=access,
                                           shapes={"/v1/messages": anthropic.error_response})])
    app.state.gate = api.gate
    return app


async def _http_error(request: Request, exc: Exception) -> Response:
    # Starlette's own 404 and 405, in OpenAI's shape.
    assert isinstance(exc, HTTPException)
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                    type=kind, headers=exc.headers).response()


class _OpenAI:
    """The endpoints. Owns the scheduler reference and whether the server is shutting down."""

    def __init__(self, scheduler: EngineClient | None, model_name: str | None, limits: ServerSection) -> None:
        self._scheduler = scheduler
        self._model_name = model_name
        self._created = int(time.time())
        self._limits = limits
        self.gate = Gate()
        self.gate.scheduler = scheduler
        self.tokens = Tokenizing(limits.tokenize_threads)
        self._texts: TokenTexts | None = None

    def lifespan(self, config: SchedulerConfig,
                 freeze_heap: bool) -> Callable[[Starlette], AbstractAsyncContextManager[None]]:
        @asynccontextmanager
        async def lifespan(app: Starlette) -> AsyncIterator[None]:
            async with Scheduler(config) as sched:
                self._scheduler = self.gate.scheduler = sched
                if freeze_heap:
                    freeze_startup_heap()
                try:
                    yield
                finally:
                    await self.gate.expire()  # 503 from here on; the one close of the scheduler

        return lifespan

    @property
    def sched(self) -> EngineClient:
        if self._scheduler is None or self.gate.closing:
            raise shutting_down()
        return self._scheduler

    def head(self, rid: str) -> rs.Head:
        if self._texts is None:
            self._texts = TokenTexts(self.sched.model.codec.tokenizer)
        return rs.Head(rid, int(time.time()), self.model_name, self._texts)

    @property
    def model_name(self) -> str:
        return self._model_name or self.sched.model.info.name

    def endpoint(
        self, handler: Handler, kind: str, prompt_field: str = "prompt", shape: Shape | None = None,
    ) -> Callable[[Request], Awaitable[Response]]:
        """Wrap `handler` so every failure becomes an error in its API's shape (OpenAI's unless
        `shape` says otherwise) with its request id."""
        shaped = shape or _openai

        async def endpoint(request: Request) -> Response:
            rid = f"{kind}-{uuid.uuid4().hex}"
            headers = {"x-request-id": rid}
            try:
                return await handler(request, rid)
            except ApiError as exc:
                return shaped(exc, headers)
            except SchedulerError as exc:
                return shaped(from_scheduler(exc, rid, prompt_field=prompt_field), headers)
            except ClientGone:
                log.debug("client_disconnected", request_id=rid)
                return Response(status_code=499, headers=headers)  # nginx's code; only logs see it
            except Exception as exc:  # the HTTP boundary: a bug answers 500, the server keeps serving
                # No traceback: its frames' locals hold the body. Class, frames and sizes only.
                log.error("request_failed", request_id=rid, path=request.url.path,
                          body_bytes=request.headers.get("content-length"),
                          error=type(exc).__name__, where=_where(exc))
                return shaped(internal(rid), headers)

        return endpoint

    # ---- endpoints ----------------------------------------------------------------------------
    async def completions(self, request: Request, rid: str) -> Response:
        req = rq.decode(await read_body(request, self._limits.body_timeout_s), rq.CompletionRequest)
        rq.check_completion(req)
        sched, head = self.sched, self.head(rid)
        vocab = sched.model.info.vocab_size
        job = rq.request(req, rq.completion_prompt(req), req.max_tokens, DEFAULT_MAX_TOKENS, vocab)
        if isinstance(job.prompt, str):  # checked as a Request first, then bounded tokenizing
            ids = await self.tokens.encode(SchedulerPrompts(sched), job.prompt)
            job = msgspec.structs.replace(job, prompt=ids)
        stream = sched.submit(job)
        if req.stream:
            render = rs.CompletionEvents(head, _usage(req), req.n or 1)
            return await event_stream(request, rid, stream, render, req.n or 1)
        return json_response(rs.completion(head, await whole(request, rid, stream)),
                             headers={"x-request-id": rid})

    async def chat(self, request: Request, rid: str) -> Response:
        req = rq.decode(await read_body(request, self._limits.body_timeout_s), rq.ChatRequest)
        rq.check_chat(req)
        sched, head = self.sched, self.head(rid)
        info, prompts = sched.model.info, SchedulerPrompts(sched)
        plan = await plan_chat(req, self.tokens, prompts, info.vocab_size, info.context_length)
        stream = sched.submit(plan.job)
        if req.stream:
            render = rs.ChatEvents(head, _usage(req), req.n or 1, plan.answer)
            return await event_stream(request, rid, stream, render, req.n or 1)
        return json_response(rs.chat_completion(head, await whole(request, rid, stream), plan.answer),
                             headers={"x-request-id": rid})

    async def models(self, request: Request, rid: str) -> Response:
        info = self.sched.model.info
        card = rs.ModelCard(self.model_name, "model", self._created, "mlx-scheduler", info.context_length)
        return json_response(rs.ModelList("list", [card]))

    async def messages(self, request: Request, rid: str) -> Response:
        body = await read_body(request, self._limits.body_timeout_s)
        sched = self.sched
        return await anthropic.messages(request, rid, body, sched, SchedulerPrompts(sched), self.tokens,
                                        self.model_name)

    async def responses(self, request: Request, rid: str) -> Response:
        body = await read_body(request, self._limits.body_timeout_s)
        sched = self.sched
        return await responses_api.respond(request, rid, body, sched, SchedulerPrompts(sched), self.tokens,
                                           self.model_name)

    async def count_tokens(self, request: Request, rid: str) -> Response:
        body = await read_body(request, self._limits.body_timeout_s)
        return await anthropic.count_tokens(body, SchedulerPrompts(self.sched), self.tokens)

    async def tokenize(self, request: Request, rid: str) -> Response:
        body = await read_body(request, self._limits.body_timeout_s)
        return json_response(await tk.tokenize(body, self.tokens, SchedulerPrompts(self.sched)))

    async def detokenize(self, request: Request, rid: str) -> Response:
        body = await read_body(request, self._limits.body_timeout_s)
        sched = self.sched
        return json_response(tk.detokenize(body, SchedulerPrompts(sched), sched.model.info.vocab_size))

    async def health(self, request: Request, rid: str) -> Response:
        sched = self.sched
        return json_response(Health("ok", self.model_name, sched.stats()))

    async def metrics(self, request: Request, rid: str) -> Response:
        sched = self.sched
        return Response(sched.metrics_text(), media_type=PROMETHEUS)


def _usage(req: rq.CompletionRequest | rq.ChatRequest) -> bool:
    return bool(req.stream_options and req.stream_options.include_usage)


def _where(exc: BaseException, depth: int = 8) -> str:
    """The innermost frames as `function (file:line)`: where a bug is, without the message or
    the frames' locals, either of which can hold the request's text."""
    frames = traceback.extract_tb(exc.__traceback__)[-depth:]
    return " <- ".join(f"{f.name} ({Path(f.filename).name}:{f.lineno})" for f in reversed(frames))
