"""Ordered, bounded writes to a trio stream that skip the event loop when the kernel takes the
bytes at once, as asyncio's transports do. A trio `send_all` passes through the scheduler
(checkpoints) before and after the write, and under load each of those waits for a whole engine
delivery pass; `write_nowait` is one non-blocking `send` from synchronous code instead.
Whatever the kernel does not take at once (or any write on a TLS stream) stays queued, in
order, for `send` — at most `SendLimits.hard_limit` bytes, with the high/low watermarks that
tell the connection to stop and resume producing (`congested`)."""

from __future__ import annotations

import contextlib
import os
import socket as stdlib_socket
import struct

import trio

from seedance.transport.send_limits import SEND_PIECE, SendBacklogFull, SendLimits, SendStalled

_LINGER_RESET = struct.pack("ii", 1, 0)


class SocketWriter:
    """One connection's outgoing bytes: written at once when possible, else queued for the
    async path. Bytes go out in the order the calls were made, whichever path they take."""

    def __init__(self, stream: trio.abc.Stream, limits: SendLimits | None = None) -> None:
        self.stream = stream
        self.limits = limits if limits is not None else SendLimits()
        self._socket = stream.socket if isinstance(stream, trio.SocketStream) else None
        self._unsent: list[bytes] = []
        self._queued = 0
        """Bytes in `_unsent`."""
        self._sending = 0
        """Bytes a `send` took from `_unsent` that the kernel has not yet accepted."""
        self.peak_backlog = 0
        """The most unsent bytes this writer ever held."""
        self._congested = False
        self._progress: trio.Event | None = None
        """Set when the kernel accepts bytes of a send (made only while someone waits)."""
        self._lock = trio.StrictFIFOLock()

    @property
    def backlog(self) -> int:
        """Unsent bytes: queued for `send`, or taken by it and not yet accepted by the kernel."""
        return self._queued + self._sending

    @property
    def congested(self) -> bool:
        """The backlog went above `limits.high_water` and has not yet dropped below
        `limits.low_water`."""
        return self._congested

    async def wait_uncongested(self) -> None:
        """Until not `congested`. Raises `SendStalled` when the kernel accepts none of the
        backlog for `limits.timeout` seconds (the peer does not read); a peer that reads
        slowly is waited for as long as it takes."""
        await trio.lowlevel.checkpoint()
        while self._congested:
            if self._progress is None:
                self._progress = trio.Event()
            progress = self._progress
            with trio.move_on_after(self.limits.timeout):
                await progress.wait()
            if not progress.is_set():
                raise SendStalled(self.backlog, self.limits.timeout)

    def _queue(self, data: bytes) -> None:
        backlog = self._queued + self._sending
        limits = self.limits
        if backlog + len(data) > limits.hard_limit:
            raise SendBacklogFull(backlog, len(data), limits.hard_limit)
        self._unsent.append(data)
        self._queued += len(data)
        backlog += len(data)
        if backlog > self.peak_backlog:
            self.peak_backlog = backlog
        if backlog > limits.high_water:
            self._congested = True

    def _took(self, size: int) -> None:
        """The kernel accepted `size` bytes of the send in progress (or they were lost with a
        failed send)."""
        self._sending -= size
        if self._congested and self._queued + self._sending < self.limits.low_water:
            self._congested = False
        progress = self._progress
        if progress is not None:
            self._progress = None
            progress.set()

    def write_nowait(self, data: bytes) -> bool:
        """Write `data` now if the socket takes all of it without blocking (True). Otherwise
        queue what is left for the next `send` (False): on a TLS stream, while an async send
        is in progress or queued, or when the socket buffer is full. Never blocks or yields;
        raises `SendBacklogFull` (queuing nothing) past the hard limit; other errors are left
        for `send` to raise."""
        socket = self._socket
        if socket is None or self._unsent or self._lock.locked():
            self._queue(data)
            return False
        fd = socket.fileno()  # -1 once trio closed it: never write to a reused descriptor
        if fd < 0:
            self._queue(data)
            return False
        try:
            sent = os.write(fd, data)
        except BlockingIOError:
            sent = 0
        except OSError:  # reset, broken pipe: `send` reports it as trio.BrokenResourceError
            sent = 0
        if sent == len(data):
            return True
        self._queue(data[sent:])
        return False

    async def send(self, data: bytes = b"") -> None:
        """Write what `write_nowait` queued, then `data` (queued at once, so the order of calls
        is the order on the wire even while this waits for an earlier send). Each piece of at
        most SEND_PIECE bytes must go out within `limits.timeout` (else `SendStalled`)."""
        if data:
            self._queue(data)
        async with self._lock:
            if not self._unsent:
                return
            pending = self._unsent[0] if len(self._unsent) == 1 else b"".join(self._unsent)
            self._unsent.clear()
            self._queued = 0
            self._sending = size = len(pending)
            timeout = self.limits.timeout
            try:
                if size <= SEND_PIECE:
                    with trio.move_on_after(timeout):
                        await self.stream.send_all(pending)
                        self._took(size)
                        return
                    raise SendStalled(self.backlog, timeout)
                view = memoryview(pending)
                for start in range(0, size, SEND_PIECE):
                    piece = view[start:start + SEND_PIECE]
                    with trio.move_on_after(timeout):
                        await self.stream.send_all(piece)
                        self._took(len(piece))
                        continue
                    raise SendStalled(self.backlog, timeout)
            finally:
                if self._sending:  # a failed send: what is left of it is lost with the stream
                    self._took(self._sending)

    def abort(self) -> None:
        """The peer is dropped for not reading: make the coming close a reset, so that the
        kernel does not keep the unread bytes (and the socket) alive after it."""
        socket = self._socket
        if socket is not None and socket.fileno() >= 0:
            with contextlib.suppress(OSError):
                socket.setsockopt(stdlib_socket.SOL_SOCKET, stdlib_socket.SO_LINGER,
                                  _LINGER_RESET)


class WrittenTransport:
    """The part of a protocol transport that its `SocketWriter` answers: the backlog, its
    congestion and the abort (shared by the WebSocket and TCP transports)."""

    def __init__(self, stream: trio.abc.Stream, limits: SendLimits | None = None) -> None:
        self.stream = stream
        self._writer = SocketWriter(stream, limits)

    @property
    def congested(self) -> bool:
        return self._writer.congested

    async def wait_uncongested(self) -> None:
        await self._writer.wait_uncongested()

    @property
    def backlog(self) -> int:
        return self._writer.backlog

    @property
    def peak_backlog(self) -> int:
        return self._writer.peak_backlog

    def abort(self) -> None:
        self._writer.abort()
