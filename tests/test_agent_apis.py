"""The endpoints agents use, through their official clients: Anthropic's Messages API (`anthropic`:
whole and streamed text, system prompts, stop sequences, token counting, errors in its shape) and
OpenAI's Responses API (`openai`: whole and streamed text, instructions, max_output_tokens)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import anthropic
import anyio
import openai
import pytest

from scheduler import SamplingParams, Scheduler
from scheduler.serving.http.app import create_app
from tests.test_server import config, uvicorn_serving

if TYPE_CHECKING:
    from pathlib import Path

pytestmark = [pytest.mark.anyio, pytest.mark.integration]

SYSTEM = "You answer briefly."
ASK = [{"role": "user", "content": "Say hello"}]


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_the_anthropic_client_gets_the_same_text_whole_and_streamed(model_cache: Path) -> None:
    with anyio.fail_after(90):
        async with (Scheduler(config(model_cache, '[server]\napi_keys = ["sk-ant"]\n')) as s,
                    uvicorn_serving(create_app(scheduler=s)) as url):

            def client(key: str) -> anthropic.AsyncAnthropic:
                return anthropic.AsyncAnthropic(base_url=url, api_key=key, max_retries=0, timeout=30)

            async with client("sk-ant") as ours, client("wrong") as other:
                whole = await ours.messages.create(model="m", max_tokens=8, extra_body={"temperature": 0}, system=SYSTEM,
                                                   messages=ASK)  # type: ignore[arg-type]
                async with ours.messages.stream(model="m", max_tokens=8, extra_body={"temperature": 0}, system=SYSTEM,
                                                messages=ASK) as stream:  # type: ignore[arg-type]
                    streamed = "".join([t async for t in stream.text_stream])
                    final = await stream.get_final_message()
                counted = await ours.messages.count_tokens(model="m", system=SYSTEM, messages=ASK)  # type: ignore[arg-type]
                prompt = s.chat_prompt([{"role": "system", "content": SYSTEM}, *ASK])
                direct = await s.complete(prompt, SamplingParams(max_tokens=8, temperature=0.0))
                cut = direct.text[2:5]
                stopped = await ours.messages.create(model="m", max_tokens=8, extra_body={"temperature": 0}, system=SYSTEM,
                                                     messages=ASK, stop_sequences=["zzz", cut])  # type: ignore[arg-type]
                with pytest.raises(anthropic.BadRequestError) as image:
                    await ours.messages.create(model="m", max_tokens=8, messages=[{"role": "user", "content": [
                        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}])
                with pytest.raises(anthropic.AuthenticationError) as denied:
                    await other.messages.create(model="m", max_tokens=8, messages=ASK)  # type: ignore[arg-type]
    assert whole.content[0].type == "text" and whole.content[0].text == direct.text
    assert whole.usage.input_tokens == len(prompt) == counted.input_tokens
    assert whole.usage.output_tokens == direct.completion_tokens
    expected = {"length": "max_tokens", "stop": "end_turn"}[direct.finish_reason]
    assert whole.stop_reason == expected and whole.stop_sequence is None
    assert streamed == whole.content[0].text and final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == cut
    assert stopped.content[0].text == direct.text[:direct.text.index(cut)]
    assert image.value.status_code == 400
    assert image.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    assert "'image' blocks are not supported" in image.value.body["error"]["message"]  # type: ignore[index]
    assert denied.value.status_code == 401 and denied.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_the_openai_responses_api_whole_and_streamed(model_cache: Path) -> None:
    with anyio.fail_after(90):
        async with Scheduler(config(model_cache)) as s, uvicorn_serving(create_app(scheduler=s)) as url:
            async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=30) as client:
                whole = await client.responses.create(model="m", instructions=SYSTEM, input="Say hello",
                                                      max_output_tokens=8, temperature=0)
                stream = await client.responses.create(model="m", instructions=SYSTEM, input="Say hello",
                                                       max_output_tokens=8, temperature=0, stream=True)
                events = [e async for e in stream]
                turns = await client.responses.create(model="m", max_output_tokens=8, temperature=0, input=[
                    {"role": "system", "content": SYSTEM}, {"role": "user", "content": [
                        {"type": "input_text", "text": "Say hello"}]}])
                with pytest.raises(openai.BadRequestError) as stored:
                    await client.responses.create(model="m", input="hi", previous_response_id="resp_1")
            prompt = s.chat_prompt([{"role": "system", "content": SYSTEM}, *ASK])
            direct = await s.complete(prompt, SamplingParams(max_tokens=8, temperature=0.0))
    assert whole.output_text == direct.text == turns.output_text
    assert whole.usage is not None and whole.usage.input_tokens == len(prompt)
    assert whole.usage.output_tokens == direct.completion_tokens
    assert whole.status == ("incomplete" if direct.finish_reason == "length" else "completed")
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-1] == "response.completed" and [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text == events[-1].response.output_text
    assert stored.value.body["param"] == "previous_response_id"  # type: ignore[index]
