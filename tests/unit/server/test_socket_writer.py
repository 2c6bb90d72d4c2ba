"""SocketWriter: bytes the kernel takes at once go out from synchronous code; the rest (a full
socket buffer, a send in progress, a stream without a socket such as TLS) waits for `send`, and
the bytes reach the peer in the order the calls were made."""

from __future__ import annotations

import socket as stdlib_socket

import pytest
import trio
import trio.testing

from seedance.server.gateway.socket_writer import SocketWriter


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
    writer = SocketWriter(local)
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
    writer = SocketWriter(local)
    big = b"a" * (4 << 20)
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(writer.send, big)
            await trio.testing.wait_all_tasks_blocked()  # the send waits for the peer to read
            assert not writer.write_nowait(b"b")
            assert await read_exactly(peer, len(big)) == big
        assert writer.backlog == 1  # the send in progress had already taken its bytes
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
