"""Errors the engine reports to its callers, each with a stable code the server maps to a
protocol `end.error` code or an HTTP status."""

from __future__ import annotations

from typing import Literal

ErrorCode = Literal[
    "invalid_request",
    "unknown_model",
    "context_length_exceeded",
    "overloaded",
    "rate_limited",
    "internal",
]


class EngineError(Exception):
    """A request the engine refuses or fails; `param` names the offending parameter if any."""

    def __init__(self, code: ErrorCode, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code: ErrorCode = code
        self.message = message
        self.param = param

    def __repr__(self) -> str:
        return f"EngineError({self.code!r}, {self.message!r}, param={self.param!r})"


def invalid(param: str, message: str) -> EngineError:
    """An `invalid_request` error naming `param`."""
    return EngineError("invalid_request", f"{param}: {message}", param=param)
