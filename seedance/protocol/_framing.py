"""Frame boundaries (docs/protocol.md §1): `FrameDecoder` cuts an arbitrary byte stream into
payloads, checking magic, zero length and `max_frame` from the 8 header bytes alone;
`encode_frame` writes one frame."""

from __future__ import annotations

import struct
from collections.abc import Iterator
from typing import Final

from .errors import ErrorCode, RemoteProtocolError
from .limits import HEADER_SIZE, MAGIC

_HEADER = struct.Struct(">II")
pack_header = _HEADER.pack
"""`pack_header(magic, length)`: the 8 header bytes of a frame."""
unpack_header_from = _HEADER.unpack_from
"""`unpack_header_from(data, offset)`: the `(magic, length)` of the header at `offset`."""

SMALL_FRAME: Final = 256
"""Payloads shorter than this take their header from `SMALL_HEADERS`."""
SMALL_HEADERS: Final = tuple(_HEADER.pack(MAGIC, length) for length in range(SMALL_FRAME))
"""The header of every payload length below `SMALL_FRAME` (deltas, acks), packed once."""


def frame_header(length: int) -> bytes:
    """The 8 header bytes of a frame whose payload is `length` bytes long."""
    return SMALL_HEADERS[length] if length < SMALL_FRAME else _HEADER.pack(MAGIC, length)


def encode_frame(payload: bytes) -> bytes:
    """One frame carrying `payload` (1 <= len(payload))."""
    if not payload:
        raise ValueError("payload: a frame carries at least one byte")
    return frame_header(len(payload)) + payload


def check_header(magic: int, length: int, max_frame: int) -> None:
    """§1: reject a bad magic, a zero length or a length over `max_frame`."""
    if magic != MAGIC:
        raise RemoteProtocolError(ErrorCode.CORRUPTED_FRAME, f"bad magic 0x{magic:08x}")
    if length == 0:
        raise RemoteProtocolError(ErrorCode.CORRUPTED_FRAME, "zero-length frame")
    if length > max_frame:
        raise RemoteProtocolError(
            ErrorCode.FRAME_TOO_LARGE, f"frame of {length} bytes exceeds max_frame {max_frame}"
        )


class FrameDecoder:
    """Incremental frame decoder: `feed` bytes split anywhere, iterate complete payloads.

    At most one frame's payload (<= `max_frame`) plus one header is ever waited for; a header
    that announces a bad frame raises as soon as its 8 bytes are in, and the buffer is dropped.
    After an error the decoder refuses more input.

    `has_partial_frame` (read-only) is False when no byte is held, once every payload of the
    last `feed` was taken: a caller may then cut a read of whole frames itself.
    """

    __slots__ = ("_buffer", "_failed", "_offset", "has_partial_frame", "max_frame")

    def __init__(self, max_frame: int) -> None:
        self.max_frame = max_frame
        self._buffer = bytearray()
        self._offset = 0  # start of the first unconsumed byte in _buffer
        self._failed = False
        self.has_partial_frame = False
        """Bytes are held (part of a frame, or payloads of a `feed` not yet taken)."""

    @property
    def buffered(self) -> int:
        """Bytes held for an incomplete frame."""
        return len(self._buffer) - self._offset

    def feed(self, data: bytes | bytearray | memoryview) -> Iterator[bytes]:
        """Take `data` now and return an iterator over every payload completed so far, in order.

        Iterating raises `RemoteProtocolError` (`corrupted_frame`, `frame_too_large`) at the
        first bad header, after the payloads before it.
        """
        if self._failed:
            raise RemoteProtocolError(ErrorCode.CORRUPTED_FRAME, "decoder already failed")
        buffer = self._buffer
        if self._offset:
            del buffer[: self._offset]
            self._offset = 0
        buffer += data
        self.has_partial_frame = bool(buffer)
        return self._payloads()

    def _payloads(self) -> Iterator[bytes]:
        buffer = self._buffer
        max_frame = self.max_frame
        while True:
            offset = self._offset
            if len(buffer) - offset < HEADER_SIZE:
                if offset == len(buffer):
                    buffer.clear()
                    self._offset = 0
                    self.has_partial_frame = False
                return
            magic, length = unpack_header_from(buffer, offset)
            if magic != MAGIC or length == 0 or length > max_frame:
                self._failed = True
                buffer.clear()
                self._offset = 0
                self.has_partial_frame = False
                check_header(magic, length, max_frame)
            end = offset + HEADER_SIZE + length
            if end > len(buffer):
                return
            self._offset = end
            yield bytes(buffer[offset + HEADER_SIZE : end])


def split_frames(data: bytes, max_frame: int) -> list[bytes]:
    """The payloads of `data`, which must hold whole frames only (a `batch` body)."""
    decoder = FrameDecoder(max_frame)
    payloads = list(decoder.feed(data))
    if decoder.buffered:
        raise RemoteProtocolError(ErrorCode.CORRUPTED_FRAME, "batch ends inside a frame")
    return payloads
