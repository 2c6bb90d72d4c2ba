"""What outlives a transport (docs/protocol.md §11): the session id, both directions'
sequence numbers and windows, the unacked frames, and the streams with their states and
credit. A new connection attaches to it on resume."""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from typing import Literal

from ._receive_window import ReceiveWindow
from ._send_window import RetransmitTimer, SendWindow
from ._stream_state import StreamEvent, StreamRecord, StreamState, next_state
from .errors import LocalProtocolError
from .limits import ProtocolLimits
from .messages import (
    Accept,
    Cancel,
    ChatMessage,
    Delta,
    End,
    EndReason,
    Open,
    ReliableMessage,
    SamplingOptions,
    StreamError,
    Usage,
)

Role = Literal["client", "server"]



def new_session_id() -> str:
    """An opaque, unguessable session id (128 random bits)."""
    return secrets.token_urlsafe(16)


class SessionState:
    """One session's reliable state, independent of any transport.

    The reliable-message methods (`accept_stream`, `send_delta`, `end_stream` for a server,
    `open_stream`, `cancel_stream` for a client) number and keep frames; the attached
    connection writes them. While detached they are kept, bounded by the peer's window, and
    written after resume.
    """

    __slots__ = (
        "attached",
        "detached_at",
        "discarded",
        "going_away",
        "id",
        "last_stream_id",
        "limits",
        "recv",
        "role",
        "send",
        "streams",
    )

    def __init__(self, role: Role, limits: ProtocolLimits, session_id: str = "") -> None:
        self.role: Role = role
        self.limits = limits
        self.id = session_id
        timer = RetransmitTimer(limits.rto_initial, limits.rto_min, limits.rto_max)
        self.send: SendWindow[ReliableMessage] = SendWindow(timer)
        self.recv: ReceiveWindow[ReliableMessage] = ReceiveWindow(
            limits.window, ack_every=limits.ack_every, ack_delay=limits.ack_delay
        )
        self.streams: dict[int, StreamRecord] = {}
        self.last_stream_id = 0
        """Highest stream id opened in this session (ids only grow, §4)."""
        self.going_away = False
        self.detached_at: float | None = None
        """When the last connection went away (None while attached or never attached)."""
        self.attached = False
        """A connection is using this session now."""
        self.discarded = False
        """Closed by an `error`: not resumable."""

    # -- lifecycle ------------------------------------------------------------------------------

    def expired(self, now: float, grace: float | None = None) -> bool:
        """True when the session can no longer be resumed at `now` (§11)."""
        if self.discarded:
            return True
        if self.detached_at is None:
            return False
        limit = self.limits.resume_grace if grace is None else grace
        return now - self.detached_at > limit

    def open_streams(self) -> tuple[int, ...]:
        return tuple(self.streams)

    # -- stream transitions ---------------------------------------------------------------------

    def _transition(self, stream: int, event: StreamEvent) -> StreamRecord:
        record = self.streams.get(stream)
        if record is None:
            raise LocalProtocolError(f"stream {stream} is not open")
        state = next_state(record.state, event)
        if state is None:
            raise LocalProtocolError(f"cannot send {event} on stream {stream} in {record.state}")
        record.state = state
        if state is StreamState.CLOSED:
            del self.streams[stream]
        return record

    def _require(self, role: Role, what: str) -> None:
        if self.role != role:
            raise LocalProtocolError(f"only a {role} sends {what}")

    def _push(self, message: ReliableMessage) -> int:
        return self.send.push(message)

    # -- server → client ------------------------------------------------------------------------

    def can_send_delta(self, stream: int, n_tokens: int = 1) -> bool:
        """Whether a delta of `n_tokens` may go out now: the send window has room, no frame is
        waiting for it, and the stream's credit allows the tokens (§6, §9)."""
        send = self.send
        if send.next_seq >= send.end:
            return False
        record = self.streams.get(stream)
        if record is None or not record.flowing:
            return False
        return record.allows(n_tokens)

    def accept_stream(self, stream: int, token_quota: int, batch_size: int) -> int:
        self._require("server", "accept")
        seq = self.send.next_seq
        self._transition(stream, "accept")
        return self._push(
            Accept(seq=seq, stream=stream, token_quota=token_quota, batch_size=batch_size)
        )

    def send_delta(self, stream: int, text: str, tokens: Sequence[int] = ()) -> int:
        """Number a delta; raise `LocalProtocolError` unless `can_send_delta` allows it."""
        send = self.send
        seq = send.next_seq
        if seq >= send.end:
            raise LocalProtocolError("send window is full: wait for SendWindowOpened")
        record = self.streams.get(stream)
        if record is None or not record.flowing:
            if self.role != "server":
                raise LocalProtocolError("only a server sends delta")
            raise LocalProtocolError(f"stream {stream} is not accepted")
        if type(tokens) is not tuple:
            tokens = tuple(tokens)
        credit = record
        index = credit.sent
        n = len(tokens)
        if credit.limit is not None and index + n > credit.limit:
            raise LocalProtocolError(
                f"stream {stream} has credit up to token {credit.limit}: wait for CreditGranted"
            )
        credit.sent = index + n
        return send.push(Delta(seq=seq, stream=stream, index=index, text=text, tokens=tokens))

    def end_stream(
        self, stream: int, reason: EndReason, usage: Usage, error: StreamError | None = None
    ) -> int:
        self._require("server", "end")
        seq = self.send.next_seq
        self._transition(stream, "end")
        return self._push(End(seq=seq, stream=stream, reason=reason, usage=usage, error=error))

    # -- client → server ------------------------------------------------------------------------

    def open_stream(
        self,
        *,
        prompt: str | None = None,
        messages: Sequence[ChatMessage] | None = None,
        model: str | None = None,
        params: SamplingOptions | None = None,
        priority: int = 0,
        deadline_ms: int | None = None,
        credit: int | None = None,
        expected_tokens: int | None = None,
        max_latency_ms: int | None = None,
    ) -> int:
        """Number an `open` for a new stream; return the stream id."""
        self._require("client", "open")
        if self.going_away:
            raise LocalProtocolError("the server sent goaway: no new streams")
        if (prompt is None) == (messages is None):
            raise LocalProtocolError("open needs exactly one of prompt and messages")
        if credit is not None and credit < 0:
            raise LocalProtocolError("credit must be >= 0")
        stream = self.last_stream_id + 1
        message = Open(
            seq=self.send.next_seq,
            stream=stream,
            prompt=prompt,
            messages=None if messages is None else tuple(messages),
            model=model,
            params=params,
            priority=priority,
            deadline_ms=deadline_ms,
            credit=credit,
            expected_tokens=expected_tokens,
            max_latency_ms=max_latency_ms,
        )
        self.last_stream_id = stream
        self.streams[stream] = StreamRecord(credit)
        self._push(message)
        return stream

    def cancel_stream(self, stream: int) -> int | None:
        """Number a `cancel`; None when the stream is already cancelled or gone."""
        self._require("client", "cancel")
        record = self.streams.get(stream)
        if record is None:
            if 0 < stream <= self.last_stream_id:
                return None
            raise LocalProtocolError(f"stream {stream} was never opened")
        if record.state is StreamState.CANCELLED:
            return None
        self._transition(stream, "cancel")
        return self._push(Cancel(seq=self.send.next_seq, stream=stream))
