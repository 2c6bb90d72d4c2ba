"""The client side of one transport (docs/protocol.md, Appendix: the Python API): says
`hello` (new or resuming), opens, credits and cancels streams, receives their tokens."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import msgspec

from ._connection import (
    _OPEN,
    ConnectionState,
    _Connection,
    _PendingPong,
    _violation,
)
from ._framing import SMALL_FRAME, SMALL_HEADERS, _unpack_header_from, pack_header
from ._heartbeat import CONNECTION, SESSION, Key
from ._session import Role, SessionState
from ._stream_state import StreamRecord, next_state
from .errors import ErrorCode, LocalProtocolError, RemoteProtocolError
from .events import (
    ConnectionTimedOut,
    DeltaReceived,
    GoAwayReceived,
    SessionTimedOut,
    StreamAccepted,
    StreamEnded,
    StreamTimedOut,
    Welcomed,
)
from .limits import HEADER_SIZE, MAGIC, PROTOCOL_VERSION, HeartbeatIntervals, ProtocolLimits
from .messages import (
    Accept,
    Ack,
    Batch,
    ChatMessage,
    Codec,
    Credit,
    Delta,
    End,
    Error,
    GoAway,
    Heartbeat,
    Hello,
    Message,
    Open,
    Ping,
    Pong,
    ReliableMessage,
    SamplingOptions,
    Welcome,
    _remote_error,
)

__all__ = ["ClientConnection"]


class ClientConnection(_Connection):
    """The client side of one transport. Pass `session=` (the old connection's session) to
    resume it on this transport."""

    __slots__ = ("_resuming",)
    _role: ClassVar[Role] = "client"

    def __init__(
        self,
        limits: ProtocolLimits | None = None,
        *,
        codec: Codec = "msgpack",
        session: SessionState | None = None,
        coalesce: bool = False,
    ) -> None:
        super().__init__(limits, codec, coalesce)
        if session is not None and (session.role != "client" or session.discarded):
            raise LocalProtocolError("session= must be a live client session")
        if session is not None and session.attached:
            raise LocalProtocolError(
                "session= is still attached: call the old connection's transport_closed(now)"
            )
        self._resuming = session is not None
        self.session = session if session is not None else SessionState("client", self.limits)

    def send_hello(
        self,
        *,
        api_key: str | None = None,
        client: str | None = None,
        heartbeat: HeartbeatIntervals | None = None,
    ) -> None:
        """Queue `hello` (a resume when this connection was given a session)."""
        if self.state is not ConnectionState.IDLE:
            raise LocalProtocolError("hello is sent once, first")
        session = self.session
        assert session is not None
        self._write(
            Hello(
                v=PROTOCOL_VERSION,
                ack=session.recv.ack,
                window=session.recv.size,
                session=session.id if self._resuming else None,
                heartbeat=None if heartbeat is None else Heartbeat(
                    heartbeat.connection, heartbeat.session, heartbeat.stream
                ),
                api_key=api_key,
                client=client,
            )
        )
        self.state = ConnectionState.AWAIT_WELCOME

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
        """Open a stream; return its id. Before `welcome` it waits and goes out after."""
        self._check_usable()
        session = self.session
        assert session is not None
        if (prompt is None) == (messages is None):
            raise LocalProtocolError("open needs exactly one of prompt and messages")
        probe = Open(
            seq=session.send.next_seq, stream=session.last_stream_id + 1, prompt=prompt,
            messages=None if messages is None else tuple(messages), model=model, params=params,
            priority=priority, deadline_ms=deadline_ms, credit=credit,
            expected_tokens=expected_tokens, max_latency_ms=max_latency_ms,
        )
        size = len(self._codec.encode(probe))
        if size > self._peer_max_frame:
            raise LocalProtocolError(
                f"open of {size} bytes does not fit the server's max_frame {self._peer_max_frame}"
            )
        stream = session.open_stream(
            prompt=prompt, messages=messages, model=model, params=params, priority=priority,
            deadline_ms=deadline_ms, credit=credit, expected_tokens=expected_tokens,
            max_latency_ms=max_latency_ms,
        )
        if self.state is _OPEN:
            assert self._heartbeat is not None
            self._heartbeat.add_stream(stream, self._now)
            self._flush_new()
        return stream

    def grant_credit(self, stream: int, limit: int) -> None:
        """Let the server send `stream`'s tokens with index < `limit` (absolute; a smaller
        value than before is ignored)."""
        self._check_usable()
        session = self.session
        assert session is not None
        record = session.streams.get(stream)
        if record is None:
            if 0 < stream <= session.last_stream_id:
                return  # ended meanwhile
            raise LocalProtocolError(f"stream {stream} was never opened")
        if record.limit is None:
            raise LocalProtocolError(f"stream {stream} was opened with unlimited credit")
        if record.grant(limit) and self.state is _OPEN:
            self._write(Credit(stream=stream, limit=limit))

    def cancel_stream(self, stream: int) -> None:
        """Ask the server to stop `stream`; its `end` (reason `cancelled`) follows."""
        self._check_usable()
        session = self.session
        assert session is not None
        session.cancel_stream(stream)
        self._flush_new()

    # -- incoming -------------------------------------------------------------------------------

    def _on_welcome(self, message: Welcome, now: float) -> None:
        if self.state is not ConnectionState.AWAIT_WELCOME:
            raise _violation("welcome without a pending hello")
        if message.v != PROTOCOL_VERSION:
            raise RemoteProtocolError(
                ErrorCode.UNSUPPORTED_VERSION, f"server speaks version {message.v}"
            )
        session = self.session
        assert session is not None
        lost: tuple[int, ...] = ()
        if self._resuming and not message.resumed:
            lost = session.open_streams()
            session = SessionState("client", self.limits, message.session)
            self.session = session
        elif not self._resuming:
            if message.resumed:
                raise _violation("resumed=true answers a hello without a session")
            session.id = message.session
        elif message.session != session.id:
            raise _violation("resumed a different session")
        hb = message.heartbeat
        intervals = HeartbeatIntervals(connection=hb.connection, session=hb.session,
                                       stream=hb.stream)
        session.detached_at = None
        session.attached = True
        session.send.peer_window = message.window
        self._peer_max_frame = message.max_frame
        self._opened(session)
        self._start_heartbeats(intervals, now)
        if message.resumed:
            self._resend_after_resume(message.ack, now)
            for stream, record in session.streams.items():
                if record.limit is not None:
                    self._write(Credit(stream=stream, limit=record.limit))
        self._flush_new()
        self._events.append(
            Welcomed(
                session_id=message.session, resumed=message.resumed, window=message.window,
                heartbeat=intervals, max_frame=message.max_frame,
                max_streams=message.max_streams, resume_grace=message.resume_grace,
                lost_streams=lost,
            )
        )

    def _on_goaway(self, message: GoAway, now: float) -> None:
        if self.state is not _OPEN:
            raise _violation("goaway before the handshake")
        assert self.session is not None
        self.session.going_away = True
        self._events.append(GoAwayReceived(reason=message.reason))

    def receive_data(self, data: bytes | bytearray | memoryview, now: float) -> None:
        """Feed bytes from the transport (see `_Connection.receive_data`).

        The per-token hot path is inlined here: a read of exactly one whole frame holding the
        next in-order `delta` of an accepted stream, within its credit (§1, §6, §9), is applied
        at once; a read of several frames goes to `_receive_frames`. Anything else, including
        every error, takes the general path, which checks and reports it.
        """
        session = self._live
        if session is None or self._pending_input:
            super().receive_data(data, now)
            return
        size = len(data)
        if not HEADER_SIZE < size <= self._max_frame_size or data[:8] != (
            SMALL_HEADERS[size - 8] if size - 8 < SMALL_FRAME else pack_header(MAGIC, size - 8)
        ):
            self._receive_frames(data, now, session)
            return
        try:
            message = self._raw_decode(data[8:])
        except msgspec.MsgspecError:
            message = None
        self._now = now
        if type(message) is Delta and self._take_delta(message, session, now):
            if session.recv.immediate:
                self._write_ack()
            return
        super().receive_data(data, now)

    def _receive_frames(
        self, data: bytes | bytearray | memoryview, now: float, session: SessionState
    ) -> None:
        """A read of several frames: each whole frame holding the next in-order `delta` is
        applied in this loop, and one ack (when due) covers the read. At the first frame that
        is anything else — another message, an error, a frame cut by the read's end — the rest
        of the read takes the general path."""
        self._now = now
        if type(data) is not bytes:
            data = bytes(data)  # the views below must not pin a caller's bytearray
        size = len(data)
        view = memoryview(data)
        raw_decode = self._raw_decode
        take_delta = self._take_delta
        max_payload = self._max_frame_size - HEADER_SIZE
        offset = 0
        while size - offset > HEADER_SIZE:
            magic, length = _unpack_header_from(data, offset)
            end = offset + HEADER_SIZE + length
            if magic != MAGIC or not 0 < length <= max_payload or end > size:
                break
            try:
                message = raw_decode(view[offset + HEADER_SIZE : end])
            except msgspec.MsgspecError:
                break
            if type(message) is not Delta or not take_delta(message, session, now):
                break
            offset = end
        if offset < size:
            super().receive_data(view[offset:] if offset else data, now)  # writes a due ack
        elif session.recv.immediate and self._live is session:
            self._write_ack()

    def _take_delta(self, message: Delta, session: SessionState, now: float) -> bool:
        """Apply `message` when it is the next in-order delta of an accepted stream, within its
        credit — the same effects as ReceiveWindow.take_next + _apply_delta, the ack counted
        but not written — and return True; else change nothing and return False."""
        record = session.streams.get(message.stream)
        if record is None or not record.flowing:
            return False
        index = message.index
        tokens = message.tokens
        end = index + len(tokens)
        limit = record.limit
        if index != record.sent or (limit is not None and end > limit):
            return False
        if not session.recv.take_next(message.seq, now):
            return False
        record.sent = end
        self._events.append(DeltaReceived(message.stream, index, message.text, tokens))
        return True

    def _receive_payload(self, payload: bytes | bytearray | memoryview, now: float) -> None:
        try:
            message = self._raw_decode(payload)
        except msgspec.MsgspecError as exc:
            raise _remote_error(exc) from None
        self._receive_payload_message(message, now)

    def _receive_payload_message(self, message: Message, now: float) -> None:
        session = self._live
        # fast path: the next delta in order, nothing held (docs/protocol.md §6)
        if (
            type(message) is Delta
            and session is not None
            and session.recv.take_next(message.seq, now)
        ):
            self._apply_delta(message, session.streams.get(message.stream))
            return
        handler = self._handlers.get(type(message))
        if handler is None:
            raise _violation(f"{type(message).__name__.lower()} is not sent to a {self._role}")
        handler(self, message, now)

    def _apply(self, message: ReliableMessage, now: float) -> None:
        session = self.session
        assert session is not None
        stream = message.stream
        record = session.streams.get(stream)
        if record is None:
            raise _violation(f"{type(message).__name__.lower()} for unknown stream {stream}")
        kind = type(message)
        if kind is Delta:
            assert isinstance(message, Delta)
            self._apply_delta(message, record)
            return
        if kind is Accept:
            assert isinstance(message, Accept)
            self._step(record, stream, "accept")
            self._events.append(
                StreamAccepted(stream=stream, token_quota=message.token_quota,
                               batch_size=message.batch_size)
            )
            return
        assert isinstance(message, End)
        self._step(record, stream, "end")
        del session.streams[stream]
        if self._heartbeat is not None:
            self._heartbeat.remove_stream(stream)
        self._events.append(
            StreamEnded(stream=stream, reason=message.reason, usage=message.usage,
                        error=message.error)
        )

    def _apply_delta(self, message: Delta, record: StreamRecord | None) -> None:
        stream = message.stream
        if record is None:
            raise _violation(f"delta for unknown stream {stream}")
        if not record.flowing:
            raise _violation(f"delta on stream {stream} before accept")
        credit = record
        tokens = message.tokens
        index = message.index
        if index != credit.sent:
            raise _violation(f"delta index {index} on stream {stream}, expected {credit.sent}")
        end = index + len(tokens)
        limit = credit.limit
        if limit is not None and end > limit:
            raise _violation(f"delta beyond stream {stream}'s credit ({end} > {limit})")
        credit.sent = end
        self._events.append(DeltaReceived(stream, index, message.text, tokens))

    @staticmethod
    def _step(record: StreamRecord, stream: int, event: Any) -> None:
        state = next_state(record.state, event)
        if state is None:
            raise _violation(f"{event} on stream {stream} in state {record.state.value}")
        record.state = state

    def _answer_ping(self, ping: _PendingPong) -> None:
        super()._answer_ping(ping)
        session = self.session
        if self.state is _OPEN and ping.tier == "stream" and ping.stream and session is not None:
            record = session.streams.get(ping.stream)
            if record is not None and record.limit is not None:
                self._write(Credit(stream=ping.stream, limit=record.limit))

    def _timed_out(self, key: Key, now: float) -> None:
        session = self.session
        assert session is not None and self._heartbeat is not None
        if key == CONNECTION:
            self._detach(now)
            self._events.append(ConnectionTimedOut())
            return
        if key == SESSION:
            self._heartbeat.rearm(SESSION, now)
            streams = session.open_streams()
            for stream in streams:
                session.cancel_stream(stream)
            self._flush_new()
            self._events.append(SessionTimedOut(streams=streams))
        elif key[1] in session.streams:
            session.cancel_stream(key[1])
            self._flush_new()
            self._events.append(StreamTimedOut(stream=key[1]))

    _handlers: ClassVar[dict[type[Any], Any]] = {
        Welcome: _on_welcome,
        Ack: _Connection._on_ack,
        Ping: _Connection._on_ping,
        Pong: _Connection._on_pong,
        Error: _Connection._on_error,
        GoAway: _on_goaway,
        Batch: _Connection._on_batch,
        Accept: _Connection._on_reliable,
        Delta: _Connection._on_reliable,
        End: _Connection._on_reliable,
    }
