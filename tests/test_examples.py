"""Every example in examples/ runs: the programs as a user runs them (a subprocess each), the
FastAPI app served in-process by uvicorn so the test can be its client."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import httpx
import pytest

from scheduler.serving.http.app import create_app
from tests.scripts import load_script
from tests.test_server import config, uvicorn_serving

if TYPE_CHECKING:
    from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def example_env(cache: Path) -> dict[str, str]:
    path = os.pathsep.join(p for p in [str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH")] if p)
    return {**os.environ, "MLX_SCHEDULER_CACHE": str(cache), "PYTHONPATH": path}


def run_example(name: str, *args: str, cache: Path, timeout: float = 120) -> str:
    proc = subprocess.run([sys.executable, str(EXAMPLES / name), *args], capture_output=True, text=True,
                          timeout=timeout, env=example_env(cache))
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def load(name: str) -> ModuleType:
    return load_script(EXAMPLES / name, name.removesuffix(".py"))


def test_asyncio_example_runs_1000_concurrent_requests(model_cache: Path) -> None:
    out = run_example("asyncio_many.py", cache=model_cache)  # the default: 1,000 requests
    assert "1000 requests, 8000 tokens" in out
    assert "finish reasons: {'length': 1000}" in out
    assert re.search(r"event-loop lag p99 [\d.]+ ms", out)


def test_trio_example_runs(model_cache: Path) -> None:
    out = run_example("trio_program.py", "--requests", "16", cache=model_cache)
    match = re.search(r"(\d+) requests finished with (\d+) tokens; the aborted one got (\d+) tokens", out)
    assert match is not None, out
    assert int(match[1]) == 16 and int(match[2]) > 0 and int(match[3]) < 2000  # cut short


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # uvicorn runs on asyncio only
async def test_fastapi_example_streams_to_its_clients(model_cache: Path) -> None:
    app = load("fastapi_app.py").create_app(config(model_cache))
    texts: dict[int, str] = {}
    with anyio.fail_after(60):
        async with uvicorn_serving(app) as url, httpx.AsyncClient(base_url=url, timeout=30) as client:

            async def one(i: int) -> None:
                body = {"prompt": f"Client {i} asks", "max_tokens": 8, "temperature": 0, "tenant": f"t{i % 3}"}
                async with client.stream("POST", "/generate", json=body) as r:
                    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
                    texts[i] = "".join([t async for t in r.aiter_text()])

            async with anyio.create_task_group() as tg:
                for i in range(8):
                    tg.start_soon(one, i)
            empty = await client.post("/generate", json={"prompt": ""})
            invalid = await client.post("/generate", json={"prompt": "x", "max_tokens": 0})
            long: dict[str, Any] = {"prompt": "Go on", "max_tokens": 1500}
            async with client.stream("POST", "/generate", json=long) as r:
                async for _ in r.aiter_raw():
                    break  # hang up after the first bytes
            while (stats := (await client.get("/stats")).json())["running"] or stats["blocks_used"]:
                await anyio.sleep(0.01)
    assert len(texts) == 8 and all(texts.values())
    assert empty.status_code == 400 and "prompt is empty" in empty.json()["detail"]
    assert invalid.status_code == 422  # FastAPI's own validation of the body model


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_openai_client_example_against_the_server(model_cache: Path) -> None:
    with anyio.fail_after(60):
        async with uvicorn_serving(create_app(config(model_cache))) as url:
            done = await anyio.run_process(
                [sys.executable, str(EXAMPLES / "openai_client.py"), "--base-url", f"{url}/v1"],
                env=example_env(model_cache), check=False,
            )
    assert done.returncode == 0, done.stderr.decode()
    out = done.stdout.decode()
    assert "completion: " in out and re.search(r"\[\d+ prompt \+ \d+ completion tokens\]", out), out


def test_chat_session_example_reuses_the_conversation(model_cache: Path) -> None:
    out = run_example("chat_session.py", "--turns", "4", cache=model_cache)
    assert "session hits: 3 of 3 follow-up turns" in out
    rows = re.findall(r"^\s+\d+\s+\d+\s+[\d.]+ ms\s+[\d.]+ ms\s+(True|False)$", out, re.MULTILINE)
    assert rows == ["True"] * 4, out  # the same replies with and without the session


def test_agent_example_calls_a_tool_and_extracts_json_on_the_real_model() -> None:
    # The real model lives in the user's model cache, as test_real_model's do: no fresh copy.
    env = {**example_env(Path()), "MLX_SCHEDULER_CACHE": os.environ.get("MLX_SCHEDULER_CACHE", "")}
    if not env["MLX_SCHEDULER_CACHE"]:
        del env["MLX_SCHEDULER_CACHE"]
    proc = subprocess.run([sys.executable, str(EXAMPLES / "agent.py")], capture_output=True, text=True,
                          timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    call = re.search(r"^tool call: get_weather\((\{.*\})\)$", proc.stdout, re.MULTILINE)
    assert call is not None and "city" in json.loads(call[1]), proc.stdout
    answer = re.search(r"^answer: (.+)$", proc.stdout, re.MULTILINE)
    assert answer is not None and len(answer[1].split()) >= 3, proc.stdout
    record = re.search(r"^record: (.+)$", proc.stdout, re.MULTILINE)
    assert record is not None
    assert set(json.loads(record[1])) == {"city", "country", "famous_for"}
