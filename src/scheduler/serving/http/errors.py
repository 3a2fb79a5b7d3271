"""Errors in OpenAI's JSON shape (`{"error": {"message", "type", "param", "code"}}`) and how the
scheduler's exceptions map to HTTP statuses."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import msgspec
from starlette.responses import Response

from scheduler.errors import InvalidRequest, QueueFull, SchedulerClosed, SchedulerError

if TYPE_CHECKING:
    from collections.abc import Mapping

# The request fields a scheduler `InvalidRequest` message can name.
_PARAMS = frozenset({
    "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "priority", "prompt",
    "messages", "logprobs", "top_logprobs", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "penalty_context", "logit_bias", "n", "input", "json_schema", "grammar",
    "structured", "tools", "tool_choice",
})
# Scheduler names whose request field is spelled otherwise in OpenAI's bodies.
_FIELD = {"json_schema": "response_format", "structured": "response_format"}


class ErrorBody(msgspec.Struct, frozen=True):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorEnvelope(msgspec.Struct, frozen=True):
    error: ErrorBody


class ApiError(Exception):
    """An error answered to the client as `status` with an OpenAI-shaped body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str,  # noqa: A002 - OpenAI's field name
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.body = ErrorBody(message, type, param, code)
        self.headers = dict(headers or {})

    def response(self, headers: Mapping[str, str] | None = None) -> Response:
        return json_response(ErrorEnvelope(self.body), self.status, {**self.headers, **(headers or {})})

    def event(self) -> bytes:
        """The same error as the data of one server-sent event (after a 200 has gone out)."""
        return msgspec.json.encode(ErrorEnvelope(self.body))


def json_response(
    content: msgspec.Struct, status: int = 200, headers: Mapping[str, str] | None = None
) -> Response:
    return Response(msgspec.json.encode(content), status, headers, media_type="application/json")


def invalid(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, type="invalid_request_error", param=param)


def not_found(message: str) -> ApiError:
    return ApiError(404, message, type="not_found_error", code="not_found")


def shutting_down() -> ApiError:
    return ApiError(503, "the server is shutting down; retry on another instance or later",
                    type="service_unavailable", code="shutting_down")


def internal(request_id: str) -> ApiError:
    return ApiError(500, f"the server failed while processing request {request_id}; the error is "
                    "logged under that id", type="server_error", code="internal_error")


def from_scheduler(exc: SchedulerError, request_id: str, *, prompt_field: str = "prompt") -> ApiError:
    """The HTTP answer to a scheduler exception raised by a request."""
    if isinstance(exc, InvalidRequest):
        # The message names the field first ("top_p must be ...", "prompt[3] = ...", "each stop ...").
        param = next((w for w in re.findall(r"[a-z_]+", str(exc)) if w in _PARAMS), None)
        param = _FIELD.get(param, param) if param else param
        return invalid(str(exc), prompt_field if param == "prompt" else param)
    if isinstance(exc, QueueFull):
        return ApiError(429, f"the scheduler's queue is full: {exc}", type="rate_limit_error",
                        code="queue_full", headers={"retry-after": "1"})
    if isinstance(exc, SchedulerClosed):
        return shutting_down()
    return internal(request_id)  # no other SchedulerError is a request's doing
