"""The three heartbeat tiers (docs/protocol.md §10): negotiating intervals from `hello`, and a
schedule that says when to ping each tier and when an unanswered ping has timed out."""

from __future__ import annotations

import heapq
import math
from typing import Literal

from .errors import ErrorCode, RemoteProtocolError
from .limits import HeartbeatIntervals, ProtocolLimits
from .messages import Heartbeat

Tier = Literal["connection", "session", "stream"]
Key = tuple[Tier, int]  # (tier, stream id or 0)

CONNECTION: Key = ("connection", 0)
SESSION: Key = ("session", 0)


def negotiate(requested: Heartbeat | None, limits: ProtocolLimits) -> HeartbeatIntervals:
    """The intervals the server adopts for a `hello` (§10.1).

    Out-of-order requests (`stream > session` or `session > connection`) are refused with
    `invalid_heartbeat`; values are then clamped to `[heartbeat_min, heartbeat_max]`, and the
    order is restored if overlapping ranges broke it.
    """
    if requested is None:
        return limits.heartbeat
    values = (requested.connection, requested.session, requested.stream)
    if not all(math.isfinite(v) and v > 0 for v in values):
        raise RemoteProtocolError(ErrorCode.INVALID_HEARTBEAT, "intervals must be positive")
    if requested.stream > requested.session or requested.session > requested.connection:
        raise RemoteProtocolError(
            ErrorCode.INVALID_HEARTBEAT,
            "heartbeat intervals need stream <= session <= connection, got "
            f"stream={requested.stream} session={requested.session} "
            f"connection={requested.connection}",
        )
    lo, hi = limits.heartbeat_min, limits.heartbeat_max
    connection = min(max(requested.connection, lo.connection), hi.connection)
    session = min(max(requested.session, lo.session), hi.session, connection)
    stream = min(max(requested.stream, lo.stream), hi.stream, session)
    return HeartbeatIntervals(connection=connection, session=session, stream=stream)


class _Timer:
    __slots__ = ("deferred", "due", "interval", "nonce", "sent_at")

    def __init__(self, interval: float, due: float) -> None:
        self.interval = interval
        self.due = due
        self.nonce: int | None = None  # outstanding ping
        self.sent_at = 0.0
        self.deferred = False


class HeartbeatSchedule:
    """When to send each tier's ping and when an unanswered one times out.

    A tier pings every `interval`; a ping unanswered after `interval` times out. A session- or
    stream-tier timeout needs proof that the transport works (a connection-tier pong to a ping
    sent no earlier than the late one), so a dead transport is reported as a connection
    timeout, never as an unresponsive peer: each session/stream ping goes out with a
    connection-tier *probe* ping, answered by the peer's protocol layer at once. Probes do not
    move the connection tier's own schedule.
    """

    def __init__(self, intervals: HeartbeatIntervals, now: float) -> None:
        self.intervals = intervals
        self._timers: dict[Key, _Timer] = {}
        self._heap: list[tuple[float, int, Key]] = []
        self._counter = 0
        self._nonce = 0
        self._alive_since = -math.inf  # sent_at of the latest answered connection ping
        self._probes: dict[int, float] = {}  # nonce -> sent_at
        self._last_probe = -math.inf
        self.next_due: float | None = None
        """Earliest timer (maybe one since removed: a harmless early wake-up)."""
        self._add(CONNECTION, intervals.connection, now)
        self._add(SESSION, intervals.session, now)

    def _add(self, key: Key, interval: float, now: float) -> None:
        timer = _Timer(interval, now + interval)
        self._timers[key] = timer
        self._push(key, timer)

    def _push(self, key: Key, timer: _Timer) -> None:
        self._counter += 1
        heapq.heappush(self._heap, (timer.due, self._counter, key))
        if self.next_due is None or timer.due < self.next_due:
            self.next_due = timer.due

    def add_stream(self, stream: int, now: float) -> None:
        if ("stream", stream) not in self._timers:
            self._add(("stream", stream), self.intervals.stream, now)

    def rearm(self, key: Key, now: float) -> None:
        """Start `key`'s tier afresh at `now` (after its timeout was reported)."""
        interval = self.intervals.stream if key[0] == "stream" else getattr(self.intervals, key[0])
        self._add(key, interval, now)

    def remove_stream(self, stream: int) -> None:
        self._timers.pop(("stream", stream), None)

    def deadline(self) -> float | None:
        """The earliest live timer (dropping stale heap entries); also refreshes `next_due`."""
        heap, timers = self._heap, self._timers
        while heap:
            due, _, key = heap[0]
            timer = timers.get(key)
            if timer is not None and timer.due == due:
                self.next_due = due
                return due
            heapq.heappop(heap)
        self.next_due = None
        return None

    def poll(self, now: float) -> tuple[list[tuple[Tier, int, int]], list[Key]]:
        """Advance to `now`: return the pings to send as (tier, stream, nonce) and the keys
        whose ping timed out (their timers are removed; a connection timeout clears all)."""
        pings: list[tuple[Tier, int, int]] = []
        timeouts: list[Key] = []
        heap, timers = self._heap, self._timers
        while heap and heap[0][0] <= now:
            due, _, key = heapq.heappop(heap)
            timer = timers.get(key)
            if timer is None or timer.due != due:
                continue
            if timer.nonce is None:
                pings.append(self._ping(key, timer, due))
                if key != CONNECTION and self._last_probe != due:
                    pings.append(self._probe(due))
                continue
            if key == CONNECTION:
                timers.clear()
                heap.clear()
                self.next_due = None
                return pings, [CONNECTION]
            if self._alive_since >= timer.sent_at:
                del timers[key]
                timeouts.append(key)
            else:  # the transport is unproven: wait for the connection tier to decide
                timer.deferred = True
                timer.due = timers[CONNECTION].due
                self._push(key, timer)
        self.deadline()
        return pings, timeouts

    def _ping(self, key: Key, timer: _Timer, now: float) -> tuple[Tier, int, int]:
        self._nonce += 1
        timer.nonce = self._nonce
        timer.sent_at = now
        timer.due = now + timer.interval
        self._push(key, timer)
        return key[0], key[1], self._nonce

    def _probe(self, now: float) -> tuple[Tier, int, int]:
        self._nonce += 1
        self._last_probe = now
        horizon = now - self.intervals.connection
        for nonce in [n for n, sent in self._probes.items() if sent < horizon]:
            del self._probes[nonce]
        self._probes[self._nonce] = now
        return "connection", 0, self._nonce

    def on_pong(self, tier: Tier, stream: int, nonce: int, now: float) -> float | None:
        """A pong arrived; return the round-trip time when it answers the outstanding ping."""
        if tier == "connection" and nonce in self._probes:
            sent_at = self._probes.pop(nonce)
            self._prove_alive(sent_at, now)
            return now - sent_at
        key: Key = (tier, stream if tier == "stream" else 0)
        timer = self._timers.get(key)
        if timer is None or timer.nonce != nonce:
            return None
        timer.nonce = None
        rtt = now - timer.sent_at
        timer.due = max(timer.sent_at + timer.interval, now)
        timer.deferred = False
        self._push(key, timer)
        if key == CONNECTION:
            self._prove_alive(timer.sent_at, now)
        return rtt

    def _prove_alive(self, sent_at: float, now: float) -> None:
        self._alive_since = max(self._alive_since, sent_at)
        for key, timer in self._timers.items():
            if timer.deferred and timer.sent_at <= self._alive_since:
                timer.deferred = False
                timer.due = now
                self._push(key, timer)

    def outstanding(self, key: Key) -> int | None:
        timer = self._timers.get(key)
        return None if timer is None else timer.nonce
