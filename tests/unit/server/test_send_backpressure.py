"""A served connection whose peer does not read, over a real socket pair: once its unsent
bytes pass the high-water mark its delivery passes stop writing and its reader stops reading,
so even a peer that acknowledges frames it never read (which keeps the frame window open)
cannot make the backlog grow — the window fills and its streams pause, while a connection
beside it keeps streaming; when the peer reads again every frame arrives, once, in order."""

from __future__ import annotations

import socket as stdlib_socket
import struct
from types import SimpleNamespace

import msgspec
import trio
import trio.testing

from seedance.protocol import ClientConnection, DeltaReceived, ProtocolLimits, StreamOpened
from seedance.server.gateway.protocol_session import ProtocolConnection
from seedance.server.gateway.session_table import SessionTable
from seedance.server.gateway.tcp import TcpTransport
from seedance.transport import SendLimits
from tests.unit.server.test_protocol_session import FakeBridge

LIMITS = SendLimits(high_water=64 << 10, low_water=16 << 10, hard_limit=4 << 20)
STREAMS = 8
TEXT = "t" * 24
"""Each delta's text: frames of ~60 bytes."""
WINDOW = 8192
"""The peer's frame window: ~500 KB of frames, far above the high-water mark."""


class Side(SimpleNamespace):
    connection: ProtocolConnection
    transport: TcpTransport
    client: ClientConnection
    peer: trio.SocketStream
    streams: list[int]


def served(bridge: FakeBridge) -> Side:
    """A ProtocolConnection on a TCP socket pair with small kernel buffers, its session
    welcomed and STREAMS streams accepted (done sans-IO, before its tasks run)."""
    left, right = trio.socket.socketpair()
    left.setsockopt(stdlib_socket.SOL_SOCKET, stdlib_socket.SO_SNDBUF, 4096)
    right.setsockopt(stdlib_socket.SOL_SOCKET, stdlib_socket.SO_RCVBUF, 4096)
    ctx = SimpleNamespace(config=SimpleNamespace(protocol=ProtocolLimits()), bridge=bridge,
                          sessions=SessionTable(),
                          metrics=SimpleNamespace(frames_retransmitted=0))
    transport = TcpTransport(trio.SocketStream(left), LIMITS)
    connection = ProtocolConnection(ctx, transport, "msgpack")  # type: ignore[arg-type]
    client = ClientConnection(ProtocolLimits(window=WINDOW))
    client.send_hello()
    conn = connection.conn
    now = trio.current_time()
    conn.receive_data(client.data_to_send(now), now)
    conn.next_event()
    conn.welcome(None)
    streams = [client.open_stream(prompt="x") for _ in range(STREAMS)]
    client.receive_data(conn.data_to_send(now), now)
    conn.receive_data(client.data_to_send(now), now)
    for stream in streams:
        assert isinstance(conn.next_event(), StreamOpened)
        conn.accept_stream(stream, token_quota=1 << 20, batch_size=1)
    client.receive_data(conn.data_to_send(now), now)
    client.events()
    return Side(connection=connection, transport=transport, client=client,
                peer=trio.SocketStream(right), streams=streams)


def run_pass(bridge: FakeBridge, sides: list[Side]) -> int:
    """One delivery pass: a delta on every stream the window admits (what a pump checks);
    returns how many streams could not send (their pumps would pause)."""
    bridge.in_pass = True
    held = 0
    for side in sides:
        for stream in side.streams:
            if side.connection.conn.can_send_delta(stream, 1):
                side.connection.conn.send_delta(stream, TEXT, (1,))
                side.connection.kick()
            else:
                held += 1
    bridge.end_pass()
    return held


def blind_ack(seq: int) -> bytes:
    """An ack for frames the peer never read (`seq` is a number the server did send)."""
    payload = msgspec.msgpack.encode({"t": "ack", "ack": seq})
    return struct.pack(">II", 0xCAFEBABE, len(payload)) + payload


async def read_all(side: Side, frames: int, *, ack: bool = True) -> list[DeltaReceived]:
    """Read until `frames` deltas arrived, acking them (`ack`) as a client does."""
    deltas: list[DeltaReceived] = []
    while len(deltas) < frames:
        side.client.receive_data(await side.peer.receive_some(65536), trio.current_time())
        deltas += [e for e in side.client.events() if isinstance(e, DeltaReceived)]
        if ack:
            await side.peer.send_all(side.client.data_to_send(trio.current_time()))
    return deltas


async def test_a_peer_that_acks_but_never_reads_cannot_grow_the_backlog_past_the_bound() -> None:
    bridge = FakeBridge()
    slow, fast = served(bridge), served(bridge)
    sent_fast = 0
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            for side in (slow, fast):
                nursery.start_soon(side.connection.driver.run)
            fast_deltas: list[DeltaReceived] = []

            async def fast_reader() -> None:
                while True:  # a peer that reads everything at once
                    fast_deltas.extend(await read_all(fast, 1))

            nursery.start_soon(fast_reader)
            conn = slow.connection.conn
            assert conn.session is not None
            while run_pass(bridge, [slow]) < STREAMS:  # until every slow stream is held
                # what a blind acker can send: every frame the server numbered so far
                with trio.move_on_after(0.001):
                    await slow.peer.send_all(blind_ack(conn.session.send.next_seq))
                await trio.sleep(0)
                assert slow.transport.backlog <= LIMITS.high_water + STREAMS * 128
            assert slow.transport.congested  # it stopped reading: the acks wait in the socket
            peak = slow.transport.peak_backlog
            assert LIMITS.high_water < peak <= LIMITS.high_water + STREAMS * 128
            for _ in range(20):  # the connection beside it is still served
                sent_fast += STREAMS - run_pass(bridge, [fast])
                await trio.testing.wait_all_tasks_blocked()
            assert run_pass(bridge, [slow]) == STREAMS  # still held, nothing more written
            assert slow.transport.peak_backlog == peak
            sent_slow = conn.session.send.next_seq - STREAMS  # the accepts were numbered too
            # it reads again (its blind acks still fill the way back): nothing was lost
            deltas = await read_all(slow, sent_slow, ack=False)
            nursery.cancel_scope.cancel()
    assert len(fast_deltas) == sent_fast
    for stream in slow.streams:
        indexes = [d.index for d in deltas if d.stream == stream]
        assert indexes == list(range(len(indexes)))  # in order, exactly once
    assert len(deltas) == sent_slow
