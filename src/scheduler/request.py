"""`Request`: one generation request, the value every path carries.

It is built once, from `Scheduler.generate`'s arguments or from an HTTP body, checked as it is
built, and carried unchanged to the admission actor (inside `Submit`) and across the Ray cluster
(inside the frontend's `Job`). A new request field is added here, in its check, and where it is
read; nothing in between spells the request out again."""

from __future__ import annotations

import math
from typing import Any

import msgspec

from scheduler.errors import InvalidRequest
from scheduler.params import SamplingParams

MAX_TENANT_CHARS = 256


class Request(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A prompt (text, or token ids) and what to do with it. Checked on construction
    (`InvalidRequest` names the field); token ids are checked against the model's vocabulary
    when the request is submitted.

    `priority`: lower runs first under the `priority` policy. `tenant`: whose request it is
    (`fair`, logs). `timeout`: seconds from submission; then it ends with "timeout". `session`:
    keep this conversation's KV for its next turn."""

    prompt: str | list[int]
    params: SamplingParams = msgspec.field(default_factory=SamplingParams)
    priority: int = 0
    tenant: str = "default"
    timeout: float | None = None
    session: str | None = None

    def __post_init__(self) -> None:
        problem = _problem(self)
        if problem is not None:
            raise InvalidRequest(problem)


def _problem(r: Request) -> str | None:  # noqa: C901 - a flat list of checks reads best
    if not isinstance(r.params, SamplingParams):
        return f"params must be SamplingParams, got {type(r.params).__name__}"
    if not isinstance(r.priority, int) or isinstance(r.priority, bool):
        return f"priority must be an integer, got {type(r.priority).__name__}"
    if not isinstance(r.tenant, str) or not r.tenant or len(r.tenant) > MAX_TENANT_CHARS:
        return (f"tenant must be a non-empty string of at most {MAX_TENANT_CHARS} characters, "
                f"got {r.tenant!r}"[:200])
    t = r.timeout
    if t is not None and (not isinstance(t, int | float) or isinstance(t, bool)
                          or not math.isfinite(t) or t <= 0):
        return f"timeout must be a positive number of seconds or None, got {t!r}"
    if (problem := _session_problem(r.session)) is not None:
        return problem
    if isinstance(r.prompt, str):
        if not r.prompt:
            return "prompt is empty"
        try:
            r.prompt.encode("utf-8")
        except UnicodeEncodeError as exc:
            return f"prompt is not valid Unicode text: {exc.reason} at position {exc.start}"
    elif isinstance(r.prompt, list):
        if not r.prompt:
            return "prompt is empty"
    else:
        return f"prompt must be a str or a list of token ids, got {type(r.prompt).__name__}"
    return None


def sibling_requests(request: Request) -> list[Request]:
    """The requests of `request`'s `n` choices, one choice each. A seeded request gives choice i
    the seed `seed + i`: the choices differ, and the whole answer still repeats."""
    params = request.params
    if params.n == 1:
        return [request]
    out = []
    for i in range(params.n):
        seed = None if params.seed is None else (params.seed + i) % 2**64
        choice = msgspec.structs.replace(params, n=1, seed=seed)
        out.append(msgspec.structs.replace(request, params=choice))
    return out


def make_request(
    prompt: object, params: object, priority: object, tenant: object, timeout: object,
    session: object,
) -> Request:
    """The `Request` for `generate`'s arguments (`params=None`: the defaults)."""
    if params is None:
        params = SamplingParams()
    return Request(prompt=prompt, params=params, priority=priority, tenant=tenant,  # type: ignore[arg-type]
                   timeout=timeout, session=session)  # type: ignore[arg-type]


def _session_problem(session: object) -> str | None:
    if session is not None and (
        not isinstance(session, str) or not session or len(session) > MAX_TENANT_CHARS
    ):
        return (f"session must be None or a non-empty string of at most {MAX_TENANT_CHARS} "
                f"characters, got {session!r}"[:200])
    return None


def check_session(session: object) -> None:
    """The session check of `Request`, for calls that take a session alone (`drop_session`)."""
    if (problem := _session_problem(session)) is not None:
        raise InvalidRequest(problem)


def check_token_ids(ids: list[Any], vocab_size: int) -> None:
    if not ids:
        raise InvalidRequest("prompt is empty")
    # The common case in C (on the event loop: a long prompt's loop below took 60 ns a token);
    # the loop only finds the first bad one. `type(t) is int` keeps bools out.
    if set(map(type, ids)) == {int} and min(ids) >= 0 and max(ids) < vocab_size:
        return
    for i, t in enumerate(ids):
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size:
            raise InvalidRequest(f"prompt[{i}] = {t!r} is not a token id in [0, {vocab_size})"[:200])


def check_for_model(request: Request, vocab_size: int, grammar_unavailable: str) -> None:
    """What a request asks of the model it is submitted to: token ids in its vocabulary, and
    structured output only where the grammar engine can read its tokenizer (`grammar_unavailable`
    says why not; "" when it can)."""
    if isinstance(request.prompt, list):
        check_token_ids(request.prompt, vocab_size)
    params = request.params
    for token, _ in params.bias:
        if token >= vocab_size:
            raise InvalidRequest(f"logit_bias names token {token}, not a token id in [0, {vocab_size})")
    if grammar_unavailable and (params.json_schema is not None or params.grammar is not None):
        raise InvalidRequest(f"structured output is unavailable for this model: {grammar_unavailable}")


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


def chat_template_ids(tokenizer: Any, messages: list[dict[str, Any]], **template: Any) -> list[int]:
    """Token ids of `messages` under `tokenizer`'s chat template, ready for `generate`. Each
    message has a `role` and a text `content` ("" beside an assistant's `tool_calls`);
    `template` holds extra template arguments (`tools`)."""
    if not isinstance(messages, list) or not messages or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in messages
    ):
        raise InvalidRequest("messages must be a non-empty list of {'role': str, 'content': str}")
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, **template)
    return [int(t) for t in ids]
