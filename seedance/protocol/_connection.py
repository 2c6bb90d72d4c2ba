"""What both connection roles share (docs/protocol.md, Appendix: the Python API): bytes in →
events out, messages in → bytes out, time passed in as `now`; framing, codecs, acks,
retransmission, heartbeats, batches and errors. The reliable state lives in a `SessionState`
that a later connection can attach to (§11). The roles are `ServerConnection` (_server.py) and
`ClientConnection` (_client.py)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from enum import Enum
from typing import Any, ClassVar, Final

import brotli

from ._framing import (
    SMALL_FRAME,
    SMALL_HEADERS,
    FrameDecoder,
    pack_header,
    split_frames,
    unpack_header_from,
)
from ._heartbeat import HeartbeatSchedule, Key, Tier
from ._session import Role, SessionState
from .errors import ErrorCode, LocalProtocolError, RemoteProtocolError, close_code_for
from .events import (
    Event,
    PeerError,
    SendWindowOpened,
)
from .limits import DEFAULT_MAX_FRAME, HEADER_SIZE, MAGIC, HeartbeatIntervals, ProtocolLimits
from .messages import (
    Ack,
    Batch,
    Codec,
    Error,
    Message,
    PayloadCodec,
    Ping,
    Pong,
    ReliableMessage,
)

__all__ = ["BaseConnection", "ConnectionState", "PendingPong", "violation"]

_COMPRESS_MIN: Final = 512
"""Batches smaller than this are never compressed: brotli cannot win enough to pay."""
_COMPRESS_GAIN: Final = 0.8
"""A compressed batch is used only when it is at most this fraction of the plain one."""


class ConnectionState(Enum):
    IDLE = "idle"
    """Client: `send_hello` not yet called."""
    AWAIT_HELLO = "await_hello"
    """Server: waiting for the client's first frame."""
    AWAIT_WELCOME = "await_welcome"
    """Client: hello sent. Server: `HelloReceived` given out, `welcome()` not yet called."""
    OPEN = "open"
    CLOSED = "closed"
    """After `error` (either way), a connection timeout or `transport_closed`."""


_OPEN = ConnectionState.OPEN


class PendingPong:
    """A session/stream-tier ping waiting in the event queue: answered when the application
    pulls it, so the pong proves the application is draining its events (§10)."""

    __slots__ = ("nonce", "stream", "tier")

    def __init__(self, tier: Tier, nonce: int, stream: int | None) -> None:
        self.tier: Tier = tier
        self.nonce = nonce
        self.stream = stream


def violation(message: str) -> RemoteProtocolError:
    """A `protocol_violation` (§12) saying `message`, for the caller to raise."""
    return RemoteProtocolError(ErrorCode.PROTOCOL_VIOLATION, message)


class BaseConnection(ABC):
    """What both roles share: framing, codecs, acks, retransmission, heartbeats, errors."""

    __slots__ = (
        "_coalesce",
        "_codec",
        "_cursor",
        "_decode",
        "_decoder",
        "_encode",
        "_events",
        "_hand_over",
        "_heartbeat",
        "_live",
        "_max_frame_size",
        "_now",
        "_out",
        "_peer_max_frame",
        "_pending_pongs",
        "_raw_decode",
        "codec",
        "error",
        "limits",
        "session",
        "state",
    )

    _role: ClassVar[Role]

    def __init__(self, limits: ProtocolLimits | None, codec: Codec, coalesce: bool) -> None:
        self.limits = limits if limits is not None else ProtocolLimits()
        self.codec: Codec = codec
        self._codec = PayloadCodec(codec)
        self._encode = self._codec.raw_encode
        self._decode = self._codec.decode
        self._raw_decode = self._codec.raw_decode
        self._decoder = FrameDecoder(self.limits.max_frame)
        self._max_frame_size = self.limits.max_frame + HEADER_SIZE  # a whole frame, with header
        self._coalesce = coalesce
        self._out: list[bytes] = []  # whole frames, one per item, not yet handed over
        self._events: list[Event | PendingPong] = []
        self._cursor = 0  # next_event's position in _events
        self._pending_pongs = 0
        self._now = 0.0
        self._heartbeat: HeartbeatSchedule | None = None
        self._peer_max_frame = DEFAULT_MAX_FRAME
        self.session: SessionState | None = None
        self._live: SessionState | None = None  # `session` while `state` is OPEN, else None
        self._hand_over: Callable[[float], None] | None = None  # `_live.send.handed_over`
        self.state = ConnectionState.IDLE
        self.error: RemoteProtocolError | None = None
        """The error that closed this connection, if the peer broke the protocol."""

    # -- public: both roles ---------------------------------------------------------------------

    def receive_data(self, data: bytes | bytearray | memoryview, now: float) -> None:
        """Feed bytes from the transport. Raises `RemoteProtocolError` when the peer broke the
        protocol; an `error` frame is then queued and the connection is closed."""
        if self.state is ConnectionState.CLOSED:
            raise LocalProtocolError("connection is closed")
        self._now = now
        decoder = self._decoder
        try:
            if not decoder.has_partial_frame and len(data) > HEADER_SIZE:
                # fast path: exactly one whole, valid frame (a token's delta, an ack)
                magic, length = unpack_header_from(data, 0)
                if (
                    magic == MAGIC
                    and length == len(data) - HEADER_SIZE
                    and length <= decoder.max_frame
                ):
                    self._receive_payload(data[HEADER_SIZE:], now)
                    live = self._live
                    if live is not None and live.recv.immediate:
                        self._write_ack()
                    return
            for payload in decoder.feed(data):
                self._receive_payload(payload, now)
            live = self._live
            if live is not None and live.recv.immediate:
                self._write_ack()
        except RemoteProtocolError as exc:
            self._fail(exc)
            raise

    def next_event(self) -> Event | None:
        """The next event, or None. Session/stream-tier pings are answered as they are
        reached here (write `data_to_send` afterwards)."""
        events = self._events
        while self._cursor < len(events):
            event = events[self._cursor]
            self._cursor += 1
            if self._cursor == len(events):
                events.clear()
                self._cursor = 0
            if type(event) is PendingPong:
                self._pending_pongs -= 1
                self._answer_ping(event)
                continue
            return event  # type: ignore[return-value]
        return None

    def events(self) -> list[Event]:
        """Take every event available now, in order (answering the pings among them)."""
        events = self._events
        if not events:
            return []
        if self._pending_pongs or self._cursor:
            return list(iter(self.next_event, None))
        self._events = []
        return events  # type: ignore[return-value]

    def data_to_send(self, now: float) -> bytes:
        """The bytes to write to the transport now (b"" when there are none)."""
        self._now = now
        out = self._out
        if not out:
            return b""
        hand_over = self._hand_over
        if hand_over is not None:
            hand_over(now)
        if len(out) == 1:
            data = out[0]
            out.clear()  # the list is kept: no allocation per write
            return data
        data = self._batched(out) if self._coalesce else b"".join(out)
        out.clear()
        return data

    def next_deadline(self) -> float | None:
        """When `handle_timers` must next run (None: no timer armed)."""
        live = self._live
        if live is None:
            return None
        deadline = live.recv.deadline
        send_deadline = live.send.deadline
        if send_deadline is not None and (deadline is None or send_deadline < deadline):
            deadline = send_deadline
        heartbeat = self._heartbeat
        if heartbeat is not None:
            beat = heartbeat.next_due
            if beat is not None and (deadline is None or beat < deadline):
                deadline = beat
        return deadline

    def handle_timers(self, now: float) -> None:
        """Run every timer due at `now`: delayed acks, retransmission, heartbeats."""
        self._now = now
        session = self._live
        if session is None:
            return
        if session.recv.ack_due(now):
            self._write_ack()
        send = session.send
        if send.deadline is not None and now >= send.deadline:
            seq = send.expire(now)
            if seq is not None:
                self._write(send.frame(seq))
        heartbeat = self._heartbeat
        if heartbeat is None:
            return
        pings, timeouts = heartbeat.poll(now)
        for tier, stream, nonce in pings:
            self._write(Ping(tier=tier, nonce=nonce, stream=stream or None))
        for key in timeouts:
            self._timed_out(key, now)
            if self.state is not _OPEN:
                break

    def transport_closed(self, now: float) -> None:
        """The transport is gone: detach the session (resumable for `resume_grace`)."""
        self._now = now
        if self.state is ConnectionState.CLOSED:
            return
        self._detach(now)

    def send_error(self, code: str, message: str = "") -> None:
        """Queue a fatal `error`; the connection is closed after it and the session discarded.
        Write `data_to_send`, then close the transport with `close_code_for(code)`."""
        self._check_usable()
        self._write(Error(code=code, message=message))
        self._close(discard=True)

    @property
    def send_window_available(self) -> int:
        """Reliable frames that may be numbered now without waiting (§6)."""
        session = self.session
        if session is None:
            return 0
        return max(0, session.send.room)

    # -- internals: output ----------------------------------------------------------------------

    def _write(self, message: Message) -> None:
        payload = self._encode(message)
        length = len(payload)
        if length > self._peer_max_frame:
            raise LocalProtocolError(
                f"{type(message).__name__} of {length} bytes exceeds the peer's max_frame "
                f"{self._peer_max_frame}"
            )
        header = SMALL_HEADERS[length] if length < SMALL_FRAME else pack_header(MAGIC, length)
        self._out.append(header + payload)

    def _write_ack(self) -> None:
        live = self._live
        assert live is not None
        recv = live.recv
        sack = recv.ack_ranges()
        self._write(Ack(ack=recv.ack, sack=sack) if sack else Ack(ack=recv.ack))
        recv.acked()

    def _flush_new(self) -> None:
        """Write the numbered frames the window now admits, in order."""
        session = self._live
        if session is None:
            return
        send = session.send
        limit = min(send.next_seq, send.end)
        start = send.next_unsent
        if start >= limit:
            return
        for seq in range(start, limit):
            self._write(send.frame(seq))
        send.next_unsent = limit

    def _batched(self, frames: list[bytes]) -> bytes:
        """Coalesce `frames` into `batch` frames that fit the peer's `max_frame`; a frame too
        big to share a batch goes out alone, as it is."""
        budget = self._peer_max_frame - 64
        if self.codec == "json":
            budget = budget * 3 // 4  # base64
        groups: list[list[bytes]] = []  # consecutive frames, each group at most `budget` bytes
        size = 0  # of the last group
        for frame in frames:
            if groups and size + len(frame) <= budget:
                groups[-1].append(frame)
                size += len(frame)
            else:
                groups.append([frame])
                size = len(frame)
        result: list[bytes] = []
        saved_out, self._out = self._out, result
        try:
            for group in groups:
                if len(group) == 1:
                    result.append(group[0])
                else:
                    self._write(self._batch_of(b"".join(group)))
        finally:
            self._out = saved_out
        return b"".join(result)

    def _batch_of(self, frames: bytes) -> Batch:
        if len(frames) >= _COMPRESS_MIN:
            packed = brotli.compress(frames, quality=4)
            if len(packed) <= len(frames) * _COMPRESS_GAIN:
                return Batch(codec="brotli", data=packed)
        return Batch(codec="none", data=frames)

    # -- internals: input -----------------------------------------------------------------------

    def _receive_payload(self, payload: bytes | bytearray | memoryview, now: float) -> None:
        self._receive_message(self._decode(payload), now)

    def _receive_message(self, message: Message, now: float) -> None:
        """Hand one decoded message to its role's handler (§3: what each side may receive)."""
        handler = self._handlers.get(type(message))
        if handler is None:
            raise violation(f"{type(message).__name__.lower()} is not sent to a {self._role}")
        handler(self, message, now)

    def _on_reliable(self, message: ReliableMessage, now: float) -> None:
        if self.state is not _OPEN:
            raise violation(f"{type(message).__name__.lower()} before the handshake")
        session = self.session
        assert session is not None
        for deliverable in session.recv.receive(message.seq, message, now):
            self._apply(deliverable, now)

    @abstractmethod
    def _apply(self, message: ReliableMessage, now: float) -> None:
        """Act on one in-order reliable message (role-specific)."""

    def _on_ack(self, message: Ack, now: float) -> None:
        session = self._live
        if session is None:
            raise violation("ack before the handshake")
        send = session.send
        room_before = send.end - send.next_seq
        progress = send.on_ack(message.ack, message.sack, now)
        if message.window is not None:
            send.peer_window = message.window
        elif not progress:
            return
        if send.next_unsent < send.next_seq:
            self._flush_new()
        if room_before <= 0:
            room = send.end - send.next_seq
            if room > 0:
                self._events.append(SendWindowOpened(available=room))

    def _on_ping(self, message: Ping, now: float) -> None:
        if self.state is not _OPEN:
            raise violation("ping before the handshake")
        if message.tier == "connection":
            self._write(Pong(tier="connection", nonce=message.nonce))
        else:
            self._events.append(PendingPong(message.tier, message.nonce, message.stream))
            self._pending_pongs += 1

    def _answer_ping(self, ping: PendingPong) -> None:
        if self.state is not _OPEN:
            return
        self._write(Pong(tier=ping.tier, nonce=ping.nonce, stream=ping.stream))

    def _on_pong(self, message: Pong, now: float) -> None:
        if self.state is not _OPEN:
            raise violation("pong before the handshake")
        heartbeat = self._heartbeat
        assert heartbeat is not None and self.session is not None
        rtt = heartbeat.on_pong(message.tier, message.stream or 0, message.nonce, now)
        if rtt is not None and message.tier == "connection":
            self.session.send.timer.sample(rtt)

    def _on_error(self, message: Error, now: float) -> None:
        self._events.append(
            PeerError(code=message.code, message=message.message,
                      close_code=close_code_for(message.code))
        )
        self._close(discard=True)

    def _on_batch(self, message: Batch, now: float) -> None:
        max_frame = self.limits.max_frame
        if message.codec == "brotli":
            try:
                decompressor = brotli.Decompressor()
                data = decompressor.process(message.data, output_buffer_limit=max_frame + 1)
                finished = decompressor.is_finished()
            except brotli.error as exc:
                raise RemoteProtocolError(
                    ErrorCode.INVALID_MESSAGE, f"batch: bad brotli data ({exc})", field="data"
                ) from None
            if len(data) > max_frame:
                raise RemoteProtocolError(
                    ErrorCode.FRAME_TOO_LARGE, f"batch expands beyond max_frame {max_frame}"
                )
            if not finished:
                raise RemoteProtocolError(
                    ErrorCode.INVALID_MESSAGE, "batch: truncated brotli data", field="data"
                )
        else:
            data = message.data
        for payload in split_frames(data, max_frame):
            inner = self._decode(payload)
            if type(inner) is Batch:
                raise violation("a batch inside a batch")
            self._receive_message(inner, now)
            if self.state is ConnectionState.CLOSED:
                return

    _handlers: ClassVar[dict[type[Any], Any]] = {}

    # -- internals: lifecycle -------------------------------------------------------------------

    def _check_usable(self) -> None:
        if self.state is ConnectionState.CLOSED:
            raise LocalProtocolError("connection is closed")

    def _check_open(self) -> SessionState:
        if self.state is not _OPEN:
            raise LocalProtocolError(f"connection is {self.state.value}, not open")
        assert self.session is not None
        return self.session

    def _start_heartbeats(self, intervals: HeartbeatIntervals, now: float) -> None:
        assert self.session is not None
        self._heartbeat = heartbeat = HeartbeatSchedule(intervals, now)
        for stream in self.session.streams:
            heartbeat.add_stream(stream, now)

    def _fail(self, exc: RemoteProtocolError) -> None:
        if self.state is ConnectionState.CLOSED:
            return
        self.error = exc
        self._out.clear()
        self._write(Error(code=exc.code, message=exc.message))
        self._close(discard=True)

    def _opened(self, session: SessionState) -> None:
        """The handshake is done: `session` is attached and the connection is OPEN."""
        self.session = self._live = session
        self._hand_over = session.send.handed_over
        self.state = _OPEN

    def _close(self, *, discard: bool) -> None:
        self.state = ConnectionState.CLOSED
        self._live = self._hand_over = None
        self._heartbeat = None
        session = self.session
        if session is not None:
            if discard:
                session.discarded = True
            session.attached = False
            session.send.detach()

    def _detach(self, now: float) -> None:
        session = self.session
        self._out.clear()
        self._close(discard=False)
        if session is not None and not session.discarded:
            session.detached_at = now

    @abstractmethod
    def _timed_out(self, key: Key, now: float) -> None:
        """React to a heartbeat timeout of `key` (role-specific)."""

    def _resend_after_resume(self, peer_ack: int, now: float) -> None:
        """§11: the peer's `ack` acknowledges; resend every unacked, un-SACKed frame from it."""
        session = self.session
        assert session is not None
        send = session.send
        if not send.acked <= peer_ack <= send.next_unsent:
            raise violation(f"resume ack {peer_ack} outside [{send.acked}, {send.next_unsent}]")
        send.on_ack(peer_ack, (), now)
        for seq in send.resend_from(peer_ack):
            send.mark_retransmitted(seq)
            self._write(send.frame(seq))
        session.recv.force_ack()
