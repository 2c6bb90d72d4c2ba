"""One protocol connection on one transport (WebSocket or raw TCP): a nursery with the reader
(bytes → `ServerConnection` → events), the writer (everything the connection queued, in one
write) and the timer task (driven by `next_deadline()`), plus the drain watcher. Events are
turned into session actions: hello/resume, opens (stream pumps), cancel, credit, timeouts.
Frames queued during an engine delivery pass are written at the pass's end, from the pass,
without waking the writer, when the transport takes them at once — unless the peer has not yet
acknowledged MAX_WRITES_IN_FLIGHT earlier writes: then they wait for its next ack and go out
together (ACK clocking: a slow reader gets fewer, larger writes instead of a backlog)."""

from __future__ import annotations

import collections
import contextlib
import logging
import math
from typing import Protocol

import trio

from seedance.protocol import (
    ConnectionState,
    ConnectionTimedOut,
    CreditGranted,
    ErrorCode,
    HelloReceived,
    LocalProtocolError,
    PeerError,
    RemoteProtocolError,
    SendWindowOpened,
    ServerConnection,
    SessionState,
    SessionTimedOut,
    StreamCancelled,
    StreamOpened,
    StreamTimedOut,
    close_code_for,
)
from seedance.protocol.messages import Codec
from seedance.server.gateway.session_table import SessionRecord, SessionTable
from seedance.server.gateway.stream_pump import StreamPump
from seedance.server.ops.structured_log import log_event
from seedance.server.server_context import ServerContext

log = logging.getLogger("seedance.server.protocol")

CLOSE_GOING_AWAY = 1001
CLOSE_SECONDS = 2.0
"""Bound on the last flush and on the close handshake of a transport we close."""
MAX_WRITES_IN_FLIGHT = 3
"""Writes the peer may leave unacknowledged before a delivery pass's frames wait for its ack."""
PEER_ACK_FRAMES = 16
"""A peer acknowledges at least every this many reliable frames (protocol-v1 §3), so waiting
for its ack is only done while this many are in flight (never on a delayed ack)."""


class FrameTransport(Protocol):
    """A byte pipe under the protocol: WebSocket binary messages or a raw TCP stream."""

    async def receive(self) -> bytes:
        """The next bytes from the peer; b"" when it closed (EOF or close handshake).
        Raises `RemoteProtocolError` when the transport itself was misused (e.g. a WebSocket
        text message)."""

    def send_nowait(self, data: bytes) -> bool:
        """Write `data` now, without blocking or yielding, if the transport takes all of it
        (True); else keep what is left for the next `send` (False). Order is kept."""

    async def send(self, data: bytes) -> None:
        """Write what `send_nowait` left, then `data` (in order; one caller at a time)."""

    async def close(self, code: int, reason: str) -> None:
        """Close with `code` (WebSocket close code; ignored on raw TCP), bounded in time."""

    @property
    def closed_cleanly(self) -> bool:
        """The peer ended the connection on purpose (WebSocket close 1000): drop its session
        instead of keeping it for resume."""


class ProtocolConnection:
    """Serves one transport until it closes; the session it carries may outlive it."""

    def __init__(self, ctx: ServerContext, transport: FrameTransport, codec: Codec) -> None:
        self.ctx = ctx
        self.transport = transport
        self.conn = ServerConnection(ctx.config.protocol, codec=codec)
        self.table: SessionTable = ctx.sessions
        self.record: SessionRecord | None = None
        self.close_code: int | None = None
        self._close_reason = ""
        self._dirty = trio.Event()
        self._timer_changed = trio.Event()
        self._timer_deadline = math.inf
        """What the timer task sleeps until (inf: until `_timer_changed`)."""
        self._scope = trio.CancelScope()
        self._sending = False
        """A write was interrupted: the transport's byte stream is cut mid-message."""
        self._flush_queued = False
        """`_flush_at_pass_end` will run at the end of the current delivery pass."""
        self._writes: collections.deque[int] = collections.deque()
        """The send window's `handed` after each write of reliable frames not yet all
        acknowledged (increasing; bounded by the frame window)."""
        self._backlog = False
        """`send_nowait` left bytes in the transport for the writer."""

    # -- AttachedConnection ------------------------------------------------------------------------

    def kick(self) -> None:
        """Frames are waiting in `conn`. During an engine delivery pass they are written at its
        end (one message per pass, no task switch); otherwise the writer wakes."""
        if self._flush_queued:
            return
        if self.ctx.bridge.at_pass_end(self._flush_at_pass_end):
            self._flush_queued = True
        else:
            self._dirty.set()

    def _flush_at_pass_end(self) -> None:
        self._flush_queued = False
        if not self._peer_behind():
            self._flush_now()
        # else the peer's next ack (`_after_input`) writes these frames with the next ones

    def _peer_behind(self) -> bool:
        """The peer has not acknowledged MAX_WRITES_IN_FLIGHT earlier writes (and owes an ack
        at once, PEER_ACK_FRAMES being in flight): it is still reading them."""
        session = self.conn.session
        if session is None:
            return False
        send = session.send
        self._forget_acked_writes(send.acked)
        return len(self._writes) >= MAX_WRITES_IN_FLIGHT and send.in_flight >= PEER_ACK_FRAMES

    def _forget_acked_writes(self, acked: int) -> None:
        writes = self._writes
        while writes and writes[0] <= acked:
            writes.popleft()

    def _flush_now(self) -> None:
        """Write what `conn` queued straight to the transport; what it does not take at once
        is left to the writer (as is everything while the connection is closing)."""
        if self.close_code is not None:
            self._dirty.set()
            return
        try:
            data = self.conn.data_to_send(trio.current_time())
            if data:
                self._wrote()
                if not self.transport.send_nowait(data):
                    self._backlog = True
                    self._dirty.set()
            self._deadline_may_have_moved()
        except Exception as exc:  # a bug: this connection ends, the server goes on
            self._internal_error(exc)

    def _wrote(self) -> None:
        """Count a write that handed new reliable frames over (control frames alone are not
        acknowledged, so they never count); at most one entry per unacknowledged frame."""
        session = self.conn.session
        if session is None:
            return
        send = session.send
        self._forget_acked_writes(send.acked)
        writes = self._writes
        if send.handed > (writes[-1] if writes else send.acked):
            writes.append(send.handed)

    def _deadline_may_have_moved(self) -> None:
        """Wake the timer task only when a send armed a deadline earlier than its own."""
        deadline = self.conn.next_deadline()
        if deadline is not None and deadline < self._timer_deadline:
            self._timer_changed.set()

    def detach_now(self) -> None:
        """Another connection resumed our session: this transport is abandoned."""
        now = trio.current_time()
        if self.conn.state is not ConnectionState.CLOSED:
            self.conn.transport_closed(now)
        self.record = None
        self._finish(CLOSE_GOING_AWAY, "session resumed elsewhere")

    # -- running ---------------------------------------------------------------------------------

    async def serve(self) -> None:
        try:
            with self._scope:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._reader)
                    nursery.start_soon(self._writer)
                    nursery.start_soon(self._timers)
                    nursery.start_soon(self._drain_watch)
        finally:
            with trio.CancelScope(shield=True):
                if self.close_code is None or self._sending:
                    self._lose_transport()
                else:
                    with trio.move_on_after(CLOSE_SECONDS):
                        await self._flush_quietly()
                    self._lose_transport()
                    with trio.move_on_after(CLOSE_SECONDS):
                        await self.transport.close(self.close_code, self._close_reason)

    def _finish(self, code: int, reason: str) -> None:
        """Stop serving this transport: the writer flushes what is queued (within
        CLOSE_SECONDS), then the transport is closed with `code`."""
        if self.close_code is None:
            self.close_code = code
            self._close_reason = reason
            self._scope.deadline = min(self._scope.deadline,
                                       trio.current_time() + CLOSE_SECONDS)
        self._dirty.set()

    def _lose_transport(self) -> None:
        """The transport is going away: detach (resumable) or drop the session."""
        now = trio.current_time()
        conn = self.conn
        record = self.record
        if conn.state is not ConnectionState.CLOSED:
            conn.transport_closed(now)
        if record is None:
            return
        self.record = None
        if (conn.session is not None and conn.session.discarded) or (self.transport.closed_cleanly and self.close_code is None):
            record.close()
        else:
            record.detach(self)

    async def _flush_quietly(self) -> None:
        data = self.conn.data_to_send(trio.current_time())
        if data or self._backlog:
            self._backlog = False
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                await self.transport.send(data)

    async def _reader(self) -> None:
        conn = self.conn
        while True:
            try:
                data = await self.transport.receive()
            except RemoteProtocolError as exc:  # e.g. a text message on the WebSocket
                self._protocol_error(exc, from_transport=True)
                return
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                data = b""
            if not data:
                self._finish_silently()
                return
            if conn.state is ConnectionState.CLOSED:
                continue
            try:
                conn.receive_data(data, trio.current_time())
                await self._handle_events()
            except RemoteProtocolError as exc:
                self._protocol_error(exc)
                return
            except Exception as exc:  # a bug: this connection ends, the server goes on
                self._internal_error(exc)
                return
            self._after_input()

    def _internal_error(self, exc: Exception) -> None:
        log.exception("protocol_internal_error", exc_info=exc)
        self.ctx.metrics.protocol_error(ErrorCode.INTERNAL)
        if self.conn.state is not ConnectionState.CLOSED:
            with contextlib.suppress(LocalProtocolError):
                self.conn.send_error(ErrorCode.INTERNAL, "internal server error")
        self._finish(close_code_for(ErrorCode.INTERNAL), "internal")

    def _finish_silently(self) -> None:
        """The peer went away: nothing to send or close with."""
        self._scope.cancel()

    def _after_input(self) -> None:
        """Answer at once (acks, pongs, and frames that waited for the peer's ack)."""
        self._flush_now()

    def _protocol_error(self, exc: RemoteProtocolError, *, from_transport: bool = False) -> None:
        self.ctx.metrics.protocol_error(exc.code)
        log_event(log, "protocol_error", level=logging.INFO, code=exc.code, message=exc.message)
        if from_transport and self.conn.state is not ConnectionState.CLOSED:
            with contextlib.suppress(LocalProtocolError):
                self.conn.send_error(exc.code, exc.message)
        self._finish(exc.close_code, exc.code)

    async def _writer(self) -> None:
        conn = self.conn
        while True:
            await self._dirty.wait()
            self._dirty = trio.Event()
            data = conn.data_to_send(trio.current_time())
            if data:
                self._wrote()
            if data or self._backlog:
                self._sending = True
                self._backlog = False
                try:
                    await self.transport.send(data)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    self._finish_silently()  # the peer is gone; the session stays resumable
                    return
                self._sending = False
            if self.close_code is not None:
                self._scope.cancel()
                return
            self._deadline_may_have_moved()

    async def _timers(self) -> None:
        conn = self.conn
        metrics = self.ctx.metrics
        while True:
            self._timer_changed = changed = trio.Event()
            deadline = conn.next_deadline()
            if deadline is None:
                self._timer_deadline = math.inf
                await changed.wait()
                continue
            if trio.current_time() < deadline:
                self._timer_deadline = deadline
                with trio.move_on_at(deadline):
                    await changed.wait()
                continue
            self._timer_deadline = -math.inf  # running: every change must be seen
            now = trio.current_time()
            session = conn.session
            resent_before = 0 if session is None else session.send.retransmissions
            try:
                conn.handle_timers(now)
                if session is not None:
                    metrics.frames_retransmitted += session.send.retransmissions - resent_before
                await self._handle_events()
            except Exception as exc:  # a bug: this connection ends, the server goes on
                self._internal_error(exc)
                return
            self._dirty.set()

    async def _drain_watch(self) -> None:
        await self.ctx.drain.started.wait()
        if self.conn.state is ConnectionState.OPEN:
            self.conn.goaway("server shutting down")
            self._dirty.set()
        elif self.conn.state is not ConnectionState.AWAIT_WELCOME:
            self._finish(CLOSE_GOING_AWAY, "server shutting down")
            return
        while True:
            record = self.record
            if record is None or not record.pumps:
                self._finish(CLOSE_GOING_AWAY, "server shutting down")
                return
            await record.wait_changed()

    # -- events ----------------------------------------------------------------------------------

    async def _handle_events(self) -> None:
        conn = self.conn
        while True:
            event = conn.next_event()
            if event is None:
                return
            record = self.record
            kind = type(event)
            if kind is CreditGranted:
                assert isinstance(event, CreditGranted)
                if record is not None:
                    record.wake(event.stream)
            elif kind is SendWindowOpened:
                if record is not None:
                    record.wake_all()
            elif kind is StreamOpened:
                assert isinstance(event, StreamOpened) and record is not None
                record.start_stream(StreamPump, event.open)
            elif kind is StreamCancelled:
                assert isinstance(event, StreamCancelled)
                pump = record.pumps.get(event.stream) if record is not None else None
                if pump is not None:
                    pump.cancel()
            elif kind is HelloReceived:
                assert isinstance(event, HelloReceived)
                if not await self._welcome(event):
                    return
            elif kind is StreamTimedOut:
                assert isinstance(event, StreamTimedOut)
                pump = record.pumps.get(event.stream) if record is not None else None
                if pump is not None:
                    pump.time_out()
            elif kind is SessionTimedOut:
                assert isinstance(event, SessionTimedOut)
                for stream in event.streams:
                    pump = record.pumps.get(stream) if record is not None else None
                    if pump is not None:
                        pump.time_out()
            elif kind is ConnectionTimedOut:
                log_event(log, "connection_timed_out",
                          session=record.id if record is not None else None)
                self._finish_silently()
                return
            elif kind is PeerError:
                assert isinstance(event, PeerError)
                log_event(log, "peer_error", code=event.code, message=event.message)
                self._finish(event.close_code, event.code)
                return

    async def _welcome(self, event: HelloReceived) -> bool:
        ctx = self.ctx
        conn = self.conn
        hello = event.hello
        now = trio.current_time()
        if not ctx.authorized(hello.api_key):
            ctx.metrics.protocol_error(ErrorCode.UNAUTHORIZED)
            conn.send_error(ErrorCode.UNAUTHORIZED, "a valid api_key is required in hello")
            self._finish(close_code_for(ErrorCode.UNAUTHORIZED), "unauthorized")
            return False
        old = self.table.resumable(hello.session, now)
        resent_before = 0 if old is None else old.session.send.retransmissions
        if old is not None and old.attached is not None:
            old.attached.detach_now()
        try:
            state: SessionState = conn.welcome(old.session if old is not None else None)
        except RemoteProtocolError as exc:
            if old is not None:
                old.close()
            self._protocol_error(exc)
            return False
        if old is not None:
            record = old
            resend = state.send.retransmissions - resent_before
            ctx.metrics.sessions_resumed += 1
            ctx.metrics.frames_retransmitted += resend
            log_event(log, "session_resumed", session=state.id, streams=len(record.pumps),
                      retransmitted=resend)
        else:
            record = SessionRecord(ctx, state, self.table)
            record.attached = self  # before its task starts, so it never looks detached
            assert ctx.session_nursery is not None
            await ctx.session_nursery.start(record.run)
            self.table.add(record)
        self.record = record
        record.attach(self)
        if ctx.drain.draining:
            conn.goaway("server shutting down")
        return True
