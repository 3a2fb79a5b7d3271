"""The cluster's HTTP entry: one Serve deployment that parses OpenAI requests with the same code
as `scheduler.serving.http`, tokenizes (the router needs the prompt's block keys), and streams each
request from the replica our router picks. Every response names its replica in `x-replica`."""

from __future__ import annotations

import asyncio
import functools
import time
import uuid
from typing import TYPE_CHECKING, Any, cast

import anyio
import msgspec
import structlog

from scheduler import errors
from scheduler.admission.kvplan import prompt_keys
from scheduler.request import chat_template_ids
from scheduler.serving.cluster import REPLICA_FAILED, grpc_by_default
from scheduler.serving.cluster.ingress import DirectIngress
from scheduler.serving.cluster.replica import Job, replica_id
from scheduler.serving.cluster.reports import ReplicaReports
from scheduler.serving.cluster.streams import Feeds, FeedStream, RemoteStream
from scheduler.serving.http import anthropic, responses_api
from scheduler.serving.http import requests as rq
from scheduler.serving.http import responses as rs
from scheduler.serving.http import tokens as tk
from scheduler.serving.http.access import Access
from scheduler.serving.http.app import DEFAULT_MAX_TOKENS
from scheduler.serving.http.bodies import read_body
from scheduler.serving.http.chat import plan_chat
from scheduler.serving.http.errors import ApiError, from_scheduler, internal, json_response, not_found
from scheduler.serving.http.errors import shutting_down as closing_error
from scheduler.serving.http.logprobs import TokenTexts
from scheduler.serving.http.prompts import Tokenizing
from scheduler.serving.http.sse import OPENAI, Dialect, EventStream
from scheduler.streaming.gather import Gather

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
    from starlette.requests import Request
    from starlette.responses import Response

    from scheduler.config import SchedulerConfig
    from scheduler.request import Request as GenRequest
    from scheduler.streaming.stream import RequestStream
    from scheduler.types import Chunk

log = structlog.get_logger("scheduler.cluster")
REPLICA_HEADER = "x-replica"
OPENING_TRIES = 3


def replica_failed(replica: str, why: str = "its process died") -> ApiError:
    return ApiError(503, f"replica {replica} failed while serving this request ({why}); "
                    "retry: the other replicas keep serving",
                    type="service_unavailable", code="replica_failed")


def starting() -> ApiError:
    return ApiError(503, "the server is starting: its replicas are loading the model; retry shortly",
                    type="service_unavailable", code="starting", headers={"retry-after": "1"})


class ClusterEventStream(EventStream):
    """`EventStream`, whose error event names the replica when it is the replica that failed."""

    def _failure(self, chunk: Chunk) -> bytes:
        if chunk.request_id == REPLICA_FAILED:
            return self._dialect.error(replica_failed(self.headers.get(REPLICA_HEADER, "unknown")))
        return super()._failure(chunk)


class Frontend:
    """The ingress deployment (`[cluster] frontends` replicas): `__call__` takes the HTTP requests
    Serve's proxy hands this one. The methods besides take `target`, this frontend's id, by which
    `cluster.app` reaches every frontend through our router."""

    def __init__(self, backend: DeploymentHandle, config: SchedulerConfig, model_name: str | None,
                 messages_per_s: float | None = None, listen: tuple[str, int] | None = None) -> None:
        """`messages_per_s`: this frontend's budget of streamed events a second to Serve's proxy
        (default `[cluster] stream_messages_per_s`). `listen`: serve HTTP on this host and port
        too (`[cluster] ingress = "direct"`), where events go as they come, unpaced."""
        self._backend = backend
        self._id = replica_id()
        self._reports = ReplicaReports(backend, self._id)
        # A handle's options travel with it from the process that built the application: the
        # replicas' streams go by value over gRPC where this process's Serve runs gRPC
        # (`cluster.app.start_ray` turns it on), as its own default handles would.
        self._streams = backend.options(stream=True, _by_reference=not grpc_by_default())
        c = config.cluster
        self._feeds = Feeds(self._streams, self._id, messages_per_s or c.stream_messages_per_s,
                            c.stream_interval_s) if c.stream_feed else None
        self._closing = False
        self._inflight = 0
        self._created = int(time.time())
        self._model_name = model_name or config.model.path
        self._body_timeout_s = config.server.body_timeout_s
        self._context = self._block_tokens = 0
        self._codec: Any = None
        self._prompts: FrontendPrompts | None = None
        # The single-process server's bounded tokenizing: refused by length first, long texts
        # and chat templates on a few threads, off this event loop.
        self._tokens = Tokenizing(config.server.tokenize_threads)
        self._access = Access.of(config.server)
        self._vocab = 0
        self._texts: TokenTexts | None = None
        # Up at once, answering 503 until the tokenizer and a replica are ready: no refused or
        # hanging connections while the replicas load the model.
        self._ready = asyncio.get_running_loop().create_task(self._start(config, model_name))
        self._ingress = None if listen is None else DirectIngress(self.__call__, config.server, *listen)

    async def _start(self, config: SchedulerConfig, model_name: str | None) -> None:
        from mlx_lm.utils import load_tokenizer

        from workers.factory import TokenizerCodec
        from workers.loading.models import resolve_model

        path = await anyio.to_thread.run_sync(resolve_model, config.model.path, config.model.cache_dir)
        self._codec = TokenizerCodec(await anyio.to_thread.run_sync(load_tokenizer, path))
        info = await self._backend.info.remote()
        self._context = int(info["context_length"])
        self._block_tokens = int(info["block_tokens"])
        self._vocab = int(info["vocab_size"])
        self._prompts = FrontendPrompts(self._codec, self._context)
        self._model_name = model_name or str(info["name"])

    async def ready(self, target: str | None = None) -> str:
        """Wait until requests are served (`cluster.app.deploy` waits on it): this frontend's id."""
        await asyncio.shield(self._ready)
        return self._id

    def check_health(self) -> None:
        """Serve's health check: a frontend that failed to start is restarted."""
        if self._ready.done() and self._ready.exception() is not None:
            raise RuntimeError(f"the frontend failed to start: {self._ready.exception()!r}")
        if self._ingress is not None and self._ingress.failure is not None:
            raise RuntimeError(f"the frontend's HTTP server failed: {self._ingress.failure!r}")

    async def close(self, target: str | None = None) -> int:
        """503 for new requests from now: how many are in flight."""
        self._closing = True
        return self._inflight

    async def drain(self, timeout: float, target: str | None = None) -> int:
        """503 for new requests from now; wait up to `timeout` for those in flight. Returns how
        many were still running when it gave up."""
        self._closing = True
        deadline = time.monotonic() + timeout
        while self._inflight and time.monotonic() < deadline:  # noqa: ASYNC110 - a count, polled
            await asyncio.sleep(0.05)
        return self._inflight

    async def __call__(self, request: Request) -> Response:
        access = self._access
        preflight = access.preflight(request.method, request.headers)
        if preflight is not None:
            return preflight
        response = await self._answer(request)
        response.headers.update(access.cors(request.headers.get("origin")))
        return response

    async def _answer(self, request: Request) -> Response:
        rid = f"req-{uuid.uuid4().hex}"
        headers = {"x-request-id": rid}
        route = (request.method, request.url.path)
        shape = anthropic.error_response if route[1].startswith("/v1/messages") else _openai
        refusal = self._access.refusal(request.method, route[1], request.headers)
        if refusal is not None:
            return shape(refusal, headers)
        handlers: dict[tuple[str, str], Callable[[Request, str], Any]] = {
            ("POST", "/v1/completions"): self._completions, ("POST", "/v1/chat/completions"): self._chat,
            ("GET", "/v1/models"): self._models, ("GET", "/health"): self._health,
            ("GET", "/metrics"): self._metrics, ("POST", "/tokenize"): self._tokenize,
            ("POST", "/detokenize"): self._detokenize, ("POST", "/v1/messages"): self._messages,
            ("POST", "/v1/messages/count_tokens"): self._count_tokens,
            ("POST", "/v1/responses"): self._responses,
        }
        handler = handlers.get(route)
        fields = {"/v1/chat/completions": "messages", "/v1/messages": "messages",
                  "/v1/messages/count_tokens": "messages", "/v1/responses": "input"}
        prompt_field = fields.get(route[1], "prompt")
        try:
            if handler is None:
                raise not_found(f"{request.method} {request.url.path}: Not Found")
            if self._closing:
                raise closing_error()
            if not self._ready.done() or self._ready.exception() is not None:
                raise starting()
            self._inflight += 1
            try:
                return cast("Response", await handler(request, rid))
            finally:
                self._inflight -= 1
        except ApiError as exc:
            return shape(exc, headers)
        except errors.SchedulerError as exc:
            return shape(from_scheduler(exc, rid, prompt_field=prompt_field), headers)
        except Exception:  # the HTTP boundary: a bug answers 500, the server keeps serving
            log.exception("request_failed", request_id=rid, path=request.url.path)
            return shape(internal(rid), headers)

    # ---- generation ---------------------------------------------------------------------------
    async def _completions(self, request: Request, rid: str) -> Response:
        req = rq.decode(await read_body(request, self._body_timeout_s), rq.CompletionRequest)
        rq.check_completion(req)
        prompt = rq.completion_prompt(req)
        assert self._prompts is not None  # __call__ waited for _start
        ids = await self._tokens.encode(self._prompts, prompt) if isinstance(prompt, str) else list(prompt)
        job = self._job(rq.request(req, ids, req.max_tokens, DEFAULT_MAX_TOKENS))
        render = rs.CompletionEvents(self._head(rid), _usage(req), req.n or 1)
        return await self._run(rid, job, bool(req.stream), render, rs.completion)

    async def _chat(self, request: Request, rid: str) -> Response:
        req = rq.decode(await read_body(request, self._body_timeout_s), rq.ChatRequest)
        rq.check_chat(req)
        assert self._prompts is not None  # __call__ waited for _start
        plan = await plan_chat(req, self._tokens, self._prompts, 0, self._context)
        render = rs.ChatEvents(self._head(rid), _usage(req), req.n or 1, plan.answer)
        return await self._run(rid, self._job(plan.job), bool(req.stream), render,
                               functools.partial(rs.chat_completion, answer=plan.answer))

    async def _messages(self, request: Request, rid: str) -> Response:
        return await self._planned(request, rid, anthropic.plan_message, anthropic.AnthropicDialect())

    async def _count_tokens(self, request: Request, rid: str) -> Response:
        assert self._prompts is not None  # __call__ waited for _start
        body = await read_body(request, self._body_timeout_s)
        return await anthropic.count_tokens(body, self._prompts, self._tokens)

    async def _responses(self, request: Request, rid: str) -> Response:
        dialect = responses_api.ResponsesDialect()
        return await self._planned(request, rid, responses_api.plan_response, dialect)

    async def _planned(
        self, request: Request, rid: str,
        plan: Callable[..., Awaitable[anthropic.MessagePlan | responses_api.ResponsePlan]], dialect: Dialect,
    ) -> Response:
        """A Messages or Responses request, planned as the single server plans it, run on a replica."""
        assert self._prompts is not None  # __call__ waited for _start
        body = await read_body(request, self._body_timeout_s)
        made = await plan(rid, body, self._prompts, self._tokens, self._model_name)
        return await self._run(rid, self._job(made.job), made.stream, made.events, lambda _, g: made.body(g),
                               dialect)

    def _job(self, request: GenRequest) -> Job:
        assert isinstance(request.prompt, list)
        return Job(request, tuple(prompt_keys(request.prompt, self._block_tokens)))

    async def _run(self, rid: str, job: Job, streaming: bool, render: Callable[[Chunk], list[bytes]],
                   whole: Callable[[rs.Head, Gather], Any], dialect: Dialect = OPENAI) -> Response:
        n = job.request.params.n
        stream: FeedStream | RemoteStream
        if self._feeds is not None:
            stream = self._feeds.open(n, paced=streaming and self._ingress is None)
            try:
                fed = msgspec.structs.replace(job, feed=(self._id, stream.key))
                gen, replica = await self._send(rid, fed)
            except BaseException:
                await stream.aclose()
                raise
            self._feeds.attach(stream, replica, gen)
        else:
            gen, replica = await self._send(rid, job)
            stream = RemoteStream(gen, replica, n)
        headers = {"x-request-id": rid, REPLICA_HEADER: replica}
        try:
            first = await stream.__anext__()  # before the 200: a full queue still gets its 429
        except BaseException:
            await stream.aclose()
            raise
        if streaming:
            response = ClusterEventStream(cast("RequestStream", stream), first, render, rid, n, dialect)
            response.headers[REPLICA_HEADER] = replica
            return response
        gathered = Gather()
        gathered.add(first)
        async with stream:
            async for chunk in stream:  # to every choice's final chunk
                gathered.add(chunk)
        for last in gathered.finals():
            if last.finish_reason == "error":
                if last.request_id == REPLICA_FAILED:
                    raise replica_failed(replica)
                log.error("request_failed", request_id=rid, error=last.error)
                raise internal(rid)
            if last.finish_reason == "cancelled":
                raise closing_error()
        return json_response(whole(self._head(rid), gathered), headers=headers)

    async def _send(self, rid: str, job: Job) -> tuple[DeploymentResponseGenerator, str]:
        """The request's `generate` call, and the replica that took it."""
        why = ""
        for attempt in range(OPENING_TRIES):
            # A replica that died before its first word produced nothing: try the survivors.
            gen = self._streams.generate.remote(job)
            try:
                opening = await gen.__anext__()
                return gen, str(opening[1])
            except Exception as exc:
                gen.cancel()
                log.warning("replica_failed", request_id=rid, attempt=attempt, error=repr(exc))
                why = type(exc).__name__
        raise replica_failed("unknown", why)

    def _head(self, rid: str) -> rs.Head:
        if self._texts is None:
            self._texts = TokenTexts(self._codec.tokenizer)
        return rs.Head(rid, int(time.time()), self._model_name, self._texts)

    # ---- the rest -----------------------------------------------------------------------------
    async def _models(self, request: Request, rid: str) -> Response:
        card = rs.ModelCard(self._model_name, "model", self._created, "mlx-scheduler", self._context)
        return json_response(rs.ModelList("list", [card]))

    async def _tokenize(self, request: Request, rid: str) -> Response:
        assert self._prompts is not None  # __call__ waited for _start
        body = await read_body(request, self._body_timeout_s)
        return json_response(await tk.tokenize(body, self._tokens, self._prompts))

    async def _detokenize(self, request: Request, rid: str) -> Response:
        assert self._prompts is not None  # __call__ waited for _start
        body = await read_body(request, self._body_timeout_s)
        return json_response(tk.detokenize(body, self._prompts, self._vocab))

    async def _health(self, request: Request, rid: str) -> Response:
        feeds = self._feeds.stats() if self._feeds is not None else None
        ingress = "proxy" if self._ingress is None else "direct"
        return await self._reports.health(self._model_name, feeds, ingress)

    async def _metrics(self, request: Request, rid: str) -> Response:
        return await self._reports.metrics()


class FrontendPrompts:
    """The frontend's own tokenizer as a `PromptModel` (the replicas hold the model)."""

    def __init__(self, codec: Any, context_length: int) -> None:
        self.tokenizer = codec.tokenizer
        self.context_length = context_length
        self.encode = codec.encode

    def chat(self, messages: list[dict[str, Any]], **template: Any) -> list[int]:
        return chat_template_ids(self.tokenizer, messages, **template)


def _openai(error: ApiError, headers: dict[str, str]) -> Response:
    return error.response(headers)


def _usage(req: rq.CompletionRequest | rq.ChatRequest) -> bool:
    return bool(req.stream_options and req.stream_options.include_usage)
