"""Ordered writes to a trio stream that skip the event loop when the kernel takes the bytes at
once, as asyncio's transports do. A trio `send_all` passes through the scheduler (checkpoints)
before and after the write, and under load each of those waits for a whole engine delivery
pass; `write_nowait` is one non-blocking `send` from synchronous code instead. Whatever the
kernel does not take at once (or any write on a TLS stream) stays queued, in order, for
`send`."""

from __future__ import annotations

import os

import trio


class SocketWriter:
    """One connection's outgoing bytes: written at once when possible, else queued for the
    async path. Bytes go out in the order the calls were made, whichever path they take."""

    def __init__(self, stream: trio.abc.Stream) -> None:
        self.stream = stream
        self._socket = stream.socket if isinstance(stream, trio.SocketStream) else None
        self._unsent: list[bytes] = []
        self._lock = trio.StrictFIFOLock()

    @property
    def backlog(self) -> int:
        """Bytes queued for `send`."""
        return sum(len(chunk) for chunk in self._unsent)

    def write_nowait(self, data: bytes) -> bool:
        """Write `data` now if the socket takes all of it without blocking (True). Otherwise
        queue what is left for the next `send` (False): on a TLS stream, while an async send
        is in progress or queued, or when the socket buffer is full. Never blocks or yields;
        errors are left for `send` to raise."""
        socket = self._socket
        if socket is None or self._unsent or self._lock.locked():
            self._unsent.append(data)
            return False
        fd = socket.fileno()  # -1 once trio closed it: never write to a reused descriptor
        if fd < 0:
            self._unsent.append(data)
            return False
        try:
            sent = os.write(fd, data)
        except BlockingIOError:
            sent = 0
        except OSError:  # reset, broken pipe: `send` reports it as trio.BrokenResourceError
            sent = 0
        if sent == len(data):
            return True
        self._unsent.append(data[sent:])
        return False

    async def send(self, data: bytes = b"") -> None:
        """Write what `write_nowait` queued, then `data` (queued at once, so the order of calls
        is the order on the wire even while this waits for an earlier send)."""
        if data:
            self._unsent.append(data)
        async with self._lock:
            if not self._unsent:
                return
            pending = self._unsent[0] if len(self._unsent) == 1 else b"".join(self._unsent)
            self._unsent.clear()
            await self.stream.send_all(pending)
