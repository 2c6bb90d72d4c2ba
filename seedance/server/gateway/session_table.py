"""Protocol sessions by id, shared by the WebSocket and TCP gateways: each `SessionRecord` owns
its stream pumps (under the server's session nursery, so they outlive a connection), knows the
connection it is attached to, and expires `resume_grace` seconds after it lost it — aborting
every engine request it still held. A session is bound to the API key of the `hello` that
created it: a resume under another key finds nothing, exactly like an unknown id."""

from __future__ import annotations

import hmac
import logging
from collections.abc import Callable, Iterator
from typing import Protocol

import trio

from seedance.protocol import (
    ConnectionState,
    Open,
    ServerConnection,
    SessionState,
    StreamError,
    Usage,
)
from seedance.protocol.messages import EndReason
from seedance.server.gateway.session_ids import credential_digest, session_tag
from seedance.server.gateway.stream_pump import PumpServer, StreamPump
from seedance.server.ops.structured_log import log_event

log = logging.getLogger("seedance.server.sessions")

_OPEN = ConnectionState.OPEN


class AttachedConnection(Protocol):
    """What a session needs from the connection it is attached to."""

    conn: ServerConnection

    def kick(self) -> None:
        """Bytes are waiting in `conn`: wake the writer."""

    def detach_now(self) -> None:
        """Another connection resumed this session: drop this transport."""


class SessionRecord:
    """One server session: its reliable state (`SessionState`), its stream pumps and the
    connection currently attached (None while detached). The reliable send methods go to the
    attached connection when it is open, else to the session (frames kept for resume)."""

    def __init__(self, ctx: PumpServer, session: SessionState, table: SessionTable, *,
                 api_key: str | None = None) -> None:
        self.ctx = ctx
        """The server, as far as the stream pumps need it."""
        self.session = session
        self.table = table
        self._credential = credential_digest(api_key)
        """The creating `hello`'s API key, hashed: a resume must present the same one."""
        self.tag = session_tag(session.id)
        """The id as logs show it (`session_tag`)."""
        self.attached: AttachedConnection | None = None
        self.pumps: dict[int, StreamPump] = {}
        self.closed = False
        """The session is over (error, clean close, expiry): no resume."""
        self._changed = trio.Event()
        self._nursery: trio.Nursery | None = None
        self._detached_at = trio.current_time()

    @property
    def id(self) -> str:
        return self.session.id

    def bound_to(self, api_key: str | None) -> bool:
        """`api_key` is the key this session was created with (constant time)."""
        return hmac.compare_digest(self._credential, credential_digest(api_key))

    def accepts_resume_ack(self, ack: int) -> bool:
        """A resuming client's `ack` lies within what this session sent (§11.4): not below
        what it already acknowledged, not beyond the next frame to go out. Checked before the
        session is touched, so that a bad resume cannot harm the connection holding it."""
        send = self.session.send
        return send.acked <= ack <= send.next_unsent

    # -- lifetime (a task in ctx.session_nursery) -------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Hold the session's pumps until it is closed, or detached for longer than
        `resume_grace`; then cancel the pumps (aborting their engine requests)."""
        grace = self.session.limits.resume_grace
        try:
            async with trio.open_nursery() as pumps:
                self._nursery = pumps
                task_status.started()
                while not self.closed:
                    changed = self._changed
                    if self.attached is None:
                        deadline = self._detached_at + grace
                        with trio.move_on_at(deadline):
                            await changed.wait()
                        # woken by any change (a pump ending, say): expire only past the grace
                        expired = trio.current_time() >= self._detached_at + grace
                        if self.attached is None and not self.closed and expired:
                            log_event(log, "session_expired", session=self.tag,
                                      streams=len(self.pumps))
                            self.closed = True
                    else:
                        await changed.wait()
                pumps.cancel_scope.cancel()
        finally:
            self.closed = True
            self._nursery = None
            self.table.remove(self)

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    def attach(self, connection: AttachedConnection) -> None:
        previous = self.attached
        self.attached = connection
        if previous is not None and previous is not connection:
            previous.detach_now()
        self._notify()
        self.wake_all()

    def detach(self, connection: AttachedConnection) -> None:
        """`connection` lost its transport; the session stays resumable for `resume_grace`."""
        if self.attached is connection:
            self.attached = None
            self._detached_at = trio.current_time()
            self._notify()

    def close(self) -> None:
        """End the session now (error, clean close by the client): its pumps are cancelled."""
        self.closed = True
        self._notify()

    # -- streams ----------------------------------------------------------------------------------

    def start_stream(self, pump_factory: Callable[[SessionRecord, Open], StreamPump],
                     open_: Open) -> None:
        assert self._nursery is not None
        pump = pump_factory(self, open_)
        self.pumps[open_.stream] = pump
        self._nursery.start_soon(pump.run)

    def pump_done(self, stream: int) -> None:
        self.pumps.pop(stream, None)
        self._notify()

    def wake_all(self) -> None:
        for pump in self.pumps.values():
            pump.wake()

    def wake(self, stream: int) -> None:
        pump = self.pumps.get(stream)
        if pump is not None:
            pump.wake()

    async def wait_changed(self) -> None:
        """Until a stream ends or the attachment changes."""
        await self._changed.wait()

    # -- reliable sends, to the attached connection or the detached session ------------------------

    def _open_conn(self) -> ServerConnection | None:
        attached = self.attached
        if attached is not None and attached.conn.state is _OPEN:
            return attached.conn
        return None

    def can_send_delta(self, stream: int, n_tokens: int) -> bool:
        conn = self._open_conn()
        if conn is not None:
            return conn.can_send_delta(stream, n_tokens)
        return self.session.can_send_delta(stream, n_tokens)

    def send_delta(self, stream: int, text: str, tokens: list[int]) -> int:
        """Send (or keep, while detached) one delta; return its seq."""
        conn = self._open_conn()
        seq = self.session.send.next_seq
        if conn is not None:
            conn.send_delta(stream, text, tokens)
            assert self.attached is not None
            self.attached.kick()
        else:
            self.session.send_delta(stream, text, tokens)
        return seq

    def accept_stream(self, stream: int, token_quota: int, batch_size: int) -> None:
        conn = self._open_conn()
        if conn is not None:
            conn.accept_stream(stream, token_quota, batch_size)
            assert self.attached is not None
            self.attached.kick()
        else:
            self.session.accept_stream(stream, token_quota, batch_size)

    def end_stream(
        self, stream: int, reason: EndReason, usage: Usage, error: StreamError | None
    ) -> None:
        if stream not in self.session.streams:
            return
        conn = self._open_conn()
        if conn is not None:
            conn.end_stream(stream, reason, usage, error)
            assert self.attached is not None
            self.attached.kick()
        else:
            self.session.end_stream(stream, reason, usage, error)


class SessionTable:
    """Sessions by id, one table per server (`ServerContext.sessions`, shared by both
    gateways); a record removes itself when its `run` task ends."""

    def __init__(self) -> None:
        self._records: dict[str, SessionRecord] = {}

    def __len__(self) -> int:
        return len(self._records)

    def get(self, session_id: str) -> SessionRecord | None:
        return self._records.get(session_id)

    def records(self) -> Iterator[SessionRecord]:
        """Every live session (a snapshot: the table may change while it is used)."""
        return iter(list(self._records.values()))

    def resumable(self, session_id: str | None, now: float, *,
                  api_key: str | None = None) -> SessionRecord | None:
        """The live record of `session_id` if it can still be resumed at `now` by a `hello`
        with `api_key`. Under another key the answer is None, as for an unknown id (and the
        session is left as it was)."""
        if session_id is None:
            return None
        record = self._records.get(session_id)
        if record is None or record.closed:
            return None
        if not record.bound_to(api_key):
            return None
        if record.attached is None and now - record._detached_at > record.session.limits.resume_grace:
            record.close()
            return None
        return record

    def add(self, record: SessionRecord) -> None:
        self._records[record.id] = record

    def remove(self, record: SessionRecord) -> None:
        if self._records.get(record.id) is record:
            del self._records[record.id]

