"""Tool calling: tools shown to the real SmolLM2 (its template has no place for them, so in a
system message), calls forced by `tool_choice` held to the function's schema, and parsed back
into OpenAI's `tool_calls`, whole and streamed, through the official `openai` client; the
output splitter and parsers on their own."""

from __future__ import annotations

import json
from typing import Any

import anyio
import jsonschema
import openai
import pytest
from mlx_lm.tool_parsers import json_tools, qwen3_coder

from scheduler import SamplingParams, Scheduler
from scheduler.chat import Markers, ToolCalling
from scheduler.chat.split import Splitter, split_all
from scheduler.errors import InvalidRequest
from scheduler.serving.http.app import create_app
from tests.test_real_model import real_config
from tests.test_server import uvicorn_serving
from workers.loading.named import DEFAULT_MODEL

pytestmark = pytest.mark.anyio

WEATHER: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 40},
                   "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city"],
}
TIMEZONE: dict[str, Any] = {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 40}},
                            "required": ["timezone"]}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather", "description": "Get the current weather in a city",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "Get the time in a timezone",
                                      "parameters": TIMEZONE}},
]
ASK: Any = [{"role": "user", "content": "What is the weather like in Paris?"}]


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_forced_calls_through_the_python_api_name_a_tool_with_valid_arguments() -> None:
    with anyio.fail_after(120):
        async with Scheduler(real_config()) as s:
            replies = {}
            for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
                calling = s.tool_calling(TOOLS, choice)
                c = await s.complete(s.chat_prompt(ASK, tools=calling),
                                     SamplingParams(max_tokens=96, temperature=0, grammar=calling.grammar()))
                replies[str(choice)] = (c, calling.reply(c.text))
    (c, required), (_, named) = replies.values()
    assert c.finish_reason == "stop" and required.content == ""
    [call] = required.tool_calls
    schema = WEATHER if call.name == "get_weather" else TIMEZONE
    jsonschema.validate(json.loads(call.arguments), {**schema, "additionalProperties": False})
    [call] = named.tool_calls
    assert call.name == "get_time" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), {**TIMEZONE, "additionalProperties": False})


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_the_openai_client_gets_tool_calls_whole_and_streamed_and_sends_results_back() -> None:
    with anyio.fail_after(180):
        async with Scheduler(real_config()) as s, uvicorn_serving(create_app(scheduler=s)) as url:
            client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
            async with client:
                whole = await client.chat.completions.create(
                    model=DEFAULT_MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                    max_tokens=96, temperature=0)
                stream = await client.chat.completions.create(
                    model=DEFAULT_MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                    max_tokens=96, temperature=0, stream=True)
                deltas, finishes = [], []
                async for chunk in stream:
                    for choice in chunk.choices:
                        deltas.append(choice.delta)
                        finishes.append(choice.finish_reason)
                call = whole.choices[0].message.tool_calls[0]  # type: ignore[index]
                follow = [*ASK, whole.choices[0].message.model_dump(exclude_none=True),
                          {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 18, "sky": "clear"}'}]
                answer = await client.chat.completions.create(
                    model=DEFAULT_MODEL, messages=follow, tools=TOOLS, max_tokens=40, temperature=0)
                plain = await client.chat.completions.create(
                    model=DEFAULT_MODEL, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=24,
                    temperature=0)
                with pytest.raises(openai.BadRequestError) as bad:
                    await client.chat.completions.create(
                        model=DEFAULT_MODEL, messages=ASK, tools=[{"type": "function", "function": {"name": "a b"}}],
                        max_tokens=8)
    message = whole.choices[0].message
    assert whole.choices[0].finish_reason == "tool_calls" and message.content is None
    assert call.type == "function" and call.function.name in ("get_weather", "get_time")
    assert isinstance(json.loads(call.function.arguments), dict)
    streamed = [tc for d in deltas for tc in (d.tool_calls or [])]
    assert len(streamed) == 1 and streamed[0].index == 0
    assert (streamed[0].function.name, streamed[0].function.arguments) == (call.function.name, call.function.arguments)
    assert deltas[0].role == "assistant" and finishes[-1] == "tool_calls"
    assert not any(d.content for d in deltas)
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls
    assert plain.choices[0].message.content and plain.choices[0].finish_reason in ("stop", "length")
    assert bad.value.status_code == 400 and bad.value.body["param"] == "tools"  # type: ignore[index]


def test_the_splitter_holds_markers_cut_across_chunks() -> None:
    markers = Markers(tool=("<tool_call>", "</tool_call>"), think=("<think>", "</think>"))
    text = 'Let me see.<think>cities...</think>Sure.<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    whole = split_all(text, markers)
    assert whole == [("content", "Let me see."), ("reasoning", "cities..."), ("content", "Sure."),
                     ("tool_call", '\n{"name": "f", "arguments": {}}\n')]
    for size in (1, 2, 3, 5, 7):  # every cut gives the same parts, and no marker leaks out
        s = Splitter(markers)
        parts = [p for i in range(0, len(text), size) for p in s.feed(text[i:i + size])] + s.close()
        joined: list[tuple[str, str]] = []
        for kind, piece in parts:
            if joined and joined[-1][0] == kind and kind != "tool_call":
                joined[-1] = (kind, joined[-1][1] + piece)
            else:
                joined.append((kind, piece))
        assert joined == whole, size
    assert split_all("<think>still thinking", markers, reasoning_first=False) == [("reasoning", "still thinking")]
    assert split_all("x</think>y", markers, reasoning_first=True) == [("reasoning", "x"), ("content", "y")]
    assert split_all("a < b <tool", markers) == [("content", "a < b <tool")]


class _Tokenizer:
    """mlx-lm's tokenizer attributes for a model whose template takes tools (a fake: what
    ToolCalling reads of the real `TokenizerWrapper`)."""

    def __init__(self, parser: Any) -> None:
        self.has_tool_calling, self.has_thinking = True, False
        self.tool_parser = parser.parse_tool_call
        self.tool_call_start, self.tool_call_end = parser.tool_call_start, parser.tool_call_end


def test_a_models_own_parser_reads_its_calls_and_bad_calls_stay_as_text() -> None:
    calling = ToolCalling(_Tokenizer(qwen3_coder), TOOLS, "auto")
    text = ("Checking.<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
            "</function>\n</tool_call>")
    reply = calling.reply(text)
    assert reply.content == "Checking."
    [call] = reply.tool_calls
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    shown, template = calling.messages(ASK)
    assert shown == ASK and [t["function"]["name"] for t in template["tools"]] == ["get_weather", "get_time"]
    with pytest.raises(InvalidRequest, match="tool_choice 'required' needs a tool-call format"):
        ToolCalling(_Tokenizer(qwen3_coder), TOOLS, "required")
    json_model = ToolCalling(_Tokenizer(json_tools), TOOLS, "required")
    assert json_model.in_template and json_model.grammar() is not None
    broken = json_model.reply('<tool_call>{"name": "get_time", "argu')
    assert broken.tool_calls == [] and broken.content == '<tool_call>{"name": "get_time", "argu</tool_call>'


@pytest.mark.parametrize(("tools", "choice", "message"), [
    ("nope", None, "tools must be a list"),
    ([{"type": "retrieval", "function": {"name": "f"}}], None, "tools[0].type must be 'function'"),
    ([TOOLS[0], TOOLS[0]], None, "is given twice"),
    (TOOLS, "sometimes", "tool_choice must be"),
    ([], "required", "tool_choice 'required' needs tools"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "objectx"}}}], "required",
     "tools: a function's parameters cannot be compiled"),
])
def test_bad_tools_and_choices_are_refused_naming_them(tools: Any, choice: Any, message: str) -> None:
    with pytest.raises(InvalidRequest, match=message.replace("[", r"\[").replace("]", r"\]")):
        ToolCalling(_Tokenizer(json_tools), tools, choice).grammar()


def test_earlier_calls_and_results_are_written_out_for_a_template_without_tools() -> None:
    calling = ToolCalling(object(), TOOLS, "auto")
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18C"}]
    shown, template = calling.messages(history)
    assert template == {} and shown[0]["role"] == "system" and "get_weather" in shown[0]["content"]
    assert shown[2] == {"role": "assistant",
                        "content": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'}
    assert shown[3] == {"role": "user", "content": "<tool_response>\n18C\n</tool_response>"}


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_anthropic_tool_use_and_responses_function_calls_with_the_official_clients() -> None:
    import anthropic

    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"]} for t in TOOLS]
    functions = [{"type": "function", **t["function"]} for t in TOOLS]
    with anyio.fail_after(240):
        async with Scheduler(real_config()) as s, uvicorn_serving(create_app(scheduler=s)) as url:
            claude = anthropic.AsyncAnthropic(base_url=url, api_key="unused", max_retries=0, timeout=60)
            used = await claude.messages.create(model="m", max_tokens=96, messages=ASK, tools=tools,  # type: ignore[arg-type]
                                                tool_choice={"type": "any"}, extra_body={"temperature": 0})
            async with claude.messages.stream(model="m", max_tokens=96, messages=ASK, tools=tools,  # type: ignore[arg-type]
                                              tool_choice={"type": "tool", "name": "get_time"},
                                              extra_body={"temperature": 0}) as stream:
                streamed = await stream.get_final_message()
            block = next(b for b in used.content if b.type == "tool_use")
            result = await claude.messages.create(model="m", max_tokens=32, tools=tools, messages=[  # type: ignore[arg-type]
                *ASK, {"role": "assistant", "content": used.content},  # type: ignore[list-item]
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": block.id, "content": "18C"}]}],
                extra_body={"temperature": 0})
            await claude.close()  # on this loop: left to the collector, it closes on a later test's
            async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60) as client:
                called = await client.responses.create(model="m", input="What time is it in Tokyo?", tools=functions,  # type: ignore[arg-type]
                                                       tool_choice="required", max_output_tokens=96, temperature=0)
                events = [e async for e in await client.responses.create(
                    model="m", input="What time is it in Tokyo?", tools=functions, tool_choice="required",  # type: ignore[arg-type]
                    max_output_tokens=96, temperature=0, stream=True)]
                call = called.output[0]
                answered = await client.responses.create(model="m", tools=functions, max_output_tokens=32,  # type: ignore[arg-type]
                                                         temperature=0, input=[
                    {"role": "user", "content": "What time is it in Tokyo?"}, call.model_dump(exclude_none=True),  # type: ignore[list-item]
                    {"type": "function_call_output", "call_id": call.call_id, "output": "09:30"}])  # type: ignore[attr-defined]
                typed = await client.responses.create(
                    model="m", input="Describe a person as JSON.", max_output_tokens=96, temperature=0,
                    text={"format": {"type": "json_schema", "name": "person", "strict": True, "schema": {
                        "type": "object", "properties": {"name": {"type": "string", "maxLength": 20}},
                        "required": ["name"], "additionalProperties": False}}})
    assert used.stop_reason == "tool_use" and block.name in ("get_weather", "get_time")
    assert block.id.startswith("toolu_") and isinstance(block.input, dict)
    [tool_block] = [b for b in streamed.content if b.type == "tool_use"]
    assert streamed.stop_reason == "tool_use" and tool_block.name == "get_time"
    jsonschema.validate(tool_block.input, {**TIMEZONE, "additionalProperties": False})
    assert result.content[0].type == "text" and result.content[0].text and result.stop_reason != "tool_use"
    assert call.type == "function_call" and call.name in ("get_weather", "get_time")  # type: ignore[union-attr]
    assert isinstance(json.loads(call.arguments), dict)  # type: ignore[union-attr]
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.done" in kinds and kinds[-1] == "response.completed"
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert done.arguments == events[-1].response.output[0].arguments  # type: ignore[union-attr]
    assert answered.output_text and answered.output[0].type == "message"
    assert json.loads(typed.output_text)["name"]


def test_reasoning_comes_apart_from_the_answer_whole_and_streamed_in_openais_shape() -> None:
    """The server's rendering of a thinking model's output (no such model is reachable here
    without a hub): `<think>` text becomes `reasoning_content`, whole and as stream deltas cut
    anywhere, and a prompt that opens the reasoning itself starts the answer inside it."""
    from scheduler.serving.http import responses as rs
    from scheduler.serving.http.chat import Answer
    from scheduler.streaming.gather import Gather
    from scheduler.types import Chunk

    tok = _Tokenizer(json_tools)
    tok.has_thinking, tok.think_start, tok.think_end = True, "<think>", "</think>"  # type: ignore[attr-defined]
    text = "<think>The user asks for a capital.</think>Paris is the capital of France."
    head = rs.Head("chatcmpl-1", 0, "m")
    for reasoning_first, given in ((False, text), (True, text.removeprefix("<think>"))):
        answer = Answer(ToolCalling(tok, None, None), reasoning_first)
        cuts = [given[i:i + 3] for i in range(0, len(given), 3)]
        chunks = [Chunk(1, piece, [0]) for piece in cuts[:-1]] + [Chunk(1, cuts[-1], [0], "stop", 20, len(cuts))]
        g = Gather()
        for c in chunks:
            g.add(c)
        message = rs.chat_completion(head, g, answer).choices[0].message
        assert (message.reasoning_content, message.content) == ("The user asks for a capital.",
                                                                "Paris is the capital of France.")
        events = rs.ChatEvents(head, False, 1, answer)
        deltas = [json.loads(e)["choices"][0]["delta"] for c in chunks for e in events(c)]
        assert "".join(d.get("reasoning_content", "") for d in deltas) == "The user asks for a capital."
        assert "".join(d.get("content", "") for d in deltas) == "Paris is the capital of France."
        assert deltas[0]["role"] == "assistant"
