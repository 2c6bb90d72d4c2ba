"""Protocol errors with a side, as in h11: `LocalProtocolError` when the caller misused the API,
`RemoteProtocolError` when the peer broke the protocol (carrying the error code and the
WebSocket close code to answer with)."""

from __future__ import annotations

from enum import IntEnum, StrEnum


class ErrorCode(StrEnum):
    """Connection error codes (docs/protocol.md §12.1), sent in an `error` message."""

    CORRUPTED_FRAME = "corrupted_frame"
    FRAME_TOO_LARGE = "frame_too_large"
    INVALID_MESSAGE = "invalid_message"
    UNKNOWN_TYPE = "unknown_type"
    PROTOCOL_VIOLATION = "protocol_violation"
    UNSUPPORTED_VERSION = "unsupported_version"
    INVALID_HEARTBEAT = "invalid_heartbeat"
    UNAUTHORIZED = "unauthorized"
    OVERLOADED = "overloaded"
    INTERNAL = "internal"


class StreamErrorCode(StrEnum):
    """Stream error codes (docs/protocol.md §12.2), carried in `end.error`."""

    INVALID_REQUEST = "invalid_request"
    UNKNOWN_MODEL = "unknown_model"
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
    RATE_LIMITED = "rate_limited"
    OVERLOADED = "overloaded"
    INTERNAL = "internal"
    SHUTTING_DOWN = "shutting_down"
    """With `reason` `cancelled`: the server's drain timed out before the stream ended."""


class CloseCode(IntEnum):
    """WebSocket close codes (docs/protocol.md §13.1)."""

    NORMAL = 1000
    GOING_AWAY = 1001
    PROTOCOL_ERROR = 1002
    UNAUTHORIZED = 1008
    TOO_LARGE = 1009
    INTERNAL = 1011
    OVERLOADED = 1013


_CLOSE_CODES: dict[str, CloseCode] = {
    ErrorCode.FRAME_TOO_LARGE: CloseCode.TOO_LARGE,
    ErrorCode.UNAUTHORIZED: CloseCode.UNAUTHORIZED,
    ErrorCode.OVERLOADED: CloseCode.OVERLOADED,
    ErrorCode.INTERNAL: CloseCode.INTERNAL,
}


def close_code_for(code: str) -> int:
    """The WebSocket close code to use after an `error` with `code` (1002 unless listed)."""
    return int(_CLOSE_CODES.get(code, CloseCode.PROTOCOL_ERROR))


class ProtocolError(Exception):
    """Base of both error sides."""


class LocalProtocolError(ProtocolError):
    """The caller misused the API (for example sent a delta without window or credit, or used
    a closed connection). The connection's state is unchanged unless the message says so."""


class RemoteProtocolError(ProtocolError):
    """The peer broke the protocol. `code` is the connection error code to send, `close_code`
    the WebSocket close code, `field` the offending field for `invalid_message`."""

    def __init__(self, code: str, message: str, *, field: str | None = None) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.field = field
        self.close_code = close_code_for(code)
