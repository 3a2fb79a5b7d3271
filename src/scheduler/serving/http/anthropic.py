"""Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`) on the same engine:
conversations with text, tool use and tool results, whole or streamed as Anthropic's named
events, errors in its shape.

A conversation goes through the model's chat template like a chat completion (`system` first);
`metadata.user_id` is the tenant. Tools, `tool_choice` and the model's calls go through the same
`ToolCalling` as chat completions ("any" and a named tool force a call). Content blocks other
than text, tool_use and tool_result (images, documents) are refused with a 400 that names them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import msgspec
from starlette.responses import Response

from scheduler.chat.tools import ToolCalling, calling_for
from scheduler.params import SamplingParams
from scheduler.request import Request
from scheduler.serving.http import requests as rq
from scheduler.serving.http.chat import Answer, tool_prompt
from scheduler.serving.http.errors import ApiError, invalid
from scheduler.serving.http.sse import NamedEvents, event_stream, named_event, whole

if TYPE_CHECKING:
    from collections.abc import Callable

    from starlette.requests import Request as HttpRequest

    from scheduler.engine import EngineClient
    from scheduler.serving.http.prompts import PromptModel, Tokenizing
    from scheduler.streaming.gather import Gather
    from scheduler.types import Chunk

_encode = msgspec.json.Encoder().encode
ERROR_TYPES = {"invalid_request_error": "invalid_request_error", "not_found_error": "not_found_error",
               "rate_limit_error": "rate_limit_error", "service_unavailable": "overloaded_error",
               "server_error": "api_error"}
STATUS_TYPES = {401: "authentication_error", 413: "request_too_large"}


class Block(msgspec.Struct, frozen=True, kw_only=True):
    type: str
    text: str | None = None
    id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None
    content: str | list[Block] | None = None
    is_error: bool | None = None


class Message(msgspec.Struct, frozen=True):
    role: str
    content: str | list[Block]


class ToolIn(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    type: str | None = None


class ToolChoice(msgspec.Struct, frozen=True, kw_only=True):
    type: str
    name: str | None = None


class Metadata(msgspec.Struct, frozen=True):
    user_id: str | None = None


class MessagesRequest(msgspec.Struct, frozen=True, kw_only=True):
    model: str
    max_tokens: int
    messages: list[Message]
    system: str | list[Block] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool | None = None
    metadata: Metadata | None = None
    tools: list[ToolIn] | None = None
    tool_choice: ToolChoice | None = None


class CountRequest(msgspec.Struct, frozen=True, kw_only=True):
    model: str
    messages: list[Message]
    system: str | list[Block] | None = None
    tools: list[ToolIn] | None = None


class BlockOut(msgspec.Struct, frozen=True, omit_defaults=True):
    type: str
    text: str | None = None
    thinking: str | None = None
    id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None


class Usage(msgspec.Struct, frozen=True):
    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: int = 0


class MessageOut(msgspec.Struct, frozen=True):
    id: str
    type: str
    role: str
    content: list[BlockOut]
    model: str
    stop_reason: str | None
    stop_sequence: str | None
    usage: Usage


def _text(content: str | list[Block] | None, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for i, block in enumerate(content):
        if block.type != "text" or block.text is None:
            raise invalid(f"{where}.content[{i}]: only text blocks are supported here, got {block.type!r}",
                          "messages")
        parts.append(block.text)
    return "".join(parts)


def conversation(system: str | list[Block] | None, messages: list[Message]) -> list[dict[str, Any]]:
    """The chat template's messages (in chat completions' shape): `system` first, then the turns;
    an assistant's tool_use blocks become its `tool_calls`, a user's tool_result blocks `tool`
    messages before the rest of its text."""
    if not messages:
        raise invalid("messages must not be empty", "messages")
    out: list[dict[str, Any]] = []
    if system is not None:
        out.append({"role": "system", "content": _text(system, "system")})
    for i, m in enumerate(messages):
        if m.role not in ("user", "assistant"):
            raise invalid(f"messages[{i}].role must be 'user' or 'assistant', got {m.role!r}", "messages")
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        texts, calls = [], []
        for k, block in enumerate(m.content):
            where = f"messages[{i}].content[{k}]"
            if block.type == "text" and block.text is not None:
                texts.append(block.text)
            elif block.type == "tool_use" and m.role == "assistant" and block.id and block.name:
                arguments = msgspec.json.encode(block.input or {}).decode()
                calls.append({"id": block.id, "type": "function",
                              "function": {"name": block.name, "arguments": arguments}})
            elif block.type == "tool_result" and m.role == "user" and block.tool_use_id:
                out.append({"role": "tool", "tool_call_id": block.tool_use_id,
                            "content": _text(block.content, where)})
            else:
                allowed = "text and tool_use" if m.role == "assistant" else "text and tool_result"
                raise invalid(f"{where}: {block.type[:32]!r} blocks are not supported; {m.role} messages "
                              f"take {allowed} blocks", "messages")
        if texts or calls or m.role == "assistant":
            message: dict[str, Any] = {"role": m.role, "content": "".join(texts)}
            if calls:
                message["tool_calls"] = calls
            out.append(message)
    return out


def tool_calling(tokenizer: Any, tools: list[ToolIn] | None, choice: ToolChoice | None) -> ToolCalling | None:
    """Anthropic's tools and tool_choice as chat completions' (None: plain text, no reasoning)."""
    functions = [{"type": "function", "function": {
        "name": t.name, **({"description": t.description} if t.description else {}),
        "parameters": t.input_schema or {"type": "object"}}} for t in tools or []]
    mode: object = None
    if choice is not None:
        modes = {"auto": "auto", "any": "required", "none": "none"}
        if choice.type == "tool":
            mode = {"type": "function", "function": {"name": choice.name}}
        elif choice.type in modes:
            mode = modes[choice.type]
        else:
            raise invalid("tool_choice.type must be 'auto', 'any', 'tool' or 'none', got "
                          f"{choice.type[:32]!r}", "tool_choice")
    return calling_for(tokenizer, functions, mode)


def stop_reason(last: Chunk) -> str | None:
    if last.finish_reason == "length":
        return "max_tokens"
    if last.finish_reason == "stop":
        return "stop_sequence" if last.stop is not None else "end_turn"
    return None


def error_response(error: ApiError, headers: dict[str, str]) -> Response:
    """`error` in Anthropic's shape: `{"type": "error", "error": {"type", "message"}}`."""
    return Response(_encode(_error_body(error)), error.status, {**error.headers, **headers},
                    media_type="application/json")


def _error_body(error: ApiError) -> dict[str, Any]:
    kind = STATUS_TYPES.get(error.status) or ERROR_TYPES.get(error.body.type, "api_error")
    return {"type": "error", "error": {"type": kind, "message": error.body.message}}


class AnthropicDialect(NamedEvents):
    """Errors after the 200 as Anthropic's `error` event."""

    def error(self, error: ApiError) -> bytes:
        return _event("error", _error_body(error))


def _event(name: str, data: Any) -> bytes:
    return named_event(name, _encode(data))


class MessageEvents:
    """A message's chunks as Anthropic's stream: message_start; each content block's start,
    deltas and stop (text; thinking; a tool_use whole, its input as one input_json_delta); then
    message_delta (stop reason, output tokens) and message_stop."""

    def __init__(self, rid: str, model: str, input_tokens: int, answer: Answer | None = None) -> None:
        self._head: dict[str, Any] = {
            "id": rid, "type": "message", "role": "assistant", "content": [], "model": model,
            "stop_reason": None, "stop_sequence": None,
        }
        self._input = input_tokens
        self._started = False
        self._stream = None if answer is None else answer.stream()
        self._open: str | None = None
        self._index = -1
        self._calls = 0

    def _start(self, block: dict[str, Any]) -> list[bytes]:
        out = self._stop()
        self._index += 1
        self._open = block["type"]
        out.append(_event("content_block_start", {"type": "content_block_start", "index": self._index,
                                                  "content_block": block}))
        return out

    def _stop(self) -> list[bytes]:
        if self._open is None:
            return []
        self._open = None
        return [_event("content_block_stop", {"type": "content_block_stop", "index": self._index})]

    def _delta(self, delta: dict[str, Any]) -> bytes:
        body = {"type": "content_block_delta", "index": self._index, "delta": delta}
        return _event("content_block_delta", body)

    def __call__(self, chunk: Chunk) -> list[bytes]:
        out = []
        last = chunk.finish_reason is not None
        if not self._started:
            self._started = True
            usage = {"input_tokens": self._input, "output_tokens": 0}
            start = {**self._head, "usage": usage}
            out.append(_event("message_start", {"type": "message_start", "message": start}))
            if self._stream is None:
                out += self._start({"type": "text", "text": ""})
        pieces = [(chunk.text, None, [])] if self._stream is None else self._stream.feed(chunk.text, last)
        for content, reasoning, calls in pieces:
            if content:
                if self._open != "text":
                    out += self._start({"type": "text", "text": ""})
                out.append(self._delta({"type": "text_delta", "text": content}))
            if reasoning:
                if self._open != "thinking":
                    out += self._start({"type": "thinking", "thinking": ""})
                out.append(self._delta({"type": "thinking_delta", "thinking": reasoning}))
            for call in calls:
                name, uid = call.function.name, _tool_use_id(call.id)
                out += self._start({"type": "tool_use", "id": uid, "name": name, "input": {}})
                out.append(self._delta({"type": "input_json_delta", "partial_json": call.function.arguments}))
                out += self._stop()
                self._calls += 1
        if last:
            if self._index < 0:
                out += self._start({"type": "text", "text": ""})
            out += self._stop()
            reason = "tool_use" if self._calls and chunk.finish_reason == "stop" else stop_reason(chunk)
            delta = {"stop_reason": reason, "stop_sequence": chunk.stop}
            out.append(_event("message_delta", {"type": "message_delta", "delta": delta,
                                                "usage": {"output_tokens": chunk.completion_tokens}}))
            out.append(_event("message_stop", {"type": "message_stop"}))
        return out


def _tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def content_blocks(text: str, answer: Answer | None) -> tuple[list[BlockOut], bool]:
    """A whole answer's content blocks, and whether it called a tool."""
    if answer is None:
        return [BlockOut("text", text)], False
    content, reasoning, calls, _ = answer.whole(text, None)
    blocks = [BlockOut("thinking", thinking=reasoning)] if reasoning else []
    if content:
        blocks.append(BlockOut("text", content))
    for call in calls:
        arguments = msgspec.json.decode(call.function.arguments)
        if isinstance(arguments, dict):
            blocks.append(BlockOut("tool_use", id=_tool_use_id(call.id), name=call.function.name,
                                   input=arguments))
        else:  # a call whose arguments are not an object stays as the text it was
            blocks.append(BlockOut("text", f"{call.function.name}({call.function.arguments})"))
    called = any(b.type == "tool_use" for b in blocks)
    return blocks or [BlockOut("text", "")], called


class MessagePlan(NamedTuple):
    """A Messages request made ready to run on any engine: its `Request`, the stream renderer,
    and the whole answer's body from the gathered chunks."""

    job: Request
    stream: bool
    events: MessageEvents
    body: Callable[[Gather], MessageOut]


async def plan_message(rid: str, body: bytes, model: PromptModel, tokens: Tokenizing,
                       model_name: str) -> MessagePlan:
    req = rq.decode(body, MessagesRequest)
    if req.temperature is not None and not 0.0 <= req.temperature <= 1.0:
        raise invalid(f"temperature must be between 0 and 1, got {req.temperature}", "temperature")
    calling = tool_calling(model.tokenizer, req.tools, req.tool_choice)
    ids, answer = await tool_prompt(tokens, model, conversation(req.system, req.messages), calling)
    params = SamplingParams(
        max_tokens=req.max_tokens, temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p, top_k=req.top_k or 0,
        stop=tuple(req.stop_sequences or ()), grammar=calling.grammar() if calling is not None else None)
    tenant = req.metadata.user_id if req.metadata and req.metadata.user_id else "default"
    mid = f"msg_{rid.split('-', 1)[-1]}"

    def whole_body(gathered: Gather) -> MessageOut:
        last = gathered.finals()[0]
        usage = Usage(last.prompt_tokens, last.completion_tokens, last.cached_tokens)
        blocks, called = content_blocks(gathered.text(), answer)
        reason = "tool_use" if called and last.finish_reason == "stop" else stop_reason(last)
        return MessageOut(mid, "message", "assistant", blocks, model_name, reason, last.stop, usage)

    job = Request(prompt=ids, params=params, tenant=tenant)
    events = MessageEvents(mid, model_name, len(ids), answer)
    return MessagePlan(job, bool(req.stream), events, whole_body)


async def messages(
    request: HttpRequest, rid: str, body: bytes, sched: EngineClient, model: PromptModel,
    tokens: Tokenizing, model_name: str,
) -> Response:
    plan = await plan_message(rid, body, model, tokens, model_name)
    stream = sched.submit(plan.job)
    if plan.stream:
        return await event_stream(request, rid, stream, plan.events, dialect=AnthropicDialect())
    gathered = await whole(request, rid, stream)
    headers = {"x-request-id": rid}
    return Response(_encode(plan.body(gathered)), media_type="application/json", headers=headers)


async def count_tokens(body: bytes, model: PromptModel, tokens: Tokenizing) -> Response:
    req = rq.decode(body, CountRequest)
    calling = tool_calling(model.tokenizer, req.tools, None)
    ids, _ = await tool_prompt(tokens, model, conversation(req.system, req.messages), calling)
    return Response(_encode({"input_tokens": len(ids)}), media_type="application/json")
