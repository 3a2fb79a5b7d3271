"""The served path (issue 19): `usage.prompt_tokens_details.cached_tokens` from prefix blocks and
sessions, in whole and streamed responses, on the real engine with the tiny model."""

from __future__ import annotations

from typing import TYPE_CHECKING

import anyio
import pytest

from scheduler import SamplingParams
from tests.test_actors import wait_idle
from tests.test_server import events, served

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
