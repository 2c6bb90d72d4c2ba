"""One protocol connection on one transport (WebSocket or raw TCP), run by the shared
`ConnectionDriver` (reader, writer, timers) plus the drain watcher. Events are turned into
session actions: hello/resume, opens (stream pumps), cancel, credit, timeouts.
Frames queued during an engine delivery pass are written at the pass's end, from the pass,
without waking the writer, when the transport takes them at once — unless the peer has not yet
acknowledged MAX_WRITES_IN_FLIGHT earlier writes (ACK clocking: then they wait for its next ack
and go out together), or the transport's unsent bytes are above their high-water mark (then
they wait in the protocol's send window, and the reader stops reading, until the backlog
drains). A peer that stops reading altogether is dropped: its unsent bytes hit the hard limit
or a write stalls for `--send-timeout` seconds."""

from __future__ import annotations

import contextlib
import logging
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
from seedance.server.ops.connection_caps import LogThrottle
from seedance.server.ops.structured_log import log_event
from seedance.server.server_context import ServerContext
from seedance.transport import (
    AckClock,
    ConnectionDriver,
    DriverHooks,
    Link,
    Outbox,
    SendBacklogFull,
    SendStalled,
)

log = logging.getLogger("seedance.server.protocol")

CLOSE_GOING_AWAY = 1001
CLOSE_SECONDS = 2.0
"""Bound on the last flush and on the close handshake of a transport we close."""
_HANDSHAKE_TIMEOUTS = LogThrottle()


class FrameTransport(Link, Outbox, Protocol):
    """A byte pipe under the protocol: WebSocket binary messages or a raw TCP stream, with
    writes from synchronous code (`send_nowait`) and a bounded backlog (`congested`)."""

    async def close(self, code: int, reason: str) -> None:
        """Close with `code` (WebSocket close code; ignored on raw TCP), bounded in time."""

    def abort(self) -> None:
        """The peer is dropped for not reading: the coming close resets the connection."""

    @property
    def backlog(self) -> int:
        """Unsent bytes."""

    @property
    def peak_backlog(self) -> int:
        """The most unsent bytes held so far."""

    @property
    def closed_cleanly(self) -> bool:
        """The peer ended the connection on purpose (WebSocket close 1000): drop its session
        instead of keeping it for resume."""


class ProtocolConnection(DriverHooks):
    """Serves one transport until it closes; the session it carries may outlive it."""

    def __init__(self, ctx: ServerContext, transport: FrameTransport, codec: Codec) -> None:
        self.ctx = ctx
        self.transport = transport
        self.conn = ServerConnection(ctx.config.protocol, codec=codec)
        self.table: SessionTable = ctx.sessions
        self.record: SessionRecord | None = None
        self.close_code: int | None = None
        self._close_reason = ""
        self.driver = ConnectionDriver(self.conn, transport, self, outbox=transport,
                                       ack_clock=AckClock(self.conn))
        self._flush_queued = False
        """`_flush_at_pass_end` will run at the end of the current delivery pass."""
        self.send_failure: SendBacklogFull | SendStalled | None = None
        """Why the peer was dropped for not reading (logged once)."""

    # -- AttachedConnection ------------------------------------------------------------------------

    def kick(self) -> None:
        """Frames are waiting in `conn`. During an engine delivery pass they are written at its
        end (one message per pass, no task switch); otherwise the writer wakes."""
        if self._flush_queued:
            return
        if self.ctx.bridge.at_pass_end(self._flush_at_pass_end):
            self._flush_queued = True
        else:
            self.driver.wake_writer()

    def _flush_at_pass_end(self) -> None:
        self._flush_queued = False
        self.driver.flush_clocked()

    def detach_now(self) -> None:
        """Another connection resumed our session: this transport is abandoned."""
        now = trio.current_time()
        if self.conn.state is not ConnectionState.CLOSED:
            self.conn.transport_closed(now)
        self.record = None
        self._finish(CLOSE_GOING_AWAY, "session resumed elsewhere")

    # -- running ---------------------------------------------------------------------------------

    async def serve(self) -> None:
        driver = self.driver
        try:
            await driver.run(self._drain_watch, self._hello_deadline)
        finally:
            with trio.CancelScope(shield=True):
                if self.close_code is None or driver.write_interrupted:
                    self._lose_transport()
                else:
                    with trio.move_on_after(CLOSE_SECONDS):
                        await driver.write_remaining()
                    self._lose_transport()
                    with trio.move_on_after(CLOSE_SECONDS):
                        await self.transport.close(self.close_code, self._close_reason)

    def _finish(self, code: int, reason: str) -> None:
        """Stop serving this transport: the writer flushes what is queued (within
        CLOSE_SECONDS), then the transport is closed with `code`."""
        if self.close_code is None:
            self.close_code = code
            self._close_reason = reason
        self.driver.finish(within=CLOSE_SECONDS)

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

    # -- DriverHooks -------------------------------------------------------------------------------

    def internal_error(self, exc: Exception) -> None:
        log.exception("protocol_internal_error", exc_info=exc)
        self.ctx.metrics.protocol_error(ErrorCode.INTERNAL)
        if self.conn.state is not ConnectionState.CLOSED:
            with contextlib.suppress(LocalProtocolError):
                self.conn.send_error(ErrorCode.INTERNAL, "internal server error")
        self._finish(close_code_for(ErrorCode.INTERNAL), "internal")

    def protocol_error(self, exc: RemoteProtocolError, *, from_link: bool = False) -> None:
        self.ctx.metrics.protocol_error(exc.code)
        log_event(log, "protocol_error", level=logging.INFO, code=exc.code, message=exc.message)
        if from_link and self.conn.state is not ConnectionState.CLOSED:
            with contextlib.suppress(LocalProtocolError):
                self.conn.send_error(exc.code, exc.message)
        self._finish(exc.close_code, exc.code)

    def link_lost(self) -> None:
        """The peer went away: nothing to send or close with (the session stays resumable)."""
        self.driver.stop()

    def send_failed(self, exc: SendBacklogFull | SendStalled) -> None:
        """The peer stopped reading: drop the connection (a reset, no close handshake: it
        would never read one); its session stays resumable like after any lost transport."""
        if self.send_failure is None:
            self.send_failure = exc
            record = self.record
            log_event(log, "send_stalled" if isinstance(exc, SendStalled) else "send_backlog_full",
                      level=logging.WARNING, session=record.tag if record is not None else None,
                      backlog=exc.backlog, peak_backlog=self.transport.peak_backlog,
                      message=str(exc))
        self.transport.abort()
        self.driver.stop()

    def retransmitted(self, frames: int) -> None:
        self.ctx.metrics.frames_retransmitted += frames

    async def _hello_deadline(self) -> None:
        """A connection that sends no `hello` within `--handshake-timeout` is closed (1002):
        an idle socket must not hold a descriptor, with or without API keys."""
        timeout = self.ctx.config.server.handshake_timeout
        await trio.sleep(timeout)
        conn = self.conn
        if conn.state is ConnectionState.AWAIT_HELLO and self.close_code is None:
            suppressed = _HANDSHAKE_TIMEOUTS.allow(trio.current_time())
            if suppressed is not None:  # a flood of idle sockets logs once a second
                log_event(log, "handshake_timeout", timeout_s=timeout, suppressed=suppressed)
            self.ctx.metrics.protocol_error(ErrorCode.PROTOCOL_VIOLATION)
            with contextlib.suppress(LocalProtocolError):
                conn.send_error(ErrorCode.PROTOCOL_VIOLATION, f"no hello within {timeout:g} s")
            self._finish(close_code_for(ErrorCode.PROTOCOL_VIOLATION), "handshake timeout")

    async def _drain_watch(self) -> None:
        await self.ctx.drain.started.wait()
        if self.conn.state is ConnectionState.OPEN:
            self.conn.goaway("server shutting down")
            self.driver.wake_writer()
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

    async def handle_events(self) -> bool:
        conn = self.conn
        while True:
            event = conn.next_event()
            if event is None:
                return True
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
                    return False
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
                          session=record.tag if record is not None else None)
                self.driver.stop()
                return False
            elif kind is PeerError:
                assert isinstance(event, PeerError)
                log_event(log, "peer_error", code=event.code, message=event.message)
                self._finish(event.close_code, event.code)
                return False

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
        old = self.table.resumable(hello.session, now, api_key=hello.api_key)
        if old is not None and not old.accepts_resume_ack(hello.ack):
            # refused before the session is touched: its connection and streams go on
            self.protocol_error(RemoteProtocolError(
                ErrorCode.PROTOCOL_VIOLATION, f"resume ack {hello.ack} outside what the "
                f"session sent [{old.session.send.acked}, {old.session.send.next_unsent}]"),
                from_link=True)
            return False
        resent_before = 0 if old is None else old.session.send.retransmissions
        if old is not None and old.attached is not None:
            old.attached.detach_now()
        try:
            state: SessionState = conn.welcome(old.session if old is not None else None)
        except RemoteProtocolError as exc:
            if old is not None:
                old.close()
            self.protocol_error(exc)
            return False
        if old is not None:
            record = old
            resend = state.send.retransmissions - resent_before
            ctx.metrics.sessions_resumed += 1
            ctx.metrics.frames_retransmitted += resend
            log_event(log, "session_resumed", session=record.tag, streams=len(record.pumps),
                      retransmitted=resend)
        else:
            record = SessionRecord(ctx, state, self.table, api_key=hello.api_key)
            record.attached = self  # before its task starts, so it never looks detached
            assert ctx.session_nursery is not None
            await ctx.session_nursery.start(record.run)
            self.table.add(record)
        self.record = record
        record.attach(self)
        if ctx.drain.draining:
            conn.goaway("server shutting down")
        return True
