"""seedance.protocol._connection: API details of ClientConnection and ServerConnection."""

from __future__ import annotations

import pytest

from seedance.protocol import (
    ClientConnection,
    ConnectionState,
    HelloReceived,
    LocalProtocolError,
    ProtocolLimits,
    ServerConnection,
    Welcomed,
)


def handshake() -> tuple[ClientConnection, ServerConnection]:
    client, server = ClientConnection(), ServerConnection()
    client.send_hello()
    server.receive_data(client.data_to_send(0.0), 0.0)
    assert isinstance(server.next_event(), HelloReceived)
    server.welcome(None)
    client.receive_data(server.data_to_send(0.0), 0.0)
    assert isinstance(client.next_event(), Welcomed)
    return client, server


def test_initial_states() -> None:
    assert ClientConnection().state is ConnectionState.IDLE
    assert ServerConnection().state is ConnectionState.AWAIT_HELLO
    assert ServerConnection().next_deadline() is None
    assert ServerConnection().data_to_send(0.0) == b""
    assert ServerConnection().next_event() is None


def test_handshake_opens_and_arms_timers() -> None:
    client, server = handshake()
    assert client.state is server.state is ConnectionState.OPEN
    assert server.next_deadline() == 15.0  # the session tier pings first
    assert client.send_window_available == 256


def test_welcome_without_hello_is_misuse() -> None:
    with pytest.raises(LocalProtocolError):
        ServerConnection().welcome(None)


def test_welcome_refuses_an_attached_session() -> None:
    _client, server = handshake()
    other = ServerConnection()
    resume = ClientConnection(session=None)
    resume.send_hello()
    other.receive_data(resume.data_to_send(0.0), 0.0)
    list(other.events())
    with pytest.raises(LocalProtocolError, match="attached"):
        other.welcome(server.session)
    server.transport_closed(1.0)
    assert other.welcome(server.session) is server.session


def test_client_refuses_to_resume_an_attached_session() -> None:
    client, _ = handshake()
    with pytest.raises(LocalProtocolError):
        ClientConnection(session=client.session)
    client.transport_closed(2.0)
    assert ClientConnection(session=client.session).state is ConnectionState.IDLE


def test_transport_closed_detaches_once() -> None:
    _client, server = handshake()
    server.transport_closed(3.0)
    server.transport_closed(4.0)
    assert server.session is not None and server.session.detached_at == 3.0
    assert server.state is ConnectionState.CLOSED
    assert server.next_deadline() is None
    server.handle_timers(100.0)  # nothing to do, no error


def test_events_drains_and_next_event_returns_none() -> None:
    client, server = handshake()
    client.open_stream(prompt="a")
    client.open_stream(prompt="b")
    server.receive_data(client.data_to_send(0.0), 0.0)
    assert len(list(server.events())) == 2
    assert server.next_event() is None


def test_open_larger_than_the_servers_max_frame_is_refused_before_numbering() -> None:
    client, _ = handshake()
    client._peer_max_frame = 100
    with pytest.raises(LocalProtocolError, match="max_frame"):
        client.open_stream(prompt="x" * 200)
    assert client.session is not None and client.session.send.next_seq == 0


def test_codec_is_validated() -> None:
    with pytest.raises(ValueError):
        ServerConnection(codec="xml")  # type: ignore[arg-type]


def test_limits_are_shared_defaults() -> None:
    assert ServerConnection().limits == ProtocolLimits()


def stream_deltas(container: type) -> list[tuple[int, str]]:
    """Deltas of every size class (cached and packed headers) fed as `container`."""
    from seedance.protocol import DeltaReceived, StreamOpened

    client, server = handshake()
    stream = client.open_stream(prompt="x")
    server.receive_data(client.data_to_send(0.0), 0.0)
    assert isinstance(server.next_event(), StreamOpened)
    server.accept_stream(stream, token_quota=100, batch_size=1)
    texts = ["a", "b" * 300, "c"]  # the second payload is over SMALL_FRAME bytes
    for i, text in enumerate(texts):
        server.send_delta(stream, text, (i,))
    seen = []
    client.receive_data(container(server.data_to_send(0.0)), 0.0)  # accept + 3 deltas at once
    for event in client.events():
        if isinstance(event, DeltaReceived):
            seen.append((event.index, event.text))
    return seen


@pytest.mark.parametrize("container", [bytes, bytearray, memoryview])
def test_deltas_arrive_whatever_the_buffer_type_and_size(container: type) -> None:
    assert stream_deltas(container) == [(0, "a"), (1, "b" * 300), (2, "c")]


def test_one_frame_per_call_takes_the_same_path_for_every_size() -> None:
    from seedance.protocol import DeltaReceived, StreamOpened

    client, server = handshake()
    stream = client.open_stream(prompt="x")
    server.receive_data(client.data_to_send(0.0), 0.0)
    assert isinstance(server.next_event(), StreamOpened)
    server.accept_stream(stream, token_quota=100, batch_size=1)
    client.receive_data(server.data_to_send(0.0), 0.0)
    client.events()
    for i, text in enumerate(["a", "b" * 300]):
        server.send_delta(stream, text, (i,))
        client.receive_data(memoryview(server.data_to_send(0.0)), 0.0)
        (event,) = client.events()
        assert isinstance(event, DeltaReceived) and (event.index, event.text) == (i, text)
