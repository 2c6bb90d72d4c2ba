"""Server-side trace for `--trace-output FILE`: the engine writes FILE; the server writes the
send time of every SSE chunk and protocol frame to `FILE.server.json`, in the same Chrome
trace-event format, process id and clock (time.monotonic, microseconds) as the engine's
TraceWriter, on its own track ("server sends"); merge the two `traceEvents` arrays to see
both in one Perfetto timeline. Events are buffered and written in blocks of `FLUSH_EVENTS`."""

from __future__ import annotations

import json
import time
from typing import IO, Any

FLUSH_EVENTS = 512
SUFFIX = ".server.json"
PID = 1
"""The engine TraceWriter's process id, so merged traces share one process."""
SERVER_TID = 1_000_000
"""The server's track, far from the engine's per-request tracks (1, 2, ...)."""


def server_trace_path(trace_output: str) -> str:
    """Where the server's events go, next to the engine's trace."""
    return trace_output + SUFFIX


class ServerTrace:
    """Instant events, one per chunk/frame sent; trio-thread only."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._file: IO[str] | None = open(path, "w", encoding="utf-8")  # noqa: SIM115
        self._file.write('{"displayTimeUnit":"ms","traceEvents":[\n')
        self._pending: list[str] = [
            json.dumps(
                {
                    "name": "thread_name",
                    "ph": "M",
                    "pid": PID,
                    "tid": SERVER_TID,
                    "args": {"name": "server sends"},
                }
            )
        ]

    def sent(self, kind: str, request_id: str, *, tokens: int, nbytes: int, **args: Any) -> None:
        """Record one chunk/frame of `request_id` written to the transport now."""
        event = {
            "name": kind,
            "ph": "i",
            "s": "t",
            "ts": round(time.monotonic() * 1e6, 3),
            "pid": PID,
            "tid": SERVER_TID,
            "args": {"request_id": request_id, "tokens": tokens, "bytes": nbytes, **args},
        }
        self._pending.append(json.dumps(event))
        if len(self._pending) >= FLUSH_EVENTS:
            self.flush()

    def flush(self) -> None:
        if self._file is not None and self._pending:
            self._file.write(",\n".join(self._pending) + ",\n")
            self._pending.clear()

    def close(self) -> None:
        """Write what is pending and end the JSON array. Idempotent."""
        if self._file is None:
            return
        self._pending.append(
            json.dumps(
                {
                    "name": "trace_end",
                    "ph": "i",
                    "s": "g",
                    "ts": time.monotonic() * 1e6,
                    "pid": PID,
                    "tid": SERVER_TID,
                }
            )
        )
        self._file.write(",\n".join(self._pending) + "\n]}\n")
        self._pending.clear()
        self._file.close()
        self._file = None
