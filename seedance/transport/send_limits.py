"""Bounds on one connection's outgoing bytes that user space holds (unsent: not yet taken by
the kernel), and the errors a writer raises past them: above the high-water mark the
connection stops producing (no delivery-pass writes, no reading), below the low-water mark it
resumes, past the hard limit or a send stall it is dropped."""

from __future__ import annotations

import math

import msgspec
import trio

HIGH_WATER = 256 * 1024
LOW_WATER = 64 * 1024
HARD_LIMIT = 16 * 1024 * 1024
SEND_TIMEOUT = 30.0
SEND_PIECE = 64 * 1024
"""A blocking write goes out in pieces of at most this many bytes, each bounded by `timeout`:
a peer reading slowly but steadily is never cut off, one that stopped reading is."""


class SendLimits(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Watermarks and limits of one connection's unsent bytes (see the module docstring)."""

    high_water: int = HIGH_WATER
    """Above this many unsent bytes the connection is congested: it stops reading its peer
    and its delivery passes stop writing (frames wait in the protocol's send window)."""
    low_water: int = LOW_WATER
    """A congested connection resumes once its unsent bytes drop below this."""
    hard_limit: int = HARD_LIMIT
    """Unsent bytes never exceed this: a write that would is refused (`SendBacklogFull`).
    Above `high_water` only the writer task still adds, one batch at a time, of what the
    protocol connection held meanwhile (bounded by the peer's frame window)."""
    timeout: float = SEND_TIMEOUT
    """A write whose next piece (at most `SEND_PIECE` bytes) the peer does not take within
    this many seconds fails (`SendStalled`); `math.inf`: never."""

    def __post_init__(self) -> None:
        if not 0 <= self.low_water <= self.high_water <= self.hard_limit:
            raise ValueError("send limits: need 0 <= low_water <= high_water <= hard_limit")
        if not (self.timeout > 0 or math.isinf(self.timeout)):
            raise ValueError("send limits: timeout must be > 0")


class SendBacklogFull(trio.BrokenResourceError):
    """A write would have taken the unsent bytes past `SendLimits.hard_limit`; nothing of it
    was queued. The connection cannot go on (its byte stream would have a hole)."""

    def __init__(self, backlog: int, size: int, limit: int) -> None:
        super().__init__(f"{backlog} unsent bytes + a write of {size} exceed the limit {limit}")
        self.backlog = backlog
        self.limit = limit


class SendStalled(trio.BrokenResourceError):
    """The peer did not take the next piece of a write within `SendLimits.timeout` seconds (it
    does not read). How much of that piece went out is unknown: the byte stream is cut."""

    def __init__(self, backlog: int, timeout: float) -> None:
        super().__init__(f"{backlog} unsent bytes: no progress in {timeout:g} s")
        self.backlog = backlog
        self.timeout = timeout
