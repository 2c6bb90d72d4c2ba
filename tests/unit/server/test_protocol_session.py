"""ProtocolConnection's writes: frames queued during an engine delivery pass go to the transport
once, at the pass's end, without waking the writer task; what the transport cannot take at once,
and anything queued outside a pass, is left to the writer; while the peer has not acknowledged
MAX_WRITES_IN_FLIGHT writes (and owes an ack), a pass's frames wait for that ack; while the
transport is congested they wait in the connection for the writer."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace

import trio

from seedance.protocol import ClientConnection, DeltaReceived, ProtocolLimits, StreamOpened
from seedance.server.gateway.protocol_session import ProtocolConnection
from seedance.server.gateway.session_table import SessionTable
from seedance.transport import MAX_WRITES_IN_FLIGHT, PEER_ACK_FRAMES


class FakeBridge:
    """Collects pass-end callbacks while `in_pass`, like EngineBridge during `_deliver`."""

    def __init__(self) -> None:
        self.in_pass = False
        self.pass_end: list[Callable[[], None]] = []

    def at_pass_end(self, callback: Callable[[], None]) -> bool:
        if self.in_pass:
            self.pass_end.append(callback)
        return self.in_pass

    def end_pass(self) -> None:
        callbacks, self.pass_end, self.in_pass = self.pass_end, [], False
        for callback in callbacks:
            callback()


class FakeTransport:
    """Records writes; `takes` says whether `send_nowait` accepts everything; `congested`
    stands for a backlog above the high-water mark."""

    closed_cleanly = False

    def __init__(self, takes: bool = True) -> None:
        self.takes = takes
        self.congested = False
        self.nowait: list[bytes] = []

    def send_nowait(self, data: bytes) -> bool:
        self.nowait.append(data)
        return self.takes


class FakeContext:
    """What ProtocolConnection reads of a ServerContext before it serves."""

    def __init__(self, bridge: FakeBridge) -> None:
        self.config = SimpleNamespace(protocol=ProtocolLimits())
        self.bridge = bridge
        self.sessions = SessionTable()


class Served(SimpleNamespace):
    connection: ProtocolConnection
    client: ClientConnection
    bridge: FakeBridge
    transport: FakeTransport
    stream: int


def served_stream(takes: bool = True) -> Served:
    """A ProtocolConnection (not running its tasks) with a welcomed session and one accepted
    stream, and the client at the other end."""
    bridge = FakeBridge()
    ctx = FakeContext(bridge)
    transport = FakeTransport(takes)
    connection = ProtocolConnection(ctx, transport, "msgpack")  # type: ignore[arg-type]
    client = ClientConnection()
    client.send_hello()
    connection.conn.receive_data(client.data_to_send(0.0), 0.0)
    connection.conn.next_event()  # hello
    connection.conn.welcome(None)
    client.receive_data(connection.conn.data_to_send(0.0), 0.0)
    stream = client.open_stream(prompt="x")
    connection.conn.receive_data(client.data_to_send(0.0), 0.0)
    assert isinstance(connection.conn.next_event(), StreamOpened)
    connection.conn.accept_stream(stream, token_quota=100, batch_size=1)
    client.receive_data(connection.conn.data_to_send(0.0), 0.0)
    client.events()
    return Served(connection=connection, client=client, bridge=bridge, transport=transport,
                  stream=stream)


async def test_a_pass_is_written_once_at_its_end_without_the_writer() -> None:
    served = served_stream()
    connection, bridge = served.connection, served.bridge
    bridge.in_pass = True
    for i in range(3):  # three streams' worth of frames in one pass: one flush
        connection.conn.send_delta(served.stream, f"t{i}", (i,))
        connection.kick()
    assert len(bridge.pass_end) == 1 and served.transport.nowait == []
    bridge.end_pass()
    assert len(served.transport.nowait) == 1
    assert not connection.driver.writer_woken and not connection.driver.backlog_left
    served.client.receive_data(served.transport.nowait[0], 0.0)
    texts = [e.text for e in served.client.events() if isinstance(e, DeltaReceived)]
    assert texts == ["t0", "t1", "t2"]


async def test_what_the_transport_does_not_take_is_left_to_the_writer() -> None:
    served = served_stream(takes=False)
    connection, bridge = served.connection, served.bridge
    bridge.in_pass = True
    connection.conn.send_delta(served.stream, "t", (1,))
    connection.kick()
    bridge.end_pass()
    assert connection.driver.writer_woken and connection.driver.backlog_left


async def test_outside_a_pass_a_kick_wakes_the_writer() -> None:
    served = served_stream()
    served.connection.conn.send_delta(served.stream, "t", (1,))
    served.connection.kick()
    assert served.connection.driver.writer_woken and served.transport.nowait == []


async def test_a_send_that_arms_an_earlier_deadline_wakes_the_timer_task() -> None:
    served = served_stream()
    connection, bridge = served.connection, served.bridge
    connection.driver._timer_deadline = trio.current_time() + 3600.0  # the heartbeat, say
    bridge.in_pass = True
    connection.conn.send_delta(served.stream, "t", (1,))  # arms the retransmission timer
    connection.kick()
    bridge.end_pass()
    assert connection.driver._timer_changed.is_set()


def run_pass(served: Served, deltas: int) -> None:
    """One delivery pass queuing `deltas` frames on the stream."""
    served.bridge.in_pass = True
    for _ in range(deltas):
        served.connection.conn.send_delta(served.stream, "t", (1,))
        served.connection.kick()
    served.bridge.end_pass()


async def test_a_pass_waits_for_the_peers_ack_while_it_is_writes_behind() -> None:
    served = served_stream()
    connection, client, transport = served.connection, served.client, served.transport
    per_pass = PEER_ACK_FRAMES // MAX_WRITES_IN_FLIGHT + 1  # the peer owes an ack at once
    for _ in range(MAX_WRITES_IN_FLIGHT):
        run_pass(served, per_pass)
    assert len(transport.nowait) == MAX_WRITES_IN_FLIGHT
    run_pass(served, 2)
    run_pass(served, 2)
    assert len(transport.nowait) == MAX_WRITES_IN_FLIGHT  # held: the peer is still reading
    assert not connection.driver.writer_woken
    for write in transport.nowait:
        client.receive_data(write, 0.0)
    client.events()
    connection.conn.receive_data(client.data_to_send(0.0), 0.0)  # its ack
    connection.driver.flush_now()
    assert len(transport.nowait) == MAX_WRITES_IN_FLIGHT + 1  # both held passes, one write
    client.receive_data(transport.nowait[-1], 0.0)
    assert [e.index for e in client.events() if isinstance(e, DeltaReceived)] == [
        MAX_WRITES_IN_FLIGHT * per_pass + i for i in range(4)
    ]


async def test_a_peer_that_owes_no_ack_yet_is_never_waited_for() -> None:
    served = served_stream()
    for _ in range(MAX_WRITES_IN_FLIGHT + 2):  # one frame each: its ack may come late (§3)
        run_pass(served, 1)
    assert len(served.transport.nowait) == MAX_WRITES_IN_FLIGHT + 2


async def test_writes_are_forgotten_once_acknowledged_and_control_frames_never_count() -> None:
    served = served_stream()
    connection, client = served.connection, served.client
    clock = connection.driver.ack_clock
    assert clock is not None
    for _ in range(MAX_WRITES_IN_FLIGHT):
        run_pass(served, 1)
    assert clock.writes_in_flight == MAX_WRITES_IN_FLIGHT
    for write in served.transport.nowait:
        client.receive_data(write, 0.0)
    client.handle_timers(1.0)  # its delayed ack
    connection.conn.receive_data(client.data_to_send(1.0), 1.0)
    connection.driver.flush_now()
    assert clock.writes_in_flight == 0
    connection.conn.handle_timers(1000.0)  # heartbeats due: pings, control frames only
    connection.driver.flush_now()
    assert clock.writes_in_flight == 0


async def test_while_the_transport_is_congested_a_pass_leaves_its_frames_in_the_window() -> None:
    served = served_stream()
    connection, transport = served.connection, served.transport
    transport.congested = True
    window = connection.conn.send_window_available
    sent = 0
    while connection.conn.can_send_delta(served.stream, 1):  # what the pump checks per batch
        run_pass(served, 1)
        sent += 1
    assert sent == window  # the window filled: the pump pauses its engine request
    assert transport.nowait == [] and connection.driver.writer_woken  # left to the writer
    transport.congested = False  # the backlog drained below the low-water mark
    connection.driver.flush_now()
    assert len(transport.nowait) == 1
    served.client.receive_data(transport.nowait[0], 0.0)
    assert len([e for e in served.client.events() if isinstance(e, DeltaReceived)]) == sent
