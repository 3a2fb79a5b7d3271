"""The Responses API's `response` object and typed event stream: output items (reasoning, a
message, function calls) built from the scheduler's chunks, whole or as they stream."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import msgspec

from scheduler.serving.http.sse import named_event

if TYPE_CHECKING:
    from scheduler.chat.tools import ToolCalling
    from scheduler.serving.http.chat import Answer, ToolCallOut
    from scheduler.types import Chunk

_encode = msgspec.json.Encoder().encode


class Body:
    """The `response` object at each stage (in progress, then completed or incomplete) and its
    output items."""

    def __init__(self, rid: str, model: str, req: Any, calling: ToolCalling | None = None) -> None:
        self.id, self._rid = f"resp_{rid}", rid
        tools = [] if calling is None else [
            {"type": "function", **msgspec.to_builtins(t.function)} for t in calling.tools]
        choice = req.tool_choice if req.tool_choice is not None else ("auto" if tools else "none")
        self._base: dict[str, Any] = {
            "id": self.id, "object": "response", "created_at": int(time.time()), "model": model,
            "parallel_tool_calls": False, "tool_choice": choice, "tools": tools,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "temperature": req.temperature, "top_p": req.top_p,
            "error": None, "incomplete_details": None,
        }

    def part(self, text: str) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def message(self, index: int, text: str | None) -> dict[str, Any]:
        return {"id": f"msg_{self._rid}_{index}", "type": "message", "role": "assistant",
                "status": "in_progress" if text is None else "completed",
                "content": [] if text is None else [self.part(text)]}

    def call(self, index: int, call: ToolCallOut, done: bool = True) -> dict[str, Any]:
        return {"id": f"fc_{self._rid}_{index}", "type": "function_call", "call_id": call.id,
                "name": call.function.name, "arguments": call.function.arguments if done else "",
                "status": "completed" if done else "in_progress"}

    def reasoning(self, index: int, text: str) -> dict[str, Any]:
        return {"id": f"rs_{self._rid}_{index}", "type": "reasoning", "summary": [],
                "content": [{"type": "reasoning_text", "text": text}]}

    def items(self, text: str, answer: Answer | None) -> list[dict[str, Any]]:
        """A whole answer's output items: reasoning, the message (if it has text), calls."""
        if answer is None:
            return [self.message(0, text)]
        content, reasoning, calls, _ = answer.whole(text, None)
        items = [self.reasoning(0, reasoning)] if reasoning else []
        if content or not calls:
            items.append(self.message(len(items), content or ""))
        items += [self.call(len(items) + k, c) for k, c in enumerate(calls)]
        return items

    def pending(self) -> dict[str, Any]:
        return {**self._base, "status": "in_progress", "output": []}

    def final(self, items: list[dict[str, Any]], last: Chunk) -> dict[str, Any]:
        cut = last.finish_reason == "length"
        usage = {"input_tokens": last.prompt_tokens, "output_tokens": last.completion_tokens,
                 "total_tokens": last.prompt_tokens + last.completion_tokens,
                 "input_tokens_details": {"cached_tokens": last.cached_tokens, "cache_write_tokens": 0},
                 "output_tokens_details": {"reasoning_tokens": 0}}
        return {**self._base, "status": "incomplete" if cut else "completed",
                "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
                "output": items, "usage": usage}


class ResponseEvents:
    """The typed event stream of one response, each event with its `sequence_number`: a message
    item opened when text comes and closed before a call or at the end; each function call an
    item of its own with its arguments in one delta; reasoning an item once it is whole."""

    def __init__(self, body: Body, answer: Answer | None = None) -> None:
        self._body = body
        self._stream = None if answer is None else answer.stream()
        self._seq = 0
        self._items: list[dict[str, Any]] = []
        self._text: list[str] | None = None
        """The open message's text so far (None: no message is open)."""
        self._reasoning: list[str] = []

    def _event(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return named_event(kind, _encode(data))

    def _where(self) -> dict[str, Any]:
        index = len(self._items)
        return {"item_id": self._body.message(index, None)["id"], "output_index": index, "content_index": 0}

    def _open(self) -> list[bytes]:
        self._text = []
        index, b = len(self._items), self._body
        return [self._event("response.output_item.added", output_index=index, item=b.message(index, None)),
                self._event("response.content_part.added", part=b.part(""), **self._where())]

    def _close(self) -> list[bytes]:
        out = self._flush_reasoning()
        if self._text is None:
            return out
        b, text, where, index = self._body, "".join(self._text), self._where(), len(self._items)
        item = b.message(index, text)
        out += [self._event("response.output_text.done", text=text, logprobs=[], **where),
                self._event("response.content_part.done", part=b.part(text), **where),
                self._event("response.output_item.done", output_index=index, item=item)]
        self._items.append(item)
        self._text = None
        return out

    def _flush_reasoning(self) -> list[bytes]:
        if not self._reasoning:
            return []
        index = len(self._items)
        item = self._body.reasoning(index, "".join(self._reasoning).strip())
        self._reasoning = []
        self._items.append(item)
        return [self._event("response.output_item.added", output_index=index, item=item),
                self._event("response.output_item.done", output_index=index, item=item)]

    def _call(self, call: ToolCallOut) -> list[bytes]:
        out = self._close()
        index, b, arguments = len(self._items), self._body, call.function.arguments
        where = {"item_id": b.call(index, call)["id"], "output_index": index}
        opened = b.call(index, call, done=False)
        out += [self._event("response.output_item.added", output_index=index, item=opened),
                self._event("response.function_call_arguments.delta", delta=arguments, **where),
                self._event("response.function_call_arguments.done", arguments=arguments, **where),
                self._event("response.output_item.done", output_index=index, item=b.call(index, call))]
        self._items.append(b.call(index, call))
        return out

    def __call__(self, chunk: Chunk) -> list[bytes]:
        b, out, last = self._body, [], chunk.finish_reason is not None
        if self._seq == 0:
            out += [self._event("response.created", response=b.pending()),
                    self._event("response.in_progress", response=b.pending())]
        pieces = [(chunk.text, None, [])] if self._stream is None else self._stream.feed(chunk.text, last)
        for content, reasoning, calls in pieces:
            if reasoning:
                self._reasoning.append(reasoning)
            if content:
                if self._text is None:
                    out += self._flush_reasoning() + self._open()
                assert self._text is not None
                self._text.append(content)
                where = self._where()
                out.append(self._event("response.output_text.delta", delta=content, logprobs=[], **where))
            for call in calls:
                out += self._call(call)
        if last:
            if not self._items and self._text is None and not self._reasoning:
                out += self._open()
            out += self._close()
            out.append(self._event("response.completed", response=b.final(self._items, chunk)))
        return out
