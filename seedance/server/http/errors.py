"""HTTP errors as the OpenAI API shapes them — `{"error": {"message", "type", "param", "code"}}` —
and the mapping from engine error codes to HTTP statuses."""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from seedance.engine.errors import EngineError

RETRY_AFTER_SECONDS = 1
"""Retry-After sent with 429 (the queue drains within about a second at typical loads)."""


class ErrorDetail(msgspec.Struct, frozen=True):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(msgspec.Struct, frozen=True):
    error: ErrorDetail


class HttpError(Exception):
    """An error response; raise it from a route handler."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        headers: Sequence[tuple[str, str]] = (),
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param
        self.headers = list(headers)

    def body(self) -> bytes:
        detail = ErrorDetail(message=self.message, type=self.type, param=self.param, code=self.code)
        return msgspec.json.encode(ErrorBody(error=detail))


def bad_request(message: str, param: str | None = None, code: str | None = None) -> HttpError:
    return HttpError(400, message, param=param, code=code)


def not_found(message: str, code: str = "not_found", param: str | None = None) -> HttpError:
    return HttpError(404, message, code=code, param=param)


def unavailable(message: str, code: str = "service_unavailable") -> HttpError:
    return HttpError(
        503,
        message,
        type="service_unavailable_error",
        code=code,
        headers=[("Retry-After", str(RETRY_AFTER_SECONDS))],
    )


def from_engine_error(error: EngineError) -> HttpError:
    """Engine/stream error code -> HTTP status (see docs/server.md, error table)."""
    code = error.code
    if code == "invalid_request":
        return HttpError(400, error.message, param=error.param, code="invalid_value")
    if code == "context_length_exceeded":
        return HttpError(400, error.message, param=error.param, code="context_length_exceeded")
    if code == "unknown_model":
        return HttpError(404, error.message, param=error.param or "model", code="model_not_found")
    if code in ("overloaded", "rate_limited"):
        return HttpError(
            429,
            error.message,
            type="rate_limit_error",
            code=code,
            headers=[("Retry-After", str(RETRY_AFTER_SECONDS))],
        )
    return HttpError(500, error.message, type="server_error", code="internal")
