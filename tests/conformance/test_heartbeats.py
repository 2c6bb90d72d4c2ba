"""docs/protocol.md §10 Heartbeats: negotiation and tier order, when each tier pings, who
answers, when an unanswered ping expires and what each expiry ends."""

from __future__ import annotations

import pytest

from seedance.protocol import (
    ClientConnection,
    ConnectionState,
    ConnectionTimedOut,
    ErrorCode,
    Heartbeat,
    HeartbeatIntervals,
    Hello,
    PayloadCodec,
    ProtocolLimits,
    RemoteProtocolError,
    ServerConnection,
    SessionTimedOut,
    StreamOpened,
    StreamTimedOut,
    Usage,
    Welcome,
    encode_frame,
    negotiate,
)
from seedance.protocol.messages import Accept, Cancel, Credit, Message, Open, Ping, Pong

from .pair import ConnectionPair, frames_of

CODEC = PayloadCodec("msgpack")


def frame(*messages: Message) -> bytes:
    return b"".join(encode_frame(CODEC.encode(m)) for m in messages)


def decoded(data: bytes) -> list[Message]:
    return [CODEC.decode(p) for p in frames_of(data)]


class FakeClient:
    """A hand-driven client in front of a real `ServerConnection`."""

    def __init__(self, heartbeat: Heartbeat | None = None, limits: ProtocolLimits | None = None):
        self.server = ServerConnection(limits)
        self.now = 0.0
        self.server.receive_data(frame(Hello(v=1, ack=0, heartbeat=heartbeat)), self.now)
        list(self.server.events())
        self.session = self.server.welcome(None)
        (self.welcome,) = decoded(self.server.data_to_send(self.now))
        self.events: list[object] = []

    def send(self, *messages: Message) -> None:
        self.server.receive_data(frame(*messages), self.now)
        self.events.extend(self.server.events())

    def run_until(self, t: float) -> list[Message]:
        """Run the server's timers up to `t`; return what it wrote."""
        out: list[Message] = []
        while (deadline := self.server.next_deadline()) is not None and deadline <= t:
            self.now = deadline
            self.server.handle_timers(self.now)
            self.events.extend(self.server.events())
            out += decoded(self.server.data_to_send(self.now))
        self.now = t
        return out

    def pongs_for(self, pings: list[Message], tiers: set[str]) -> None:
        for ping in pings:
            if isinstance(ping, Ping) and ping.tier in tiers:
                self.send(Pong(tier=ping.tier, nonce=ping.nonce, stream=ping.stream))


# -- negotiation -------------------------------------------------------------------------------


def test_10_defaults_are_30_15_8() -> None:
    welcome = FakeClient().welcome
    assert isinstance(welcome, Welcome)
    assert welcome.heartbeat == Heartbeat(connection=30.0, session=15.0, stream=8.0)


def test_10_requested_intervals_are_clamped_to_the_servers_ranges() -> None:
    welcome = FakeClient(Heartbeat(connection=100, session=50, stream=1)).welcome
    assert welcome.heartbeat == Heartbeat(connection=45.0, session=20.0, stream=3.0)  # type: ignore[union-attr]
    welcome = FakeClient(Heartbeat(connection=26, session=11, stream=4)).welcome
    assert welcome.heartbeat == Heartbeat(connection=26.0, session=11.0, stream=4.0)  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "requested",
    [Heartbeat(connection=30, session=15, stream=16), Heartbeat(connection=30, session=31,
                                                                  stream=8)],
)
def test_10_out_of_order_tiers_are_invalid_heartbeat(requested: Heartbeat) -> None:
    server = ServerConnection()
    with pytest.raises(RemoteProtocolError) as info:
        server.receive_data(frame(Hello(v=1, ack=0, heartbeat=requested)), 0.0)
    assert info.value.code == ErrorCode.INVALID_HEARTBEAT
    assert info.value.close_code == 1002


def test_10_clamping_keeps_the_order_with_overlapping_ranges() -> None:
    limits = ProtocolLimits(
        heartbeat_min=HeartbeatIntervals(connection=5, session=5, stream=5),
        heartbeat_max=HeartbeatIntervals(connection=10, session=60, stream=60),
    )
    got = negotiate(Heartbeat(connection=50, session=40, stream=30), limits)
    assert got == HeartbeatIntervals(connection=10, session=10, stream=10)


def test_10_client_adopts_the_welcome_intervals() -> None:
    pair = ConnectionPair(hello={"heartbeat": HeartbeatIntervals(40, 12, 5)})
    pair.pump()
    assert pair.client_events[0].heartbeat == HeartbeatIntervals(40, 12, 5)  # type: ignore[attr-defined]


# -- pings and pongs ---------------------------------------------------------------------------


def test_10_each_tier_pings_when_its_interval_passes() -> None:
    fake = FakeClient()
    fake.now = 1.0
    fake.send(Open(seq=0, stream=1, prompt="x"))
    out = fake.run_until(30.0)
    pings = [(m.tier, m.stream) for m in out if isinstance(m, Ping)]
    assert ("stream", 1) in pings and ("session", None) in pings and ("connection", None) in pings


def test_10_ping_times_are_exact() -> None:
    fake = FakeClient()
    fake.now = 1.0
    fake.send(Open(seq=0, stream=1, prompt="x"))
    times: dict[tuple[str, int | None], float] = {}
    while (deadline := fake.server.next_deadline()) is not None and deadline <= 30.0:
        fake.now = deadline
        fake.server.handle_timers(deadline)
        for m in decoded(fake.server.data_to_send(deadline)):
            if isinstance(m, Ping):
                times.setdefault((m.tier, m.stream), deadline)
                fake.send(Pong(tier=m.tier, nonce=m.nonce, stream=m.stream))
    assert times[("stream", 1)] == pytest.approx(9.0)
    assert times[("session", None)] == pytest.approx(15.0)


def test_10_connection_pings_are_answered_at_once() -> None:
    pair = ConnectionPair()
    pair.pump()
    pair.client.receive_data(frame(Ping(tier="connection", nonce=42)), 1.0)
    assert decoded(pair.client.data_to_send(1.0)) == [Pong(tier="connection", nonce=42)]


def test_10_session_and_stream_pings_are_answered_when_the_application_takes_events() -> None:
    pair = ConnectionPair()
    pair.pump()
    stream = pair.client.open_stream(prompt="x", credit=7)
    pair.pump()
    pair.client.receive_data(
        frame(Ping(tier="session", nonce=1), Ping(tier="stream", nonce=2, stream=stream)), 1.0
    )
    assert decoded(pair.client.data_to_send(1.0)) == []  # nobody pulled the events yet
    assert list(pair.client.events()) == []
    assert decoded(pair.client.data_to_send(1.0)) == [
        Pong(tier="session", nonce=1),
        Pong(tier="stream", nonce=2, stream=stream),
        Credit(stream=stream, limit=7),  # §9: the credit is repeated with the stream pong
    ]


def test_10_pong_round_trips_feed_the_rto() -> None:
    fake = FakeClient()
    out = fake.run_until(15.0)  # the session ping goes out with a connection-tier probe
    (ping,) = [m for m in out if isinstance(m, Ping) and m.tier == "connection"]
    fake.now = 15.5
    fake.send(Pong(tier="connection", nonce=ping.nonce))
    assert fake.session.send.timer.srtt == pytest.approx(0.5)


def test_10_a_pong_nobody_asked_for_is_ignored() -> None:
    fake = FakeClient()
    fake.send(Pong(tier="session", nonce=999))
    assert fake.server.state is ConnectionState.OPEN


# -- expiry ------------------------------------------------------------------------------------


def test_10_connection_tier_expires_exactly_after_its_interval() -> None:
    fake = FakeClient()
    out = fake.run_until(59.999)
    assert any(isinstance(m, Ping) and m.tier == "connection" for m in out)
    assert not [e for e in fake.events if isinstance(e, ConnectionTimedOut)]
    fake.run_until(60.0)
    assert [e for e in fake.events if isinstance(e, ConnectionTimedOut)] == [ConnectionTimedOut()]


def test_10_connection_timeout_keeps_the_session_resumable() -> None:
    fake = FakeClient()
    fake.send(Open(seq=0, stream=1, prompt="x"))
    fake.run_until(60.0)
    assert fake.server.state is ConnectionState.CLOSED
    assert not fake.session.discarded
    assert fake.session.detached_at == 60.0
    assert fake.session.open_streams() == (1,)
    assert not fake.session.expired(90.0) and fake.session.expired(90.001)
    assert not [e for e in fake.events if isinstance(e, (SessionTimedOut, StreamTimedOut))]


def test_10_dead_transport_is_a_connection_timeout_not_a_session_timeout() -> None:
    fake = FakeClient()
    fake.send(Open(seq=0, stream=1, prompt="x"))
    fake.run_until(100.0)  # nothing ever answers
    kinds = {type(e) for e in fake.events}
    assert ConnectionTimedOut in kinds
    assert SessionTimedOut not in kinds and StreamTimedOut not in kinds


def test_10_session_tier_expires_exactly_and_ends_every_stream() -> None:
    fake = FakeClient()
    fake.send(Open(seq=0, stream=1, prompt="x"), Open(seq=1, stream=2, prompt="y"))
    t = 0.0
    while t < 30.0:  # the transport answers, the application does not
        nxt = min(fake.server.next_deadline() or 31.0, 30.0)
        out = fake.run_until(nxt)
        fake.pongs_for(out, {"connection", "stream"})
        t = nxt
        timed_out = [e for e in fake.events if isinstance(e, SessionTimedOut)]
        if t < 30.0:
            assert timed_out == []
    assert [e for e in fake.events if isinstance(e, SessionTimedOut)] == [
        SessionTimedOut(streams=(1, 2))
    ]
    assert fake.server.state is ConnectionState.OPEN  # only the streams end


def test_10_stream_tier_expires_exactly_and_ends_that_stream() -> None:
    fake = FakeClient()
    fake.now = 2.0
    fake.send(Open(seq=0, stream=1, prompt="x"), Open(seq=1, stream=2, prompt="y"))
    answered_stream = 2
    while fake.now < 18.0:
        nxt = min(fake.server.next_deadline() or 18.0, 18.0)
        out = fake.run_until(nxt)
        for m in out:
            if isinstance(m, Ping) and (m.tier != "stream" or m.stream == answered_stream):
                fake.send(Pong(tier=m.tier, nonce=m.nonce, stream=m.stream))
        if fake.now < 18.0:
            assert not [e for e in fake.events if isinstance(e, StreamTimedOut)]
    assert [e for e in fake.events if isinstance(e, StreamTimedOut)] == [StreamTimedOut(stream=1)]
    assert not [e for e in fake.events if isinstance(e, SessionTimedOut)]


def test_10_stream_timer_stops_when_the_stream_ends() -> None:
    pair = ConnectionPair()
    pair.pump()
    stream = pair.client.open_stream(prompt="x")
    pair.pump()
    assert pair.server._heartbeat is not None
    assert pair.server._heartbeat.outstanding(("stream", stream)) is None
    pair.server.end_stream(stream, "stop", Usage())
    assert ("stream", stream) not in pair.server._heartbeat._timers


def test_10_client_stream_timeout_cancels_the_stream() -> None:
    client = ClientConnection()
    client.send_hello()
    client.data_to_send(0.0)
    client.receive_data(
        frame(Welcome(v=1, session="s", resumed=False, ack=0, window=8,
                      heartbeat=Heartbeat(30, 15, 8), max_frame=1 << 20, max_streams=4,
                      resume_grace=30)),
        0.0,
    )
    list(client.events())
    stream = client.open_stream(prompt="x")
    client.data_to_send(0.0)
    client.receive_data(frame(Accept(seq=0, stream=stream, token_quota=9, batch_size=1)), 0.5)
    list(client.events())
    pings = {}
    now = 0.0
    while now < 16.0:
        now = client.next_deadline() or 16.0
        client.handle_timers(now)
        for m in decoded(client.data_to_send(now)):
            if isinstance(m, Ping):
                pings[(m.tier, m.stream)] = m
                if m.tier == "connection":  # the transport works; the stream never answers
                    client.receive_data(frame(Pong(tier="connection", nonce=m.nonce)), now)
            if isinstance(m, Cancel):
                assert m.stream == stream
                assert now == pytest.approx(16.0)
    events = list(client.events())
    assert StreamTimedOut(stream=stream) in events
    assert client.state is ConnectionState.OPEN


def test_10_client_session_timeout_cancels_every_stream() -> None:
    pair = ConnectionPair()
    pair.pump()
    a = pair.client.open_stream(prompt="a")
    b = pair.client.open_stream(prompt="b")
    pair.pump()
    # the server's transport answers, its application never pulls events again
    t = pair.now
    while t < 40.0:
        t = min(pair.client.next_deadline() or 40.0, 40.0)
        pair.client.handle_timers(t)
        data = pair.client.data_to_send(t)
        if data:
            pair.server.receive_data(data, t)  # events are not drained
            reply = pair.server.data_to_send(t)
            if reply:
                pair.client.receive_data(reply, t)
        pair.client_events.extend(pair.client.events())
    (timeout,) = [e for e in pair.client_events if isinstance(e, SessionTimedOut)]
    assert timeout.streams == (a, b)
    assert pair.server._events  # the server application really was asleep
    assert not [e for e in pair.server_events if isinstance(e, StreamOpened) and e.open.stream > b]
