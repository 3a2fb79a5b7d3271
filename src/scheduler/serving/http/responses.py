"""OpenAI response bodies and stream chunks, built from the scheduler's `Chunk`s."""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    from scheduler.types import Chunk

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
    logprobs: None = None


class TextCompletion(msgspec.Struct, frozen=True, omit_defaults=True):
    """A whole completion (`object="text_completion"`), and also each of its stream chunks."""

    id: str
    object: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ChatMessage(msgspec.Struct, frozen=True):
    role: str
    content: str


class ChatChoice(msgspec.Struct, frozen=True):
    index: int
    message: ChatMessage
    finish_reason: str | None
    logprobs: None = None


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


class ChatChunkChoice(msgspec.Struct, frozen=True):
    index: int
    delta: Delta
    finish_reason: str | None
    logprobs: None = None


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
    """What every body of one request shares."""

    id: str
    created: int
    model: str


def completion(head: Head, text: str, last: Chunk) -> TextCompletion:
    return TextCompletion(head.id, "text_completion", head.created, head.model,
                          [CompletionChoice(0, text, last.finish_reason)], usage(last))


def chat_completion(head: Head, text: str, last: Chunk) -> ChatCompletion:
    choice = ChatChoice(0, ChatMessage("assistant", text), last.finish_reason)
    return ChatCompletion(head.id, "chat.completion", head.created, head.model, [choice], usage(last))


class CompletionEvents:
    """Renders a completion's chunks as stream events (JSON bytes, one per SSE `data:`)."""

    def __init__(self, head: Head, include_usage: bool) -> None:
        self._head = head
        self._include_usage = include_usage

    def __call__(self, chunk: Chunk) -> list[bytes]:
        h = self._head
        if not chunk.text and chunk.finish_reason is None:
            return []  # the detokenizer is holding back a partial character
        choice = CompletionChoice(0, chunk.text, chunk.finish_reason)
        out = [_encode(TextCompletion(h.id, "text_completion", h.created, h.model, [choice]))]
        if chunk.finish_reason is not None and self._include_usage:
            out.append(_encode(TextCompletion(h.id, "text_completion", h.created, h.model, [],
                                              usage(chunk))))
        return out


class ChatEvents:
    """Renders a chat completion's chunks as `chat.completion.chunk` events; the first carries the
    assistant role, the last the finish reason (and usage, in a chunk of its own, when asked)."""

    def __init__(self, head: Head, include_usage: bool) -> None:
        self._head = head
        self._include_usage = include_usage
        self._first = True

    def __call__(self, chunk: Chunk) -> list[bytes]:
        h = self._head
        if not chunk.text and chunk.finish_reason is None and not self._first:
            return []
        delta = Delta("assistant" if self._first else None,
                      chunk.text if chunk.text or self._first else None)
        self._first = False
        choice = ChatChunkChoice(0, delta, chunk.finish_reason)
        out = [_encode(ChatChunk(h.id, "chat.completion.chunk", h.created, h.model, [choice]))]
        if chunk.finish_reason is not None and self._include_usage:
            out.append(_encode(ChatChunk(h.id, "chat.completion.chunk", h.created, h.model, [],
                                         usage(chunk))))
        return out
