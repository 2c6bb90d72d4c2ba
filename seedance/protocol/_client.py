"""The client side of one transport (docs/protocol.md, Appendix: the Python API): says
`hello` (new or resuming), opens, credits and cancels streams, receives their tokens."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import msgspec

from ._connection import BaseConnection, ConnectionState, PendingPong, violation
from ._framing import SMALL_FRAME, SMALL_HEADERS, check_header, pack_header, unpack_header_from
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
    Open,
    Ping,
    Pong,
    ReliableMessage,
    SamplingOptions,
    Welcome,
)

__all__ = ["ClientConnection"]

_OPEN = ConnectionState.OPEN


class ClientConnection(BaseConnection):
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
            raise violation("welcome without a pending hello")
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
                raise violation("resumed=true answers a hello without a session")
            session.id = message.session
        elif message.session != session.id:
            raise violation("resumed a different session")
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
            raise violation("goaway before the handshake")
        assert self.session is not None
        self.session.going_away = True
        self._events.append(GoAwayReceived(reason=message.reason))

    def receive_data(self, data: bytes | bytearray | memoryview, now: float) -> None:
        """Feed bytes from the transport (see `BaseConnection.receive_data`).

        The per-token hot path: while open with no partial frame held, the read's whole frames
        are cut and decoded here, straight from `data` (a read of exactly one frame, the usual
        token's delta, without a view); every in-order `delta` among them is applied in this
        loop and one ack (when due) covers the read (§7.2); anything else goes to its handler,
        a frame cut by the read's end to the decoder. Every delta, on this path or any other,
        is applied by `_apply_delta`, the one place its stream, index and credit are checked
        (§4, §9), after the receive window counted it in order (§6).
        """
        session = self._live
        decoder = self._decoder
        if session is None or decoder.has_partial_frame:
            super().receive_data(data, now)
            return
        self._now = now
        size = len(data)
        if HEADER_SIZE < size <= self._max_frame_size and data[:HEADER_SIZE] == (
            SMALL_HEADERS[size - HEADER_SIZE]
            if size - HEADER_SIZE < SMALL_FRAME
            else pack_header(MAGIC, size - HEADER_SIZE)
        ):
            # exactly one whole frame: the usual read (a token's delta)
            payload = data[HEADER_SIZE:]
            try:
                try:
                    message = self._raw_decode(payload)
                except msgspec.MsgspecError:
                    message = self._decode(payload)  # raises the §12 error naming the field
                if type(message) is Delta and session.recv.take_next(message.seq, now):
                    self._apply_delta(message, session)
                else:
                    self._receive_message(message, now)
                if session.recv.immediate and self._live is session:
                    self._write_ack()
            except RemoteProtocolError as exc:
                self._fail(exc)
                raise
            return
        if type(data) is not bytes:
            data = bytes(data)  # the views below must not pin a caller's bytearray
        live: SessionState | None = session
        raw_decode = self._raw_decode
        apply_delta = self._apply_delta
        max_frame = decoder.max_frame
        view: memoryview | None = None
        offset = 0
        try:
            while size - offset > HEADER_SIZE:
                magic, length = unpack_header_from(data, offset)
                if magic != MAGIC or length == 0 or length > max_frame:
                    check_header(magic, length, max_frame)
                end = offset + HEADER_SIZE + length
                if end > size:
                    break
                if view is None:
                    view = memoryview(data)
                payload = view[offset + HEADER_SIZE : end]
                offset = end
                try:
                    message = raw_decode(payload)
                except msgspec.MsgspecError:
                    message = self._decode(payload)  # raises the §12 error naming the field
                if type(message) is Delta and live is not None and live.recv.take_next(
                    message.seq, now
                ):
                    apply_delta(message, live)
                else:
                    self._receive_message(message, now)
                    live = self._live  # a message may close the connection
            if offset < size:
                for payload in decoder.feed(data[offset:] if offset else data):
                    self._receive_message(self._decode(payload), now)  # never: a cut frame
            live = self._live
            if live is not None and live.recv.immediate:
                self._write_ack()
        except RemoteProtocolError as exc:
            self._fail(exc)
            raise

    def _on_delta(self, message: Delta, now: float) -> None:
        """A `delta` that did not take the in-order path of `receive_data` (from the decoder,
        a batch, or out of order): through the receive window, which holds it, drops it as a
        duplicate or releases it with the frames it unblocks, each to `_apply`."""
        session = self._live
        if session is not None and session.recv.take_next(message.seq, now):
            self._apply_delta(message, session)
        else:
            self._on_reliable(message, now)

    def _apply(self, message: ReliableMessage, now: float) -> None:
        session = self.session
        assert session is not None
        kind = type(message)
        if kind is Delta:
            assert isinstance(message, Delta)
            self._apply_delta(message, session)
            return
        stream = message.stream
        record = session.streams.get(stream)
        if record is None:
            raise violation(f"{type(message).__name__.lower()} for unknown stream {stream}")
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

    def _apply_delta(self, message: Delta, session: SessionState) -> None:
        """Deliver one in-order `delta` (the receive window has counted it): the one check of
        its stream (accepted), index (the next token) and credit, then the event."""
        record = session.streams.get(message.stream)
        tokens = message.tokens
        index = message.index
        end = index + len(tokens)
        if (
            record is None
            or not record.flowing
            or index != record.sent
            or (record.limit is not None and end > record.limit)
        ):
            raise _bad_delta(message, record)
        record.sent = end
        self._events.append(DeltaReceived(message.stream, index, message.text, tokens))

    @staticmethod
    def _step(record: StreamRecord, stream: int, event: Any) -> None:
        state = next_state(record.state, event)
        if state is None:
            raise violation(f"{event} on stream {stream} in state {record.state.value}")
        record.state = state

    def _answer_ping(self, ping: PendingPong) -> None:
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
        Ack: BaseConnection._on_ack,
        Ping: BaseConnection._on_ping,
        Pong: BaseConnection._on_pong,
        Error: BaseConnection._on_error,
        GoAway: _on_goaway,
        Batch: BaseConnection._on_batch,
        Accept: BaseConnection._on_reliable,
        Delta: _on_delta,
        End: BaseConnection._on_reliable,
    }


def _bad_delta(message: Delta, record: StreamRecord | None) -> RemoteProtocolError:
    """The `protocol_violation` for a delta `_apply_delta` refuses, saying which rule broke."""
    stream = message.stream
    if record is None:
        return violation(f"delta for unknown stream {stream}")
    if not record.flowing:
        return violation(f"delta on stream {stream} before accept")
    if message.index != record.sent:
        return violation(f"delta index {message.index} on stream {stream}, expected {record.sent}")
    end = message.index + len(message.tokens)
    return violation(f"delta beyond stream {stream}'s credit ({end} > {record.limit})")
