"""Prompt text to token ids with bounded work: a prompt that cannot fit the context is refused
from its length in characters before any tokenizing, and long prompts and chat templates run on a
few threads at once, off the event loop.

The bound: no token of the vocabulary spells more than `longest` characters (a byte-level or
SentencePiece token's string has at least one character per character it decodes to), so a text
of more than `context * longest` characters needs more than `context` tokens."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Protocol

import anyio
import structlog
from jinja2 import TemplateError

from scheduler.errors import InvalidRequest
from scheduler.request import chat_template_ids
from scheduler.serving.http.errors import ApiError, invalid

if TYPE_CHECKING:
    from collections.abc import Callable

    from scheduler.engine import EngineClient

log = structlog.get_logger("scheduler.http")

INLINE_CHARS = 2048  # shorter texts are tokenized on the loop: a thread hop costs more


def longest_token_chars(tokenizer: Any) -> int:
    """Characters in the vocabulary's longest token string (0: unknown, no bound)."""
    try:
        vocab = tokenizer.get_vocab()
    except Exception:  # a tokenizer without a vocabulary gets no character bound, said once
        log.warning("prompt_char_bound_off", reason="the tokenizer has no get_vocab()")
        return 0
    return max((len(t) for t in vocab), default=0)


class PromptModel(Protocol):
    """What bounded tokenizing needs of a model: a `Scheduler` (`SchedulerPrompts`) or the
    cluster frontend's own tokenizer."""

    tokenizer: Any
    context_length: int

    def encode(self, text: str) -> list[int]: ...

    def chat(self, messages: list[dict[str, Any]], **template: Any) -> list[int]: ...


class SchedulerPrompts:
    """An engine's model as a `PromptModel`."""

    def __init__(self, sched: EngineClient) -> None:
        self.tokenizer = sched.model.codec.tokenizer
        self.context_length = sched.model.info.context_length
        self.encode = sched.model.codec.encode

    def chat(self, messages: list[dict[str, Any]], **template: Any) -> list[int]:
        return chat_template_ids(self.tokenizer, messages, **template)


class Tokenizing:
    """Tokenization for the app: the character bound of one model, and a limiter for threads."""

    def __init__(self, threads: int) -> None:
        self._limiter = anyio.CapacityLimiter(threads)
        self._longest: int | None = None
        self.threads = threads

    def max_chars(self, model: PromptModel) -> int:
        """Characters a prompt may have before it is refused untokenized (0: no bound)."""
        if self._longest is None:
            self._longest = longest_token_chars(model.tokenizer)
        context = model.context_length
        return context * self._longest if context and self._longest else 0

    def check_chars(self, model: PromptModel, chars: int, field: str) -> None:
        bound = self.max_chars(model)
        if bound and chars > bound:
            raise invalid(
                f"{field} has {chars} characters, more than the model's context of "
                f"{model.context_length} tokens can hold (at most {bound} characters)",
                field,
            )

    async def encode(self, model: PromptModel, text: str) -> list[int]:
        """Token ids of a completion prompt, refused by length first."""
        self.check_chars(model, len(text), "prompt")
        ids = await self._run(model.encode, text, len(text))
        if not ids:
            raise InvalidRequest("prompt encodes to no tokens")
        return ids

    async def chat(self, model: PromptModel, messages: list[dict[str, Any]], **template: Any) -> list[int]:
        """Token ids of the conversation through the chat template (with `template`'s extra
        arguments, such as `tools`), refused by length first."""
        # Tools shown through the template count too: a huge tool list is refused untokenized.
        chars = sum(len(m.get("content") or "") for m in messages) + (len(str(template)) if template else 0)
        self.check_chars(model, chars, "messages")
        return await self._run(functools.partial(model.chat, **template), messages, chars)

    async def _run(self, fn: Callable[[Any], list[int]], arg: Any, chars: int) -> list[int]:
        if chars <= INLINE_CHARS:
            return fn(arg)
        return await anyio.to_thread.run_sync(fn, arg, limiter=self._limiter)


async def chat_ids(
    tokens: Tokenizing, model: PromptModel, messages: list[dict[str, Any]], **template: Any,
) -> list[int]:
    """`tokens.chat`, with a chat template's refusal as a 400 that names `messages`."""
    try:
        return await tokens.chat(model, messages, **template)
    except (InvalidRequest, ApiError):
        raise
    except (TemplateError, ValueError, TypeError) as exc:  # templates raise on roles they refuse
        raise invalid(f"messages: the model's chat template rejected them: {exc}", "messages") from None
