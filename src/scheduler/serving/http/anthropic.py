"""Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`) on the same engine:
text conversations, whole or streamed as Anthropic's named events, errors in its shape.

A conversation goes through the model's chat template like a chat completion (`system` first);
`metadata.user_id` is the tenant. Content blocks other than text (images, tool use and tool
results) are refused with a 400 that names them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec
from starlette.responses import Response

from scheduler.params import SamplingParams
from scheduler.request import Request
from scheduler.serving.http import requests as rq
from scheduler.serving.http.errors import ApiError, invalid
from scheduler.serving.http.prompts import chat_ids
from scheduler.serving.http.sse import NamedEvents, event_stream, named_event, whole

if TYPE_CHECKING:
    from starlette.requests import Request as HttpRequest

    from scheduler.engine import EngineClient
    from scheduler.serving.http.prompts import PromptModel, Tokenizing
    from scheduler.types import Chunk

_encode = msgspec.json.Encoder().encode
ERROR_TYPES = {"invalid_request_error": "invalid_request_error", "not_found_error": "not_found_error",
               "rate_limit_error": "rate_limit_error", "service_unavailable": "overloaded_error",
               "server_error": "api_error"}
STATUS_TYPES = {401: "authentication_error", 413: "request_too_large"}


class Block(msgspec.Struct, frozen=True, kw_only=True):
    type: str
    text: str | None = None


class Message(msgspec.Struct, frozen=True):
    role: str
    content: str | list[Block]


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
    tools: list[Any] | None = None


class CountRequest(msgspec.Struct, frozen=True, kw_only=True):
    model: str
    messages: list[Message]
    system: str | list[Block] | None = None


class TextOut(msgspec.Struct, frozen=True):
    type: str
    text: str


class Usage(msgspec.Struct, frozen=True):
    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: int = 0


class MessageOut(msgspec.Struct, frozen=True):
    id: str
    type: str
    role: str
    content: list[TextOut]
    model: str
    stop_reason: str | None
    stop_sequence: str | None
    usage: Usage


def _text(content: str | list[Block], where: str) -> str:
    if isinstance(content, str):
        return content
    parts = []
    for i, block in enumerate(content):
        if block.type != "text" or block.text is None:
            raise invalid(f"{where}.content[{i}]: only text blocks are supported, got {block.type!r}",
                          "messages")
        parts.append(block.text)
    return "".join(parts)


def conversation(system: str | list[Block] | None, messages: list[Message]) -> list[dict[str, str]]:
    """The chat template's messages: `system` first, then the turns, text only."""
    if not messages:
        raise invalid("messages must not be empty", "messages")
    out = [] if system is None else [{"role": "system", "content": _text(system, "system")}]
    for i, m in enumerate(messages):
        if m.role not in ("user", "assistant"):
            raise invalid(f"messages[{i}].role must be 'user' or 'assistant', got {m.role!r}", "messages")
        out.append({"role": m.role, "content": _text(m.content, f"messages[{i}]")})
    return out


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
    """A message's chunks as Anthropic's stream: message_start, one text block's start, deltas
    and stop, then message_delta (stop reason, output tokens) and message_stop."""

    def __init__(self, rid: str, model: str, input_tokens: int) -> None:
        self._head: dict[str, Any] = {
            "id": rid, "type": "message", "role": "assistant", "content": [], "model": model,
            "stop_reason": None, "stop_sequence": None,
        }
        self._input = input_tokens
        self._started = False

    def __call__(self, chunk: Chunk) -> list[bytes]:
        out = []
        if not self._started:
            self._started = True
            usage = {"input_tokens": self._input, "output_tokens": 0}
            start = {**self._head, "usage": usage}
            out.append(_event("message_start", {"type": "message_start", "message": start}))
            out.append(_event("content_block_start", {"type": "content_block_start", "index": 0,
                                                      "content_block": {"type": "text", "text": ""}}))
        if chunk.text:
            out.append(_event("content_block_delta", {"type": "content_block_delta", "index": 0,
                                                      "delta": {"type": "text_delta", "text": chunk.text}}))
        if chunk.finish_reason is not None:
            out.append(_event("content_block_stop", {"type": "content_block_stop", "index": 0}))
            delta = {"stop_reason": stop_reason(chunk), "stop_sequence": chunk.stop}
            out.append(_event("message_delta", {"type": "message_delta", "delta": delta,
                                                "usage": {"output_tokens": chunk.completion_tokens}}))
            out.append(_event("message_stop", {"type": "message_stop"}))
        return out


async def messages(
    request: HttpRequest, rid: str, body: bytes, sched: EngineClient, model: PromptModel,
    tokens: Tokenizing, model_name: str,
) -> Response:
    req = rq.decode(body, MessagesRequest)
    if req.tools:
        raise invalid("tools are not supported yet", "tools")
    if req.temperature is not None and not 0.0 <= req.temperature <= 1.0:
        raise invalid(f"temperature must be between 0 and 1, got {req.temperature}", "temperature")
    ids = await chat_ids(tokens, model, conversation(req.system, req.messages))
    params = SamplingParams(
        max_tokens=req.max_tokens, temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p, top_k=req.top_k or 0,
        stop=tuple(req.stop_sequences or ()))
    tenant = req.metadata.user_id if req.metadata and req.metadata.user_id else "default"
    stream = sched.submit(Request(prompt=ids, params=params, tenant=tenant))
    mid = f"msg_{rid.split('-', 1)[-1]}"
    if req.stream:
        return await event_stream(request, rid, stream, MessageEvents(mid, model_name, len(ids)),
                                  dialect=AnthropicDialect())
    gathered = await whole(request, rid, stream)
    last = gathered.finals()[0]
    usage = Usage(last.prompt_tokens, last.completion_tokens, last.cached_tokens)
    out = MessageOut(mid, "message", "assistant", [TextOut("text", gathered.text())], model_name,
                     stop_reason(last), last.stop, usage)
    return Response(_encode(out), media_type="application/json", headers={"x-request-id": rid})


async def count_tokens(body: bytes, model: PromptModel, tokens: Tokenizing) -> Response:
    req = rq.decode(body, CountRequest)
    ids = await chat_ids(tokens, model, conversation(req.system, req.messages))
    return Response(_encode({"input_tokens": len(ids)}), media_type="application/json")
