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


class ChatMessage(msgspec.Struct, frozen=True):
    role: str
    content: str


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


class Collected:
    """A request's chunks gathered into one answer: the text, the log-probabilities (when
    asked for) and the last chunk, which has the finish reason and the counts."""

    def __init__(self) -> None:
        self._text: list[str] = []
        self.logprobs: list[TokenLogprob] | None = None
        self.last: Chunk | None = None

    def add(self, chunk: Chunk) -> None:
        self._text.append(chunk.text)
        if chunk.logprobs is not None:
            self.logprobs = (self.logprobs or []) + chunk.logprobs
        self.last = chunk

    @property
    def text(self) -> str:
        return "".join(self._text)

    @property
    def final(self) -> Chunk:
        assert self.last is not None and self.last.finish_reason is not None
        return self.last


def completion(head: Head, c: Collected) -> TextCompletion:
    lps = None if c.logprobs is None else completion_logprobs(c.logprobs, head.texts, 0)
    return TextCompletion(head.id, "text_completion", head.created, head.model,
                          [CompletionChoice(0, c.text, c.final.finish_reason, lps)], usage(c.final))


def chat_completion(head: Head, c: Collected) -> ChatCompletion:
    lps = None if c.logprobs is None else chat_logprobs(c.logprobs, head.texts)
    choice = ChatChoice(0, ChatMessage("assistant", c.text), c.final.finish_reason, lps)
    return ChatCompletion(head.id, "chat.completion", head.created, head.model, [choice],
                          usage(c.final))


class CompletionEvents:
    """Renders a completion's chunks as stream events (JSON bytes, one per SSE `data:`)."""

    def __init__(self, head: Head, include_usage: bool) -> None:
        self._head = head
        self._include_usage = include_usage
        self._lps = _Pending()
        self._offset = 0

    def __call__(self, chunk: Chunk) -> list[bytes]:
        h = self._head
        lps = self._lps.add(chunk)
        if not chunk.text and chunk.finish_reason is None:
            return []  # the detokenizer is holding back a partial character
        rendered = None if lps is None else completion_logprobs(lps, h.texts, self._offset)
        self._offset += len(chunk.text)
        choice = CompletionChoice(0, chunk.text, chunk.finish_reason, rendered)
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
        self._lps = _Pending()

    def __call__(self, chunk: Chunk) -> list[bytes]:
        h = self._head
        lps = self._lps.add(chunk)
        if not chunk.text and chunk.finish_reason is None and not self._first:
            return []
        delta = Delta("assistant" if self._first else None,
                      chunk.text if chunk.text or self._first else None)
        self._first = False
        rendered = None if lps is None else chat_logprobs(lps, h.texts)
        choice = ChatChunkChoice(0, delta, chunk.finish_reason, rendered)
        out = [_encode(ChatChunk(h.id, "chat.completion.chunk", h.created, h.model, [choice]))]
        if chunk.finish_reason is not None and self._include_usage:
            out.append(_encode(ChatChunk(h.id, "chat.completion.chunk", h.created, h.model, [],
                                         usage(chunk))))
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
