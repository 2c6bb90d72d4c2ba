"""The server side of one transport (docs/protocol.md, Appendix: the Python API): answers
`hello` with `welcome` (new or resumed session), admits and serves streams."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

from ._connection import BaseConnection, ConnectionState, violation
from ._framing import SMALL_FRAME, SMALL_HEADERS, pack_header
from ._heartbeat import CONNECTION, SESSION, Key, negotiate
from ._session import Role, SessionState, new_session_id
from ._stream_state import StreamRecord, StreamState, next_state
from .errors import ErrorCode, LocalProtocolError, RemoteProtocolError
from .events import (
    ConnectionTimedOut,
    CreditGranted,
    HelloReceived,
    SessionTimedOut,
    StreamCancelled,
    StreamOpened,
    StreamTimedOut,
)
from .limits import MAGIC, PROTOCOL_VERSION, HeartbeatIntervals, ProtocolLimits
from .messages import (
    Ack,
    Batch,
    Cancel,
    Codec,
    Credit,
    Delta,
    EndReason,
    Error,
    GoAway,
    Heartbeat,
    Hello,
    Open,
    Ping,
    Pong,
    ReliableMessage,
    StreamError,
    Usage,
    Welcome,
)

__all__ = ["ServerConnection"]

_OPEN = ConnectionState.OPEN
_CANCELLED = StreamState.CANCELLED


class ServerConnection(BaseConnection):
    """The server side of one transport."""

    __slots__ = ("_hello", "_intervals", "_stash", "_stashed")
    _role: ClassVar[Role] = "server"

    def __init__(
        self,
        limits: ProtocolLimits | None = None,
        *,
        codec: Codec = "msgpack",
        coalesce: bool = False,
    ) -> None:
        super().__init__(limits, codec, coalesce)
        self.state = ConnectionState.AWAIT_HELLO
        self._hello: Hello | None = None
        self._intervals: HeartbeatIntervals | None = None
        self._stash: list[bytes] = []
        self._stashed = 0

    def _receive_payload(self, payload: bytes | bytearray | memoryview, now: float) -> None:
        if self._live is not None:
            self._receive_message(self._decode(payload), now)
            return
        if self.state is ConnectionState.AWAIT_WELCOME:
            # frames pipelined after hello wait for the application's welcome()
            self._stashed += len(payload)
            if self._stashed > self.limits.max_frame:
                raise violation("too much data before welcome")
            self._stash.append(bytes(payload))
            return
        if self.state is ConnectionState.AWAIT_HELLO:
            message = self._decode(payload)
            if type(message) is not Hello:
                raise violation(f"{type(message).__name__.lower()} before hello")
            self._on_hello(message, now)
            return
        super()._receive_payload(payload, now)

    def _on_hello(self, hello: Hello, now: float) -> None:
        if hello.v != PROTOCOL_VERSION:
            raise RemoteProtocolError(
                ErrorCode.UNSUPPORTED_VERSION,
                f"protocol version {hello.v} is not supported (this server speaks "
                f"{PROTOCOL_VERSION})",
            )
        self._intervals = negotiate(hello.heartbeat, self.limits)
        self._hello = hello
        self.state = ConnectionState.AWAIT_WELCOME
        self._events.append(HelloReceived(hello=hello))

    def welcome(
        self, session: SessionState | None = None, *, session_id: str | None = None
    ) -> SessionState:
        """Answer the pending `hello`: attach `session` (a resume) or start a new one.

        Raises `RemoteProtocolError` when the client's resume `ack` does not fit the session
        (an `error` is then queued), or when frames pipelined after `hello` break the protocol.
        """
        if self.state is not ConnectionState.AWAIT_WELCOME or self._hello is None:
            raise LocalProtocolError("welcome() answers a HelloReceived event")
        hello, intervals = self._hello, self._intervals
        assert intervals is not None
        now = self._now
        resumed = session is not None
        if session is not None:
            if session.role != "server" or session.expired(now):
                raise LocalProtocolError("welcome() needs a live server session to resume")
            if session.attached:
                raise LocalProtocolError(
                    "the session is attached to another connection: call its "
                    "transport_closed(now) and close that transport first"
                )
        else:
            session = SessionState("server", self.limits, session_id or new_session_id())
        session.detached_at = None
        session.attached = True
        session.send.peer_window = hello.window
        self._opened(session)
        self._write(
            Welcome(
                v=PROTOCOL_VERSION,
                session=session.id,
                resumed=resumed,
                ack=session.recv.ack,
                window=session.recv.size,
                heartbeat=Heartbeat(intervals.connection, intervals.session, intervals.stream),
                max_frame=self.limits.max_frame,
                max_streams=self.limits.max_streams,
                resume_grace=self.limits.resume_grace,
            )
        )
        self._start_heartbeats(intervals, now)
        try:
            if resumed:
                self._resend_after_resume(hello.ack, now)
            self._flush_new()
            stash, self._stash = self._stash, []
            for payload in stash:
                super()._receive_payload(payload, now)
            if session.recv.immediate and self.state is _OPEN:
                self._write_ack()
        except RemoteProtocolError as exc:
            self._fail(exc)
            raise
        return session

    # -- reliable messages from the client ------------------------------------------------------

    def _apply(self, message: ReliableMessage, now: float) -> None:
        session = self.session
        assert session is not None
        if type(message) is Open:
            self._apply_open(message, session, now)
            return
        assert type(message) is Cancel
        record = session.streams.get(message.stream)
        if record is None:
            if message.stream > session.last_stream_id:
                raise violation(f"cancel of stream {message.stream}, never opened")
            return  # crossed our end: nothing left to cancel
        if record.state is not _CANCELLED:
            state = next_state(record.state, "cancel")
            assert state is not None
            record.state = state
            self._events.append(StreamCancelled(stream=message.stream))

    def _apply_open(self, message: Open, session: SessionState, now: float) -> None:
        stream = message.stream
        if stream <= session.last_stream_id:
            raise violation(
                f"stream id {stream} reused (ids increase; last was {session.last_stream_id})"
            )
        session.last_stream_id = stream
        session.streams[stream] = StreamRecord(message.credit)
        refusal = None
        if session.going_away:
            refusal = "the server is going away"
        elif len(session.streams) > self.limits.max_streams:
            refusal = f"max_streams ({self.limits.max_streams}) streams are open"
        if refusal is not None:
            session.end_stream(
                stream, "error", Usage(), StreamError(code="overloaded", message=refusal)
            )
            self._flush_new()
            return
        assert self._heartbeat is not None
        self._heartbeat.add_stream(stream, now)
        self._events.append(StreamOpened(open=message))

    def _on_credit(self, message: Credit, now: float) -> None:
        if self.state is not _OPEN:
            raise violation("credit before the handshake")
        session = self.session
        assert session is not None
        record = session.streams.get(message.stream)
        if record is None:
            if message.stream > session.last_stream_id:
                raise violation(f"credit for stream {message.stream}, never opened")
            return
        if record.grant(message.limit):
            self._events.append(CreditGranted(stream=message.stream, limit=message.limit))

    def _on_hello_again(self, message: Hello, now: float) -> None:
        raise violation("a second hello")

    # -- sending --------------------------------------------------------------------------------

    def can_send_delta(self, stream: int, n_tokens: int = 1) -> bool:
        """True when the window and `stream`'s credit allow a delta of `n_tokens` now."""
        session = self._live
        if session is None:
            return False
        send = session.send
        if send.next_seq >= send.end:
            return False
        record = session.streams.get(stream)
        if record is None or not record.flowing:
            return False
        limit = record.limit
        return limit is None or record.sent + n_tokens <= limit

    def accept_stream(self, stream: int, token_quota: int, batch_size: int) -> None:
        self._check_open().accept_stream(stream, token_quota, batch_size)
        self._flush_new()

    def send_delta(self, stream: int, text: str, tokens: Sequence[int] = ()) -> None:
        """Send one delta; `LocalProtocolError` unless `can_send_delta` allows it.

        The per-token hot path: `SessionState.send_delta`'s checks, inlined, and the frame
        encoded straight into the output buffer. Nothing changes when it raises.
        """
        session = self._live
        if session is None:
            raise LocalProtocolError(f"connection is {self.state.value}, not open")
        send = session.send
        seq = send.next_seq
        if seq >= send.end or seq != send.next_unsent:
            raise LocalProtocolError("send window is full: wait for SendWindowOpened")
        record = session.streams.get(stream)
        if record is None or not record.flowing:
            raise LocalProtocolError(f"stream {stream} is not accepted")
        if type(tokens) is not tuple:
            tokens = tuple(tokens)
        index = record.sent
        end = index + len(tokens)
        limit = record.limit
        if limit is not None and end > limit:
            raise LocalProtocolError(
                f"stream {stream} has credit up to token {limit}: wait for CreditGranted"
            )
        message = Delta(seq, stream, index, text, tokens)  # push_written below numbers it seq
        payload = self._encode(message)
        length = len(payload)
        if length > self._peer_max_frame:
            raise LocalProtocolError(f"delta of {length} bytes exceeds the peer's max_frame")
        self._out.append(
            (SMALL_HEADERS[length] if length < SMALL_FRAME else pack_header(MAGIC, length))
            + payload
        )
        record.sent = end
        send.push_written(message)

    def end_stream(
        self, stream: int, reason: EndReason, usage: Usage, error: StreamError | None = None
    ) -> None:
        session = self._check_open()
        session.end_stream(stream, reason, usage, error)
        if self._heartbeat is not None:
            self._heartbeat.remove_stream(stream)
        self._flush_new()

    def goaway(self, reason: str = "") -> None:
        """No new streams on this session; running ones finish (§3.1)."""
        session = self._check_open()
        session.going_away = True
        self._write(GoAway(reason=reason))

    def _timed_out(self, key: Key, now: float) -> None:
        session = self.session
        assert session is not None and self._heartbeat is not None
        if key == CONNECTION:
            self._detach(now)
            self._events.append(ConnectionTimedOut())
        elif key == SESSION:
            self._heartbeat.rearm(SESSION, now)
            self._events.append(SessionTimedOut(streams=session.open_streams()))
        elif key[1] in session.streams:
            self._events.append(StreamTimedOut(stream=key[1]))

    _handlers: ClassVar[dict[type[Any], Any]] = {
        Hello: _on_hello_again,
        Ack: BaseConnection._on_ack,
        Credit: _on_credit,
        Ping: BaseConnection._on_ping,
        Pong: BaseConnection._on_pong,
        Error: BaseConnection._on_error,
        Batch: BaseConnection._on_batch,
        Open: BaseConnection._on_reliable,
        Cancel: BaseConnection._on_reliable,
    }
