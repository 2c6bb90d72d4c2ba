"""Engine error codes map to the documented HTTP statuses and OpenAI error objects."""

from __future__ import annotations

import json

import pytest

from seedance.engine.errors import EngineError
from seedance.server.http.errors import HttpError, from_engine_error


@pytest.mark.parametrize(
    ("code", "status", "kind"),
    [
        ("invalid_request", 400, "invalid_request_error"),
        ("context_length_exceeded", 400, "invalid_request_error"),
        ("unknown_model", 404, "invalid_request_error"),
        ("overloaded", 429, "rate_limit_error"),
        ("rate_limited", 429, "rate_limit_error"),
        ("internal", 500, "server_error"),
    ],
)
def test_engine_error_codes_map_to_statuses(code: str, status: int, kind: str) -> None:
    error = from_engine_error(EngineError(code, "msg", param="p"))  # type: ignore[arg-type]
    assert (error.status, error.type) == (status, kind)
    body = json.loads(error.body())
    assert set(body["error"]) == {"message", "type", "param", "code"}
    if status == 429:
        assert ("Retry-After", "1") in error.headers


def test_error_body_shape() -> None:
    body = json.loads(HttpError(413, "too big", code="request_too_large").body())
    assert body == {"error": {"message": "too big", "type": "invalid_request_error",
                              "param": None, "code": "request_too_large"}}
