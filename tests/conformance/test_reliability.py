"""docs/protocol.md §5 Sequence numbers, §6 Receive window, §7 Acknowledgement and
§8 Retransmission, checked frame by frame with a fake clock."""

from __future__ import annotations

import pytest

from seedance.protocol import (
    Ack,
    ConnectionState,
    Delta,
    DeltaReceived,
    Error,
    ErrorCode,
    HeartbeatIntervals,
    LocalProtocolError,
    PayloadCodec,
    ProtocolLimits,
    RemoteProtocolError,
    RetransmitTimer,
    encode_frame,
)
from seedance.protocol.messages import Message, Open

from .pair import ConnectionPair, frames_of

CODEC = PayloadCodec("msgpack")


def frame(message: Message) -> bytes:
    return encode_frame(CODEC.encode(message))


def decoded(data: bytes) -> list[Message]:
    return [CODEC.decode(p) for p in frames_of(data)]


QUIET = HeartbeatIntervals(connection=10_000, session=10_000, stream=10_000)
"""Heartbeats far away, so long clock jumps test retransmission alone."""


def streaming_pair(limits: ProtocolLimits | None = None) -> tuple[ConnectionPair, int]:
    """A pair with one accepted stream; the server's next reliable seq is 1."""
    pair = ConnectionPair(limits or ProtocolLimits(heartbeat=QUIET))
    pair.pump()
    stream = pair.client.open_stream(prompt="Hi")
    pair.pump()
    pair.server.accept_stream(stream, 10_000, 1)
    pair.pump()
    pair.advance(0.1)  # delayed acks out: both sides have nothing unacked
    return pair, stream


def delta(seq: int, stream: int = 1, index: int | None = None) -> Delta:
    index = seq - 1 if index is None else index
    return Delta(seq=seq, stream=stream, index=index, text=f"t{index}", tokens=(index,))


def deltas_seen(pair: ConnectionPair) -> list[int]:
    return [e.index for e in pair.client_events if isinstance(e, DeltaReceived)]


def acks_in(data: bytes) -> list[Ack]:
    return [m for m in decoded(data) if isinstance(m, Ack)]


# -- §5 sequence numbers -----------------------------------------------------------------------


def test_5_seq_starts_at_zero_and_counts_reliable_messages_per_direction() -> None:
    pair = ConnectionPair()
    pair.pump()
    pair.client.open_stream(prompt="a")
    pair.client.open_stream(prompt="b")
    sent = decoded(pair.to_server())
    assert [m.seq for m in sent if isinstance(m, Open)] == [0, 1]
    pair.server.accept_stream(1, 10, 1)
    pair.server.send_delta(1, "x", (1,))
    pair.server.goaway("bye")  # control: not numbered
    pair.server.accept_stream(2, 10, 1)
    sent = decoded(pair.to_client())
    assert [getattr(m, "seq", None) for m in sent] == [0, 1, None, 2]


# -- §6 receive window -------------------------------------------------------------------------


def test_6_early_frames_are_held_and_delivered_in_order_once() -> None:
    pair, _stream = streaming_pair()
    pair.client.receive_data(frame(delta(3)) + frame(delta(2)), pair.now)
    pair.drain_client()
    assert deltas_seen(pair) == []
    assert pair.client.session is not None and pair.client.session.recv.held == 2
    pair.client.receive_data(frame(delta(1)), pair.now)
    pair.drain_client()
    assert deltas_seen(pair) == [0, 1, 2]


def test_6_duplicate_below_the_window_is_dropped_and_reacked() -> None:
    pair, _stream = streaming_pair()
    pair.client.receive_data(frame(delta(1)), pair.now)
    pair.client.data_to_send(pair.now)
    pair.client.receive_data(frame(delta(1)), pair.now)
    pair.drain_client()
    assert deltas_seen(pair) == [0]
    (ack,) = acks_in(pair.client.data_to_send(pair.now))
    assert ack.ack == 2


def test_6_duplicate_of_a_held_frame_is_dropped_and_reacked() -> None:
    pair, _stream = streaming_pair()
    pair.client.receive_data(frame(delta(3)), pair.now)
    pair.client.data_to_send(pair.now)
    pair.client.receive_data(frame(delta(3)), pair.now)
    (ack,) = acks_in(pair.client.data_to_send(pair.now))
    assert (ack.ack, ack.sack) == (1, ((3, 4),))
    pair.client.receive_data(frame(delta(1)) + frame(delta(2)), pair.now)
    pair.drain_client()
    assert deltas_seen(pair) == [0, 1, 2]


def test_6_frames_beyond_the_window_are_dropped() -> None:
    pair, _stream = streaming_pair(ProtocolLimits(window=8, heartbeat=QUIET))
    pair.client.receive_data(frame(delta(9 + 1)), pair.now)  # window is [1, 9)
    assert pair.client.session is not None
    assert pair.client.session.recv.held == 0
    assert pair.client.session.recv.dropped_beyond == 1
    (ack,) = acks_in(pair.client.data_to_send(pair.now))
    assert ack.ack == 1


def test_6_seq_far_beyond_the_window_is_protocol_violation() -> None:
    pair, _stream = streaming_pair(ProtocolLimits(window=8, heartbeat=QUIET))
    with pytest.raises(RemoteProtocolError) as info:
        pair.client.receive_data(frame(delta(1 + 16)), pair.now)
    assert info.value.code == ErrorCode.PROTOCOL_VIOLATION


# -- §7 acknowledgement ------------------------------------------------------------------------


def test_7_ack_after_every_16_frames() -> None:
    pair, _stream = streaming_pair()
    for seq in range(1, 16):
        pair.client.receive_data(frame(delta(seq)), pair.now)
        assert acks_in(pair.client.data_to_send(pair.now)) == []
    pair.client.receive_data(frame(delta(16)), pair.now)
    (ack,) = acks_in(pair.client.data_to_send(pair.now))
    assert ack.ack == 17


def test_7_ack_within_25ms_of_the_first_unacked_frame() -> None:
    pair, _stream = streaming_pair()
    t0 = pair.now
    pair.client.receive_data(frame(delta(1)), t0)
    pair.client.receive_data(frame(delta(2)), t0 + 0.010)
    assert acks_in(pair.client.data_to_send(t0 + 0.010)) == []
    assert pair.client.next_deadline() == pytest.approx(t0 + 0.025)
    pair.client.handle_timers(t0 + 0.0249)
    assert acks_in(pair.client.data_to_send(t0 + 0.0249)) == []
    pair.client.handle_timers(t0 + 0.025)
    (ack,) = acks_in(pair.client.data_to_send(t0 + 0.025))
    assert ack.ack == 3


def test_7_gap_acks_at_once_with_sack_ranges() -> None:
    pair, _stream = streaming_pair()
    pair.client.receive_data(frame(delta(1)) + frame(delta(3)) + frame(delta(4)), pair.now)
    pair.client.receive_data(frame(delta(6)), pair.now)
    acks = acks_in(pair.client.data_to_send(pair.now))
    assert acks[-1] == Ack(ack=2, sack=((3, 5), (6, 7)))


def test_7_at_most_16_sack_ranges_lowest_first() -> None:
    pair, _stream = streaming_pair()
    data = b"".join(frame(delta(seq)) for seq in range(3, 60, 2))
    pair.client.receive_data(data, pair.now)
    ack = acks_in(pair.client.data_to_send(pair.now))[-1]
    assert ack.ack == 1
    assert len(ack.sack) == 16
    assert ack.sack[0] == (3, 4) and ack.sack[-1] == (33, 34)


def test_7_stale_ack_is_ignored_acks_are_never_reneged() -> None:
    pair, stream = streaming_pair()
    for _ in range(5):
        pair.server.send_delta(stream, "x", (1,))
    pair.server.data_to_send(pair.now)
    pair.server.receive_data(frame(Ack(ack=6)), pair.now)
    pair.server.receive_data(frame(Ack(ack=3)), pair.now)  # reordered, older
    assert pair.server.session is not None and pair.server.session.send.acked == 6


def test_7_ack_of_an_unsent_frame_is_protocol_violation() -> None:
    pair, _stream = streaming_pair()
    with pytest.raises(RemoteProtocolError) as info:
        pair.server.receive_data(frame(Ack(ack=99)), pair.now)
    assert info.value.code == ErrorCode.PROTOCOL_VIOLATION


BAD_SACKS = {
    "empty": ((3, 3),),
    "at or below ack": ((0, 1),),
    "beyond the next seq": ((2, 99),),
    "overlapping": ((2, 4), (3, 5)),
    "descending": ((4, 5), (2, 3)),
    "repeated": ((3, 4), (3, 4)),
    "adjacent": ((2, 3), (3, 4)),
}


@pytest.mark.parametrize("sack", list(BAD_SACKS.values()), ids=list(BAD_SACKS))
def test_7_bad_sack_range_is_protocol_violation(sack: tuple[tuple[int, int], ...]) -> None:
    pair, stream = streaming_pair()
    for _ in range(5):
        pair.server.send_delta(stream, "x", (1,))
    pair.server.data_to_send(pair.now)
    with pytest.raises(RemoteProtocolError) as info:
        pair.server.receive_data(frame(Ack(ack=1, sack=sack)), pair.now)
    assert info.value.code == ErrorCode.PROTOCOL_VIOLATION
    assert pair.server.state is ConnectionState.CLOSED
    assert decoded(pair.server.data_to_send(pair.now)) == [
        Error(code="protocol_violation", message=info.value.message)
    ]
    assert pair.server.session is not None and pair.server.session.expired(pair.now)


def test_7_a_bad_sack_closes_only_the_connection_it_came_on() -> None:
    """§12: the offending connection is closed with `protocol_violation` and its session
    discarded; another connection pair, streaming meanwhile, is unaffected."""
    victim, victim_stream = streaming_pair()
    other, other_stream = streaming_pair()
    for i in range(3):
        victim.server.send_delta(victim_stream, "v", (i,))
        other.server.send_delta(other_stream, "o", (i,))
    victim.server.data_to_send(victim.now)
    other.to_client()
    with pytest.raises(RemoteProtocolError):
        victim.server.receive_data(frame(Ack(ack=1, sack=((2, 4), (3, 4)))), victim.now)
    assert victim.server.state is ConnectionState.CLOSED
    with pytest.raises(LocalProtocolError):
        victim.server.send_delta(victim_stream, "v", (9,))
    for i in range(3, 40):
        assert other.server.can_send_delta(other_stream)
        other.server.send_delta(other_stream, "o", (i,))
        other.pump()
    other.advance(0.1)
    assert deltas_seen(other) == list(range(40))
    session = other.server.session
    assert other.server.state is ConnectionState.OPEN and session is not None
    assert session.send.acked == session.send.next_seq  # every frame acknowledged


# -- §8 retransmission -------------------------------------------------------------------------


def sent_seqs(data: bytes) -> list[int]:
    return [m.seq for m in decoded(data) if isinstance(m, Delta)]


def sender(limits: ProtocolLimits | None = None, n: int = 5) -> tuple[ConnectionPair, int]:
    """A server with `n` deltas (seq 1..n) written at t=100 and nothing acked."""
    pair, stream = streaming_pair(limits)
    session = pair.server.session
    assert session is not None
    session.send.timer = RetransmitTimer(1.0, 0.2, 60.0)  # no RTT sample yet
    pair.now = 100.0
    for _ in range(n):
        pair.server.send_delta(stream, "x", (1,))
    assert sent_seqs(pair.server.data_to_send(pair.now)) == list(range(1, n + 1))
    return pair, stream


def expire(pair: ConnectionPair) -> list[int]:
    deadline = pair.server.session.send.deadline  # type: ignore[union-attr]
    assert deadline is not None
    pair.now = deadline
    pair.server.handle_timers(pair.now)
    return sent_seqs(pair.server.data_to_send(pair.now))


def test_8_initial_rto_is_one_second() -> None:
    pair, _ = sender()
    assert pair.server.session is not None
    assert pair.server.session.send.deadline == pytest.approx(101.0)


def test_8_timeout_retransmits_only_the_oldest_unacked_frame() -> None:
    pair, _ = sender()
    assert expire(pair) == [1]


def test_8_rto_doubles_on_each_consecutive_expiry_up_to_60s() -> None:
    pair, _ = sender()
    times = []
    for _ in range(9):
        start = pair.now
        assert expire(pair) == [1]
        times.append(round(pair.now - start, 6))
    assert times == [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 60.0, 60.0, 60.0]


def test_8_rto_resets_when_an_ack_makes_progress() -> None:
    pair, _ = sender()
    expire(pair)
    expire(pair)  # backoff x4 now
    pair.server.receive_data(frame(Ack(ack=2)), pair.now)
    session = pair.server.session
    assert session is not None
    assert session.send.timer.backoff == 0
    assert session.send.deadline == pytest.approx(pair.now + session.send.timer.rto)


def test_8_sacked_frames_are_never_retransmitted() -> None:
    pair, _ = sender()
    pair.server.receive_data(frame(Ack(ack=1, sack=((2, 6),))), pair.now)
    for _ in range(5):
        assert expire(pair) == [1]
    pair.server.receive_data(frame(Ack(ack=2, sack=((3, 6),))), pair.now)
    pair.server.receive_data(frame(Ack(ack=6)), pair.now)
    assert pair.server.session is not None and pair.server.session.send.deadline is None


def test_8_acked_frames_are_never_retransmitted() -> None:
    pair, _ = sender()
    pair.server.receive_data(frame(Ack(ack=4)), pair.now)
    assert expire(pair) == [4]


def test_8_rto_follows_rfc_6298_from_rtt_samples() -> None:
    pair, stream = streaming_pair()
    send = pair.server.session.send  # type: ignore[union-attr]
    send.timer = RetransmitTimer(1.0, 0.2, 60.0)
    t = 50.0
    for i, rtt in enumerate([0.4, 0.4, 0.8]):
        pair.server.send_delta(stream, "x", (1,))
        pair.server.data_to_send(t)
        pair.server.receive_data(frame(Ack(ack=i + 2)), t + rtt)
        t += 10
    srtt, rttvar = 0.4, 0.2
    rttvar, srtt = 0.75 * rttvar + 0.25 * abs(srtt - 0.4), 0.875 * srtt + 0.125 * 0.4
    rttvar, srtt = 0.75 * rttvar + 0.25 * abs(srtt - 0.8), 0.875 * srtt + 0.125 * 0.8
    assert send.timer.srtt == pytest.approx(srtt)
    assert send.timer.rto == pytest.approx(srtt + 4 * rttvar)


def test_8_rto_never_below_200ms() -> None:
    pair, stream = streaming_pair()
    pair.server.send_delta(stream, "x", (1,))
    pair.server.data_to_send(10.0)
    pair.server.receive_data(frame(Ack(ack=2)), 10.001)
    assert pair.server.session is not None
    assert pair.server.session.send.timer.rto == pytest.approx(0.2)


def test_8_retransmitted_frames_give_no_rtt_sample() -> None:
    pair, _ = sender(n=1)
    expire(pair)
    timer = pair.server.session.send.timer  # type: ignore[union-attr]
    pair.server.receive_data(frame(Ack(ack=2)), pair.now + 0.01)
    assert timer.srtt is None  # Karn: ambiguous sample ignored


def test_8_the_receiver_acks_a_retransmission_it_already_has() -> None:
    pair, stream = streaming_pair()
    pair.server.send_delta(stream, "x", (1,))
    pair.to_client()
    lost_ack = pair.client.data_to_send(pair.now)  # nothing yet (delayed)
    assert lost_ack == b""
    pair.advance(0.05)  # the delayed ack goes out and is received
    pair.now += 5
    pair.server.handle_timers(pair.now)
    assert pair.server.data_to_send(pair.now) == b""  # acked: no retransmission
