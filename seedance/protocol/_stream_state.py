"""The life of a stream (docs/protocol.md §4) as data: a transition table from (state, message
type) to the next state, shared by both roles; anything not in the table is a violation."""

from __future__ import annotations

from enum import Enum
from typing import Final, Literal

from ._credit import StreamCredit

StreamEvent = Literal["accept", "delta", "end", "cancel"]


class StreamState(Enum):
    OPENED = "opened"
    """`open` sent/received, not yet accepted."""
    ACCEPTED = "accepted"
    """`accept` sent/received: deltas flow."""
    CANCELLED = "cancelled"
    """`cancel` sent/received: waiting for the server's `end`."""
    CLOSED = "closed"
    """`end` sent/received; the stream is forgotten."""


_O, _A, _X, _C = StreamState.OPENED, StreamState.ACCEPTED, StreamState.CANCELLED, StreamState.CLOSED

TRANSITIONS: Final[dict[tuple[StreamState, StreamEvent], StreamState]] = {
    (_O, "accept"): _A,
    (_O, "end"): _C,  # rejected at admission
    (_O, "cancel"): _X,
    (_A, "delta"): _A,
    (_A, "end"): _C,
    (_A, "cancel"): _X,
    (_X, "accept"): _X,  # accept/delta already on the wire when the cancel crossed them
    (_X, "delta"): _X,
    (_X, "end"): _C,
    (_X, "cancel"): _X,
}


def next_state(state: StreamState, event: StreamEvent) -> StreamState | None:
    """The state after `event`, or None when the table does not allow it."""
    return TRANSITIONS.get((state, event))


class StreamRecord(StreamCredit):
    """One open stream of a session: its token credit (inherited, so the per-token checks
    read one object) and its state. `flowing` (deltas may be sent and received: accepted, or
    cancelled while deltas already on the wire arrive) follows `state`, so that the per-token
    paths test one attribute."""

    __slots__ = ("_state", "flowing")

    def __init__(self, credit_limit: int | None) -> None:
        super().__init__(credit_limit)
        self._state = StreamState.OPENED
        self.flowing = False

    @property
    def state(self) -> StreamState:
        return self._state

    @state.setter
    def state(self, state: StreamState) -> None:
        self._state = state
        self.flowing = state is _A or state is _X

    @property
    def credit(self) -> StreamCredit:
        """The stream's credit (the record itself)."""
        return self
