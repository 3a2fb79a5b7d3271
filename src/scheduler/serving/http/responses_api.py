"""OpenAI's Responses API (`/v1/responses`) on the same engine: text in (a string, or messages
with `instructions` as the system turn), text out, whole or streamed as its typed events.

Nothing is stored: `previous_response_id` is refused, and so are tools and non-text input."""

from __future__ import annotations

import time
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
ROLES = frozenset({"user", "assistant", "system", "developer"})
DEFAULT_MAX_OUTPUT_TOKENS = 512


class Part(msgspec.Struct, frozen=True, kw_only=True):
    type: str
    text: str | None = None


class InputMessage(msgspec.Struct, frozen=True, kw_only=True):
    role: str
    content: str | list[Part]
    type: str | None = None


class ResponsesRequest(msgspec.Struct, frozen=True, kw_only=True):
    input: str | list[InputMessage]
    model: str | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = None
    user: str | None = None
    tools: list[Any] | None = None
    previous_response_id: str | None = None
    # Extensions, as on the chat endpoint: scheduling priority and session.
    priority: rq.Priority = 0
    session: str | None = None


def conversation(req: ResponsesRequest) -> list[dict[str, str]]:
    out = [] if req.instructions is None else [{"role": "system", "content": req.instructions}]
    if isinstance(req.input, str):
        return [*out, {"role": "user", "content": req.input}]
    if not req.input:
        raise invalid("input must not be empty", "input")
    for i, m in enumerate(req.input):
        if m.role not in ROLES:
            raise invalid(f"input[{i}].role must be one of {sorted(ROLES)}, got {m.role!r}", "input")
        if isinstance(m.content, str):
            text = m.content
        else:
            bad = [p.type for p in m.content if p.type not in ("input_text", "output_text") or p.text is None]
            if bad:
                raise invalid(f"input[{i}].content: only text parts are supported, got {bad[0]!r}", "input")
            text = "".join(p.text or "" for p in m.content)
        out.append({"role": "system" if m.role == "developer" else m.role, "content": text})
    return out


class Body:
    """The `response` object at each stage: in progress, then completed or incomplete."""

    def __init__(self, rid: str, model: str, req: ResponsesRequest) -> None:
        self.id, self.item_id = f"resp_{rid}", f"msg_{rid}"
        self._base: dict[str, Any] = {
            "id": self.id, "object": "response", "created_at": int(time.time()), "model": model,
            "parallel_tool_calls": False, "tool_choice": "none", "tools": [],
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "temperature": req.temperature, "top_p": req.top_p,
            "error": None, "incomplete_details": None,
        }

    def part(self, text: str) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def item(self, text: str | None) -> dict[str, Any]:
        return {"id": self.item_id, "type": "message", "role": "assistant",
                "status": "in_progress" if text is None else "completed",
                "content": [] if text is None else [self.part(text)]}

    def pending(self) -> dict[str, Any]:
        return {**self._base, "status": "in_progress", "output": []}

    def final(self, text: str, last: Chunk) -> dict[str, Any]:
        cut = last.finish_reason == "length"
        usage = {"input_tokens": last.prompt_tokens, "output_tokens": last.completion_tokens,
                 "total_tokens": last.prompt_tokens + last.completion_tokens,
                 "input_tokens_details": {"cached_tokens": last.cached_tokens, "cache_write_tokens": 0},
                 "output_tokens_details": {"reasoning_tokens": 0}}
        return {**self._base, "status": "incomplete" if cut else "completed",
                "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
                "output": [self.item(text)], "usage": usage}


class ResponseEvents:
    """The typed event stream of one text response, each with its `sequence_number`."""

    def __init__(self, body: Body) -> None:
        self._body = body
        self._seq = 0
        self._text: list[str] = []

    def _event(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return named_event(kind, _encode(data))

    def __call__(self, chunk: Chunk) -> list[bytes]:
        b, out = self._body, []
        where = {"item_id": b.item_id, "output_index": 0, "content_index": 0}
        if self._seq == 0:
            out += [self._event("response.created", response=b.pending()),
                    self._event("response.in_progress", response=b.pending()),
                    self._event("response.output_item.added", output_index=0, item=b.item(None)),
                    self._event("response.content_part.added", part=b.part(""), **where)]
        if chunk.text:
            self._text.append(chunk.text)
            out.append(self._event("response.output_text.delta", delta=chunk.text, logprobs=[], **where))
        if chunk.finish_reason is not None:
            text = "".join(self._text)
            out += [self._event("response.output_text.done", text=text, logprobs=[], **where),
                    self._event("response.content_part.done", part=b.part(text), **where),
                    self._event("response.output_item.done", output_index=0, item=b.item(text)),
                    self._event("response.completed", response=b.final(text, chunk))]
        return out


class ResponsesDialect(NamedEvents):
    """A failure after the 200 as the Responses API's `error` event."""

    def error(self, error: ApiError) -> bytes:
        data = {"type": "error", "code": error.body.code, "message": error.body.message,
                "param": error.body.param, "sequence_number": 0}
        return named_event("error", _encode(data))


async def respond(
    request: HttpRequest, rid: str, body: bytes, sched: EngineClient, model: PromptModel,
    tokens: Tokenizing, model_name: str,
) -> Response:
    req = rq.decode(body, ResponsesRequest)
    if req.previous_response_id is not None:
        raise invalid("previous_response_id is not supported: responses are not stored; send the "
                      "whole conversation as input", "previous_response_id")
    if req.tools:
        raise invalid("tools are not supported yet", "tools")
    if req.temperature is not None and req.temperature > rq.MAX_TEMPERATURE:
        raise invalid(f"temperature must be between 0 and {rq.MAX_TEMPERATURE:g}", "temperature")
    ids = await chat_ids(tokens, model, conversation(req))
    room = model.context_length - len(ids)
    default = min(DEFAULT_MAX_OUTPUT_TOKENS, room) if room > 0 else DEFAULT_MAX_OUTPUT_TOKENS
    params = SamplingParams(
        max_tokens=default if req.max_output_tokens is None else req.max_output_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p)
    stream = sched.submit(Request(prompt=ids, params=params, priority=req.priority,
                                  tenant=req.user or "default", session=req.session))
    shape = Body(rid.split("-", 1)[-1], model_name, req)
    if req.stream:
        return await event_stream(request, rid, stream, ResponseEvents(shape), dialect=ResponsesDialect())
    gathered = await whole(request, rid, stream)
    final = shape.final(gathered.text(), gathered.finals()[0])
    return Response(_encode(final), media_type="application/json", headers={"x-request-id": rid})
