"""The OpenAI-compatible server: the app through httpx's ASGI transport (asyncio and trio), a real
uvicorn driven by the official `openai` client, hypercorn on trio, and `mlx-scheduler serve`."""

from __future__ import annotations

import json
import signal
import socket
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import anyio
import httpx
import openai
import pytest
import structlog

from scheduler import SamplingParams, Scheduler, SchedulerConfig
from scheduler.serving.http.app import create_app
from scheduler.types import Chunk
from tests.serve_process import serve
from tests.test_actors import wait_idle

if TYPE_CHECKING:
    from collections.abc import AsyncIterator
    from pathlib import Path

    from starlette.applications import Starlette

pytestmark = pytest.mark.anyio
HELLO = {"role": "user", "content": "Say hello"}


def config(cache: Path, extra: str = "") -> SchedulerConfig:
    return SchedulerConfig.from_toml(f'[model]\npath = "synthetic:tiny"\ncache_dir = "{cache}"\n{extra}')


@asynccontextmanager
async def served(cache: Path, extra: str = "", **app_kw: Any) -> AsyncIterator[tuple[Scheduler, httpx.AsyncClient]]:
    async with Scheduler(config(cache, extra)) as s:
        transport = httpx.ASGITransport(app=create_app(scheduler=s, **app_kw))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            yield s, client


def events(text: str) -> list[Any]:
    """The `data:` payloads of an SSE body, JSON-decoded except the final `[DONE]`."""
    out: list[Any] = []
    for block in text.split("\n\n"):
        if block.strip():
            assert block.startswith("data: "), block
            data = block[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


# ---- the app through the ASGI transport (asyncio and trio) --------------------------------------
async def test_completions_whole_and_streamed_agree(model_cache: Path) -> None:
    body = {"prompt": "Once upon a time", "max_tokens": 7, "temperature": 0, "ignore_eos": True}
    with anyio.fail_after(30):
        async with served(model_cache) as (s, c):
            whole = await c.post("/v1/completions", json=body)
            streamed = await c.post("/v1/completions", json={
                **body, "stream": True, "stream_options": {"include_usage": True}})
            direct = await s.complete("Once upon a time", SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True))
            await wait_idle(s)
    assert whole.status_code == 200 and whole.headers["x-request-id"].startswith("cmpl-")
    w = whole.json()
    assert w["object"] == "text_completion" and w["model"] == "synthetic:tiny" and w["id"] == whole.headers["x-request-id"]
    assert w["choices"] == [{"index": 0, "text": direct.text, "finish_reason": "length", "logprobs": None}]
    assert w["usage"] == {"prompt_tokens": direct.prompt_tokens, "completion_tokens": 7,
                          "total_tokens": direct.prompt_tokens + 7,
                          "prompt_tokens_details": {"cached_tokens": 0}}
    assert streamed.status_code == 200 and streamed.headers["content-type"].startswith("text/event-stream")
    ev = events(streamed.text)
    assert ev[-1] == "[DONE]" and ev[-2]["choices"] == [] and ev[-2]["usage"] == w["usage"]
    chunks = ev[:-2]
    assert "".join(e["choices"][0]["text"] for e in chunks) == direct.text
    assert [e["choices"][0]["finish_reason"] for e in chunks].count("length") == 1
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and "usage" not in chunks[0]


async def test_chat_uses_the_template_and_streams_deltas(model_cache: Path) -> None:
    body = {"messages": [HELLO], "max_tokens": 6, "temperature": 0, "ignore_eos": True, "user": "alice"}
    with anyio.fail_after(30):
        async with served(model_cache, model_name="tiny-chat") as (s, c):
            whole = (await c.post("/v1/chat/completions", json=body)).json()
            ev = events((await c.post("/v1/chat/completions", json={**body, "stream": True})).text)
            ids = s.chat_prompt([HELLO])
            direct = await s.complete(ids, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    assert whole["object"] == "chat.completion" and whole["model"] == "tiny-chat"
    assert whole["choices"][0]["message"] == {"role": "assistant", "content": direct.text}
    assert whole["usage"]["prompt_tokens"] == len(ids)
    assert ev[-1] == "[DONE]" and all(e["object"] == "chat.completion.chunk" for e in ev[:-1])
    deltas = [e["choices"][0]["delta"] for e in ev[:-1]]
    assert deltas[0]["role"] == "assistant" and all("role" not in d for d in deltas[1:])
    assert "".join(d.get("content", "") for d in deltas) == direct.text
    assert ev[-2]["choices"][0]["finish_reason"] == "length" and "usage" not in ev[-2]


async def test_sampling_fields_reach_the_scheduler(model_cache: Path) -> None:
    seeded = {"prompt": [5, 6, 7], "max_tokens": 12, "temperature": 1.0, "top_p": 0.9, "seed": 42, "ignore_eos": True}
    with anyio.fail_after(30):
        async with served(model_cache) as (s, c):
            a = (await c.post("/v1/completions", json=seeded)).json()["choices"][0]["text"]
            b = (await c.post("/v1/completions", json=seeded)).json()["choices"][0]["text"]
            greedy = {"prompt": [5, 6, 7], "max_tokens": 30, "temperature": 0, "ignore_eos": True}
            full = (await c.post("/v1/completions", json=greedy)).json()["choices"][0]["text"]
            stop = full[len(full) // 2: len(full) // 2 + 3]
            cut = (await c.post("/v1/completions", json={**greedy, "stop": stop})).json()["choices"][0]
            default = (await c.post("/v1/completions", json={"prompt": "Hi", "ignore_eos": True})).json()
            await wait_idle(s)
    assert a == b
    assert cut == {"index": 0, "text": full[: full.find(stop)], "finish_reason": "stop", "logprobs": None}
    assert default["usage"]["completion_tokens"] == 16  # OpenAI's default for /v1/completions


async def test_a_chat_session_continues_the_conversations_kv(model_cache: Path) -> None:
    greedy = {"max_tokens": 8, "temperature": 0}
    with anyio.fail_after(60):
        async with served(model_cache) as (s, client):
            messages = [{"role": "user", "content": "Say hello " * 20}]
            first = await client.post("/v1/chat/completions",
                                      json={"messages": messages, "session": "chat-9", **greedy})
            assert first.status_code == 200, first.text
            messages.append({"role": "assistant", "content": first.json()["choices"][0]["message"]["content"]})
            messages.append({"role": "user", "content": "And again"})
            second = await client.post("/v1/chat/completions",
                                       json={"messages": messages, "session": "chat-9", **greedy})
            assert second.status_code == 200, second.text
            assert s.stats().session_hits == 1
            bad = await client.post("/v1/chat/completions", json={"messages": messages, "session": ""})
            assert bad.status_code == 400 and "session" in bad.text
            assert await s.drop_session("chat-9") is True


async def test_models_health_and_metrics(model_cache: Path) -> None:
    with anyio.fail_after(30):
        async with served(model_cache) as (s, c):
            models = (await c.get("/v1/models")).json()
            health = await c.get("/health")
            metrics = await c.get("/metrics")
    assert [m["id"] for m in models["data"]] == ["synthetic:tiny"] and models["object"] == "list"
    assert models["data"][0]["max_model_len"] == 2048
    assert health.status_code == 200 and health.json()["status"] == "ok"
    assert {"running": 0, "waiting": 0, "engine_batch": 0, "blocks_used": 0}.items() <= health.json()["stats"].items()
    assert metrics.status_code == 200 and metrics.headers["content-type"].startswith("text/plain; version=0.0.4")
    assert "# TYPE " in metrics.text


BAD_COMPLETIONS = [
    ({"prompt": "x", "n": 17}, "n", "n must be an integer in [1, 16]"),
    ({"prompt": "x", "n": 0}, "n", "n must be an integer"),
    ({"prompt": "x", "temperature": -0.5}, "temperature", "temperature must be >= 0"),
    ({"prompt": "x", "top_p": 0}, "top_p", "top_p must be in (0, 1]"),
    ({"prompt": "x", "top_p": 1.5}, "top_p", "top_p"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens", "max_tokens must be >= 1"),
    ({"prompt": "x", "max_tokens": "many"}, "max_tokens", "max_tokens: expected `int"),
    ({"prompt": "x", "seed": -1}, "seed", "seed must be"),
    ({"prompt": "x", "stop": 3}, "stop", "stop: expected"),
    ({"prompt": "x", "stop": ["ok", ""]}, "stop", "each stop string"),
    ({"prompt": "x", "top_k": -1}, "top_k", "top_k must be"),
    ({"prompt": "x", "logprobs": 21}, "top_logprobs", "top_logprobs must be an integer in [0, 20]"),
    ({"prompt": "x", "presence_penalty": 2.5}, "presence_penalty", "presence_penalty must be a number in [-2, 2]"),
    ({"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias", "logit_bias entries must be"),
    ({"prompt": "x", "repetition_penalty": -1}, "repetition_penalty", "repetition_penalty must be"),
    ({"prompt": "x", "user": "u" * 300}, "user", "user must have at most 256"),
    ({"prompt": "x", "priority": "high"}, "priority", "priority: expected `int`"),
    ({}, "prompt", "prompt is required"),
    ({"prompt": ""}, "prompt", "prompt is empty"),
    ({"prompt": ["a", "b"]}, "prompt", "batch of 2 prompts"),
    ({"prompt": [1] * 5000}, "prompt", "longer than the model's context"),
    ({"prompt": [1, 99999]}, "prompt", "is not a token id"),
    ({"prompt": "x", "max_tokens": 4000}, "prompt", "exceeds the model's context"),
]
BAD_CHATS = [
    ({"messages": []}, "messages", "messages must not be empty"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages", "only text parts"),
    ({"messages": [HELLO], "tools": [{"type": "function"}]}, "tools", "tools[0]: Object missing required field `function`"),
    ({"messages": [HELLO], "tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice", "names the function 'g'"),
    ({"messages": [HELLO], "max_completion_tokens": 0}, "max_tokens", "max_tokens must be >= 1"),
    ({"messages": [HELLO], "response_format": {"type": "yaml"}}, "response_format", "response_format.type must be"),
    ({"messages": [HELLO], "response_format": {"type": "json_schema"}}, "response_format", "schema is required"),
    ({"messages": "hi"}, "messages", "messages: expected `array`"),
]


async def test_invalid_requests_are_400_naming_the_field(model_cache: Path) -> None:
    with anyio.fail_after(30):
        async with served(model_cache) as (s, c):
            cases = [("/v1/completions", *b) for b in BAD_COMPLETIONS] + [("/v1/chat/completions", *b) for b in BAD_CHATS]
            for path, body, param, message in cases:
                for stream in (False, True):
                    r = await c.post(path, json={**body, "stream": stream})
                    assert r.status_code == 400, (body, r.text)
                    error = r.json()["error"]
                    assert error["type"] == "invalid_request_error" and error["param"] == param, (body, error)
                    assert message in error["message"], (body, error)
            junk = await c.post("/v1/completions", content=b"{not json")
            assert junk.status_code == 400 and "not valid JSON" in junk.json()["error"]["message"]
            assert (await c.get("/v1/nothing")).json()["error"]["type"] == "not_found_error"
            assert (await c.get("/v1/completions")).status_code == 405
            ok = await c.post("/v1/completions", json={"prompt": "still serving", "max_tokens": 3})
            assert ok.status_code == 200
            await wait_idle(s)


async def _consume(s: Scheduler, prompt: list[int]) -> None:
    await s.complete(prompt, SamplingParams(max_tokens=2000, ignore_eos=True))


async def test_queue_full_is_429_with_retry_after(model_cache: Path) -> None:
    with anyio.fail_after(30):
        async with served(model_cache, "[worker]\nmax_batch = 1\n[scheduler]\nmax_queue = 1") as (s, c):
            async with anyio.create_task_group() as tg:
                tg.start_soon(_consume, s, [5, 6, 7])
                tg.start_soon(_consume, s, [8, 9, 10])
                while s.stats().running < 1 or s.stats().waiting < 1:
                    await anyio.sleep(0.005)
                for stream in (False, True):
                    r = await c.post("/v1/completions", json={"prompt": "x", "stream": stream})
                    assert r.status_code == 429 and r.headers["retry-after"] == "1"
                    assert r.json()["error"]["code"] == "queue_full"
                tg.cancel_scope.cancel()
            await wait_idle(s)


async def test_shutting_down_is_503_before_and_during_a_request(model_cache: Path) -> None:
    long = {"prompt": [5, 6, 7], "max_tokens": 1500, "ignore_eos": True}
    answers: dict[str, httpx.Response] = {}
    release, closed = anyio.Event(), anyio.Event()

    async def own(*, task_status: anyio.abc.TaskStatus[Scheduler]) -> None:
        # The scheduler lives in a task of its own, as in a lifespan; leaving `async with` closes it.
        async with Scheduler(config(model_cache)) as s:
            task_status.started(s)
            await release.wait()
        closed.set()

    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            s = await tg.start(own)
            transport = httpx.ASGITransport(app=create_app(scheduler=s))
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:

                async def ask(name: str, body: dict[str, Any]) -> None:
                    answers[name] = await c.post("/v1/completions", json=body)

                async with anyio.create_task_group() as asks:
                    asks.start_soon(ask, "whole", long)
                    asks.start_soon(ask, "stream", {**long, "stream": True})
                    while s.stats().engine_batch < 2:
                        await anyio.sleep(0.005)
                    release.set()
                await closed.wait()
                after = await c.post("/v1/chat/completions", json={"messages": [HELLO], "stream": True})
    assert answers["whole"].status_code == 503
    assert answers["whole"].json()["error"]["code"] == "shutting_down"
    ev = events(answers["stream"].text)  # the 200 had gone out: an error event, then [DONE]
    assert ev[-1] == "[DONE]" and ev[-2]["error"]["code"] == "shutting_down"
    assert after.status_code == 503 and after.json()["error"]["type"] == "service_unavailable"


class FailingStream:
    """Stands in for a RequestStream whose request failed inside the engine."""

    def __init__(self) -> None:
        self.chunks = [Chunk(0, "partial", [1]), Chunk(0, "", [], finish_reason="error", error="boom")]

    async def __anext__(self) -> Chunk:
        if not self.chunks:
            raise StopAsyncIteration
        return self.chunks.pop(0)

    def ready(self) -> list[Chunk]:  # both chunks were delivered at once
        ready, self.chunks = self.chunks, []
        return ready

    def __aiter__(self) -> FailingStream:
        return self

    async def aclose(self) -> None:
        pass

    async def __aenter__(self) -> FailingStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        pass


async def test_internal_failures_are_500_with_a_request_id(model_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with anyio.fail_after(30):
        async with served(model_cache) as (s, c):
            monkeypatch.setattr(s.model.codec.tokenizer, "apply_chat_template", lambda *a, **k: 1 / 0)
            with structlog.testing.capture_logs() as logs:
                crashed = await c.post("/v1/chat/completions", json={"messages": [HELLO]})
            monkeypatch.setattr(s, "submit", lambda *a, **k: FailingStream())
            failed = await c.post("/v1/completions", json={"prompt": "x"})
            failed_stream = await c.post("/v1/completions", json={"prompt": "x", "stream": True})
    rid = crashed.headers["x-request-id"]
    assert crashed.status_code == 500 and rid in crashed.json()["error"]["message"]
    assert any(e["event"] == "request_failed" and e["request_id"] == rid for e in logs)
    failure = next(e for e in logs if e["event"] == "request_failed")  # class and frames, no locals
    assert failure["error"] == "ZeroDivisionError" and "<lambda>" in failure["where"] and "exc_info" not in failure
    assert failed.status_code == 500 and failed.json()["error"]["type"] == "server_error"
    ev = events(failed_stream.text)
    assert ev[0]["choices"][0]["text"] == "partial" and ev[1]["error"]["code"] == "internal_error"
    assert failed_stream.headers["x-request-id"] in ev[1]["error"]["message"] and ev[2] == "[DONE]"


def completions_scope() -> dict[str, Any]:
    """A fresh ASGI scope for POST /v1/completions, for tests that drive the app by hand (the app
    adds its own keys to the scope it is given)."""
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
            "method": "POST", "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
            "query_string": b"", "root_path": "", "headers": [(b"content-type", b"application/json")],
            "client": ("127.0.0.1", 5000), "server": ("test", 80)}


async def test_client_disconnect_mid_stream_aborts_within_one_step(model_cache: Path) -> None:
    body = json.dumps({"prompt": [5, 6, 7], "max_tokens": 1500, "ignore_eos": True, "stream": True}).encode()
    scope = completions_scope()
    with anyio.fail_after(30):
        async with Scheduler(config(model_cache)) as s:
            app = create_app(scheduler=s)
            gone = anyio.Event()
            sent: list[dict[str, Any]] = []
            requested = False
            at_disconnect: dict[str, int] = {}

            async def receive() -> dict[str, Any]:
                nonlocal requested
                if not requested:
                    requested = True
                    return {"type": "http.request", "body": body, "more_body": False}
                await gone.wait()
                return {"type": "http.disconnect"}

            async def send(message: dict[str, Any]) -> None:
                sent.append(message)
                if len([m for m in sent if m.get("body")]) == 3 and not gone.is_set():
                    stats = s.stats()
                    assert stats.engine_batch == 1 and stats.blocks_used > 0
                    at_disconnect["steps"] = stats.steps
                    gone.set()

            await app(scope, receive, send)  # returns once the disconnect has cancelled the stream
            await wait_idle(s)
            assert s.stats().steps - at_disconnect["steps"] <= 2
            assert b"[DONE]" not in b"".join(m.get("body", b"") for m in sent)


# ---- real servers on loopback -------------------------------------------------------------------
@asynccontextmanager
async def uvicorn_serving(app: Starlette) -> AsyncIterator[str]:
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
    async with anyio.create_task_group() as tg:
        tg.start_soon(server.serve, [sock])
        while not server.started:
            await anyio.sleep(0.01)
        try:
            yield f"http://127.0.0.1:{sock.getsockname()[1]}"
        finally:
            server.should_exit = True


# uvicorn runs only on asyncio; trio gets hypercorn (below).
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_openai_client_against_uvicorn(model_cache: Path) -> None:
    greedy: dict[str, Any] = {"model": "synthetic:tiny", "max_tokens": 6, "temperature": 0,
                              "extra_body": {"ignore_eos": True}}
    with anyio.fail_after(60):
        async with uvicorn_serving(create_app(config(model_cache))) as url:
            client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
            async with client:
                models = await client.models.list()
                whole = await client.completions.create(prompt="Once upon a time", **greedy)
                stream = await client.completions.create(prompt="Once upon a time", stream=True, **greedy)
                streamed = [c.choices[0].text async for c in stream]
                chat = await client.chat.completions.create(messages=[HELLO], **greedy)
                chunks = [c async for c in await client.chat.completions.create(
                    messages=[HELLO], stream=True, stream_options={"include_usage": True}, **greedy)]
                three = {"model": "synthetic:tiny", "n": 3, "max_tokens": 5, "seed": 11, "temperature": 1.0,
                         "extra_body": {"ignore_eos": True}}
                many = await client.completions.create(prompt="Once upon a time", **three)
                many_streamed = [c async for c in await client.completions.create(
                    prompt="Once upon a time", stream=True, stream_options={"include_usage": True}, **three)]
                many_chat = await client.chat.completions.create(messages=[HELLO], **three)
                with pytest.raises(openai.BadRequestError, match="n must be an integer"):
                    await client.completions.create(prompt="x", n=17, model="synthetic:tiny")
    assert [m.id for m in models.data] == ["synthetic:tiny"]
    assert whole.choices[0].finish_reason == "length" and whole.usage is not None and whole.usage.completion_tokens == 6
    assert "".join(streamed) == whole.choices[0].text
    assert chat.choices[0].message.role == "assistant" and chat.usage is not None
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == chat.choices[0].message.content
    assert chunks[-1].usage is not None and chunks[-1].usage.total_tokens == chat.usage.total_tokens
    # n = 3: three choices, each its own seed, the same whether streamed or not
    assert [c.index for c in many.choices] == [0, 1, 2] and many.usage is not None
    assert many.usage.completion_tokens == 15 and len({c.text for c in many.choices}) > 1
    by_index: dict[int, str] = {}
    for event in many_streamed:
        for c in event.choices:
            by_index[c.index] = by_index.get(c.index, "") + c.text
    assert by_index == {c.index: c.text for c in many.choices}
    assert sum(1 for e in many_streamed for c in e.choices if c.finish_reason) == 3
    assert many_streamed[-1].usage is not None and many_streamed[-1].usage.completion_tokens == 15
    assert [c.index for c in many_chat.choices] == [0, 1, 2]
    assert all(c.message.role == "assistant" and c.finish_reason == "length" for c in many_chat.choices)


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_socket_disconnect_under_uvicorn_frees_the_request(model_cache: Path) -> None:
    body = {"prompt": [5, 6, 7], "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with anyio.fail_after(30):
        async with Scheduler(config(model_cache)) as s, uvicorn_serving(create_app(scheduler=s)) as url:
            async with httpx.AsyncClient() as client, client.stream("POST", f"{url}/v1/completions", json=body) as r:
                assert r.status_code == 200
                seen = 0
                async for line in r.aiter_lines():
                    seen += line.startswith("data: ")
                    if seen == 3:
                        assert s.stats().engine_batch == 1
                        break
            with anyio.fail_after(2):
                await wait_idle(s)
            # A client that gives up on a whole (non-streamed) answer aborts it too.
            async with httpx.AsyncClient(timeout=0.5) as client:
                with pytest.raises(httpx.ReadTimeout):
                    await client.post(f"{url}/v1/completions", json={**body, "stream": False})
            with anyio.fail_after(2):
                await wait_idle(s)
            assert s.stats().generated_tokens < 1500


@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_hypercorn_on_trio_serves_the_app(model_cache: Path) -> None:
    from hypercorn.config import Config
    from hypercorn.trio import serve

    hc = Config()
    hc.bind = ["127.0.0.1:0"]
    hc.accesslog = None
    stop = anyio.Event()
    body = {"messages": [HELLO], "max_tokens": 5, "stream": True, "ignore_eos": True}
    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            binds = await tg.start(lambda task_status: serve(
                create_app(config(model_cache)), hc, shutdown_trigger=stop.wait, task_status=task_status))
            async with httpx.AsyncClient(base_url=binds[0]) as client:
                health = await client.get("/health")
                ev = events((await client.post("/v1/chat/completions", json=body)).text)
            stop.set()
    assert health.status_code == 200
    assert ev[-1] == "[DONE]" and ev[-2]["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize(("sigint_ignored", "server"), [(False, ()), (True, ()), (True, ("--trio",))],
                         ids=["sigint-default", "sigint-ignored-at-start", "trio-sigint-ignored-at-start"])
def test_cli_serve_streams_to_the_openai_client_and_stops_on_sigint(
        model_cache: Path, tmp_path: Path, sigint_ignored: bool, server: tuple[str, ...]) -> None:
    with serve(model_cache, tmp_path, "", *server, sigint_ignored=sigint_ignored) as srv:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=30)
        with client:
            stream = client.chat.completions.create(
                model="synthetic:tiny", messages=[HELLO], max_tokens=8, stream=True,
                extra_body={"ignore_eos": True})
            deltas = [c.choices[0] for c in stream]
        assert deltas[0].delta.role == "assistant" and deltas[-1].finish_reason == "length"
        srv.proc.send_signal(signal.SIGINT)
        assert srv.proc.wait(timeout=30) == 130  # SIGINT raised again once it has shut down
        log = srv.log(wait=5)  # to the end of its stderr: the process has exited
    assert "Traceback" not in log, log
    assert "scheduler_closed" in log, log  # the lifespan closed it


def test_the_removed_engine_process_option_is_said_once_and_serving_goes_on_in_process(
    model_cache: Path, tmp_path: Path
) -> None:
    with serve(model_cache, tmp_path, "[server]\nengine_process = true\n", "--engine-process") as srv:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=30)
        with client:
            done = client.completions.create(model="synthetic:tiny", prompt="hello", max_tokens=4,
                                             extra_body={"ignore_eos": True})
        assert done.usage is not None and done.usage.completion_tokens == 4
        health = srv.health()
        log = srv.log(wait=1)
    assert health["stats"]["finished"] == 1  # the scheduler answering /health is the one that served
    assert log.count("engine_process_removed") == 1, log
    assert "deprecated and ignored" in log and "engine_process_started" not in log
