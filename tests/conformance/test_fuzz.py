"""docs/protocol.md §14 Security considerations: random and mutated bytes into a server
connection raise only the protocol's own errors, and memory stays bounded."""

from __future__ import annotations

import struct
import tracemalloc

from hypothesis import given, settings
from hypothesis import strategies as st

from seedance.protocol import (
    MAGIC,
    HelloReceived,
    PayloadCodec,
    ProtocolLimits,
    RemoteProtocolError,
    ServerConnection,
    encode_frame,
)
from seedance.protocol.messages import Ack, Cancel, Credit, Hello, Message, Open, Ping, Pong

LIMITS = ProtocolLimits(max_frame=4096, window=16)
CODEC = PayloadCodec("msgpack")

VALID: list[Message] = [
    Hello(v=1, ack=0),
    Open(seq=0, stream=1, prompt="hi", credit=3),
    Credit(stream=1, limit=9),
    Ping(tier="connection", nonce=1),
    Open(seq=1, stream=2, prompt="yo"),
    Ack(ack=0),
    Cancel(seq=2, stream=1),
    Pong(tier="session", nonce=3),
]
VALID_BYTES = b"".join(encode_frame(CODEC.encode(m)) for m in VALID)


def feed(chunks: list[bytes]) -> ServerConnection:
    server = ServerConnection(LIMITS)
    now = 0.0
    try:
        for chunk in chunks:
            now += 0.01
            server.receive_data(chunk, now)
            for event in server.events():
                if isinstance(event, HelloReceived):
                    server.welcome(None)
            server.handle_timers(now)
            server.data_to_send(now)
    except RemoteProtocolError as exc:
        assert exc.code and exc.close_code in (1002, 1008, 1009, 1011, 1013)
        assert server.data_to_send(now)  # the error frame
    check_bounded(server)
    return server


def check_bounded(server: ServerConnection) -> None:
    assert server._decoder.buffered <= LIMITS.max_frame + 8
    assert server._stashed <= LIMITS.max_frame + LIMITS.max_frame
    if server.session is not None:
        assert server.session.recv.held <= LIMITS.window
        assert len(server.session.streams) <= LIMITS.max_streams + 1
    assert len(server._events) <= 10_000


@given(st.lists(st.binary(max_size=300), max_size=20))
@settings(max_examples=300)
def test_14_random_bytes_raise_only_protocol_errors(chunks: list[bytes]) -> None:
    feed(chunks)


@given(st.lists(st.binary(max_size=60), max_size=8))
@settings(max_examples=300)
def test_14_random_bytes_after_magic_raise_only_protocol_errors(chunks: list[bytes]) -> None:
    feed([VALID_BYTES[:37], *(struct.pack(">I", MAGIC) + c for c in chunks)])


@given(st.data())
@settings(max_examples=300)
def test_14_mutated_valid_streams_raise_only_protocol_errors(data: st.DataObject) -> None:
    stream = bytearray(VALID_BYTES)
    for _ in range(data.draw(st.integers(1, 8))):
        op = data.draw(st.sampled_from(["flip", "insert", "delete", "dup"]))
        at = data.draw(st.integers(0, len(stream) - 1))
        if op == "flip":
            stream[at] ^= 1 << data.draw(st.integers(0, 7))
        elif op == "insert":
            stream[at:at] = data.draw(st.binary(min_size=1, max_size=8))
        elif op == "delete":
            del stream[at : at + data.draw(st.integers(1, 8))]
        else:
            end = min(len(stream), at + data.draw(st.integers(1, 40)))
            stream[at:at] = stream[at:end]
        if not stream:
            stream = bytearray(b"\x00")
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=6)))
    pieces = [bytes(stream[a:b]) for a, b in zip([0, *cuts], [*cuts, len(stream)], strict=True)]
    feed(pieces)


@given(st.lists(st.dictionaries(st.sampled_from(
    ["t", "seq", "stream", "ack", "sack", "v", "limit", "tier", "nonce", "prompt", "codec",
     "data", "window", "heartbeat", "messages", "credit"]),
    st.one_of(st.integers(-5, 2**64 - 1), st.text(max_size=5), st.none(), st.binary(max_size=8),
              st.lists(st.integers(-2, 40), max_size=3), st.sampled_from(
                  ["hello", "open", "ack", "credit", "ping", "pong", "cancel", "batch",
                   "connection", "none", "brotli"])),
    max_size=6), max_size=6))
@settings(max_examples=300)
def test_14_structured_garbage_raises_only_protocol_errors(maps: list[dict[str, object]]) -> None:
    import msgspec

    frames = [encode_frame(msgspec.msgpack.encode(m) or b"\xc0") for m in maps]
    feed([VALID_BYTES[:37], *frames])


def test_14_memory_stays_bounded_under_a_flood() -> None:
    """1,000 frame headers announcing max_frame payloads, fed slowly: only one frame is ever
    buffered, and a flood of valid frames before welcome is cut off."""
    tracemalloc.start()
    try:
        server = ServerConnection(LIMITS)
        server.receive_data(encode_frame(CODEC.encode(Hello(v=1, ack=0))), 0.0)
        pipelined = encode_frame(CODEC.encode(Ping(tier="connection", nonce=1))) * 2000
        try:
            server.receive_data(pipelined, 0.0)
        except RemoteProtocolError as exc:
            assert exc.code == "protocol_violation"
        server = ServerConnection(LIMITS)
        header = struct.pack(">II", MAGIC, LIMITS.max_frame)
        for _ in range(1000):
            server._decoder = type(server._decoder)(LIMITS.max_frame)
            list(server._decoder.feed(header))
            list(server._decoder.feed(b"\x00" * 100))
            assert server._decoder.buffered <= LIMITS.max_frame + 8
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2_000_000
