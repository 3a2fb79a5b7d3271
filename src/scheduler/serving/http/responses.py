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


def chat_completion(head: Head, g: Gather) -> ChatCompletion:
    choices = []
    for last in g.finals():
        lps = g.logprobs(last.index)
        rendered = None if lps is None else chat_logprobs(lps, head.texts)
        message = ChatMessage("assistant", g.text(last.index))
        choices.append(ChatChoice(last.index, message, last.finish_reason, rendered))
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
    of its own after every choice has ended."""

    def __init__(self, head: Head, include_usage: bool, n: int = 1) -> None:
        self._head = head
        self._include_usage = include_usage
        self._first = [True] * n
        self._lps = [_Pending() for _ in range(n)]
        self._finals: list[Chunk] = []
        self._n = n

    def __call__(self, chunk: Chunk) -> list[bytes]:
        h, i = self._head, chunk.index
        lps = self._lps[i].add(chunk)
        first = self._first[i]
        if not chunk.text and chunk.finish_reason is None and not first:
            return []
        delta = Delta("assistant" if first else None, chunk.text if chunk.text or first else None)
        self._first[i] = False
        rendered = None if lps is None else chat_logprobs(lps, h.texts)
        choice = ChatChunkChoice(i, delta, chunk.finish_reason, rendered)
        out = [_encode(ChatChunk(h.id, "chat.completion.chunk", h.created, h.model, [choice]))]
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
