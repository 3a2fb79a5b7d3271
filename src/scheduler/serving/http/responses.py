"""OpenAI response bodies and stream chunks, built from the scheduler's `Chunk`s."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec

from scheduler.serving.http.logprobs import (
    ChatLogprobs,
    CompletionLogprobs,
    chat_logprobs,
    completion_logprobs,
)

if TYPE_CHECKING:
    from scheduler.serving.http.chat import Answer, ToolCallOut
    from scheduler.streaming.gather import Gather
    from scheduler.types import Chunk, TokenLogprob

_encode = msgspec.json.Encoder().encode


class PromptTokensDetails(msgspec.Struct, frozen=True):
    cached_tokens: int
    """Prompt tokens served from prefix blocks or a session (as vLLM and mlx_lm.server report)."""


class Usage(msgspec.Struct, frozen=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


def usage(last: Chunk) -> Usage:
    return Usage(last.prompt_tokens, last.completion_tokens, last.prompt_tokens + last.completion_tokens,
                 PromptTokensDetails(last.cached_tokens))


class CompletionChoice(msgspec.Struct, frozen=True):
    index: int
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobs | None = None


class TextCompletion(msgspec.Struct, frozen=True, omit_defaults=True):
    """A whole completion (`object="text_completion"`), and also each of its stream chunks."""

    id: str
    object: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ChatMessage(msgspec.Struct, frozen=True, omit_defaults=True):
    role: str
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallOut] = []


class ChatChoice(msgspec.Struct, frozen=True):
    index: int
    message: ChatMessage
    finish_reason: str | None
    logprobs: ChatLogprobs | None = None


class ChatCompletion(msgspec.Struct, frozen=True, omit_defaults=True):
    id: str
    object: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None


class Delta(msgspec.Struct, frozen=True, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallOut] = []


class ChatChunkChoice(msgspec.Struct, frozen=True):
    index: int
    delta: Delta
    finish_reason: str | None
    logprobs: ChatLogprobs | None = None


class ChatChunk(msgspec.Struct, frozen=True, omit_defaults=True):
    id: str
    object: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(msgspec.Struct, frozen=True):
    id: str
    object: str
    created: int
    owned_by: str
    max_model_len: int


class ModelList(msgspec.Struct, frozen=True):
    object: str
    data: list[ModelCard]


class Head(msgspec.Struct, frozen=True):
    """What every body of one request shares; `texts` (a `TokenTexts`) names tokens in logprobs."""

    id: str
    created: int
    model: str
    texts: Any = None


def total_usage(finals: list[Chunk]) -> Usage:
    """Usage of all of a request's choices: the prompt once, every choice's output."""
    first = finals[0]
    done = sum(c.completion_tokens for c in finals)
    return Usage(first.prompt_tokens, done, first.prompt_tokens + done,
                 PromptTokensDetails(first.cached_tokens))


def completion(head: Head, g: Gather) -> TextCompletion:
    choices = []
    for last in g.finals():
        lps = g.logprobs(last.index)
        rendered = None if lps is None else completion_logprobs(lps, head.texts, 0)
        choices.append(CompletionChoice(last.index, g.text(last.index), last.finish_reason, rendered))
    return TextCompletion(head.id, "text_completion", head.created, head.model, choices,
                          total_usage(g.finals()))


def chat_completion(head: Head, g: Gather, answer: Answer | None = None) -> ChatCompletion:
    """The whole chat completion; `answer` splits each choice's text into content, reasoning
    and tool calls."""
    choices = []
    for last in g.finals():
        lps = g.logprobs(last.index)
        rendered = None if lps is None else chat_logprobs(lps, head.texts)
        finish: str | None = last.finish_reason
        if answer is None:
            message = ChatMessage("assistant", g.text(last.index))
        else:
            content, reasoning, calls, finish = answer.whole(g.text(last.index), finish)
            message = ChatMessage("assistant", content, reasoning, calls)
        choices.append(ChatChoice(last.index, message, finish, rendered))
    return ChatCompletion(head.id, "chat.completion", head.created, head.model, choices,
                          total_usage(g.finals()))


class CompletionEvents:
    """Renders a completion's chunks as stream events (JSON bytes, one per SSE `data:`)."""

    def __init__(self, head: Head, include_usage: bool, n: int = 1) -> None:
        self._head = head
        self._include_usage = include_usage
        self._lps = [_Pending() for _ in range(n)]
        self._offset = [0] * n
        self._finals: list[Chunk] = []
        self._n = n

    def __call__(self, chunk: Chunk) -> list[bytes]:
        h, i = self._head, chunk.index
        lps = self._lps[i].add(chunk)
        if not chunk.text and chunk.finish_reason is None:
            return []  # the detokenizer is holding back a partial character
        rendered = None if lps is None else completion_logprobs(lps, h.texts, self._offset[i])
        self._offset[i] += len(chunk.text)
        choice = CompletionChoice(i, chunk.text, chunk.finish_reason, rendered)
        out = [_encode(TextCompletion(h.id, "text_completion", h.created, h.model, [choice]))]
        if chunk.finish_reason is not None:
            self._finals.append(chunk)
            if len(self._finals) == self._n and self._include_usage:
                out.append(_encode(TextCompletion(h.id, "text_completion", h.created, h.model, [],
                                                  total_usage(self._finals))))
        return out


class ChatEvents:
    """Renders a chat completion's chunks as `chat.completion.chunk` events; each choice's first
    carries the assistant role, its last the finish reason; usage, when asked, comes in a chunk
    of its own after every choice has ended. With an `answer`, text is split as it streams:
    reasoning in `reasoning_content`, and each tool call as one `tool_calls` delta once whole."""

    def __init__(self, head: Head, include_usage: bool, n: int = 1, answer: Answer | None = None) -> None:
        self._head = head
        self._include_usage = include_usage
        self._first = [True] * n
        self._lps = [_Pending() for _ in range(n)]
        self._finals: list[Chunk] = []
        self._n = n
        self._answers = None if answer is None else [answer.stream() for _ in range(n)]

    def __call__(self, chunk: Chunk) -> list[bytes]:
        h, i = self._head, chunk.index
        lps = self._lps[i].add(chunk)
        first = self._first[i]
        if not chunk.text and chunk.finish_reason is None and not first:
            return []
        finish: str | None = chunk.finish_reason
        if self._answers is None:
            deltas = [Delta(None, chunk.text if chunk.text or first else None)]
        else:
            stream = self._answers[i]
            deltas = [Delta(None, c, r, t) for c, r, t in stream.feed(chunk.text, finish is not None)]
            if stream.calls and finish == "stop":
                finish = "tool_calls"
            if not deltas and (first or finish is not None):
                deltas = [Delta(None, "" if first else None)]
            if not deltas:
                self._lps[i].hold(lps)
                return []
        if first:
            deltas[0] = msgspec.structs.replace(deltas[0], role="assistant")
        self._first[i] = False
        rendered = None if lps is None else chat_logprobs(lps, h.texts)
        out = []
        for k, delta in enumerate(deltas):
            last = k == len(deltas) - 1
            choice = ChatChunkChoice(i, delta, finish if last else None, rendered if k == 0 else None)
            out.append(_encode(ChatChunk(h.id, "chat.completion.chunk", h.created, h.model, [choice])))
        if chunk.finish_reason is not None:
            self._finals.append(chunk)
            if len(self._finals) == self._n and self._include_usage:
                out.append(_encode(ChatChunk(h.id, "chat.completion.chunk", h.created, h.model, [],
                                             total_usage(self._finals))))
        return out


class _Pending:
    """Log-probabilities of chunks whose text is held back (part of a character), sent with
    the next event that goes out, so every token's entry is sent once."""

    def __init__(self) -> None:
        self._held: list[TokenLogprob] | None = None

    def add(self, chunk: Chunk) -> list[TokenLogprob] | None:
        """What the event for `chunk` carries if it goes out (and is then no longer held)."""
        if chunk.logprobs is None:
            return None
        held = (self._held or []) + chunk.logprobs
        if not chunk.text and chunk.finish_reason is None:
            self._held = held
            return None
        self._held = None
        return held

    def hold(self, lps: list[TokenLogprob] | None) -> None:
        """Keep `lps` for the next event after all (the chunk's text was held back)."""
        if lps is not None:
            self._held = lps + (self._held or [])
