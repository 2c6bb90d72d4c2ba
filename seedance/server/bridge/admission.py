"""Admission control: at most `limit` requests hold a slot (are in the engine) at once; later
ones wait in priority order (lower first, then arrival), and beyond `max_waiting` waiting ones
a request is refused with EngineError('overloaded') — HTTP 429 / protocol `overloaded`."""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

import trio

from seedance.engine.errors import EngineError


@dataclass(order=True)
class _Waiter:
    priority: int
    arrival: int
    event: trio.Event = field(compare=False, default_factory=trio.Event)
    granted: bool = field(compare=False, default=False)
    gone: bool = field(compare=False, default=False)


class AdmissionSlots:
    """A priority semaphore with a bounded queue; trio-thread only."""

    def __init__(self, limit: int, max_waiting: int) -> None:
        self.limit = limit
        self.max_waiting = max_waiting
        self.in_use = 0
        self._heap: list[_Waiter] = []
        self._num_waiting = 0
        self._arrivals = itertools.count()

    @property
    def num_waiting(self) -> int:
        return self._num_waiting

    async def acquire(self, priority: int = 0) -> None:
        """Take a slot, waiting in priority order; raises EngineError('overloaded') at once
        when the queue is full. Cancellation while waiting leaves no trace."""
        if self.in_use < self.limit and self._num_waiting == 0:
            self.in_use += 1
            await trio.lowlevel.checkpoint()
            return
        if self._num_waiting >= self.max_waiting:
            raise EngineError(
                "overloaded",
                f"server is at capacity: {self.in_use} requests running, "
                f"{self._num_waiting} waiting (limit {self.max_waiting})",
            )
        waiter = _Waiter(priority, next(self._arrivals))
        heapq.heappush(self._heap, waiter)
        self._num_waiting += 1
        try:
            await waiter.event.wait()
        except BaseException:
            if waiter.granted:  # woken with the slot, then failed: the slot is ours to pass
                self.release()
            else:
                waiter.gone = True
                self._num_waiting -= 1
            raise

    def release(self) -> None:
        """Give a slot back; the most urgent waiter gets it."""
        while self._heap:
            waiter = heapq.heappop(self._heap)
            if waiter.gone:
                continue
            self._num_waiting -= 1
            waiter.granted = True
            waiter.event.set()
            return
        self.in_use -= 1
