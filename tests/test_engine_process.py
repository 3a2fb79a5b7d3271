"""`[server] engine_process`: the scheduler in a child process, HTTP in this one (issue 19). The
real engine runs in the child on the tiny model; these tests check that it answers as the
in-process scheduler does, that refusals, cancellations and its own death cross the process
boundary, and that `serve --engine-process` starts and stops with its child."""

from __future__ import annotations

import os
import re
import signal
from typing import TYPE_CHECKING

import anyio
import httpx
import openai
import pytest

from scheduler import SamplingParams, Scheduler, SchedulerConfig
from scheduler.errors import ModelLoadError, QueueFull, SchedulerClosed
from scheduler.http.app import create_app
from scheduler.remote.client import EngineProcess
from tests.serve_process import serve
from tests.test_server import HELLO, config, events

if TYPE_CHECKING:
    from pathlib import Path

pytestmark = pytest.mark.anyio
GREEDY = {"temperature": 0, "ignore_eos": True}


async def idle(engine: EngineProcess) -> dict[str, int]:
    """The engine's stats once nothing runs, waits or holds blocks (at most 10 s)."""
    keys = ("running", "waiting", "engine_batch", "blocks_used")
    with anyio.fail_after(10):
        while True:
            stats = await engine.fetch_stats()
            if not any(getattr(stats, k) for k in keys):
                return {k: getattr(stats, k) for k in (*keys, "finished")}
            await anyio.sleep(0.05)


async def test_the_engine_process_answers_as_the_scheduler_in_process(model_cache: Path) -> None:
    prompt = "Once upon a time there was a"
    body = {"prompt": prompt, "max_tokens": 12, **GREEDY}
    with anyio.fail_after(60):
        async with Scheduler(config(model_cache)) as s:
            direct = await s.complete(prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
        async with EngineProcess(config(model_cache)) as engine:
            transport = httpx.ASGITransport(app=create_app(scheduler=engine))
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
                whole = (await c.post("/v1/completions", json=body)).json()
                streamed = events((await c.post("/v1/completions", json={**body, "stream": True})).text)
                chat = events((await c.post("/v1/chat/completions", json={
                    "messages": [HELLO], "max_tokens": 5, "stream": True, **GREEDY})).text)
                health = (await c.get("/health")).json()
                metrics = (await c.get("/metrics")).text
            after = await idle(engine)
    assert whole["choices"][0]["text"] == direct.text and whole["usage"]["completion_tokens"] == 12
    assert "".join(e["choices"][0]["text"] for e in streamed[:-1]) == direct.text
    assert streamed[-1] == "[DONE]" and streamed[-2]["choices"][0]["finish_reason"] == "length"
    assert chat[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chat[-2]["choices"][0]["finish_reason"] == "length" and chat[-1] == "[DONE]"
    assert health["status"] == "ok" and health["model"] == "synthetic:tiny"
    assert health["stats"]["finished"] == 3  # the engine's own books, read across the socket
    assert "mlx_scheduler_generation_tokens" in metrics
    assert after == {"running": 0, "waiting": 0, "engine_batch": 0, "blocks_used": 0, "finished": 3}


async def test_refusals_and_cancellations_cross_the_process_boundary(model_cache: Path) -> None:
    long = SamplingParams(max_tokens=1500, temperature=0.0, ignore_eos=True)
    cfg = config(model_cache, "[worker]\nmax_batch = 1\n[scheduler]\nmax_queue = 1\n")
    with anyio.fail_after(60):
        async with EngineProcess(cfg) as engine:
            transport = httpx.ASGITransport(app=create_app(scheduler=engine))
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
                too_long = await c.post("/v1/completions", json={"prompt": [1] * 3000, "max_tokens": 2})
            running = engine.generate([5, 6, 7], long)
            first = await running.__anext__()  # admitted: the batch of one is full
            waiting = engine.generate([8, 9], long)
            async with anyio.create_task_group() as tg:
                tg.start_soon(waiting.__anext__)  # queued behind the running one
                with anyio.fail_after(10):
                    while (await engine.fetch_stats()).waiting < 1:
                        await anyio.sleep(0.02)
                with pytest.raises(QueueFull):
                    await engine.generate([10], long).__anext__()
                tg.cancel_scope.cancel()
            await waiting.aclose()
            await running.aclose()  # leaving early cancels it in the engine
            after = await idle(engine)
    assert too_long.status_code == 400
    assert "longer than the model's context" in too_long.json()["error"]["message"]
    assert first.finish_reason is None and first.token_ids
    assert after["finished"] == 2 and after["blocks_used"] == 0  # both cancelled, their blocks back


async def test_a_dead_engine_ends_every_stream_and_refuses_new_requests(model_cache: Path) -> None:
    long = SamplingParams(max_tokens=1500, temperature=0.0, ignore_eos=True)
    with anyio.fail_after(60):
        async with EngineProcess(config(model_cache)) as engine:
            stream = engine.generate([5, 6, 7], long)
            await stream.__anext__()
            assert engine.pid is not None
            os.kill(engine.pid, signal.SIGKILL)
            chunks = [c async for c in stream]
            with pytest.raises(SchedulerClosed, match="failed"):
                engine.generate([5], long)
    assert chunks[-1].finish_reason == "error" and "engine process exited" in (chunks[-1].error or "")


async def test_a_model_that_cannot_load_fails_the_start_with_its_cause(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    engine = EngineProcess(SchedulerConfig.from_toml(f'[model]\npath = "{missing}"\n'))
    with anyio.fail_after(60), pytest.raises(ModelLoadError, match="no-such-model"):
        async with engine:
            pass
    assert engine.pid is not None and engine.returncode is not None  # no child left behind


def test_cli_serve_engine_process_streams_and_stops_with_its_child(model_cache: Path, tmp_path: Path) -> None:
    with serve(model_cache, tmp_path, "", "--engine-process") as srv:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=30)
        with client:
            stream = client.completions.create(model="synthetic:tiny", prompt="Hello", max_tokens=6,
                                               stream=True, extra_body={"ignore_eos": True})
            parts = list(stream)
        health = srv.health()
        srv.proc.send_signal(signal.SIGINT)
        assert srv.proc.wait(timeout=40) == 130
        log = srv.log(wait=5)
    assert parts[-1].choices[0].finish_reason == "length"
    assert health["stats"]["finished"] == 1
    assert "engine_process_started" in log and "Traceback" not in log, log
    assert "engine_process_experimental" in log  # said once, at start
    plain = re.sub(r"\x1b\[[0-9;]*m", "", log)  # the console renderer's colours
    pid = int(re.findall(r"engine_process_started\s+pid=(\d+)", plain)[0])
    with pytest.raises(ProcessLookupError):  # the child exited with the server
        os.kill(pid, 0)

