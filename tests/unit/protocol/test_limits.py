"""seedance.protocol.limits: defaults and validation."""

from __future__ import annotations

import pytest

from seedance.protocol import HeartbeatIntervals, ProtocolLimits


def test_defaults_match_the_spec() -> None:
    limits = ProtocolLimits()
    assert limits.max_frame == 1 << 20 and limits.window == 256
    assert limits.heartbeat == HeartbeatIntervals(30, 15, 8)
    assert limits.heartbeat_min == HeartbeatIntervals(25, 10, 3)
    assert limits.heartbeat_max == HeartbeatIntervals(45, 20, 12)
    assert (limits.ack_every, limits.ack_delay) == (16, 0.025)
    assert (limits.rto_initial, limits.rto_min, limits.rto_max) == (1.0, 0.2, 60.0)
    assert limits.resume_grace == 30.0


@pytest.mark.parametrize(
    "kwargs",
    [{"max_frame": 10}, {"window": 0}, {"max_streams": 0}, {"resume_grace": -1},
     {"ack_every": 0}, {"rto_min": 2.0}],
)
def test_bad_limits_are_refused(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        ProtocolLimits(**kwargs)  # type: ignore[arg-type]
