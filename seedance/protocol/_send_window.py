"""The send side of reliability (docs/protocol.md §5, §8): sequence numbers, the in-flight
window, acknowledgement (cumulative and selective), RTT estimation and the retransmission
timer of RFC 6298 with exponential backoff, retransmitting only the oldest unacked frame."""

from __future__ import annotations

from typing import Generic, TypeVar

from .errors import ErrorCode, RemoteProtocolError

T = TypeVar("T")


class RetransmitTimer:
    """RFC 6298 RTO: SRTT/RTTVAR from samples, clamped to [rto_min, rto_max], doubled per
    consecutive expiry (`back_off`) and back to the estimate on progress (`reset_backoff`)."""

    __slots__ = ("_base", "backoff", "rto_max", "rto_min", "rttvar", "srtt")

    def __init__(self, initial: float, minimum: float, maximum: float) -> None:
        self.rto_min = minimum
        self.rto_max = maximum
        self.srtt: float | None = None
        self.rttvar = 0.0
        self._base = initial
        self.backoff = 0

    @property
    def rto(self) -> float:
        return min(self._base * (1 << self.backoff), self.rto_max)

    def sample(self, rtt: float) -> None:
        """Feed one round-trip time measurement (seconds)."""
        if rtt < 0.0:
            rtt = 0.0
        if self.srtt is None:
            self.srtt = rtt
            self.rttvar = rtt / 2
        else:
            self.rttvar = 0.75 * self.rttvar + 0.25 * abs(self.srtt - rtt)
            self.srtt = 0.875 * self.srtt + 0.125 * rtt
        rto = self.srtt + (4 * self.rttvar if self.rttvar > 0.00025 else 0.001)
        self._base = self.rto_min if rto < self.rto_min else rto if rto < self.rto_max else self.rto_max

    def back_off(self) -> None:
        if self._base * (1 << self.backoff) < self.rto_max:
            self.backoff += 1

    def reset_backoff(self) -> None:
        self.backoff = 0


def check_sack(ack: int, sack: tuple[tuple[int, int], ...], next_seq: int) -> None:
    """§7.3: raise `protocol_violation` unless every SACK range `[start, end)` is non-empty,
    starts above `ack` and above the previous range's end (ascending, disjoint, with the
    missing frame between them that made them two ranges), and ends at or below `next_seq`."""
    low = ack
    for start, end in sack:
        if low < start < end <= next_seq:
            low = end
            continue
        if start >= end:
            problem = "is empty"
        elif start <= ack:
            problem = f"starts at or below ack {ack}"
        elif start <= low:
            problem = f"overlaps, touches or precedes the range before it (ending at {low})"
        else:
            problem = f"reaches beyond the next seq {next_seq}"
        raise RemoteProtocolError(
            ErrorCode.PROTOCOL_VIOLATION, f"sack range [{start}, {end}) {problem}"
        )


class SendWindow(Generic[T]):
    """Reliable frames from sequence number assignment until acknowledgement.

    Frames with `seq < acked` are acknowledged and forgotten. The owner writes frames in order
    and advances `next_unsent` past them (or numbers and writes one at once: `push_written`);
    `handed_over(now)` says they reached the transport.
    `peer_window` bounds `next_seq - acked` (§9.1): `room` is how many more frames may be
    numbered now. One frame at a time is timed for an RTT sample (as in BSD TCP; RFC 6298
    asks for at least one sample per round trip).

    `end` (`acked + peer_window`, kept up to date by the `peer_window` setter and `on_ack`) is
    the first seq the peer's window does not admit: the per-token checks compare one number.
    """

    __slots__ = (
        "_acked",
        "_entries",
        "_handed",
        "_peer_window",
        "_retransmitted",
        "_sacked",
        "_timed_at",
        "_timed_seq",
        "deadline",
        "end",
        "next_seq",
        "next_unsent",
        "retransmissions",
        "timer",
    )

    def __init__(self, timer: RetransmitTimer, peer_window: int = 0) -> None:
        self._entries: dict[int, T] = {}
        self._sacked: set[int] = set()
        self._retransmitted: set[int] = set()  # Karn: their acks give no RTT sample
        self.next_seq = 0
        self.next_unsent = 0
        """Every frame below this seq has been written at least once."""
        self._handed = 0  # frames below this were handed to the transport
        self._acked = 0
        self._peer_window = peer_window
        self.end = peer_window
        """`acked + peer_window`: frames from this seq on wait for the window (read-only)."""
        self.timer = timer
        self.deadline: float | None = None
        """When the retransmission timer expires (None: nothing in flight)."""
        self._timed_seq: int | None = None
        self._timed_at = 0.0
        self.retransmissions = 0
        """Frames written again so far (timer expiries and resumes), for metrics."""

    @property
    def acked(self) -> int:
        """Every frame below this seq has been acknowledged (and forgotten)."""
        return self._acked

    @property
    def peer_window(self) -> int:
        """How many frames may be in flight (the peer's `window`, §9.1)."""
        return self._peer_window

    @peer_window.setter
    def peer_window(self, window: int) -> None:
        self._peer_window = window
        self.end = self._acked + window

    @property
    def room(self) -> int:
        return self.end - self.next_seq

    @property
    def unacked(self) -> int:
        return self.next_seq - self._acked

    @property
    def in_flight(self) -> int:
        """Frames handed to the transport and not yet acknowledged."""
        return self._handed - self._acked

    @property
    def handed(self) -> int:
        """Every frame below this seq has been handed to the transport."""
        return self._handed

    def push(self, frame: T) -> int:
        """Number `frame` with the next sequence number and keep it until acknowledged."""
        seq = self.next_seq
        self._entries[seq] = frame
        self.next_seq = seq + 1
        return seq

    def push_written(self, frame: T) -> int:
        """`push` for an owner that writes `frame` at once (nothing may wait to be written):
        also count it written, past `next_unsent`."""
        seq = self.next_seq
        self._entries[seq] = frame
        self.next_seq = self.next_unsent = seq + 1
        return seq

    def frame(self, seq: int) -> T:
        return self._entries[seq]

    def is_sacked(self, seq: int) -> bool:
        return seq in self._sacked

    def handed_over(self, now: float) -> None:
        """Everything written so far reached the transport at `now`: time one new frame for
        an RTT sample and start the retransmission timer if it is not running (RFC 6298 5.1).
        Called per write: while a frame is timed and the timer runs it only moves `handed`."""
        if self._timed_seq is None and self._handed != self.next_unsent:
            self._timed_seq = self._handed
            self._timed_at = now
        self._handed = self.next_unsent
        if self.deadline is None and self._oldest_unsacked() is not None:
            self.deadline = now + self.timer.rto

    def on_ack(self, ack: int, sack: tuple[tuple[int, int], ...], now: float) -> bool:
        """Apply a cumulative `ack` and SACK ranges; return True when `ack` made progress.

        An `ack` below an earlier one is stale (reordered) and ignored; acknowledging a frame
        that was never sent, or SACK ranges that are not ascending, disjoint and apart, each
        non-empty and within `(ack, next_seq]` (§7.3), is a `protocol_violation`; nothing
        changes then.
        """
        next_seq = self.next_seq
        if ack > next_seq:
            raise RemoteProtocolError(
                ErrorCode.PROTOCOL_VIOLATION, f"ack {ack} acknowledges unsent seq {next_seq}"
            )
        entries = self._entries
        if sack:
            check_sack(ack, sack, next_seq)
            for start, end in sack:
                self._sacked.update(seq for seq in range(start, end) if seq in entries)
        acked = self._acked
        if ack <= acked:
            return False
        if ack == next_seq:
            entries.clear()  # everything acknowledged (the common case of a streaming server)
        else:
            for seq in range(acked, ack):
                del entries[seq]
        if self._sacked:
            self._sacked = {seq for seq in self._sacked if seq >= ack}
        if self._retransmitted:
            self._retransmitted = {seq for seq in self._retransmitted if seq >= ack}
        self._acked = ack
        self.end = ack + self._peer_window
        timer = self.timer
        timed = self._timed_seq
        if timed is not None and timed < ack:
            self._timed_seq = None
            timer.sample(now - self._timed_at)
        timer.backoff = 0  # RFC 6298 5.7: progress ends the backoff
        self.deadline = (
            now + timer.rto if entries and self._oldest_unsacked() is not None else None
        )
        return True

    def _oldest_unsacked(self) -> int | None:
        """The oldest written frame neither acknowledged nor SACKed."""
        next_unsent = self.next_unsent
        sacked = self._sacked
        for seq in self._entries:
            if seq >= next_unsent:
                return None
            if seq not in sacked:
                return seq
        return None

    def _retransmitting(self, seq: int) -> None:
        self.retransmissions += 1
        self._retransmitted.add(seq)
        if seq == self._timed_seq:
            self._timed_seq = None  # Karn: its ack would be ambiguous

    def expire(self, now: float) -> int | None:
        """The retransmission timer fired: back off and return the one seq to resend (the
        oldest unacknowledged, un-SACKed frame that was written), or None."""
        seq = self._oldest_unsacked()
        self.timer.back_off()
        if seq is None:
            self.deadline = None
            return None
        self._retransmitting(seq)
        self.deadline = now + self.timer.rto
        return seq

    def resend_from(self, ack: int) -> list[int]:
        """Seqs to write again after a resume: written ones from the peer's `ack` on, minus
        SACKed frames (§11). No side effect: call `mark_retransmitted` for those written."""
        sacked = self._sacked
        return [seq for seq in self._entries if ack <= seq < self.next_unsent and seq not in sacked]

    def mark_retransmitted(self, seq: int) -> None:
        """`seq` is being written again: its ack gives no RTT sample (Karn's rule)."""
        self._retransmitting(seq)

    def detach(self) -> None:
        """The transport is gone: stop the timer; frames stay until acked after resume."""
        self.deadline = None
        self._timed_seq = None
        self._handed = self.next_unsent
