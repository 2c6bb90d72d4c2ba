"""The I/O around one sans-IO protocol connection, shared by the server's sessions and the
client: a nursery with the reader (bytes -> `receive_data` -> events), the writer (everything
the connection queued, in one write, when woken) and the timer task (sleeping until
`next_deadline()`). What differs between its users comes in through `DriverHooks` (what the
events mean, how errors end the connection) and two optional parts: an `Outbox` that writes
without blocking (the server's delivery-pass and after-input writes, bounded and with
backpressure) and an `AckClock` (delivery-pass frames wait for the peer's ack)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Awaitable, Callable
from typing import Protocol

import trio

from seedance.protocol import ConnectionState, Event, RemoteProtocolError, SessionState
from seedance.transport.ack_clock import AckClock
from seedance.transport.send_limits import SendBacklogFull, SendStalled


class SansIOConnection(Protocol):
    """What the driver uses of a `ServerConnection` / `ClientConnection`."""

    @property
    def state(self) -> ConnectionState: ...
    @property
    def session(self) -> SessionState | None: ...
    def receive_data(self, data: bytes, now: float) -> None: ...
    def next_event(self) -> Event | None: ...
    def data_to_send(self, now: float) -> bytes: ...
    def next_deadline(self) -> float | None: ...
    def handle_timers(self, now: float) -> None: ...


class Link(Protocol):
    """A byte pipe under the protocol (WebSocket binary messages, a TCP stream)."""

    async def receive(self) -> bytes:
        """The next bytes from the peer; b"" when it closed. May raise `RemoteProtocolError`
        (the transport itself was misused, e.g. a WebSocket text message)."""

    async def send(self, data: bytes) -> None:
        """Write what `Outbox.send_nowait` left, then `data` (one caller at a time)."""


class Outbox(Protocol):
    """A link's writes from synchronous code, with a bounded backlog (the server's links)."""

    def send_nowait(self, data: bytes) -> bool:
        """Write `data` now without blocking if the socket takes all of it (True); else keep
        the rest, in order, for the next `Link.send` (False). May raise `SendBacklogFull`."""

    @property
    def congested(self) -> bool:
        """Unsent bytes went above the high-water mark and not yet back below the low one."""

    async def wait_uncongested(self) -> None:
        """Until `congested` is False; raises `SendStalled` when the peer stopped reading."""


class DriverHooks:
    """What the owner of a driven connection does with what the driver meets. Subclass and
    override `handle_events`; the other defaults end the connection."""

    driver: ConnectionDriver

    async def handle_events(self) -> bool:
        """Act on every event the connection holds; False when this link is finished (the
        caller stops reading; the hook has arranged how the link ends)."""
        raise NotImplementedError

    def protocol_error(self, exc: RemoteProtocolError, *, from_link: bool) -> None:
        """The peer broke the protocol (`from_link`: the transport under it, so no `error`
        frame was queued yet). Reading stops."""
        self.driver.finish()

    def internal_error(self, exc: Exception) -> None:
        """A bug while handling input or timers. Reading (or the timers) stop."""
        raise exc

    def link_lost(self) -> None:
        """The peer closed or reset the link: nothing more can be written."""
        self.driver.stop()

    def send_failed(self, exc: SendBacklogFull | SendStalled) -> None:
        """The peer does not read: the unsent bytes hit the hard limit or stalled."""
        self.driver.stop()

    def retransmitted(self, frames: int) -> None:
        """The retransmission timer wrote `frames` frames again (for metrics)."""


class ConnectionDriver:
    """Serves one connection over one link until `stop` (or the end of `finish`)."""

    def __init__(self, conn: SansIOConnection, link: Link, hooks: DriverHooks, *,
                 outbox: Outbox | None = None, ack_clock: AckClock | None = None) -> None:
        self.conn = conn
        self.link = link
        self.hooks = hooks
        hooks.driver = self
        self.outbox = outbox
        self.ack_clock = ack_clock
        self.scope = trio.CancelScope()
        self.finishing = False
        """`finish` was called: the writer's next write is its last."""
        self.write_interrupted = False
        """A write was cut (cancelled, failed): the link's byte stream may end mid-message."""
        self._dirty = trio.Event()
        self._backlog = False
        """`send_nowait` left bytes in the outbox for the writer."""
        self._timer_changed = trio.Event()
        self._timer_deadline = math.inf
        """What the timer task sleeps until (inf: until `_timer_changed`)."""

    @property
    def writer_woken(self) -> bool:
        """The writer task has been asked to write (and has not yet)."""
        return self._dirty.is_set()

    @property
    def backlog_left(self) -> bool:
        """A `send_nowait` left bytes for the writer that it has not yet taken."""
        return self._backlog

    async def run(self, *tasks: Callable[[], Awaitable[None]]) -> None:
        """Run the reader, the writer, the timers and `tasks` until stopped."""
        with self.scope:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._reader)
                nursery.start_soon(self._writer)
                nursery.start_soon(self._timers)
                for task in tasks:
                    nursery.start_soon(task)
                self._dirty.set()  # whatever was queued before (a hello, say)

    def stop(self) -> None:
        """End now: nothing more is read or written."""
        self.scope.cancel()

    def finish(self, within: float = math.inf) -> None:
        """Write what the connection queued (within `within` seconds), then stop."""
        if not self.finishing:
            self.finishing = True
            self.scope.deadline = min(self.scope.deadline, trio.current_time() + within)
        self._dirty.set()

    # -- writes ---------------------------------------------------------------------------------

    def wake_writer(self) -> None:
        self._dirty.set()

    def flush_now(self) -> None:
        """Write what the connection queued straight to the outbox, if there is one and it is
        not congested; otherwise (and while finishing) the writer does it."""
        outbox = self.outbox
        if outbox is None or self.finishing or outbox.congested:
            self._dirty.set()
            return
        try:
            data = self.conn.data_to_send(trio.current_time())
            if data:
                clock = self.ack_clock
                if clock is not None:
                    clock.wrote()
                if not outbox.send_nowait(data):
                    self._backlog = True
                    self._dirty.set()
            self._deadline_may_have_moved()
        except SendBacklogFull as exc:
            self.write_interrupted = True  # what was refused left a hole in the byte stream
            self.hooks.send_failed(exc)
        except Exception as exc:  # a bug: this connection ends, its owner goes on
            self.hooks.internal_error(exc)

    def flush_clocked(self) -> None:
        """`flush_now`, unless the ACK clock says the peer is still reading earlier writes:
        then these frames go out with the next ones, after its ack (`flush_now` on input)."""
        clock = self.ack_clock
        if clock is None or not clock.peer_behind():
            self.flush_now()

    async def write_remaining(self) -> None:
        """Write what is queued, ignoring a link that is gone (the last flush of a close)."""
        data = self.conn.data_to_send(trio.current_time())
        if data or self._backlog:
            self._backlog = False
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                await self.link.send(data)

    def _deadline_may_have_moved(self) -> None:
        """Wake the timer task only when a send armed a deadline earlier than its own."""
        deadline = self.conn.next_deadline()
        if deadline is not None and deadline < self._timer_deadline:
            self._timer_changed.set()

    # -- the tasks ------------------------------------------------------------------------------

    async def _reader(self) -> None:
        conn = self.conn
        link = self.link
        outbox = self.outbox
        hooks = self.hooks
        while True:
            try:
                if outbox is not None and outbox.congested:
                    await outbox.wait_uncongested()  # backpressure: the peer is not reading
                data = await link.receive()
            except RemoteProtocolError as exc:  # e.g. a text message on the WebSocket
                hooks.protocol_error(exc, from_link=True)
                return
            except (SendBacklogFull, SendStalled) as exc:  # also from answering a WebSocket ping
                self.write_interrupted = True
                hooks.send_failed(exc)
                return
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                data = b""
            if not data:
                hooks.link_lost()
                return
            if conn.state is ConnectionState.CLOSED:
                continue  # closing: what the peer still sends is read and dropped
            try:
                conn.receive_data(data, trio.current_time())
                if not await hooks.handle_events():
                    return
            except RemoteProtocolError as exc:
                hooks.protocol_error(exc, from_link=False)
                return
            except Exception as exc:  # a bug: this connection ends, its owner goes on
                hooks.internal_error(exc)
                return
            self.flush_now()  # acks, pongs, and frames that waited for the peer's ack

    async def _writer(self) -> None:
        conn = self.conn
        link = self.link
        clock = self.ack_clock
        while True:
            await self._dirty.wait()
            self._dirty = trio.Event()
            data = conn.data_to_send(trio.current_time())
            if data and clock is not None:
                clock.wrote()
            if data or self._backlog:
                self.write_interrupted = True
                self._backlog = False
                try:
                    await link.send(data)
                except (SendBacklogFull, SendStalled) as exc:
                    self.hooks.send_failed(exc)
                    return
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    self.hooks.link_lost()
                    return
                self.write_interrupted = False
            if self.finishing:
                self.scope.cancel()
                return
            self._deadline_may_have_moved()

    async def _timers(self) -> None:
        conn = self.conn
        hooks = self.hooks
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
            session = conn.session
            resent_before = 0 if session is None else session.send.retransmissions
            try:
                conn.handle_timers(trio.current_time())
                if session is not None and session.send.retransmissions != resent_before:
                    hooks.retransmitted(session.send.retransmissions - resent_before)
                if not await hooks.handle_events():
                    return
            except Exception as exc:  # a bug: this connection ends, its owner goes on
                hooks.internal_error(exc)
                return
            self._dirty.set()
