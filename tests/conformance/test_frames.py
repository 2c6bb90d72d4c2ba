"""docs/protocol.md §1 Frames: boundaries, split points, coalescing and the header checks."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from seedance.protocol import (
    HEADER_SIZE,
    MAGIC,
    ClientConnection,
    ConnectionState,
    ErrorCode,
    FrameDecoder,
    ProtocolLimits,
    RemoteProtocolError,
    ServerConnection,
    encode_frame,
)
from seedance.protocol.messages import Error, PayloadCodec

from .pair import frames_of

PAYLOADS = [b"a", b"hello world", bytes(range(256)) * 3, b"\x00" * 70]
STREAM = b"".join(encode_frame(p) for p in PAYLOADS)


def decode_chunks(chunks: list[bytes], max_frame: int = 1 << 20) -> list[bytes]:
    decoder = FrameDecoder(max_frame)
    out: list[bytes] = []
    for chunk in chunks:
        out.extend(decoder.feed(chunk))
    assert decoder.buffered == 0
    return out


def test_1_frame_layout_is_magic_length_payload() -> None:
    frame = encode_frame(b"xyz")
    assert frame == b"\xca\xfe\xba\xbe\x00\x00\x00\x03xyz"
    assert struct.unpack(">II", frame[:HEADER_SIZE]) == (MAGIC, 3)


@pytest.mark.parametrize("cut", range(1, len(STREAM)))
def test_1_every_split_point_gives_the_same_frames(cut: int) -> None:
    assert decode_chunks([STREAM[:cut], STREAM[cut:]]) == PAYLOADS


def test_1_every_pair_of_split_points_gives_the_same_frames() -> None:
    n = len(STREAM)
    for a in range(0, n, 7):
        for b in range(a, n, 5):
            assert decode_chunks([STREAM[:a], STREAM[a:b], STREAM[b:]]) == PAYLOADS


def test_1_byte_at_a_time() -> None:
    assert decode_chunks([STREAM[i : i + 1] for i in range(len(STREAM))]) == PAYLOADS


def test_1_many_frames_in_one_read() -> None:
    assert decode_chunks([STREAM * 50]) == PAYLOADS * 50


@given(st.lists(st.binary(min_size=1, max_size=300), min_size=1, max_size=12), st.data())
def test_1_any_chunking_of_any_frames(payloads: list[bytes], data: st.DataObject) -> None:
    stream = b"".join(encode_frame(p) for p in payloads)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=10)))
    chunks = [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)], strict=True)]
    assert decode_chunks(chunks) == payloads


def test_1_bad_magic_is_corrupted_frame() -> None:
    decoder = FrameDecoder(1024)
    with pytest.raises(RemoteProtocolError) as info:
        list(decoder.feed(b"\xde\xad\xbe\xef\x00\x00\x00\x01x"))
    assert info.value.code == ErrorCode.CORRUPTED_FRAME
    assert info.value.close_code == 1002


def test_1_zero_length_is_corrupted_frame() -> None:
    decoder = FrameDecoder(1024)
    with pytest.raises(RemoteProtocolError) as info:
        list(decoder.feed(struct.pack(">II", MAGIC, 0)))
    assert info.value.code == ErrorCode.CORRUPTED_FRAME


def test_1_length_over_max_frame_is_frame_too_large() -> None:
    decoder = FrameDecoder(1024)
    with pytest.raises(RemoteProtocolError) as info:
        list(decoder.feed(struct.pack(">II", MAGIC, 1025)))
    assert info.value.code == ErrorCode.FRAME_TOO_LARGE
    assert info.value.close_code == 1009


def test_1_length_equal_to_max_frame_is_accepted() -> None:
    assert decode_chunks([encode_frame(b"x" * 1024)], max_frame=1024) == [b"x" * 1024]


def test_1_default_max_frame_is_one_mebibyte() -> None:
    assert ProtocolLimits().max_frame == 1_048_576


def test_1_oversize_header_rejected_without_reading_the_payload() -> None:
    """Only the 8 header bytes are fed: the error comes before any payload exists."""
    decoder = FrameDecoder(1 << 20)
    header = struct.pack(">II", MAGIC, (1 << 20) + 1)
    with pytest.raises(RemoteProtocolError):
        list(decoder.feed(header))
    assert decoder.buffered == 0


def test_1_oversize_header_with_payload_in_the_same_read_is_not_kept() -> None:
    decoder = FrameDecoder(64)
    with pytest.raises(RemoteProtocolError):
        list(decoder.feed(struct.pack(">II", MAGIC, 10_000) + b"x" * 5000))
    assert decoder.buffered == 0


def test_1_bad_header_split_across_reads_fails_when_complete() -> None:
    decoder = FrameDecoder(1024)
    assert list(decoder.feed(b"\xca\xfe")) == []
    assert list(decoder.feed(b"\xba")) == []
    with pytest.raises(RemoteProtocolError):
        list(decoder.feed(b"\xbf\x00\x00\x00\x01"))


def test_1_frames_before_a_bad_header_are_delivered() -> None:
    decoder = FrameDecoder(1024)
    got = []
    with pytest.raises(RemoteProtocolError):
        for payload in decoder.feed(encode_frame(b"ok") + b"\x00" * 8):
            got.append(payload)
    assert got == [b"ok"]


def test_1_a_failed_decoder_refuses_more_input() -> None:
    decoder = FrameDecoder(1024)
    with pytest.raises(RemoteProtocolError):
        list(decoder.feed(b"\x00" * 8))
    with pytest.raises(RemoteProtocolError):
        list(decoder.feed(encode_frame(b"x")))


@pytest.mark.parametrize(
    ("header", "code", "close"),
    [
        (b"\x00\x00\x00\x00\x00\x00\x00\x05", "corrupted_frame", 1002),
        (struct.pack(">II", MAGIC, 0), "corrupted_frame", 1002),
        (struct.pack(">II", MAGIC, (1 << 20) + 1), "frame_too_large", 1009),
    ],
)
def test_1_server_answers_a_bad_header_with_error_and_close_code(
    header: bytes, code: str, close: int
) -> None:
    server = ServerConnection()
    with pytest.raises(RemoteProtocolError) as info:
        server.receive_data(header, 0.0)
    assert (info.value.code, info.value.close_code) == (code, close)
    assert server.state is ConnectionState.CLOSED
    (payload,) = frames_of(server.data_to_send(0.0))
    message = PayloadCodec("msgpack").decode(payload)
    assert isinstance(message, Error) and message.code == code


def test_1_server_max_frame_is_its_configured_limit() -> None:
    server = ServerConnection(ProtocolLimits(max_frame=100))
    with pytest.raises(RemoteProtocolError) as info:
        server.receive_data(struct.pack(">II", MAGIC, 101), 0.0)
    assert info.value.code == "frame_too_large"


def test_1_client_connection_checks_headers_too() -> None:
    client = ClientConnection()
    client.send_hello()
    with pytest.raises(RemoteProtocolError) as info:
        client.receive_data(b"GET / HTTP/1.1\r\n", 0.0)
    assert info.value.code == "corrupted_frame"
