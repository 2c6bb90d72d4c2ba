"""seedance.protocol._send_window: SendWindow and RetransmitTimer."""

from __future__ import annotations

import pytest

from seedance.protocol import ErrorCode, RemoteProtocolError, RetransmitTimer, SendWindow


def window(n: int = 0, peer_window: int = 8) -> SendWindow[str]:
    send: SendWindow[str] = SendWindow(RetransmitTimer(1.0, 0.2, 60.0), peer_window)
    for i in range(n):
        send.push(f"f{i}")
    return send


def write(send: SendWindow[str], upto: int, now: float) -> None:
    """The owner wrote frames below `upto` and handed them to the transport at `now`."""
    send.next_unsent = upto
    send.handed_over(now)


def test_push_numbers_from_zero() -> None:
    send = window()
    assert [send.push("a"), send.push("b")] == [0, 1]
    assert send.frame(1) == "b" and send.unacked == 2 and send.room == 6


def test_timer_starts_on_first_write() -> None:
    send = window(2)
    assert send.deadline is None
    write(send, 2, 5.0)
    assert send.deadline == 6.0


def test_cumulative_ack_forgets_frames_and_restarts_the_timer() -> None:
    send = window(3)
    write(send, 3, 0.0)
    assert send.on_ack(2, (), 0.5)
    assert send.acked == 2 and send.unacked == 1
    assert send.deadline == pytest.approx(0.5 + send.timer.rto)
    assert send.on_ack(3, (), 0.6)
    assert send.deadline is None


def test_stale_ack_changes_nothing() -> None:
    send = window(3)
    write(send, 3, 0.0)
    send.on_ack(2, (), 0.1)
    assert not send.on_ack(1, (), 0.2)
    assert send.acked == 2


def test_expire_picks_the_oldest_unsacked_and_backs_off() -> None:
    send = window(4)
    write(send, 4, 0.0)
    send.on_ack(0, ((1, 2),), 0.0)
    assert send.expire(1.0) == 0
    assert send.timer.rto == 2.0
    send.on_ack(1, (), 1.5)
    assert send.expire(3.0) == 2  # 1 was SACKed
    assert send.resend_from(1) == [2, 3]


def test_backoff_caps_at_rto_max() -> None:
    timer = RetransmitTimer(1.0, 0.2, 60.0)
    for _ in range(20):
        timer.back_off()
    assert timer.rto == 60.0
    timer.reset_backoff()
    assert timer.rto == 1.0


def test_rto_from_samples() -> None:
    timer = RetransmitTimer(1.0, 0.2, 60.0)
    timer.sample(0.1)
    assert timer.srtt == 0.1 and timer.rttvar == 0.05
    assert timer.rto == pytest.approx(0.3)
    timer.sample(100.0)
    assert timer.rto == 60.0


def test_ack_beyond_sent_raises() -> None:
    send = window(2)
    with pytest.raises(RemoteProtocolError):
        send.on_ack(3, (), 0.0)


def test_unwritten_frames_are_never_retransmitted() -> None:
    send = window(3)
    write(send, 1, 0.0)
    assert send.expire(1.0) == 0
    assert send.resend_from(0) == [0]
    assert send.resend_from(0) == [0]  # no side effect


def test_resent_frames_give_no_sample() -> None:
    send = window(2)
    write(send, 2, 0.0)
    for seq in send.resend_from(0):
        send.mark_retransmitted(seq)
    send.on_ack(2, (), 0.5)
    assert send.timer.srtt is None


def test_one_frame_is_timed_per_round_trip() -> None:
    send = window(3)
    write(send, 1, 0.0)
    write(send, 3, 0.5)  # frames 1, 2 are not timed: frame 0 is
    send.on_ack(3, (), 0.25)
    assert send.timer.srtt == 0.25


def test_retransmitted_timed_frame_gives_no_sample() -> None:
    send = window(1)
    write(send, 1, 0.0)
    assert send.expire(1.0) == 0
    send.on_ack(1, (), 1.1)
    assert send.timer.srtt is None


def test_retransmissions_count_timer_expiries_and_resume_rewrites() -> None:
    send = window(3)
    write(send, 3, 0.0)
    assert send.retransmissions == 0
    assert send.expire(1.0) == 0
    assert send.retransmissions == 1
    for seq in send.resend_from(1):
        send.mark_retransmitted(seq)
    assert send.retransmissions == 3


def test_end_follows_peer_window_and_acks() -> None:
    send = window(3, peer_window=4)
    assert send.end == 4 and send.room == 1
    send.peer_window = 6
    assert send.end == 6 and send.room == 3
    write(send, 3, 0.0)
    assert send.on_ack(2, (), 0.1)
    assert send.acked == 2 and send.end == 8 and send.room == 5


def test_partial_and_complete_acks_forget_exactly_the_acknowledged_frames() -> None:
    send = window(4)
    write(send, 4, 0.0)
    send.on_ack(1, (), 0.1)
    assert [seq for seq in range(4) if seq in send._entries] == [1, 2, 3]
    assert send.deadline is not None  # frames 1..3 still in flight
    send.on_ack(4, (), 0.2)  # everything: the window empties at once
    assert not send._entries and send.deadline is None and send.unacked == 0


def test_acked_is_read_only() -> None:
    send = window()
    with pytest.raises(AttributeError):
        send.acked = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    ("sack", "problem"),
    [
        (((3, 5), (4, 6)), "overlaps"),  # overlapping
        (((5, 6), (2, 3)), "overlaps"),  # descending
        (((2, 4), (2, 4)), "overlaps"),  # the same range twice
        (((2, 3), (3, 4)), "touches"),  # adjacent: one run of held frames, sent as two
        (((2, 2),), "empty"),
        (((4, 3),), "empty"),
        (((1, 3),), "at or below ack"),
        (((0, 1),), "at or below ack"),
        (((2, 9),), "beyond the next seq"),
    ],
)
def test_sack_ranges_must_ascend_apart_above_ack_and_within_sent(
    sack: tuple[tuple[int, int], ...], problem: str
) -> None:
    send = window(8)
    write(send, 8, 0.0)
    send.on_ack(1, ((3, 4),), 0.1)
    deadline = send.deadline
    with pytest.raises(RemoteProtocolError) as info:
        send.on_ack(1, sack, 0.2)
    assert info.value.code == ErrorCode.PROTOCOL_VIOLATION and problem in info.value.message
    # a refused ack changes nothing: no new SACKed frame, the same ack and timer
    assert [seq for seq in range(8) if send.is_sacked(seq)] == [3]
    assert send.acked == 1 and send.deadline == deadline


def test_ascending_sack_ranges_with_gaps_between_are_taken() -> None:
    send = window(8)
    write(send, 8, 0.0)
    assert send.on_ack(1, ((2, 4), (5, 6), (7, 8)), 0.1)
    assert [seq for seq in range(8) if send.is_sacked(seq)] == [2, 3, 5, 7]
    assert send.resend_from(1) == [1, 4, 6]  # the SACKed are never written again


def test_push_written_numbers_the_frame_and_counts_it_written() -> None:
    send = window(peer_window=8)
    assert send.push_written("a") == 0 and send.push_written("b") == 1
    assert send.next_seq == send.next_unsent == 2 and send.frame(1) == "b"
    assert send.handed == 0  # written, not yet handed to the transport
    send.handed_over(3.0)
    assert send.handed == 2 and send.in_flight == 2 and send.deadline == 4.0


def test_handed_over_times_one_frame_until_its_ack() -> None:
    send = window(peer_window=8)
    send.push_written("a")
    send.handed_over(0.0)  # frame 0 is timed
    send.push_written("b")
    send.handed_over(0.5)  # frame 0 still timed: 1 is only handed over
    assert send.handed == 2
    send.on_ack(1, (), 0.25)
    assert send.timer.srtt == 0.25  # the sample is frame 0's, sent at 0.0
