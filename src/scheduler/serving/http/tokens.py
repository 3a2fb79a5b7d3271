"""`/tokenize` and `/detokenize` (vLLM's shapes): what the model's tokenizer makes of a prompt or
a conversation, and the text of token ids, so clients can count and budget before they ask."""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from scheduler.serving.http import requests as rq
from scheduler.serving.http.errors import invalid
from scheduler.serving.http.prompts import chat_ids

if TYPE_CHECKING:
    from scheduler.serving.http.prompts import PromptModel, Tokenizing


class TokenizeRequest(msgspec.Struct, kw_only=True, frozen=True):
    model: str | None = None
    prompt: str | None = None
    messages: list[rq.Message] | None = None
    """A conversation, through the chat template with the assistant's turn opened."""
    add_special_tokens: bool = True
    """For `prompt`: BOS and the like, as a completion would get them."""


class TokenizeResponse(msgspec.Struct, frozen=True):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(msgspec.Struct, kw_only=True, frozen=True):
    tokens: list[int]
    model: str | None = None


class DetokenizeResponse(msgspec.Struct, frozen=True):
    prompt: str


async def tokenize(body: bytes, tokens: Tokenizing, model: PromptModel) -> TokenizeResponse:
    req = rq.decode(body, TokenizeRequest)
    if (req.prompt is None) == (req.messages is None):
        raise invalid("give exactly one of prompt or messages", "prompt")
    if req.messages is not None:
        chat = rq.ChatRequest(messages=req.messages)
        ids = await chat_ids(tokens, model, rq.chat_messages(chat))
    elif req.add_special_tokens:
        ids = await tokens.encode(model, req.prompt or "")
    else:
        tokens.check_chars(model, len(req.prompt or ""), "prompt")
        ids = list(model.tokenizer.encode(req.prompt, add_special_tokens=False))
    return TokenizeResponse(len(ids), model.context_length, ids)


def detokenize(body: bytes, model: PromptModel, vocab_size: int) -> DetokenizeResponse:
    req = rq.decode(body, DetokenizeRequest)
    for i, t in enumerate(req.tokens):
        if not 0 <= t < vocab_size:
            raise invalid(f"tokens[{i}] = {t} is not a token id in [0, {vocab_size})", "tokens")
    return DetokenizeResponse(model.tokenizer.decode(req.tokens))
