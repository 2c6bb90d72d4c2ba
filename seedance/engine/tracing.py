"""Observability of the step loop: a Chrome trace-event JSON writer (per-step stage spans and
one event per generated token, for Perfetto) and the queue-backlog warning."""

from __future__ import annotations

import json
import logging
import os
import threading
from typing import IO, Any

log = logging.getLogger("seedance.engine")

STAGES = ("schedule", "prepare", "forward", "sample", "detokenize")
BACKLOG_WAIT_S = 0.015
BACKLOG_STEPS = 3


class TraceWriter:
    """Streams trace events into `path` as they happen; `close()` completes the JSON document.
    Timestamps are time.monotonic() seconds, written as microseconds."""

    PID = 1
    ENGINE_TID = 0

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self._file: IO[str] | None = open(self.path, "w", encoding="utf-8")  # noqa: SIM115
        self._file.write('{"displayTimeUnit":"ms","traceEvents":[\n')
        self._first = True
        self._lock = threading.Lock()
        self._tids: dict[str, int] = {}
        self._emit(
            {
                "ph": "M",
                "name": "process_name",
                "pid": self.PID,
                "tid": 0,
                "args": {"name": "seedance engine"},
            }
        )
        self._emit(
            {
                "ph": "M",
                "name": "thread_name",
                "pid": self.PID,
                "tid": 0,
                "args": {"name": "engine step"},
            }
        )

    def _emit(self, event: dict[str, Any]) -> None:
        if self._file is None:
            return
        if not self._first:
            self._file.write(",\n")
        self._first = False
        self._file.write(json.dumps(event, separators=(",", ":")))

    def _tid(self, request_id: str) -> int:
        tid = self._tids.get(request_id)
        if tid is None:
            tid = self._tids[request_id] = len(self._tids) + 1
            self._emit(
                {
                    "ph": "M",
                    "name": "thread_name",
                    "pid": self.PID,
                    "tid": tid,
                    "args": {"name": f"request {request_id}"},
                }
            )
        return tid

    def step(
        self, step: int, start: float, stage_s: dict[str, float], num_seqs: int, num_tokens: int
    ) -> None:
        """One span per stage of step `step`, laid end to end from `start`."""
        with self._lock:
            t = start
            for stage in STAGES:
                dur = stage_s.get(stage, 0.0)
                self._emit(
                    {
                        "ph": "X",
                        "name": stage,
                        "cat": "step",
                        "pid": self.PID,
                        "tid": self.ENGINE_TID,
                        "ts": round(t * 1e6, 3),
                        "dur": round(dur * 1e6, 3),
                        "args": {"step": step, "seqs": num_seqs, "tokens": num_tokens},
                    }
                )
                t += dur

    def token(
        self,
        request_id: str,
        dispatch_time: float,
        index: int,
        token_id: int,
        block_ids: list[int],
        step: int,
        stage_s: dict[str, float],
    ) -> None:
        """One instant event per generated token: when it was dispatched, for which request,
        which KV blocks the step touched for it, and the step's stage timings (ms)."""
        with self._lock:
            self._emit(
                {
                    "ph": "i",
                    "s": "t",
                    "name": "token",
                    "cat": "token",
                    "pid": self.PID,
                    "tid": self._tid(request_id),
                    "ts": round(dispatch_time * 1e6, 3),
                    "args": {
                        "request_id": request_id,
                        "index": index,
                        "token_id": token_id,
                        "kv_blocks": block_ids,
                        "step": step,
                        **{f"{k}_ms": round(v * 1e3, 4) for k, v in stage_s.items()},
                    },
                }
            )

    def close(self) -> None:
        with self._lock:
            if self._file is None:
                return
            self._file.write("\n]}\n")
            self._file.close()
            self._file = None


class QueueBacklogMonitor:
    """Warns when the oldest waiting request has waited more than 15 ms for 3 steps in a row
    (the hint that the batch window or the budget is too small for the load)."""

    def __init__(self, wait_s: float = BACKLOG_WAIT_S, steps: int = BACKLOG_STEPS) -> None:
        self.wait_s = wait_s
        self.steps = steps
        self.consecutive = 0
        self.warnings = 0

    def observe(self, oldest_wait_s: float) -> bool:
        """Record one step; True when this step triggers the warning."""
        if oldest_wait_s <= self.wait_s:
            self.consecutive = 0
            return False
        self.consecutive += 1
        if self.consecutive == self.steps:
            self.warnings += 1
            log.warning(
                "queue backlog: requests have waited more than %.0f ms for %d steps in a row "
                "(oldest %.1f ms); consider a larger max_batch_size / max_num_batched_tokens",
                self.wait_s * 1e3,
                self.steps,
                oldest_wait_s * 1e3,
            )
            return True
        return False
