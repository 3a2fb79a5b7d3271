"""The served path: `usage.prompt_tokens_details.cached_tokens` from prefix blocks and
sessions, in whole and streamed responses, and streams that coalesce what a slow reader has not
taken yet into one write; on the real engine with the tiny model."""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING, Any

import anyio
import msgspec
import pytest

from scheduler import SamplingParams, Scheduler
from scheduler.serving.http.app import create_app
from scheduler.serving.http.sse import OPENAI, NamedEvents, coalesce, named_event
from scheduler.types import Chunk, TokenLogprob
from tests.test_actors import wait_idle
from tests.test_server import completions_scope, config, events, served

if TYPE_CHECKING:
    from pathlib import Path

pytestmark = pytest.mark.anyio
BLOCKS = "[kvpool]\nblock_tokens = 16\nmemory = 8000000\n"


async def test_cached_tokens_count_the_prefix_blocks_a_prompt_reused(model_cache: Path) -> None:
    prompt = list(range(5, 5 + 40))  # two full blocks of 16, and 8 tokens more
    body = {"prompt": prompt, "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with anyio.fail_after(60):
        async with served(model_cache, BLOCKS) as (s, c):
            cold = (await c.post("/v1/completions", json=body)).json()["usage"]
            await wait_idle(s)
            warm = (await c.post("/v1/completions", json=body)).json()["usage"]
            streamed = events((await c.post("/v1/completions", json=stream)).text)[-2]["usage"]
            other = (await c.post("/v1/completions", json={**body, "prompt": [9] * 40})).json()["usage"]
            direct = await s.complete(prompt, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
            hit_tokens = s.stats().prefix_hit_tokens
            await wait_idle(s)
    assert cold["prompt_tokens_details"] == {"cached_tokens": 0}
    assert warm["prompt_tokens_details"] == {"cached_tokens": 32} and warm["prompt_tokens"] == 40
    assert streamed["prompt_tokens_details"] == {"cached_tokens": 32}
    assert other["prompt_tokens_details"] == {"cached_tokens": 0}
    assert direct.cached_tokens == 32 and hit_tokens == 3 * 32


async def test_cached_tokens_count_a_sessions_kv_in_chat(model_cache: Path) -> None:
    greedy = {"max_tokens": 8, "temperature": 0}
    with anyio.fail_after(60):
        async with served(model_cache) as (s, c):
            messages = [{"role": "user", "content": "Say hello " * 20}]
            first = (await c.post("/v1/chat/completions",
                                  json={"messages": messages, "session": "chat-1", **greedy})).json()
            messages.append({"role": "assistant", "content": first["choices"][0]["message"]["content"]})
            messages.append({"role": "user", "content": "And again"})
            ev = events((await c.post("/v1/chat/completions", json={
                "messages": messages, "session": "chat-1", "stream": True,
                "stream_options": {"include_usage": True}, **greedy})).text)
            assert s.stats().session_hits == 1
            await s.drop_session("chat-1")
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    usage = ev[-2]["usage"]
    # The session holds the first turn's prompt and answer: all of it is reused, the new turn is not.
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert first["usage"]["prompt_tokens"] < cached < usage["prompt_tokens"]


def test_coalesce_joins_each_choices_run_and_keeps_its_ending() -> None:
    first = Chunk(3, "He", [1], logprobs=[TokenLogprob(1, -0.5)])
    assert coalesce([first]) == [first]
    last = Chunk(3, "!", [4], finish_reason="length", prompt_tokens=5, completion_tokens=3, cached_tokens=2,
                 logprobs=[TokenLogprob(4, -0.25)])
    other = Chunk(3, "x", [9], index=1)
    merged = coalesce([first, Chunk(3, "llo", [2, 3], logprobs=[TokenLogprob(2, -1.0), TokenLogprob(3, -2.0)]),
                       other, Chunk(3, "y", [8], index=1), last])
    assert merged == [
        Chunk(3, "Hello", [1, 2, 3], logprobs=[TokenLogprob(1, -0.5), TokenLogprob(2, -1.0), TokenLogprob(3, -2.0)]),
        Chunk(3, "xy", [9, 8], index=1),
        last,
    ]
    assert coalesce([last, Chunk(3, "late", [5])])[1].text == "late"  # a final ends its run


def test_a_tokens_unicode_line_breaks_do_not_cut_its_event_in_two() -> None:
    """JSON leaves U+0085, U+2028 and U+2029 unescaped, and readers that split lines the way
    Python's `str.splitlines` does (httpx's `iter_lines`) would end the event's line there."""
    text = "one\u2028two\u0085three\u2029four\nfive"
    payload = msgspec.json.encode({"text": text})
    for framed in (OPENAI.frames([payload, b"[DONE]"]), NamedEvents().frames([named_event("delta", payload)])):
        lines = [line for line in framed.decode().splitlines() if line.startswith("data: ")]
        assert msgspec.json.decode(lines[0][6:])["text"] == text
    plain = msgspec.json.encode({"text": "nothing to escape: \u00e9\u20ac"})
    assert OPENAI.frames([plain]) == b"data: " + plain + b"\n\n"


async def test_a_stream_sends_what_a_slow_reader_missed_in_one_write(model_cache: Path) -> None:
    body = {"prompt": [5, 6, 7], "max_tokens": 12, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    scope = completions_scope()
    with anyio.fail_after(30):
        async with Scheduler(config(model_cache)) as s:
            direct = await s.complete([5, 6, 7], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
            sent: list[dict[str, Any]] = []
            requested = False

            async def receive() -> dict[str, Any]:
                nonlocal requested
                if not requested:
                    requested = True
                    return {"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}
                await anyio.sleep_forever()
                raise AssertionError

            async def send(message: dict[str, Any]) -> None:
                sent.append(message)
                if message.get("body"):  # a reader that takes the first write only once it all ended
                    while s.stats().finished < 2:
                        await anyio.sleep(0.005)

            await create_app(scheduler=s)(scope, receive, send)
            await wait_idle(s)
    bodies = [m for m in sent if m["type"] == "http.response.body"]
    # The first event, then everything else (11 tokens, the ending, usage, [DONE]) in the last write.
    assert len(bodies) == 2 and bodies[-1]["more_body"] is False
    ev = events(b"".join(m["body"] for m in bodies).decode())
    assert ev[-1] == "[DONE]" and ev[-2]["usage"]["completion_tokens"] == 12
    assert ev[-3]["choices"][0]["finish_reason"] == "length"
    assert "".join(e["choices"][0]["text"] for e in ev[:-2]) == direct.text
    assert len(events(bodies[-1]["body"].decode())) == 3


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # a subprocess: once is enough
async def test_the_benchmark_client_drives_our_server_process_like_the_peers(
    tmp_path: Path, model_cache: Path
) -> None:
    # peers.py's `served` backend: `mlx-scheduler serve` in its own process, the peers' client.
    import httpx

    from scheduler.cli.bench.datasets import RequestSpec
    from scheduler.cli.bench.mlxlm import MlxLmServer
    from scheduler.cli.bench.targets import OpenAITarget, Record, Sampling

    toml = tmp_path / "s.toml"
    toml.write_text(f'[model]\npath = "synthetic:tiny"\ncache_dir = "{model_cache}"\n'
                    '[kvpool]\nblock_tokens = 16\n[logging]\nlevel = "warning"\n')
    cmd = [sys.executable, "-m", "scheduler.cli", "serve", "--config", str(toml), "--port", "{port}"]
    spec = RequestSpec(prompt="Once upon a time " * 8, prompt_tokens=0, max_tokens=9)
    records = [Record(0, 9) for _ in range(3)]
    with MlxLmServer(model_cache, command=cmd, log_path=tmp_path / "served.log", start_timeout_s=60) as server:
        async with httpx.AsyncClient(timeout=30) as client:
            target = OpenAITarget(client, server.url)
            for rec in records:
                await target.send(spec, Sampling(temperature=0.0, ignore_eos=True), rec)
            body = {"prompt": spec.prompt, "max_tokens": 2, "ignore_eos": True}
            usage = (await client.post(server.url + "/v1/completions", json=body)).json()["usage"]
    assert all(r.ok and r.output_tokens == 9 and r.finish_reason == "length" for r in records), records
    assert records[0].prompt_tokens == usage["prompt_tokens"] > 16
    assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] // 16 * 16
