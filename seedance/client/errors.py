"""The client's exceptions: every failure the caller sees is a `SeedanceError` carrying the
protocol's error code."""

from __future__ import annotations


class SeedanceError(Exception):
    """An error from the server or the connection: `code` is the protocol's error code."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}" if message else code)
        self.code = code
        self.message = message


class ConnectFailed(SeedanceError):
    """The server could not be reached (refused, unknown host, TLS, handshake)."""


class SessionLost(SeedanceError):
    """The connection dropped and the session could not be resumed; its streams are gone."""


class StreamFailed(SeedanceError):
    """A stream ended with `reason="error"` (`code`: `invalid_request`, `unknown_model`,
    `context_length_exceeded`, `overloaded`, ...)."""
