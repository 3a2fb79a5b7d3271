"""Log-probabilities in OpenAI's two shapes: chat's `{"content": [...]}` and the legacy
completions' parallel lists, rendered from the scheduler's `TokenLogprob`s."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec

if TYPE_CHECKING:
    from scheduler.types import TokenLogprob


class TopLogprob(msgspec.Struct, frozen=True):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(msgspec.Struct, frozen=True):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct, frozen=True):
    content: list[ChatTokenLogprob]


class CompletionLogprobs(msgspec.Struct, frozen=True):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class TokenTexts:
    """Each token's text alone (a token that is part of a character shows as U+FFFD; its
    `bytes` then are those of that text, not the token's raw bytes)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self._tokenizer.decode([token_id])
        return text


def chat_logprobs(lps: list[TokenLogprob], texts: TokenTexts) -> ChatLogprobs:
    def top(tid: int, lp: float) -> TopLogprob:
        text = texts(tid)
        return TopLogprob(text, lp, list(text.encode()))

    out = []
    for t in lps:
        text = texts(t.token_id)
        out.append(ChatTokenLogprob(text, t.logprob, list(text.encode()), [top(i, lp) for i, lp in t.top]))
    return ChatLogprobs(out)


def completion_logprobs(lps: list[TokenLogprob], texts: TokenTexts, offset: int) -> CompletionLogprobs:
    """`offset`: characters of the completion's text before these tokens."""
    tokens, offsets = [], []
    for t in lps:
        text = texts(t.token_id)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
    tops = [{texts(i): lp for i, lp in t.top} for t in lps]
    return CompletionLogprobs(tokens, [t.logprob for t in lps], tops, offsets)
