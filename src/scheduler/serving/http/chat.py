"""A chat completion made ready to run, shared by the single server and the cluster frontend:
its prompt through the chat template (with tools), its `Request`, and how its answer is split
into content, reasoning and tool calls, whole or as stream deltas."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import msgspec

from scheduler.chat.split import Splitter
from scheduler.chat.tools import ToolCall, ToolCalling, calling_for, shown_to
from scheduler.serving.http import requests as rq
from scheduler.serving.http.errors import invalid
from scheduler.serving.http.prompts import chat_ids

if TYPE_CHECKING:
    from scheduler.chat.split import Part
    from scheduler.request import Request
    from scheduler.serving.http.prompts import PromptModel, Tokenizing

DEFAULT_CHAT_MAX_TOKENS = 512  # as mlx_lm.server; lowered to fit the context


class FunctionOut(msgspec.Struct, frozen=True):
    name: str
    arguments: str


class ToolCallOut(msgspec.Struct, frozen=True, omit_defaults=True):
    id: str
    type: str
    function: FunctionOut
    index: int | None = None
    """Set in stream deltas only, as OpenAI does."""


def tool_call_out(call: ToolCall, index: int | None = None) -> ToolCallOut:
    return ToolCallOut(call.id, "function", FunctionOut(call.name, call.arguments), index=index)


class Answer:
    """How one request's answers are read: its tool calling (and the model's reasoning markers)."""

    def __init__(self, calling: ToolCalling, reasoning_first: bool) -> None:
        self.calling = calling
        self.reasoning_first = reasoning_first

    def whole(
        self, text: str, finish: str | None,
    ) -> tuple[str | None, str | None, list[ToolCallOut], str | None]:
        """(content, reasoning, tool calls, finish reason) of a whole answer."""
        reply = self.calling.reply(text, reasoning_first=self.reasoning_first)
        calls = [tool_call_out(c) for c in reply.tool_calls]
        content = None if calls and not reply.content else reply.content
        return content, reply.reasoning, calls, "tool_calls" if calls and finish == "stop" else finish

    def stream(self) -> AnswerStream:
        return AnswerStream(self)


class AnswerStream:
    """One choice's answer as it streams: text in, (content, reasoning, calls) pieces out."""

    def __init__(self, answer: Answer) -> None:
        self._calling = answer.calling
        self._split = Splitter(answer.calling.markers, reasoning_first=answer.reasoning_first)
        self.calls = 0

    def feed(self, text: str, last: bool) -> list[tuple[str | None, str | None, list[ToolCallOut]]]:
        parts: list[Part] = self._split.feed(text) + (self._split.close() if last else [])
        out: list[tuple[str | None, str | None, list[ToolCallOut]]] = []
        for kind, piece in parts:
            if kind == "reasoning":
                out.append((None, piece, []))
            elif kind == "tool_call":
                parsed = self._calling.parse(piece)
                if parsed is None:
                    out.append((self._calling.unparsed(piece), None, []))
                    continue
                calls = [tool_call_out(c, self.calls + k) for k, c in enumerate(parsed)]
                self.calls += len(calls)
                out.append((None, None, calls))
            else:
                out.append((piece, None, []))
        return out


class ChatPlan(NamedTuple):
    job: Request
    answer: Answer | None


async def plan_chat(req: rq.ChatRequest, tokens: Tokenizing, prompts: PromptModel, vocab: int,
                    context: int) -> ChatPlan:
    """The `Request` for a chat body, and how to read its answer (None: plain text)."""
    calling = calling_for(prompts.tokenizer, req.tools, req.tool_choice)
    ids, answer = await tool_prompt(tokens, prompts, rq.chat_messages(req), calling)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    job = rq.request(req, ids, max_tokens, default_max_tokens(DEFAULT_CHAT_MAX_TOKENS, context, ids), vocab)
    grammar = calling.grammar() if calling is not None else None
    if grammar is not None:
        if job.params.json_schema is not None:
            raise invalid("response_format cannot be combined with a tool_choice that forces a call",
                          "tool_choice")
        job = msgspec.structs.replace(job, params=msgspec.structs.replace(job.params, grammar=grammar))
    return ChatPlan(job, answer)


async def tool_prompt(
    tokens: Tokenizing, model: PromptModel, messages: list[dict[str, Any]], calling: ToolCalling | None,
) -> tuple[list[int], Answer | None]:
    """The prompt's token ids with the tools shown, and how to read its answer (None: plain)."""
    shown, template = shown_to(calling, messages)
    ids = await chat_ids(tokens, model, shown, **template)
    return ids, None if calling is None else Answer(calling, opens_reasoning(model.tokenizer, ids))


def default_max_tokens(cap: int, context: int, ids: list[int]) -> int:
    """`cap`, lowered to the room the prompt leaves in the context (`cap` when it leaves none:
    the length check then refuses the request by name)."""
    room = context - len(ids)
    return min(cap, room) if room > 0 else cap


def opens_reasoning(tokenizer: Any, ids: list[int]) -> bool:
    """Whether the prompt itself opens the model's reasoning (templates that write `<think>`
    into the generation prompt): the answer then starts inside it."""
    start = getattr(tokenizer, "think_start", None) if getattr(tokenizer, "has_thinking", False) else None
    if not start:
        return False
    return str(tokenizer.decode(ids[-8:])).rstrip().endswith(start)
