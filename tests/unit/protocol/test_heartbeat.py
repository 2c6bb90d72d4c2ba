"""seedance.protocol._heartbeat: negotiate and HeartbeatSchedule."""

from __future__ import annotations

import pytest

from seedance.protocol import (
    Heartbeat,
    HeartbeatIntervals,
    HeartbeatSchedule,
    ProtocolLimits,
    RemoteProtocolError,
    negotiate,
)

INTERVALS = HeartbeatIntervals(connection=30, session=15, stream=8)


def test_negotiate_defaults_without_request() -> None:
    assert negotiate(None, ProtocolLimits()) == ProtocolLimits().heartbeat


def test_negotiate_rejects_non_finite() -> None:
    with pytest.raises(RemoteProtocolError):
        negotiate(Heartbeat(float("inf"), 10, 5), ProtocolLimits())


def test_first_pings_and_probe() -> None:
    schedule = HeartbeatSchedule(INTERVALS, 0.0)
    assert schedule.deadline() == 15.0
    pings, timeouts = schedule.poll(15.0)
    assert [p[:2] for p in pings] == [("session", 0), ("connection", 0)]  # + probe
    assert timeouts == []


def test_answered_ping_schedules_the_next_one() -> None:
    schedule = HeartbeatSchedule(INTERVALS, 0.0)
    pings, _ = schedule.poll(15.0)
    session_nonce = pings[0][2]
    assert schedule.on_pong("session", 0, session_nonce, 15.2) == pytest.approx(0.2)
    assert schedule.outstanding(("session", 0)) is None


def test_stream_timeout_needs_proof_of_a_live_transport() -> None:
    schedule = HeartbeatSchedule(INTERVALS, 0.0)
    schedule.add_stream(1, 0.0)
    pings, _ = schedule.poll(8.0)
    probe = next(p for p in pings if p[0] == "connection")
    _, timeouts = schedule.poll(16.0)
    assert timeouts == []  # not proven alive: deferred
    schedule.on_pong("connection", 0, probe[2], 16.5)
    _, timeouts = schedule.poll(16.5)
    assert timeouts == [("stream", 1)]


def test_connection_timeout_clears_everything() -> None:
    schedule = HeartbeatSchedule(INTERVALS, 0.0)
    schedule.poll(30.0)
    _, timeouts = schedule.poll(60.0)
    assert ("connection", 0) in timeouts
    assert schedule.deadline() is None


def test_removed_stream_never_fires() -> None:
    schedule = HeartbeatSchedule(INTERVALS, 0.0)
    schedule.add_stream(3, 0.0)
    schedule.remove_stream(3)
    pings, _ = schedule.poll(9.0)
    assert all(p[0] != "stream" for p in pings)
