"""OpenAI's Responses API (`/v1/responses`) on the same engine: text in (a string, or messages
with `instructions` as the system turn, and earlier function calls and their outputs), text and
function calls out (through the same `ToolCalling` as chat completions), JSON held to
`text.format`'s schema, whole or streamed as its typed events (`responses_events`).

Nothing is stored: `previous_response_id` is refused, and so are non-function tools and non-text
input."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import msgspec
from starlette.responses import Response

from scheduler.chat.tools import ToolCalling, calling_for
from scheduler.params import SamplingParams
from scheduler.request import Request
from scheduler.serving.http import requests as rq
from scheduler.serving.http.chat import default_max_tokens, tool_prompt
from scheduler.serving.http.errors import ApiError, invalid
from scheduler.serving.http.responses_events import Body, ResponseEvents
from scheduler.serving.http.sse import NamedEvents, event_stream, named_event, whole

if TYPE_CHECKING:
    from collections.abc import Callable

    from starlette.requests import Request as HttpRequest

    from scheduler.engine import EngineClient
    from scheduler.serving.http.prompts import PromptModel, Tokenizing
    from scheduler.streaming.gather import Gather

_encode = msgspec.json.Encoder().encode
ROLES = frozenset({"user", "assistant", "system", "developer"})
DEFAULT_MAX_OUTPUT_TOKENS = 512


class Part(msgspec.Struct, frozen=True, kw_only=True):
    type: str
    text: str | None = None


class InputItem(msgspec.Struct, frozen=True, kw_only=True):
    """A message (`role`, `content`), or a function call the model made before
    (`type="function_call"`) or its result (`type="function_call_output"`)."""

    type: str | None = None
    role: str | None = None
    content: str | list[Part] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | None = None


class TextFormat(msgspec.Struct, frozen=True, kw_only=True):
    type: str
    name: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None


class TextOptions(msgspec.Struct, frozen=True, kw_only=True):
    format: TextFormat | None = None


class ResponsesRequest(msgspec.Struct, frozen=True, kw_only=True):
    input: str | list[InputItem]
    model: str | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = None
    user: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    text: TextOptions | None = None
    previous_response_id: str | None = None
    # Extensions, as on the chat endpoint: scheduling priority and session.
    priority: rq.Priority = 0
    session: str | None = None


def conversation(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The chat template's messages (in chat completions' shape): `instructions` first; earlier
    function calls join an assistant turn's `tool_calls`, their outputs become `tool` messages."""
    out: list[dict[str, Any]] = []
    if req.instructions is not None:
        out.append({"role": "system", "content": req.instructions})
    if isinstance(req.input, str):
        return [*out, {"role": "user", "content": req.input}]
    if not req.input:
        raise invalid("input must not be empty", "input")
    for i, m in enumerate(req.input):
        if m.type == "function_call":
            if not (m.call_id and m.name and m.arguments is not None):
                raise invalid(f"input[{i}]: a function_call needs call_id, name and arguments", "input")
            function = {"name": m.name, "arguments": m.arguments}
            call = {"id": m.call_id, "type": "function", "function": function}
            if out and out[-1]["role"] == "assistant" and "tool_calls" in out[-1]:
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
            continue
        if m.type == "function_call_output":
            if not m.call_id or m.output is None:
                raise invalid(f"input[{i}]: a function_call_output needs call_id and output", "input")
            out.append({"role": "tool", "tool_call_id": m.call_id, "content": m.output})
            continue
        if m.type not in (None, "message") or m.role not in ROLES:
            raise invalid(f"input[{i}] must be a message with a role in {sorted(ROLES)}, a function_call "
                          f"or a function_call_output; got type {m.type!r}, role {m.role!r}", "input")
        if m.content is None or isinstance(m.content, str):
            text = m.content or ""
        else:
            bad = [p.type for p in m.content if p.type not in ("input_text", "output_text") or p.text is None]
            if bad:
                raise invalid(f"input[{i}].content: only text parts are supported, got {bad[0]!r}", "input")
            text = "".join(p.text or "" for p in m.content)
        out.append({"role": "system" if m.role == "developer" else m.role, "content": text})
    return out


def tool_calling(tokenizer: Any, req: ResponsesRequest) -> ToolCalling | None:
    """The request's function tools as chat completions' (None: plain text, no reasoning)."""
    functions = []
    for i, tool in enumerate(req.tools or []):
        if tool.get("type") != "function":
            kind = str(tool.get("type"))[:40]
            raise invalid(f"tools[{i}]: only function tools are supported, got {kind!r}", "tools")
        keys = ("name", "description", "parameters", "strict")
        spec = {k: tool[k] for k in keys if tool.get(k) is not None}
        functions.append({"type": "function", "function": spec})
    choice: object = req.tool_choice
    if isinstance(choice, dict) and choice.get("type") == "function" and "function" not in choice:
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    return calling_for(tokenizer, functions, choice)


def schema(req: ResponsesRequest) -> dict[str, Any] | None:
    fmt = req.text.format if req.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "object"}
    if fmt.type == "json_schema" and fmt.schema is not None:
        return fmt.schema
    raise invalid("text.format must be text, json_object, or json_schema with a schema", "text")


class ResponsesDialect(NamedEvents):
    """A failure after the 200 as the Responses API's `error` event."""

    def error(self, error: ApiError) -> bytes:
        data = {"type": "error", "code": error.body.code, "message": error.body.message,
                "param": error.body.param, "sequence_number": 0}
        return named_event("error", _encode(data))


class ResponsePlan(NamedTuple):
    """A Responses request made ready to run on any engine: its `Request`, the stream renderer,
    and the whole answer's body from the gathered chunks."""

    job: Request
    stream: bool
    events: ResponseEvents
    body: Callable[[Gather], dict[str, Any]]


async def plan_response(rid: str, body: bytes, model: PromptModel, tokens: Tokenizing,
                        model_name: str) -> ResponsePlan:
    req = rq.decode(body, ResponsesRequest)
    if req.previous_response_id is not None:
        raise invalid("previous_response_id is not supported: responses are not stored; send the "
                      "whole conversation as input", "previous_response_id")
    if req.temperature is not None and req.temperature > rq.MAX_TEMPERATURE:
        raise invalid(f"temperature must be between 0 and {rq.MAX_TEMPERATURE:g}", "temperature")
    calling = tool_calling(model.tokenizer, req)
    ids, answer = await tool_prompt(tokens, model, conversation(req), calling)
    default = default_max_tokens(DEFAULT_MAX_OUTPUT_TOKENS, model.context_length, ids)
    grammar = calling.grammar() if calling is not None else None
    json_schema = schema(req)
    if grammar is not None and json_schema is not None:
        raise invalid("text.format cannot be combined with a tool_choice that forces a call", "tool_choice")
    params = SamplingParams(
        max_tokens=default if req.max_output_tokens is None else req.max_output_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p, json_schema=json_schema, grammar=grammar)
    job = Request(prompt=ids, params=params, priority=req.priority, tenant=req.user or "default",
                  session=req.session)
    shape = Body(rid.split("-", 1)[-1], model_name, req, calling)

    def whole_body(gathered: Gather) -> dict[str, Any]:
        return shape.final(shape.items(gathered.text(), answer), gathered.finals()[0])

    return ResponsePlan(job, bool(req.stream), ResponseEvents(shape, answer), whole_body)


async def respond(
    request: HttpRequest, rid: str, body: bytes, sched: EngineClient, model: PromptModel,
    tokens: Tokenizing, model_name: str,
) -> Response:
    plan = await plan_response(rid, body, model, tokens, model_name)
    stream = sched.submit(plan.job)
    if plan.stream:
        return await event_stream(request, rid, stream, plan.events, dialect=ResponsesDialect())
    gathered = await whole(request, rid, stream)
    headers = {"x-request-id": rid}
    return Response(_encode(plan.body(gathered)), media_type="application/json", headers=headers)
