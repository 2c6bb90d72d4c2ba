"""SessionRecord and SessionTable: a detached session expires after resume_grace and cancels
its stream pumps (aborting their engine requests); re-attaching in time keeps it; closed or
expired sessions are not resumable."""

from __future__ import annotations

from typing import Any

import trio
import trio.testing

from seedance.protocol import Open, ProtocolLimits, SessionState
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
