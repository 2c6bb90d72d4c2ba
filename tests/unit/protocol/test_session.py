"""seedance.protocol._session.SessionState and the stream transition table."""

from __future__ import annotations

import pytest

from seedance.protocol import (
    TRANSITIONS,
    LocalProtocolError,
    ProtocolLimits,
    SessionState,
    StreamState,
    Usage,
)
from seedance.protocol._stream_state import StreamRecord, next_state


def server_session(window: int = 4) -> SessionState:
    session = SessionState("server", ProtocolLimits(), "s")
    session.send.peer_window = window
    return session


def test_new_session_id_is_random() -> None:
    from seedance.protocol._session import new_session_id

    assert new_session_id() != new_session_id()
    assert len(new_session_id()) >= 20


def test_roles_are_enforced() -> None:
    client = SessionState("client", ProtocolLimits())
    with pytest.raises(LocalProtocolError):
        client.accept_stream(1, 1, 1)
    server = server_session()
    with pytest.raises(LocalProtocolError):
        server.open_stream(prompt="x")


def test_delta_needs_window_credit_and_state() -> None:
    session = server_session(window=2)
    session.streams[1] = StreamRecord(credit_limit=1)
    assert not session.can_send_delta(1)  # not accepted
    session.accept_stream(1, 10, 1)
    assert session.can_send_delta(1)
    session.send_delta(1, "a", [7])  # a list is accepted and stored as a tuple
    assert session.send.frame(1).tokens == (7,)  # type: ignore[union-attr]
    assert not session.can_send_delta(1)  # window (2) full and credit (1) used
    with pytest.raises(LocalProtocolError):
        session.send_delta(1, "b", (8,))


def test_end_closes_and_forgets_the_stream() -> None:
    session = server_session()
    session.streams[1] = StreamRecord(None)
    session.end_stream(1, "stop", Usage())
    assert session.open_streams() == ()
    with pytest.raises(LocalProtocolError):
        session.end_stream(1, "stop", Usage())


def test_cancel_twice_sends_once() -> None:
    session = SessionState("client", ProtocolLimits())
    stream = session.open_stream(prompt="x")
    assert session.cancel_stream(stream) == 1
    assert session.cancel_stream(stream) is None
    with pytest.raises(LocalProtocolError):
        session.cancel_stream(99)


def test_expiry() -> None:
    session = server_session()
    assert not session.expired(1e9)  # attached or never detached
    session.detached_at = 10.0
    assert not session.expired(40.0) and session.expired(40.5)
    assert session.expired(11.0, grace=0.5)
    session.discarded = True
    assert session.expired(10.0)


@pytest.mark.parametrize(("state", "event"), list(TRANSITIONS))
def test_next_state_follows_the_table(state: StreamState, event: str) -> None:
    assert next_state(state, event) is TRANSITIONS[(state, event)]  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("state", "event"),
    [(StreamState.OPENED, "delta"), (StreamState.ACCEPTED, "accept")],
)
def test_next_state_refuses_what_the_table_lacks(state: StreamState, event: str) -> None:
    assert next_state(state, event) is None  # type: ignore[arg-type]
