"""Connection caps at accept (total, per client address, an IPv6 /64 as one client), the
file-descriptor limit raised at start-up, the log throttle for accept errors and refusals, the
flags that set them, and the drain's expiry callbacks (issue 12, holes 1 and 9)."""

from __future__ import annotations

import argparse
import resource

import pytest

from seedance.config import ConfigError, add_flags, build_config, config_from_args
from seedance.server.ops.connection_caps import (
    ConnectionCaps,
    LogThrottle,
    client_key,
    raise_fd_limit,
)
from seedance.server.server_context import DrainState


def test_the_total_cap_refuses_past_it_and_frees_on_release() -> None:
    caps = ConnectionCaps(total=2, per_client=10)
    assert caps.admit("10.0.0.1") is None and caps.admit("10.0.0.2") is None
    assert caps.admit("10.0.0.3") == "max_connections"
    caps.release("10.0.0.1")
    assert caps.admit("10.0.0.3") is None
    assert caps.open == 2


def test_the_per_client_cap_leaves_other_clients_alone() -> None:
    caps = ConnectionCaps(total=100, per_client=2)
    assert caps.admit("10.0.0.1") is None and caps.admit("10.0.0.1") is None
    assert caps.admit("10.0.0.1") == "max_connections_per_client"
    assert caps.admit("10.0.0.2") is None
    assert caps.held_by("10.0.0.1") == 2 and caps.open == 3
    caps.release("10.0.0.1")
    caps.release("10.0.0.1")
    assert caps.held_by("10.0.0.1") == 0
    assert caps.admit("10.0.0.1") is None


def test_a_refused_admission_takes_no_slot() -> None:
    caps = ConnectionCaps(total=1, per_client=1)
    assert caps.admit("a") is None
    for _ in range(5):
        assert caps.admit("a") is not None
        assert caps.admit("b") is not None
    caps.release("a")
    assert caps.open == 0 and caps.admit("b") is None


def test_an_ipv6_client_is_its_slash_64_and_a_mapped_ipv4_its_address() -> None:
    assert client_key("2001:db8:1:2:aaaa::1") == client_key("2001:db8:1:2:ffff::9")
    assert client_key("2001:db8:1:2::1") != client_key("2001:db8:1:3::1")
    assert client_key("::ffff:192.0.2.7") == client_key("192.0.2.7") == "192.0.2.7"
    assert client_key("fe80::1%eth0") == client_key("fe80::2")
    assert client_key(None) is None


def test_the_log_throttle_lets_one_line_a_second_through_with_the_suppressed_count() -> None:
    throttle = LogThrottle(interval=1.0)
    assert throttle.allow(100.0) == 0
    assert [throttle.allow(100.0 + i / 10) for i in range(1, 10)] == [None] * 9
    assert throttle.allow(101.0) == 9
    assert throttle.allow(101.5) is None
    assert throttle.allow(103.0) == 1


def test_the_soft_fd_limit_is_raised_to_the_hard_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard <= 256:
        pytest.fail("the hard fd limit is too low to lower the soft one for the test")
    lowered = 256
    resource.setrlimit(resource.RLIMIT_NOFILE, (lowered, hard))
    try:
        before, after = raise_fd_limit()
        assert before == lowered
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == after > lowered
        if hard != resource.RLIM_INFINITY:
            assert after == hard
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_the_flags_set_the_handshake_timeout_and_the_caps() -> None:
    parser = argparse.ArgumentParser()
    add_flags(parser)
    args = parser.parse_args(["--handshake-timeout", "2.5", "--max-connections", "100",
                              "--max-connections-per-client", "7"])
    server = config_from_args(args).server
    assert (server.handshake_timeout, server.max_connections,
            server.max_connections_per_client) == (2.5, 100, 7)
    defaults = build_config({}).server
    assert (defaults.handshake_timeout, defaults.max_connections,
            defaults.max_connections_per_client) == (10.0, 8192, 1024)


@pytest.mark.parametrize(("field", "value", "flag"), [
    ("handshake_timeout", 0, "--handshake-timeout"),
    ("max_connections", 0, "--max-connections"),
    ("max_connections_per_client", 0, "--max-connections-per-client"),
])
def test_bad_values_name_their_flag(field: str, value: float, flag: str) -> None:
    with pytest.raises(ConfigError, match=flag):
        build_config({"server": {field: value}})


async def test_the_drain_expiry_ends_what_registered_and_only_while_registered() -> None:
    drain = DrainState()
    ended: list[str] = []
    with drain.at_expiry(lambda: ended.append("inside")):
        pass
    with drain.at_expiry(lambda: ended.append("running")):
        drain.expire()
        assert drain.expired
    assert ended == ["running"]
    with drain.at_expiry(lambda: ended.append("late")):  # registered after expiry: at once
        pass
    assert ended == ["running", "late"]
