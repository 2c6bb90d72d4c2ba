"""ACK clocking of a sender's writes: while the peer has not acknowledged MAX_WRITES_IN_FLIGHT
earlier writes of reliable frames (and owes an ack at once), new frames wait for its next ack
and go out together with it. A slow reader gets fewer, larger writes instead of a backlog; a
fast one is never held."""

from __future__ import annotations

import collections
from typing import Protocol

from seedance.protocol import SessionState

MAX_WRITES_IN_FLIGHT = 3
"""Writes the peer may leave unacknowledged before new frames wait for its ack."""
PEER_ACK_FRAMES = 16
"""A peer acknowledges at least every this many reliable frames (protocol-v1 §3), so waiting
for its ack is only done while this many are in flight (never on a delayed ack)."""


class HasSession(Protocol):
    """A protocol connection: its session (None before `welcome`) holds the send window."""

    @property
    def session(self) -> SessionState | None: ...


class AckClock:
    """The send window's `handed` after each write of reliable frames not yet all acknowledged
    (increasing; at most one entry per unacknowledged frame, so bounded by the frame window)."""

    def __init__(self, conn: HasSession, max_writes: int = MAX_WRITES_IN_FLIGHT,
                 peer_ack_frames: int = PEER_ACK_FRAMES) -> None:
        self.conn = conn
        self.max_writes = max_writes
        self.peer_ack_frames = peer_ack_frames
        self._writes: collections.deque[int] = collections.deque()

    @property
    def writes_in_flight(self) -> int:
        """Writes of reliable frames not yet all acknowledged (as of the last `wrote`)."""
        return len(self._writes)

    def peer_behind(self) -> bool:
        """The peer has not acknowledged `max_writes` earlier writes and owes an ack at once
        (`peer_ack_frames` in flight): it is still reading them."""
        session = self.conn.session
        if session is None:
            return False
        send = session.send
        self._forget(send.acked)
        return len(self._writes) >= self.max_writes and send.in_flight >= self.peer_ack_frames

    def wrote(self) -> None:
        """Count a write that handed new reliable frames over (control frames alone are not
        acknowledged, so they never count)."""
        session = self.conn.session
        if session is None:
            return
        send = session.send
        self._forget(send.acked)
        writes = self._writes
        if send.handed > (writes[-1] if writes else send.acked):
            writes.append(send.handed)

    def _forget(self, acked: int) -> None:
        writes = self._writes
        while writes and writes[0] <= acked:
            writes.popleft()
