"""OpenAI request bodies as msgspec Structs, checked and mapped onto the scheduler's arguments.

Unknown fields are ignored (clients send many); known OpenAI features this server cannot honour
(echo, suffix, best_of, ...) are rejected with a 400 that names the field."""

from __future__ import annotations

import re
from typing import Annotated, Any, TypeVar

import msgspec

from scheduler.params import SamplingParams
from scheduler.request import MAX_TENANT_CHARS, Request
from scheduler.serving.http.errors import ApiError, invalid

T = TypeVar("T")

MAX_USER_CHARS = MAX_TENANT_CHARS  # `user` is the tenant
MAX_TEMPERATURE = 2.0  # OpenAI's range is [0, 2]; above it sampling is noise, and slow
MIN_TEMPERATURE = 1e-2  # vLLM's floor: a smaller positive temperature overflows the logits
ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})  # OpenAI's
# A priority is a signed 64-bit integer, as every consumer (policies, metrics, JSON) can hold it.
Priority = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]
_AT = re.compile(r"^(.*) - at `\$\.?(.*)`$")


class StreamOptions(msgspec.Struct, frozen=True):
    include_usage: bool | None = None


class JsonSchemaFormat(msgspec.Struct, frozen=True):
    name: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(msgspec.Struct, frozen=True):
    type: str
    json_schema: JsonSchemaFormat | None = None


class _Request(msgspec.Struct, kw_only=True, frozen=True):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    # Extensions: scheduling priority (lower first, as in vLLM); a session whose KV the next turn
    # continues; sampler knobs mlx_lm.server takes.
    priority: Priority = 0
    session: str | None = None
    top_k: int | None = None
    min_p: float | None = None
    ignore_eos: bool | None = None
    repetition_penalty: float | None = None
    repetition_context_size: int | None = None


class CompletionRequest(_Request, kw_only=True, frozen=True):
    prompt: str | list[str | int | list[int]]
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None
    logprobs: int | None = None


class ContentPart(msgspec.Struct, frozen=True):
    type: str
    text: str | None = None


class Message(msgspec.Struct, frozen=True):
    role: str
    content: str | list[ContentPart] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    name: str | None = None


class ChatRequest(_Request, kw_only=True, frozen=True):
    messages: list[Message]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None


def decode(body: bytes, kind: type[T]) -> T:
    """The request as `kind`, or a 400 naming the field that is wrong."""
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        raise _explain(str(exc)) from None
    except msgspec.DecodeError as exc:
        if "UTF-8" in str(exc):  # msgspec 0.23 says "Invalid UTF-8 encoded string" here
            raise invalid(BAD_UTF8) from None
        raise invalid("the request body is not valid JSON") from None
    except RecursionError:  # nesting in an ignored field is skipped recursively by msgspec
        raise invalid("the request body is not valid JSON: it is nested too deeply") from None
    except UnicodeDecodeError:  # msgspec before 0.23
        raise invalid(BAD_UTF8) from None


BAD_UTF8 = "the request body is not valid JSON: a string holds invalid UTF-8"


def _explain(message: str) -> ApiError:
    # msgspec says "Expected `int | null`, got `str` - at `$.max_tokens`"; say "max_tokens: ..." instead.
    match = _AT.match(message)
    if match is None:
        if message.startswith("Object missing required field"):
            field = message.split("`")[1]
            return invalid(f"{field} is required", field)
        return invalid("the request body must be a JSON object")
    what, where = match.groups()
    return invalid(f"{where}: {what[0].lower()}{what[1:]}", re.split(r"[.\[]", where, maxsplit=1)[0])


def check_common(req: _Request) -> None:
    """Reject what this server cannot do rather than silently doing something else."""
    if req.user is not None and len(req.user) > MAX_USER_CHARS:
        raise invalid(f"user must have at most {MAX_USER_CHARS} characters", "user")
    if req.session is not None and not 0 < len(req.session) <= MAX_USER_CHARS:
        raise invalid(f"session must have 1 to {MAX_USER_CHARS} characters", "session")


def check_completion(req: CompletionRequest) -> None:
    check_common(req)
    if req.best_of not in (None, 1):
        raise invalid(f"best_of must be 1, got {req.best_of}", "best_of")
    if req.echo:
        raise invalid("echo is not supported", "echo")
    if req.suffix:
        raise invalid("suffix is not supported", "suffix")


def check_chat(req: ChatRequest) -> None:
    check_common(req)
    if req.top_logprobs and not req.logprobs:
        raise invalid("top_logprobs needs logprobs: true", "top_logprobs")


def completion_prompt(req: CompletionRequest) -> str | list[int]:
    """The one prompt of a completion request: text, or token ids used as given."""
    prompt = req.prompt
    if isinstance(prompt, str):
        return prompt
    if not prompt:
        raise invalid("prompt is empty", "prompt")
    if all(isinstance(t, int) for t in prompt):
        return [t for t in prompt if isinstance(t, int)]
    if len(prompt) == 1 and isinstance(prompt[0], str | list):
        return prompt[0]
    if len(prompt) > 1 and all(isinstance(p, str | list) for p in prompt):
        raise invalid(f"prompt holds a batch of {len(prompt)} prompts; send one per request", "prompt")
    raise invalid("prompt must be a string, a list of token ids, or a list holding one of those",
                  "prompt")


def chat_messages(req: ChatRequest) -> list[dict[str, Any]]:
    """Messages as the chat template takes them; content parts must be text. An assistant's
    `tool_calls` and a tool result's `tool_call_id` and `name` are kept for the template."""
    out: list[dict[str, Any]] = []
    for i, m in enumerate(req.messages):
        if m.content is None or isinstance(m.content, str):
            content = m.content or ""
        else:
            texts: list[str] = []
            for part in m.content:
                if part.type != "text" or part.text is None:
                    raise invalid(
                        f"messages[{i}].content: only text parts are supported, got {part.type!r}",
                        "messages",
                    )
                texts.append(part.text)
            content = "".join(texts)
        if m.role not in ROLES:
            raise invalid(f"messages[{i}].role must be one of {', '.join(sorted(ROLES))}; "
                          f"got {m.role[:32]!r}", "messages")
        message: dict[str, Any] = {"role": m.role, "content": content}
        if m.tool_calls:
            message["tool_calls"] = _tool_calls(m.tool_calls, i)
        for key in ("tool_call_id", "name"):
            if getattr(m, key) is not None:
                message[key] = getattr(m, key)
        out.append(message)
    if not out:
        raise invalid("messages must not be empty", "messages")
    return out


def _tool_calls(calls: list[dict[str, Any]], i: int) -> list[dict[str, Any]]:
    for call in calls:
        function = call.get("function")
        if not (isinstance(function, dict) and isinstance(function.get("name"), str)
                and isinstance(function.get("arguments", ""), str | dict)):
            raise invalid(f"messages[{i}].tool_calls: each call needs a function with a name and "
                          "arguments", "messages")
    return calls


def request(
    req: CompletionRequest | ChatRequest, prompt: str | list[int], max_tokens: int | None,
    default_max_tokens: int, vocab_size: int = 0,
) -> Request:
    """The `Request` for the body `req` (its prompt already taken out or tokenized); it raises
    `InvalidRequest` naming a bad field."""
    params = sampling(req, max_tokens, default_max_tokens, vocab_size)
    return Request(prompt=prompt, params=params, priority=req.priority, tenant=tenant(req),
                   session=req.session)


def sampling(
    req: CompletionRequest | ChatRequest, max_tokens: int | None, default_max_tokens: int, vocab_size: int = 0
) -> SamplingParams:
    """`SamplingParams` for the request; it raises `InvalidRequest` naming a bad field.
    Temperature: over 2 is refused (OpenAI), (0, 0.01) raised to 0.01 (vLLM); a `top_k` of at
    least the vocabulary keeps every token, so it is off (vLLM clamps it likewise)."""
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    temperature = 1.0 if req.temperature is None else req.temperature
    if temperature > MAX_TEMPERATURE:
        raise invalid(f"temperature must be between 0 and {MAX_TEMPERATURE:g}, got {temperature}",
                      "temperature")
    if 0 < temperature < MIN_TEMPERATURE:
        temperature = MIN_TEMPERATURE
    top_k = req.top_k or 0
    if vocab_size and top_k >= vocab_size:
        top_k = 0
    if isinstance(req, ChatRequest):
        logprobs, top = bool(req.logprobs), req.top_logprobs or 0
    else:  # a completion's `logprobs` is how many of the likeliest tokens to list (0: none)
        logprobs, top = req.logprobs is not None, req.logprobs or 0
    return SamplingParams(
        max_tokens=default_max_tokens if max_tokens is None else max_tokens,
        temperature=temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=top_k,
        min_p=req.min_p or 0.0,
        seed=req.seed,
        stop=stop,
        ignore_eos=bool(req.ignore_eos),
        logprobs=logprobs,
        top_logprobs=top,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        penalty_context=req.repetition_context_size or 20,
        logit_bias=logit_bias(req.logit_bias),
        n=1 if req.n is None else req.n,
        json_schema=response_schema(req.response_format),
    )


def response_schema(fmt: ResponseFormat | None) -> dict[str, Any] | None:
    """The JSON schema `response_format` asks the output to follow (None: free text)."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "object"}
    if fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema is None:
            raise invalid("response_format.json_schema.schema is required for type 'json_schema'",
                          "response_format")
        return fmt.json_schema.schema
    raise invalid(f"response_format.type must be 'text', 'json_object' or 'json_schema', got "
                  f"{fmt.type[:40]!r}", "response_format")


def logit_bias(bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's `{"token id": bias}` as (token_id, bias) pairs."""
    if not bias:
        return ()
    pairs = []
    for key, value in bias.items():
        if not key.isdigit():
            raise invalid(f"logit_bias keys must be token ids, got {key!r}"[:200], "logit_bias")
        pairs.append((int(key), value))
    return tuple(sorted(pairs))


def tenant(req: _Request) -> str:
    """OpenAI's `user` is the scheduler's tenant (fair sharing, logs)."""
    return req.user or "default"
