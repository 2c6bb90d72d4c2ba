"""Immutable events a connection hands to its application (docs/protocol.md, Appendix: the
Python API). Pings, pongs, acks and batches are handled inside and produce none."""

from __future__ import annotations

import msgspec

from .limits import HeartbeatIntervals
from .messages import EndReason, Hello, Open, StreamError, Usage

__all__ = [
    "ConnectionTimedOut",
    "CreditGranted",
    "DeltaReceived",
    "Event",
    "GoAwayReceived",
    "HelloReceived",
    "PeerError",
    "SendWindowOpened",
    "SessionTimedOut",
    "StreamAccepted",
    "StreamCancelled",
    "StreamEnded",
    "StreamOpened",
    "StreamTimedOut",
    "Welcomed",
]


class Event(msgspec.Struct, frozen=True):
    """Base of every event."""


class HelloReceived(Event, frozen=True):
    """Server: a client said `hello` (new, or resuming `hello.session` from `hello.ack`).
    Answer with `ServerConnection.welcome(session_or_None)`."""

    hello: Hello


class Welcomed(Event, frozen=True):
    """Client: the server answered `hello`. `lost_streams`: streams of the session we tried
    to resume that are gone because the server did not have it (`resumed=False`)."""

    session_id: str
    resumed: bool
    window: int
    heartbeat: HeartbeatIntervals
    max_frame: int
    max_streams: int
    resume_grace: float
    lost_streams: tuple[int, ...] = ()


class StreamOpened(Event, frozen=True):
    """Server: a client opened a stream; `open` carries every field."""

    open: Open


class StreamAccepted(Event, frozen=True):
    stream: int
    token_quota: int
    batch_size: int


class DeltaReceived(Event, frozen=True):
    stream: int
    index: int
    text: str
    tokens: tuple[int, ...]


class StreamEnded(Event, frozen=True):
    stream: int
    reason: EndReason
    usage: Usage
    error: StreamError | None = None


class StreamCancelled(Event, frozen=True):
    """Server: the client cancelled `stream`; abort it and end it with `cancelled`."""

    stream: int


class CreditGranted(Event, frozen=True):
    """Server: the client raised `stream`'s token limit to `limit`."""

    stream: int
    limit: int


class SendWindowOpened(Event, frozen=True):
    """The send window had been full and now has room for `available` reliable frames."""

    available: int


class GoAwayReceived(Event, frozen=True):
    """Client: the server takes no new streams; running ones finish."""

    reason: str


class StreamTimedOut(Event, frozen=True):
    """A stream-tier ping went unanswered. Server: abort the request and end the stream with
    `timeout`. Client: the connection has already sent `cancel`."""

    stream: int


class SessionTimedOut(Event, frozen=True):
    """A session-tier ping went unanswered: the peer application is unresponsive. Server: end
    every stream in `streams` with `timeout`. Client: every one has been cancelled."""

    streams: tuple[int, ...]


class ConnectionTimedOut(Event, frozen=True):
    """A connection-tier ping went unanswered: the transport is dead. Close it and call
    `transport_closed`; the session stays resumable."""


class PeerError(Event, frozen=True):
    """The peer sent `error`: the connection is over (close with `close_code`) and the session
    is discarded."""

    code: str
    message: str
    close_code: int
