"""seedance.protocol._receive_window.ReceiveWindow."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from seedance.protocol import ReceiveWindow, RemoteProtocolError


def test_in_order_frames_are_delivered_at_once() -> None:
    window: ReceiveWindow[str] = ReceiveWindow(4)
    assert window.receive(0, "a", 0.0) == ["a"]
    assert window.receive(1, "b", 0.0) == ["b"]
    assert window.ack == 2 and not window.immediate


def test_gap_holds_and_releases_in_order() -> None:
    window: ReceiveWindow[str] = ReceiveWindow(8)
    assert window.receive(2, "c", 0.0) == []
    assert window.receive(1, "b", 0.0) == []
    assert window.ack_ranges() == ((1, 3),)
    assert window.receive(0, "a", 0.0) == ["a", "b", "c"]
    assert window.held == 0 and window.ack == 3


def test_take_next_is_the_in_order_fast_path() -> None:
    window: ReceiveWindow[str] = ReceiveWindow(8)
    assert window.take_next(0, 1.0)
    assert window.deadline == pytest.approx(1.025)
    assert not window.take_next(5, 1.0)
    window.receive(3, "x", 1.0)
    assert not window.take_next(1, 1.0)  # something is held: use receive()


def test_delayed_ack_deadline_is_set_by_the_first_unacked_frame() -> None:
    window: ReceiveWindow[str] = ReceiveWindow(64, ack_delay=0.025)
    window.receive(0, "a", 1.0)
    window.receive(1, "b", 1.02)
    assert window.deadline == pytest.approx(1.025)
    assert not window.ack_due(1.024) and window.ack_due(1.025)
    window.acked()
    assert window.deadline is None


def test_ack_every_makes_an_ack_due_at_once() -> None:
    window: ReceiveWindow[int] = ReceiveWindow(64, ack_every=3)
    for seq in range(2):
        window.receive(seq, seq, 0.0)
    assert not window.immediate
    window.receive(2, 2, 0.0)
    assert window.immediate


def test_sack_ranges_are_capped_at_16() -> None:
    window: ReceiveWindow[int] = ReceiveWindow(1000)
    for seq in range(1, 100, 2):
        window.receive(seq, seq, 0.0)
    ranges = window.ack_ranges()
    assert len(ranges) == 16
    assert ranges[0] == (1, 2) and all(b - a == 1 for a, b in ranges)


def test_far_beyond_the_window_raises() -> None:
    window: ReceiveWindow[int] = ReceiveWindow(4)
    assert window.receive(5, 5, 0.0) == []
    assert window.dropped_beyond == 1
    with pytest.raises(RemoteProtocolError):
        window.receive(8, 8, 0.0)


@given(st.permutations(list(range(20))), st.lists(st.integers(0, 19), max_size=10))
def test_any_arrival_order_with_duplicates_delivers_each_once_in_order(
    order: list[int], dups: list[int]
) -> None:
    window: ReceiveWindow[int] = ReceiveWindow(32)
    delivered: list[int] = []
    for seq in order + dups:
        delivered += window.receive(seq, seq, 0.0)
    assert delivered == list(range(20))
