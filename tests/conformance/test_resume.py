"""docs/protocol.md §11 Sessions and resume: a new connection attaches to the session
mid-stream in both directions, losing and duplicating nothing; expiry; misuse."""

from __future__ import annotations

import pytest

from seedance.protocol import (
    ClientConnection,
    ConnectionState,
    CreditGranted,
    DeltaReceived,
    ErrorCode,
    HeartbeatIntervals,
    Hello,
    LocalProtocolError,
    PayloadCodec,
    ProtocolLimits,
    RemoteProtocolError,
    ServerConnection,
    SessionState,
    StreamCancelled,
    StreamEnded,
    StreamOpened,
    Usage,
    Welcomed,
    encode_frame,
)
from seedance.protocol.messages import Credit, Message

from .pair import ConnectionPair, frames_of

CODEC = PayloadCodec("msgpack")
QUIET = HeartbeatIntervals(connection=5e4, session=5e4, stream=5e4)
LIMITS = ProtocolLimits(window=8, heartbeat=QUIET)


def decoded(data: bytes) -> list[Message]:
    return [CODEC.decode(p) for p in frames_of(data)]


def deltas(pair: ConnectionPair) -> list[int]:
    return [e.index for e in pair.client_events if isinstance(e, DeltaReceived)]


def streaming(credit: int | None = None) -> tuple[ConnectionPair, int]:
    pair = ConnectionPair(LIMITS)
    pair.pump()
    stream = pair.client.open_stream(prompt="story", credit=credit)
    pair.pump()
    pair.server.accept_stream(stream, 1000, 1)
    pair.pump()
    pair.advance(0.1)
    return pair, stream


def break_transport(pair: ConnectionPair) -> None:
    """Both ends lose the transport; whatever was in flight is gone."""
    pair.client.data_to_send(pair.now)
    pair.server.data_to_send(pair.now)
    pair.client.transport_closed(pair.now)
    pair.server.transport_closed(pair.now)


def resume(pair: ConnectionPair, after: float = 1.0) -> ConnectionPair:
    assert pair.client.session is not None
    new = ConnectionPair(
        LIMITS, now=pair.now + after, client_session=pair.client.session, sessions=pair.sessions
    )
    new.client_events = pair.client_events
    new.server_events = pair.server_events
    new.pump()
    new.advance(0.1)
    return new


def test_11_resume_mid_stream_server_to_client_loses_and_duplicates_nothing() -> None:
    pair, stream = streaming()
    for i in range(3):
        pair.server.send_delta(stream, f"{i}", (i,))
    pair.to_client()  # 0..2 arrive; their ack is delayed and will be lost
    for i in range(3, 6):
        pair.server.send_delta(stream, f"{i}", (i,))
    break_transport(pair)  # 3..5 are lost on the wire, the ack for 0..2 too
    session = pair.server.session
    assert session is not None
    for i in range(6, 8):  # detached: the engine keeps generating into the window
        assert session.can_send_delta(stream)
        session.send_delta(stream, f"{i}", (i,))
    pair = resume(pair)
    (welcome,) = [e for e in pair.client_events if isinstance(e, Welcomed) and e.resumed]
    assert welcome.session_id == session.id
    pair.server.end_stream(stream, "stop", Usage(1, 8))
    pair.pump()
    assert deltas(pair) == list(range(8))
    assert pair.of("client", StreamEnded)[-1].reason == "stop"


def test_11_resume_mid_stream_client_to_server_loses_and_duplicates_nothing() -> None:
    pair, stream = streaming()
    second = pair.client.open_stream(prompt="lost on the wire")
    pair.client.cancel_stream(stream)
    break_transport(pair)
    assert pair.client.session is not None
    third = pair.client.session.open_stream(prompt="made while detached")
    pair = resume(pair)
    opened = [e.open.stream for e in pair.server_events if isinstance(e, StreamOpened)]
    assert opened == [stream, second, third]
    assert pair.of("server", StreamCancelled) == [StreamCancelled(stream=stream)]


def test_11_resume_retransmits_only_from_the_peers_ack() -> None:
    pair, stream = streaming()
    for i in range(4):
        pair.server.send_delta(stream, f"{i}", (i,))
    pair.to_client()
    pair.advance(0.1)  # acked: the server forgets them
    for i in range(4, 6):
        pair.server.send_delta(stream, f"{i}", (i,))
    pair.to_client()  # received, ack lost
    break_transport(pair)
    assert pair.client.session is not None and pair.client.session.recv.ack == 7
    new = ConnectionPair(LIMITS, now=pair.now + 1, client_session=pair.client.session,
                         sessions=pair.sessions)
    new.to_server()
    resent = [m for m in decoded(new.server.data_to_send(new.now)) if hasattr(m, "seq")]
    assert resent == []  # the client's hello.ack=7 acknowledged 5..6: nothing is resent
    assert deltas(pair) == list(range(6))


def test_11_session_state_after_resume_is_the_same_object() -> None:
    pair, _stream = streaming()
    server_session = pair.server.session
    break_transport(pair)
    pair = resume(pair)
    assert pair.server.session is server_session
    assert pair.server.state is ConnectionState.OPEN


def test_11_client_resends_every_open_streams_credit_after_resume() -> None:
    pair, stream = streaming(credit=4)
    pair.client.grant_credit(stream, 9)  # lost with the transport
    break_transport(pair)
    pair = resume(pair)
    assert pair.of("server", CreditGranted) == [CreditGranted(stream=stream, limit=9)]


def test_11_resume_hello_carries_session_and_ack() -> None:
    pair, stream = streaming()
    pair.server.send_delta(stream, "x", (1,))
    pair.to_client()
    break_transport(pair)
    client = ClientConnection(LIMITS, session=pair.client.session)
    client.send_hello()
    (hello,) = decoded(client.data_to_send(0.0))
    assert isinstance(hello, Hello)
    assert hello.session == pair.client.session.id  # type: ignore[union-attr]
    assert hello.ack == 2  # accept (seq 0) and the delta (seq 1) arrived


def test_11_expired_session_gets_a_new_one_and_reports_lost_streams() -> None:
    pair, stream = streaming()
    break_transport(pair)
    old_id = pair.client.session.id  # type: ignore[union-attr]
    pair = resume(pair, after=LIMITS.resume_grace + 0.5)
    welcomed = [e for e in pair.client_events if isinstance(e, Welcomed)][-1]
    assert not welcomed.resumed and welcomed.session_id != old_id
    assert welcomed.lost_streams == (stream,)
    assert pair.client.session is not None and pair.client.session.id == welcomed.session_id
    assert pair.client.open_stream(prompt="fresh") == 1


def test_11_unknown_session_gets_resumed_false() -> None:
    client_session = SessionState("client", LIMITS, "no-such-session")
    pair = ConnectionPair(LIMITS, client_session=client_session)
    pair.pump()
    (welcomed,) = pair.of("client", Welcomed)
    assert not welcomed.resumed and welcomed.session_id != "no-such-session"


def test_11_session_outlives_its_connection_for_resume_grace() -> None:
    pair, _ = streaming()
    break_transport(pair)
    session = pair.server.session
    assert session is not None and session.detached_at == pair.now
    assert not session.expired(pair.now + 30.0)
    assert session.expired(pair.now + 30.001)


def test_11_detached_session_fills_the_window_then_pauses() -> None:
    pair, stream = streaming()
    break_transport(pair)
    session = pair.server.session
    assert session is not None
    sent = 0
    while session.can_send_delta(stream):
        session.send_delta(stream, "x", (sent,))
        sent += 1
    assert sent == LIMITS.window  # the window bounds what waits for the client
    with pytest.raises(LocalProtocolError):
        session.send_delta(stream, "x", (sent,))
    pair = resume(pair)
    assert deltas(pair) == list(range(sent))


def test_11_resume_ack_beyond_what_was_sent_is_protocol_violation() -> None:
    pair, _stream = streaming()
    break_transport(pair)
    server = ServerConnection(LIMITS)
    session_id = pair.server.session.id  # type: ignore[union-attr]
    server.receive_data(encode_frame(CODEC.encode(Hello(v=1, ack=50, session=session_id))), 0.0)
    list(server.events())
    with pytest.raises(RemoteProtocolError) as info:
        server.welcome(pair.sessions[session_id])
    assert info.value.code == ErrorCode.PROTOCOL_VIOLATION


def test_11_a_session_closed_by_error_cannot_be_resumed() -> None:
    pair, _ = streaming()
    pair.server.send_error("internal", "boom")
    pair.to_client()
    session = pair.server.session
    assert session is not None and session.discarded and session.expired(pair.now)
    with pytest.raises(LocalProtocolError):
        ClientConnection(LIMITS, session=pair.client.session)
    server = ServerConnection(LIMITS)
    server.receive_data(encode_frame(CODEC.encode(Hello(v=1, ack=0, session=session.id))), 0.0)
    list(server.events())
    with pytest.raises(LocalProtocolError):
        server.welcome(session)


def test_11_resume_after_lossy_break_with_early_frames_held() -> None:
    pair, stream = streaming()
    for i in range(5):
        pair.server.send_delta(stream, f"{i}", (i,))
    data = pair.server.data_to_send(pair.now)
    frames = frames_of(data)
    # the client gets frames 0, 2 and 4 only (1 and 3 lost), then the transport dies
    pair.client.receive_data(b"".join(encode_frame(frames[i]) for i in (0, 2, 4)), pair.now)
    pair.drain_client()
    break_transport(pair)
    pair = resume(pair)
    pair.server.end_stream(stream, "stop", Usage())
    pair.pump()
    assert deltas(pair) == [0, 1, 2, 3, 4]


def test_11_credit_lost_with_the_transport_is_not_needed_twice() -> None:
    pair, _stream = streaming(credit=2)
    break_transport(pair)
    pair = resume(pair)
    sent = [m for m in decoded(pair.to_server()) if isinstance(m, Credit)]
    assert sent == []  # resent once during the handshake already, nothing more
