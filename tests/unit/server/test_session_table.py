"""SessionRecord and SessionTable: a detached session expires after resume_grace and cancels
its stream pumps (aborting their engine requests); re-attaching in time keeps it; closed or
expired sessions are not resumable; a session resumes only under the API key that created it
and only with an `ack` within what it sent; logs see a hash of its id."""

from __future__ import annotations

from typing import Any

import trio
import trio.testing

from seedance.protocol import Open, ProtocolLimits, SessionState
from seedance.server.gateway.session_ids import session_tag, stream_request_id
from seedance.server.gateway.session_table import SessionRecord, SessionTable
from seedance.server.gateway.websocket import choose_subprotocol


class FakeConnection:
    def __init__(self) -> None:
        self.conn: Any = None
        self.kicked = 0
        self.detached = False

    def kick(self) -> None:
        self.kicked += 1

    def detach_now(self) -> None:
        self.detached = True


class ForeverPump:
    def __init__(self, record: SessionRecord, open_: Open) -> None:
        self.record = record
        self.stream = open_.stream
        self.cancelled = False
        self.woken = 0

    def wake(self) -> None:
        self.woken += 1

    async def run(self) -> None:
        try:
            await trio.sleep_forever()
        finally:
            self.cancelled = True
            self.record.pump_done(self.stream)


def _record(table: SessionTable, grace: float = 5.0) -> SessionRecord:
    session = SessionState("server", ProtocolLimits(resume_grace=grace), "sid")
    record = SessionRecord(None, session, table)  # type: ignore[arg-type]
    table.add(record)
    return record


async def test_detached_session_expires_after_grace_and_cancels_its_pumps(
    autojump_clock: trio.testing.MockClock,
) -> None:
    table = SessionTable()
    record = _record(table)
    connection = FakeConnection()
    record.attached = connection
    async with trio.open_nursery() as nursery:
        await nursery.start(record.run)
        record.start_stream(ForeverPump, Open(seq=0, stream=1, prompt="x"))  # type: ignore[arg-type]
        pump = record.pumps[1]
        await trio.sleep(100)  # attached: never expires
        assert table.get("sid") is record and not pump.cancelled  # type: ignore[attr-defined]
        record.detach(connection)
        detached_at = trio.current_time()
        await trio.sleep(4.9)
        assert table.resumable("sid", trio.current_time()) is record
        await trio.sleep(0.2)
    assert pump.cancelled  # type: ignore[attr-defined]
    assert trio.current_time() - detached_at >= 5.0
    assert table.get("sid") is None and record.closed
    assert table.resumable("sid", trio.current_time()) is None


async def test_reattaching_within_grace_keeps_the_session(
    autojump_clock: trio.testing.MockClock,
) -> None:
    table = SessionTable()
    record = _record(table)
    first, second = FakeConnection(), FakeConnection()
    record.attached = first
    async with trio.open_nursery() as nursery:
        await nursery.start(record.run)
        record.start_stream(ForeverPump, Open(seq=0, stream=1, prompt="x"))  # type: ignore[arg-type]
        record.detach(first)
        await trio.sleep(3)
        record.attach(second)
        assert record.pumps[1].woken == 1  # type: ignore[attr-defined]
        await trio.sleep(60)
        assert not record.closed and table.get("sid") is record
        # a third connection resuming it drops the second one
        third = FakeConnection()
        record.attach(third)
        assert second.detached
        record.close()
    assert record.pumps == {} and table.get("sid") is None


async def test_resumable_refuses_unknown_and_closed_sessions() -> None:
    table = SessionTable()
    assert table.resumable(None, 0.0) is None
    assert table.resumable("nope", 0.0) is None
    record = _record(table)
    record.close()
    assert table.resumable("sid", trio.current_time()) is None


def test_subprotocol_choice() -> None:
    assert choose_subprotocol([]) == "seedance.v1.msgpack"
    assert choose_subprotocol(["seedance.v1.json"]) == "seedance.v1.json"
    assert choose_subprotocol(["chat", "seedance.v1.msgpack"]) == "seedance.v1.msgpack"
    assert choose_subprotocol(["chat"]) is None


class FinishingPump(ForeverPump):
    """A stream that ends on its own after a while (its engine request finished)."""

    async def run(self) -> None:
        try:
            await trio.sleep(1.0)
        finally:
            self.record.pump_done(self.stream)


async def test_a_stream_ending_while_detached_does_not_expire_the_session_early(
    autojump_clock: trio.testing.MockClock,
) -> None:
    table = SessionTable()
    record = _record(table)
    connection = FakeConnection()
    record.attached = connection
    async with trio.open_nursery() as nursery:
        await nursery.start(record.run)
        record.start_stream(FinishingPump, Open(seq=0, stream=1, prompt="x"))  # type: ignore[arg-type]
        record.detach(connection)
        await trio.sleep(2.0)  # the stream has ended meanwhile, waking the session
        assert 1 not in record.pumps
        assert table.resumable("sid", trio.current_time()) is record and not record.closed
        record.close()


# -- binding to credentials (issue 12, hole 2) ------------------------------------------------


def _keyed_record(table: SessionTable, api_key: str | None) -> SessionRecord:
    session = SessionState("server", ProtocolLimits(), "keyed")
    record = SessionRecord(None, session, table, api_key=api_key)  # type: ignore[arg-type]
    table.add(record)
    return record


async def test_a_session_resumes_only_under_the_key_that_created_it() -> None:
    table = SessionTable()
    record = _keyed_record(table, "key-a")
    connection = FakeConnection()
    record.attached = connection
    now = trio.current_time()
    assert table.resumable("keyed", now, api_key="key-b") is None  # as for an unknown id
    assert table.resumable("keyed", now) is None
    assert table.resumable("keyed", now, api_key="key-a ") is None
    # a refused resume leaves the session as it was: attached, open, in the table
    assert record.attached is connection and not connection.detached and not record.closed
    assert table.resumable("keyed", now, api_key="key-a") is record


async def test_a_session_created_without_a_key_refuses_every_key() -> None:
    table = SessionTable()
    record = _keyed_record(table, None)
    now = trio.current_time()
    assert table.resumable("keyed", now, api_key="anything") is None
    assert table.resumable("keyed", now, api_key="") is None
    assert table.resumable("keyed", now) is record


async def test_a_session_keeps_a_hash_of_its_key_never_the_key() -> None:
    record = SessionRecord(None, SessionState("server", ProtocolLimits(), "s"),  # type: ignore[arg-type]
                           SessionTable(), api_key="secret-key")
    assert "secret-key" not in repr(vars(record))
    assert record.bound_to("secret-key") and not record.bound_to("secret-kez")


async def test_a_resume_ack_must_lie_within_what_the_session_sent() -> None:
    session = SessionState("server", ProtocolLimits(), "acks")
    record = SessionRecord(None, session, SessionTable())  # type: ignore[arg-type]
    for _ in range(3):
        session.send.push_written(object())  # type: ignore[arg-type]
    sent = session.send.next_unsent
    assert sent == 3
    assert record.accepts_resume_ack(0) and record.accepts_resume_ack(sent)
    assert not record.accepts_resume_ack(sent + 1)
    session.send.on_ack(2, (), 0.0)
    assert not record.accepts_resume_ack(1)  # below what the client already acknowledged
    assert record.accepts_resume_ack(2)


async def test_logs_show_a_short_hash_of_a_session_id() -> None:
    record = SessionRecord(None, SessionState("server", ProtocolLimits(), "a-secret-id"),  # type: ignore[arg-type]
                           SessionTable())
    assert record.tag == session_tag("a-secret-id")
    assert len(record.tag) == 8 and "secret" not in record.tag
    assert stream_request_id("a-secret-id", 3).endswith("-3")
    assert "a-secret-id" not in stream_request_id("a-secret-id", 3)
