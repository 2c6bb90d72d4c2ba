"""docs/protocol.md §9 Flow control: per-stream token credit, the session-wide frame window,
and control messages flowing while both are closed."""

from __future__ import annotations

import pytest

from seedance.protocol import (
    Ack,
    CreditGranted,
    DeltaReceived,
    ErrorCode,
    HeartbeatIntervals,
    LocalProtocolError,
    PayloadCodec,
    ProtocolLimits,
    RemoteProtocolError,
    SendWindowOpened,
    StreamCancelled,
    StreamEnded,
    Usage,
    encode_frame,
)
from seedance.protocol.messages import Credit, Delta, Message, Ping, Pong

from .pair import ConnectionPair, frames_of

CODEC = PayloadCodec("msgpack")
QUIET = HeartbeatIntervals(connection=5e4, session=5e4, stream=5e4)


def frame(message: Message) -> bytes:
    return encode_frame(CODEC.encode(message))


def decoded(data: bytes) -> list[Message]:
    return [CODEC.decode(p) for p in frames_of(data)]


def accepted(credit: int | None = None, window: int = 256) -> tuple[ConnectionPair, int]:
    pair = ConnectionPair(ProtocolLimits(window=window, heartbeat=QUIET))
    pair.pump()
    stream = pair.client.open_stream(prompt="Hi", credit=credit)
    pair.pump()
    pair.server.accept_stream(stream, 100, 1)
    pair.pump()
    pair.advance(0.1)
    return pair, stream


# -- token credit ------------------------------------------------------------------------------


def test_9_credit_pauses_the_stream_at_its_limit() -> None:
    pair, stream = accepted(credit=3)
    for i in range(3):
        assert pair.server.can_send_delta(stream)
        pair.server.send_delta(stream, "x", (i,))
    assert not pair.server.can_send_delta(stream)
    with pytest.raises(LocalProtocolError, match="credit"):
        pair.server.send_delta(stream, "x", (3,))
    assert pair.server.can_send_delta(stream, 0)  # text held back, no tokens: allowed


def test_9_credit_counts_tokens_not_frames() -> None:
    pair, stream = accepted(credit=4)
    assert pair.server.can_send_delta(stream, 4)
    assert not pair.server.can_send_delta(stream, 5)
    pair.server.send_delta(stream, "abc", (1, 2, 3))
    assert not pair.server.can_send_delta(stream, 2)


def test_9_credit_resumes_the_stream_with_an_event() -> None:
    pair, stream = accepted(credit=2)
    pair.server.send_delta(stream, "a", (1,))
    pair.server.send_delta(stream, "b", (2,))
    pair.pump()
    pair.client.grant_credit(stream, 5)
    pair.pump()
    assert pair.of("server", CreditGranted) == [CreditGranted(stream=stream, limit=5)]
    assert pair.server.can_send_delta(stream, 3)


def test_9_smaller_credit_is_ignored() -> None:
    pair, stream = accepted(credit=5)
    pair.server.receive_data(frame(Credit(stream=stream, limit=3)), pair.now)
    pair.drain_server()
    assert pair.of("server", CreditGranted) == []
    assert pair.server.can_send_delta(stream, 5)
    pair.client.grant_credit(stream, 2)  # smaller: nothing is sent
    assert pair.client.data_to_send(pair.now) == b""


def test_9_credit_is_absolute_so_repeats_are_harmless() -> None:
    pair, stream = accepted(credit=1)
    for _ in range(3):
        pair.server.receive_data(frame(Credit(stream=stream, limit=4)), pair.now)
    pair.drain_server()
    assert pair.of("server", CreditGranted) == [CreditGranted(stream=stream, limit=4)]


def test_9_absent_credit_means_unlimited() -> None:
    pair, stream = accepted(credit=None)
    assert pair.server.can_send_delta(stream, 10_000)
    with pytest.raises(LocalProtocolError):
        pair.client.grant_credit(stream, 5)


def test_9_delta_beyond_credit_is_protocol_violation_at_the_client() -> None:
    pair, stream = accepted(credit=1)
    data = frame(Delta(seq=1, stream=stream, index=0, text="ab", tokens=(1, 2)))
    with pytest.raises(RemoteProtocolError) as info:
        pair.client.receive_data(data, pair.now)
    assert info.value.code == ErrorCode.PROTOCOL_VIOLATION


def test_9_credit_for_an_ended_stream_is_ignored() -> None:
    pair, stream = accepted(credit=1)
    pair.server.end_stream(stream, "stop", Usage())
    pair.server.receive_data(frame(Credit(stream=stream, limit=9)), pair.now)
    pair.drain_server()
    assert pair.of("server", CreditGranted) == []


def test_9_credit_for_a_never_opened_stream_is_protocol_violation() -> None:
    pair, _ = accepted()
    with pytest.raises(RemoteProtocolError):
        pair.server.receive_data(frame(Credit(stream=77, limit=9)), pair.now)


# -- the frame window --------------------------------------------------------------------------


def test_9_full_window_blocks_the_sender() -> None:
    pair, stream = accepted(window=4)
    for i in range(4):
        pair.server.send_delta(stream, "x", (i,))
    assert pair.server.send_window_available == 0
    assert not pair.server.can_send_delta(stream)
    with pytest.raises(LocalProtocolError, match="window"):
        pair.server.send_delta(stream, "x", (9,))


def test_9_window_opens_again_with_an_event() -> None:
    pair, stream = accepted(window=4)
    for i in range(4):
        pair.server.send_delta(stream, "x", (i,))
    pair.to_client()
    pair.advance(0.05)  # the client's delayed ack
    assert pair.of("server", SendWindowOpened) == [SendWindowOpened(available=4)]
    assert pair.server.can_send_delta(stream)


def test_9_accept_and_end_wait_for_the_window_in_order() -> None:
    pair = ConnectionPair(ProtocolLimits(window=2, heartbeat=QUIET))
    pair.pump()
    a = pair.client.open_stream(prompt="a")
    b = pair.client.open_stream(prompt="b")
    pair.pump()
    pair.server.accept_stream(a, 10, 1)
    pair.server.send_delta(a, "x", (1,))
    pair.server.accept_stream(b, 10, 1)  # window full: queued, never refused
    pair.server.end_stream(a, "stop", Usage())
    assert not pair.server.can_send_delta(b)  # a frame is waiting: deltas wait behind it
    sent = decoded(pair.server.data_to_send(pair.now))
    assert [m.seq for m in sent if hasattr(m, "seq")] == [0, 1]
    pair.client.receive_data(b"".join(frame(m) for m in sent), pair.now)
    pair.advance(1.0)
    pair.pump()
    kinds = [type(e).__name__ for e in pair.client_events[1:] if type(e).__name__[:6] in
             ("Stream", "DeltaR")]
    assert kinds == ["StreamAccepted", "DeltaReceived", "StreamAccepted", "StreamEnded"]


def test_9_control_messages_flow_while_the_window_is_closed() -> None:
    pair, stream = accepted(window=2, credit=2)
    pair.server.send_delta(stream, "x", (1,))
    pair.server.send_delta(stream, "y", (2,))
    pair.server.data_to_send(pair.now)  # lost: nothing acks, the window stays shut
    assert not pair.server.can_send_delta(stream)
    pair.client.grant_credit(stream, 10)
    pair.client.receive_data(frame(Ping(tier="connection", nonce=5)), pair.now)
    pair.to_server()
    assert pair.of("server", CreditGranted) == [CreditGranted(stream=stream, limit=10)]
    assert decoded(pair.client.data_to_send(pair.now)) == []  # the pong went with to_server
    pair.server.receive_data(frame(Ping(tier="connection", nonce=6)), pair.now)
    pong = decoded(pair.server.data_to_send(pair.now))
    assert pong == [Pong(tier="connection", nonce=6)]
    pair.server.goaway("still works")
    assert decoded(pair.server.data_to_send(pair.now))[0].reason == "still works"  # type: ignore[union-attr]


def test_9_cancel_is_reliable_and_waits_for_the_clients_window() -> None:
    pair = ConnectionPair(ProtocolLimits(window=1, heartbeat=QUIET))
    pair.pump()
    a = pair.client.open_stream(prompt="a")
    b = pair.client.open_stream(prompt="b")
    pair.client.cancel_stream(a)
    sent = decoded(pair.client.data_to_send(pair.now))
    assert [type(m).__name__ for m in sent] == ["Open"]
    pair.server.receive_data(b"".join(frame(m) for m in sent), pair.now)
    pair.drain_server()
    pair.advance(1.0)
    pair.pump()
    assert pair.of("server", StreamCancelled) == [StreamCancelled(stream=a)]
    assert b == 2


def test_9_acks_flow_while_the_window_is_closed() -> None:
    pair, stream = accepted(window=1)
    pair.server.send_delta(stream, "x", (1,))
    assert not pair.server.can_send_delta(stream)
    pair.to_client()
    pair.advance(0.05)
    assert pair.server.can_send_delta(stream)
    assert [type(e) for e in pair.client_events if isinstance(e, DeltaReceived)] == [
        DeltaReceived
    ]


def test_9_ack_window_field_updates_the_peer_window() -> None:
    pair, stream = accepted(window=4)
    pair.server.receive_data(frame(Ack(ack=1, window=1)), pair.now)
    pair.server.send_delta(stream, "x", (1,))
    assert not pair.server.can_send_delta(stream)


def test_9_stream_ends_while_paused_for_credit() -> None:
    pair, stream = accepted(credit=0)
    assert not pair.server.can_send_delta(stream)
    pair.server.end_stream(stream, "length", Usage(3, 0))
    pair.pump()
    assert pair.of("client", StreamEnded)[0].reason == "length"
