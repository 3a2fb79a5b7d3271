"""Request checks that raise `InvalidRequest` naming the field or what is wrong with the prompt."""

from __future__ import annotations

import math
from typing import Any

from scheduler.errors import InvalidRequest
from scheduler.params import SamplingParams

MAX_TENANT_CHARS = 256


def check_session(session: object) -> None:
    if session is not None and (
        not isinstance(session, str) or not session or len(session) > MAX_TENANT_CHARS
    ):
        raise InvalidRequest(
            f"session must be None or a non-empty string of at most {MAX_TENANT_CHARS} characters, "
            f"got {session!r}"[:200]
        )


def check_arguments(
    prompt: object,
    params: object,
    priority: object,
    tenant: object,
    timeout: object,
    vocab_size: int,
) -> SamplingParams:
    """The checks `generate()` makes before anything is queued; returns the parameters to use."""
    if params is None:
        params = SamplingParams()
    elif not isinstance(params, SamplingParams):
        raise InvalidRequest(f"params must be SamplingParams, got {type(params).__name__}")
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise InvalidRequest(f"priority must be an integer, got {type(priority).__name__}")
    if not isinstance(tenant, str) or not tenant or len(tenant) > MAX_TENANT_CHARS:
        raise InvalidRequest(
            f"tenant must be a non-empty string of at most {MAX_TENANT_CHARS} characters, "
            f"got {tenant!r}"[:200]
        )
    if timeout is not None and (
        not isinstance(timeout, int | float) or isinstance(timeout, bool)
        or not math.isfinite(timeout) or timeout <= 0
    ):
        raise InvalidRequest(f"timeout must be a positive number of seconds or None, got {timeout!r}")
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidRequest("prompt is empty")
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise InvalidRequest(
                f"prompt is not valid Unicode text: {exc.reason} at position {exc.start}"
            ) from None
    elif isinstance(prompt, list):
        check_token_ids(prompt, vocab_size)
    else:
        raise InvalidRequest(f"prompt must be a str or a list of token ids, got {type(prompt).__name__}")
    return params


def check_token_ids(ids: list[object], vocab_size: int) -> None:
    if not ids:
        raise InvalidRequest("prompt is empty")
    for i, t in enumerate(ids):
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size:
            raise InvalidRequest(f"prompt[{i}] = {t!r} is not a token id in [0, {vocab_size})"[:200])


def check_length(prompt_tokens: int, max_tokens: int, context_length: int) -> None:
    """The prompt, and the prompt with its output, must fit the model's context (0: unknown)."""
    context = context_length or 2**62
    if prompt_tokens > context:
        raise InvalidRequest(
            f"prompt has {prompt_tokens} tokens, longer than the model's context of {context}"
        )
    if prompt_tokens + max_tokens > context:
        raise InvalidRequest(
            f"prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) exceeds the "
            f"model's context of {context}; lower max_tokens"
        )


def chat_template_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of `messages` under `tokenizer`'s chat template, ready for `generate`."""
    if not isinstance(messages, list) or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str)
        and isinstance(m.get("content"), str) for m in messages
    ) or not messages:
        raise InvalidRequest("messages must be a non-empty list of {'role': str, 'content': str}")
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return [int(t) for t in ids]
