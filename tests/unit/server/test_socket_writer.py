"""SocketWriter: bytes the kernel takes at once go out from synchronous code; the rest (a full
socket buffer, a send in progress, a stream without a socket such as TLS) waits for `send`, and
the bytes reach the peer in the order the calls were made. The unsent bytes are bounded: above
the high-water mark the writer is congested until they drop below the low-water mark, a write
past the hard limit is refused, and a send the peer does not read stalls out."""

from __future__ import annotations

import socket as stdlib_socket

import pytest
import trio
import trio.testing

from seedance.server.gateway.socket_writer import SocketWriter
from seedance.transport import SendBacklogFull, SendLimits, SendStalled


def socket_stream_pair() -> tuple[trio.SocketStream, trio.SocketStream]:
    left, right = trio.socket.socketpair()
    return trio.SocketStream(left), trio.SocketStream(right)


async def read_exactly(stream: trio.abc.ReceiveStream, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        chunk = await stream.receive_some(65536)
        assert chunk, "the peer closed early"
        data += chunk
    return bytes(data)


async def test_write_nowait_hands_the_bytes_to_the_kernel_at_once() -> None:
    local, peer = socket_stream_pair()
    writer = SocketWriter(local)
    assert writer.write_nowait(b"hello ")
    assert writer.write_nowait(b"world")
    assert writer.backlog == 0
    with trio.fail_after(5):
        assert await read_exactly(peer, 11) == b"hello world"


async def test_what_the_kernel_cannot_take_waits_for_send_and_order_is_kept() -> None:
    local, peer = socket_stream_pair()
    local.setsockopt(stdlib_socket.SOL_SOCKET, stdlib_socket.SO_SNDBUF, 4096)
    writer = SocketWriter(local, SendLimits(hard_limit=8 << 20))
    big = bytes(range(256)) * 16384  # 4 MiB: more than any socket buffer holds
    assert not writer.write_nowait(big)
    assert 0 < writer.backlog < len(big)
    assert not writer.write_nowait(b"second")  # queued behind the rest, never ahead of it
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            received: list[bytes] = []

            async def reader() -> None:
                received.append(await read_exactly(peer, len(big) + 11))

            nursery.start_soon(reader)
            await writer.send(b"third")
    assert received == [big + b"second" + b"third"]
    assert writer.backlog == 0


async def test_writes_during_a_send_queue_behind_it() -> None:
    local, peer = socket_stream_pair()
    local.setsockopt(stdlib_socket.SOL_SOCKET, stdlib_socket.SO_SNDBUF, 4096)
    writer = SocketWriter(local, SendLimits(hard_limit=8 << 20))
    big = b"a" * (4 << 20)
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(writer.send, big)
            await trio.testing.wait_all_tasks_blocked()  # the send waits for the peer to read
            assert not writer.write_nowait(b"b")
            assert await read_exactly(peer, len(big)) == big
        assert writer.backlog == 1  # the send in progress had already taken its bytes
        assert writer.peak_backlog >= len(big)  # counted until the kernel took them
        await writer.send()
        assert await read_exactly(peer, 1) == b"b"


async def test_a_stream_without_a_socket_queues_everything_for_send() -> None:
    local, peer = trio.testing.memory_stream_pair()  # like TLS: no socket to write to
    writer = SocketWriter(local)
    assert not writer.write_nowait(b"one ")
    assert writer.backlog == 4
    await writer.send(b"two")
    with trio.fail_after(5):
        assert await read_exactly(peer, 7) == b"one two"


async def test_a_closed_socket_is_never_written_and_send_raises() -> None:
    local, _peer = socket_stream_pair()
    writer = SocketWriter(local)
    await local.aclose()  # its descriptor may be reused at once: it must not be written
    assert not writer.write_nowait(b"lost")
    with pytest.raises(trio.ClosedResourceError):
        await writer.send()


async def test_a_reset_peer_makes_send_raise_broken_resource() -> None:
    local, peer = socket_stream_pair()
    writer = SocketWriter(local)
    await peer.aclose()
    with trio.fail_after(5):
        while writer.write_nowait(b"x" * 65536):  # the first writes may still be accepted
            pass
        with pytest.raises(trio.BrokenResourceError):
            await writer.send()


def small_buffers(local: trio.SocketStream, peer: trio.SocketStream) -> None:
    local.setsockopt(stdlib_socket.SOL_SOCKET, stdlib_socket.SO_SNDBUF, 4096)
    peer.setsockopt(stdlib_socket.SOL_SOCKET, stdlib_socket.SO_RCVBUF, 4096)


def fill_kernel(writer: SocketWriter) -> None:
    """Write until the kernel takes no more (the peer does not read)."""
    while writer.write_nowait(b"k" * 4096):
        pass


async def test_a_backlog_past_high_water_is_congested_until_it_drains_below_low_water() -> None:
    local, peer = socket_stream_pair()
    small_buffers(local, peer)
    limits = SendLimits(high_water=64 << 10, low_water=16 << 10, hard_limit=1 << 20)
    writer = SocketWriter(local, limits)
    fill_kernel(writer)
    while not writer.congested:
        assert not writer.write_nowait(b"x" * 1024)
    assert limits.high_water < writer.backlog <= limits.high_water + 1024 + 4096
    unblocked: list[int] = []
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:

            async def wait_then_record() -> None:
                await writer.wait_uncongested()
                unblocked.append(writer.backlog)
                nursery.cancel_scope.cancel()

            nursery.start_soon(wait_then_record)
            nursery.start_soon(writer.send)
            await trio.testing.wait_all_tasks_blocked()
            assert unblocked == [] and writer.congested  # the peer reads nothing yet
            while True:  # the peer reads, the backlog drains
                assert await peer.receive_some(4096)
    assert unblocked[0] < limits.low_water and not writer.congested


async def test_a_write_past_the_hard_limit_is_refused_and_nothing_of_it_is_queued() -> None:
    local, peer = socket_stream_pair()
    small_buffers(local, peer)
    writer = SocketWriter(local, SendLimits(high_water=8 << 10, low_water=0,
                                            hard_limit=32 << 10))
    fill_kernel(writer)
    while writer.backlog + 4096 <= 32 << 10:
        writer.write_nowait(b"y" * 4096)
    before = writer.backlog
    with pytest.raises(SendBacklogFull):
        writer.write_nowait(b"z" * 4096)
    with pytest.raises(SendBacklogFull):
        await writer.send(b"z" * 4096)
    assert writer.backlog == before == writer.peak_backlog
    assert writer.backlog <= 32 << 10


async def test_a_send_the_peer_never_reads_stalls_after_the_timeout() -> None:
    local, peer = socket_stream_pair()
    small_buffers(local, peer)
    writer = SocketWriter(local, SendLimits(timeout=0.2))
    fill_kernel(writer)
    writer.write_nowait(b"w" * (200 << 10))  # several pieces: the first never goes out
    start = trio.current_time()
    with trio.fail_after(5), pytest.raises(SendStalled):
        await writer.send()
    assert trio.current_time() - start >= 0.2


async def test_a_peer_that_reads_slowly_never_stalls() -> None:
    local, peer = socket_stream_pair()
    small_buffers(local, peer)
    writer = SocketWriter(local, SendLimits(timeout=0.5))
    data = bytes(range(256)) * 1024  # 256 KiB: four pieces, each read within the timeout
    received = bytearray()

    async def slow_reader() -> None:
        while len(received) < len(data):
            await trio.sleep(0.01)
            received.extend(await peer.receive_some(32 << 10))

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(slow_reader)
            await writer.send(data)
    assert bytes(received) == data


async def test_waiting_for_a_slow_reader_to_drain_the_backlog_is_not_a_stall() -> None:
    local, peer = socket_stream_pair()
    small_buffers(local, peer)
    limits = SendLimits(high_water=32 << 10, low_water=8 << 10, timeout=1.0)
    writer = SocketWriter(local, limits)
    fill_kernel(writer)
    writer.write_nowait(b"s" * (768 << 10))  # draining it takes longer than the timeout
    assert writer.congested
    waited: list[float] = []

    async def slow_reader() -> None:
        while True:
            await trio.sleep(0.01)  # ~4 KiB per 10 ms: a piece per ~0.2 s, ~2 s to drain
            assert await peer.receive_some(8192)

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(writer.send)
            nursery.start_soon(slow_reader)
            start = trio.current_time()
            await writer.wait_uncongested()
            waited.append(trio.current_time() - start)
            nursery.cancel_scope.cancel()
    assert waited[0] > limits.timeout and not writer.congested
