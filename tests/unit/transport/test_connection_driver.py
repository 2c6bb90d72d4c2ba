"""ConnectionDriver: its reader turns bytes into events for the hooks and answers at once, its
writer writes what the connection queued when woken, its timer task runs the connection's
timers at their deadline; EOF, bad bytes, a misused link and a stalled or overfull outbox each
end the link through their hook; while the outbox is congested the reader does not read."""

from __future__ import annotations

import trio
import trio.testing

from seedance.protocol import (
    ClientConnection,
    ConnectionTimedOut,
    DeltaReceived,
    ErrorCode,
    Event,
    HelloReceived,
    ProtocolLimits,
    RemoteProtocolError,
    ServerConnection,
    StreamEnded,
    StreamOpened,
    Usage,
    Welcomed,
)
from seedance.transport import ConnectionDriver, DriverHooks, SendBacklogFull, SendStalled


class StreamLink:
    """A trio stream as a `Link`; `misuse` makes the next receive fail like a WebSocket text
    message does."""

    def __init__(self, stream: trio.abc.Stream) -> None:
        self.stream = stream
        self.misuse = False

    async def receive(self) -> bytes:
        data = bytes(await self.stream.receive_some(65536))
        if self.misuse:
            raise RemoteProtocolError(ErrorCode.PROTOCOL_VIOLATION, "text message")
        return data

    async def send(self, data: bytes) -> None:
        if data:
            await self.stream.send_all(data)


class Recorder(DriverHooks):
    """Collects events (answering hello and opens like a tiny server) and what ended the link."""

    def __init__(self, conn: ServerConnection | ClientConnection) -> None:
        self.conn = conn
        self.events: list[Event] = []
        self.changed = trio.Event()
        self.ended: list[str] = []

    async def handle_events(self) -> bool:
        try:
            return self._handle()
        finally:
            self.changed.set()
            self.changed = trio.Event()

    def _handle(self) -> bool:
        while (event := self.conn.next_event()) is not None:
            self.events.append(event)
            conn = self.conn
            if isinstance(event, HelloReceived) and isinstance(conn, ServerConnection):
                conn.welcome(None)
            elif isinstance(event, StreamOpened) and isinstance(conn, ServerConnection):
                conn.accept_stream(event.open.stream, token_quota=2, batch_size=1)
                conn.send_delta(event.open.stream, "hi", (104, 105))
                conn.end_stream(event.open.stream, "length", Usage(completion_tokens=2), None)
            elif isinstance(event, ConnectionTimedOut):
                self.ended.append("timed out")
                self.driver.stop()
                return False
        return True

    async def wait_for(self, kind: type[Event]) -> Event:
        while not any(isinstance(e, kind) for e in self.events):
            await self.changed.wait()
        return next(e for e in self.events if isinstance(e, kind))

    def protocol_error(self, exc: RemoteProtocolError, *, from_link: bool) -> None:
        self.ended.append(f"protocol_error from_link={from_link}")
        self.driver.finish()

    def link_lost(self) -> None:
        self.ended.append("lost")
        self.driver.stop()

    def send_failed(self, exc: SendBacklogFull | SendStalled) -> None:
        self.ended.append(type(exc).__name__)
        self.driver.stop()


class FakeOutbox:
    """An outbox the test congests and drains by hand; `stall` makes the wait fail."""

    def __init__(self, link: StreamLink) -> None:
        self.link = link
        self.congested = False
        self.stall = False
        self.drained = trio.Event()
        self.written: list[bytes] = []

    def send_nowait(self, data: bytes) -> bool:
        self.written.append(data)
        return False  # the writer sends it (`backlog_left`)

    async def wait_uncongested(self) -> None:
        if self.stall:
            raise SendStalled(1 << 20, 0.1)
        await self.drained.wait()


def served_pair() -> tuple[ClientConnection, ServerConnection, trio.abc.Stream, StreamLink]:
    """A client connection on the test's side of a memory stream, a server connection on the
    driver's side."""
    ours, theirs = trio.testing.memory_stream_pair()
    return ClientConnection(), ServerConnection(), ours, StreamLink(theirs)


async def exchange(client: ClientConnection, ours: trio.abc.Stream,
                   until: type[Event]) -> list[Event]:
    """Write what the client queued, then read and feed the server's bytes until `until`."""
    await ours.send_all(client.data_to_send(trio.current_time()))
    seen: list[Event] = []
    while not any(isinstance(e, until) for e in seen):
        client.receive_data(await ours.receive_some(65536), trio.current_time())
        seen += client.events()
    return seen


async def test_the_driver_carries_a_handshake_and_a_stream_both_ways() -> None:
    client, server, ours, link = served_pair()
    hooks = Recorder(server)
    driver = ConnectionDriver(server, link, hooks)
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(driver.run)
            client.send_hello()
            assert any(isinstance(e, Welcomed) for e in await exchange(client, ours, Welcomed))
            stream = client.open_stream(prompt="x")
            seen = await exchange(client, ours, StreamEnded)
            driver.stop()
    assert [e.text for e in seen if isinstance(e, DeltaReceived)] == ["hi"]
    assert [type(e) for e in hooks.events] == [HelloReceived, StreamOpened]
    assert isinstance(hooks.events[1], StreamOpened) and hooks.events[1].open.stream == stream


async def test_the_timer_task_runs_the_connections_timers_at_their_deadline(
        autojump_clock: trio.testing.MockClock) -> None:
    limits = ProtocolLimits(heartbeat_min=ProtocolLimits().heartbeat)  # the defaults, 30 s
    ours, theirs = trio.testing.memory_stream_pair()
    client, server = ClientConnection(), ServerConnection(limits)
    hooks = Recorder(server)
    driver = ConnectionDriver(server, StreamLink(theirs), hooks)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(driver.run)
        client.send_hello()
        await exchange(client, ours, Welcomed)
        start = trio.current_time()
        await hooks.wait_for(ConnectionTimedOut)  # we answer no ping: the link is dead
    assert hooks.ended == ["timed out"]
    assert trio.current_time() - start >= limits.heartbeat.connection


async def test_eof_ends_the_link_as_lost() -> None:
    _client, server, ours, link = served_pair()
    hooks = Recorder(server)
    driver = ConnectionDriver(server, link, hooks)
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(driver.run)
            await ours.aclose()
    assert hooks.ended == ["lost"]


async def test_bytes_that_break_the_protocol_are_a_protocol_error_and_the_error_goes_out() -> None:
    client, server, ours, link = served_pair()
    hooks = Recorder(server)
    driver = ConnectionDriver(server, link, hooks)
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(driver.run)
            await ours.send_all(b"\x00" * 16)  # not the frame magic
            error = await ours.receive_some(65536)  # `finish` wrote the queued error frame
    assert hooks.ended == ["protocol_error from_link=False"]
    client.send_hello()
    client.receive_data(error, 0.0)  # an `error` frame: the client closes
    assert client.events()


async def test_a_misused_link_is_a_protocol_error_from_the_link() -> None:
    _client, server, ours, link = served_pair()
    link.misuse = True
    hooks = Recorder(server)
    driver = ConnectionDriver(server, link, hooks)
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(driver.run)
            await ours.send_all(b"text")
    assert hooks.ended == ["protocol_error from_link=True"]


async def test_the_reader_reads_nothing_while_the_outbox_is_congested() -> None:
    client, server, ours, link = served_pair()
    hooks = Recorder(server)
    outbox = FakeOutbox(link)
    outbox.congested = True
    driver = ConnectionDriver(server, link, hooks, outbox=outbox)
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(driver.run)
            client.send_hello()
            await ours.send_all(client.data_to_send(0.0))
            await trio.testing.wait_all_tasks_blocked()
            assert hooks.events == []  # the hello waits in the socket, unread
            outbox.congested = False
            outbox.drained.set()
            await hooks.wait_for(HelloReceived)
            driver.stop()
    assert outbox.written  # the welcome went to the outbox at once, after the input


async def test_a_stalled_outbox_ends_the_link_through_send_failed() -> None:
    _client, server, _ours, link = served_pair()
    hooks = Recorder(server)
    outbox = FakeOutbox(link)
    outbox.congested = outbox.stall = True
    driver = ConnectionDriver(server, link, hooks, outbox=outbox)
    with trio.fail_after(5):
        await driver.run()
    assert hooks.ended == ["SendStalled"] and driver.write_interrupted


async def test_finish_writes_what_is_queued_then_stops() -> None:
    client, server, ours, link = served_pair()
    hooks = Recorder(server)
    driver = ConnectionDriver(server, link, hooks)
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(driver.run)
            client.send_hello()
            await exchange(client, ours, Welcomed)
            server.goaway("bye")
            driver.finish()
            data = await ours.receive_some(65536)
    assert data and not driver.write_interrupted
