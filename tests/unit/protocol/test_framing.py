"""seedance.protocol._framing: FrameDecoder and encode_frame."""

from __future__ import annotations

import pytest

from seedance.protocol import FrameDecoder, RemoteProtocolError, encode_frame
from seedance.protocol._framing import split_frames


def test_encode_frame_refuses_an_empty_payload() -> None:
    with pytest.raises(ValueError):
        encode_frame(b"")


def test_feed_takes_the_bytes_even_if_not_iterated() -> None:
    decoder = FrameDecoder(100)
    decoder.feed(encode_frame(b"abc")[:5])
    assert decoder.buffered == 5
    assert list(decoder.feed(encode_frame(b"abc")[5:])) == [b"abc"]
    assert decoder.buffered == 0


def test_partially_iterated_feed_keeps_the_rest() -> None:
    decoder = FrameDecoder(100)
    payloads = decoder.feed(encode_frame(b"a") + encode_frame(b"b") + encode_frame(b"c"))
    assert next(payloads) == b"a"
    assert list(decoder.feed(b"")) == [b"b", b"c"]


def test_buffer_is_compacted_between_feeds() -> None:
    decoder = FrameDecoder(100)
    for _ in range(1000):
        assert list(decoder.feed(encode_frame(b"xyz"))) == [b"xyz"]
    assert decoder.buffered == 0
    assert len(decoder._buffer) <= 11


def test_split_frames_needs_whole_frames() -> None:
    assert split_frames(encode_frame(b"a") + encode_frame(b"bc"), 10) == [b"a", b"bc"]
    with pytest.raises(RemoteProtocolError) as info:
        split_frames(encode_frame(b"abc")[:-1], 10)
    assert info.value.code == "corrupted_frame"


def test_memoryview_and_bytearray_input() -> None:
    data = encode_frame(b"hello")
    assert list(FrameDecoder(10).feed(memoryview(data))) == [b"hello"]
    assert list(FrameDecoder(10).feed(bytearray(data))) == [b"hello"]


def test_cached_small_headers_match_packed_ones() -> None:
    import struct

    from seedance.protocol._framing import SMALL_FRAME, frame_header
    from seedance.protocol.limits import MAGIC

    for length in (1, 60, SMALL_FRAME - 1, SMALL_FRAME, 70_000):
        assert frame_header(length) == struct.pack(">II", MAGIC, length)


def test_has_partial_frame_says_whether_bytes_are_held() -> None:
    decoder = FrameDecoder(100)
    frame = encode_frame(b"abc")
    assert not decoder.has_partial_frame
    assert list(decoder.feed(frame)) == [b"abc"]
    assert not decoder.has_partial_frame  # every payload taken: a caller may cut reads itself
    assert list(decoder.feed(frame + frame[:3])) == [b"abc"]
    assert decoder.has_partial_frame  # three header bytes held
    assert list(decoder.feed(frame[3:])) == [b"abc"]
    assert not decoder.has_partial_frame
    payloads = decoder.feed(frame + frame)
    assert next(payloads) == b"abc"
    assert decoder.has_partial_frame  # the second payload is not taken yet
    assert list(payloads) == [b"abc"] and not decoder.has_partial_frame


def test_has_partial_frame_is_cleared_by_a_bad_header() -> None:
    decoder = FrameDecoder(100)
    with pytest.raises(RemoteProtocolError):
        list(decoder.feed(b"\x00" * 12))
    assert not decoder.has_partial_frame and decoder.buffered == 0
