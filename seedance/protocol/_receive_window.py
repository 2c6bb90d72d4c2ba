"""The receive side of reliability (docs/protocol.md §6, §7): the window `[ack, ack + size)`,
early-frame buffering, duplicate dropping, SACK ranges and when to acknowledge."""

from __future__ import annotations

from typing import Generic, TypeVar

from .errors import ErrorCode, RemoteProtocolError
from .limits import MAX_SACK_RANGES

T = TypeVar("T")


class ReceiveWindow(Generic[T]):
    """Orders reliable frames by `seq` and decides acknowledgements.

    `receive` returns the frames that become deliverable, in order, each exactly once.
    The owner sends an `ack` (from `ack_ranges()`) when `ack_due(now)` is true and then calls
    `acked(now)`; `deadline` is when a delayed ack falls due.
    """

    __slots__ = (
        "_ack_delay",
        "_ack_every",
        "_held",
        "_unacked",
        "ack",
        "deadline",
        "dropped_beyond",
        "duplicates",
        "immediate",
        "size",
    )

    def __init__(self, size: int, *, ack_every: int = 16, ack_delay: float = 0.025) -> None:
        self.size = size
        self.ack = 0
        """Next sequence number expected: every seq < ack has been delivered."""
        self._held: dict[int, T] = {}
        self._ack_every = ack_every
        self._ack_delay = ack_delay
        self._unacked = 0
        self.deadline: float | None = None
        """When a delayed ack is due (None: nothing to acknowledge)."""
        self.immediate = False
        """An ack is due now (gap, duplicate, `ack_every` frames, or a resume)."""
        self.duplicates = 0
        self.dropped_beyond = 0

    def receive(self, seq: int, frame: T, now: float) -> list[T]:
        """Take one reliable frame; return the frames now deliverable in order.

        A duplicate (below `ack`, or already held) or a frame beyond the window is dropped
        and makes an ack due at once. A `seq` at or beyond `ack + 2 * size` cannot come from a
        sender that respects the window: `protocol_violation`.
        """
        ack = self.ack
        if seq == ack and not self._held:
            self.ack = ack + 1
            self._count(now)
            return [frame]
        if seq < ack or seq in self._held:
            self.duplicates += 1
            self.immediate = True
            return []
        if seq >= ack + self.size:
            if seq >= ack + 2 * self.size:
                raise RemoteProtocolError(
                    ErrorCode.PROTOCOL_VIOLATION,
                    f"seq {seq} is beyond the receive window [{ack}, {ack + self.size})",
                )
            self.dropped_beyond += 1
            self.immediate = True
            return []
        if seq != ack:
            self._held[seq] = frame
            self.immediate = True  # a gap
            self._count(now)
            return []
        held = self._held
        out = [frame]
        ack += 1
        while ack in held:
            out.append(held.pop(ack))
            ack += 1
        self.ack = ack
        self.immediate = True  # the gap closed: tell the sender at once
        self._count(now)
        return out

    def take_next(self, seq: int, now: float) -> bool:
        """Fast path of `receive`: when `seq` is exactly the next expected and nothing is held,
        count it delivered and return True (the caller delivers the frame itself)."""
        if seq != self.ack or self._held:
            return False
        self.ack = seq + 1
        unacked = self._unacked = self._unacked + 1
        if unacked >= self._ack_every:
            self.immediate = True
        elif self.deadline is None:
            self.deadline = now + self._ack_delay
        return True

    def _count(self, now: float) -> None:
        self._unacked += 1
        if self._unacked >= self._ack_every:
            self.immediate = True
        elif self.deadline is None:
            self.deadline = now + self._ack_delay

    def ack_due(self, now: float) -> bool:
        return self.immediate or (self.deadline is not None and now >= self.deadline)

    def force_ack(self) -> None:
        """Make an ack due at once (used after a resume and on a duplicate hello)."""
        self.immediate = True

    def ack_ranges(self) -> tuple[tuple[int, int], ...]:
        """SACK ranges `[start, end)` of held frames above `ack`, lowest first, at most 16."""
        if not self._held:
            return ()
        ranges: list[tuple[int, int]] = []
        start = end = -1
        for seq in sorted(self._held):
            if seq == end:
                end += 1
                continue
            if start >= 0:
                ranges.append((start, end))
                if len(ranges) == MAX_SACK_RANGES:
                    return tuple(ranges)
            start, end = seq, seq + 1
        ranges.append((start, end))
        return tuple(ranges[:MAX_SACK_RANGES])

    def acked(self) -> None:
        """An ack reflecting the current state has been sent."""
        self._unacked = 0
        self.deadline = None
        self.immediate = False

    @property
    def held(self) -> int:
        """Early frames buffered above the gap."""
        return len(self._held)
