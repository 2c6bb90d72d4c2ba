"""docs/protocol.md §12 Errors, §13 Transports and §15 Versioning."""

from __future__ import annotations

import random

import pytest

from seedance.protocol import (
    CloseCode,
    ConnectionState,
    DeltaReceived,
    ErrorCode,
    Heartbeat,
    HeartbeatIntervals,
    Hello,
    LocalProtocolError,
    PayloadCodec,
    PeerError,
    ProtocolError,
    ProtocolLimits,
    RemoteProtocolError,
    ServerConnection,
    StreamEnded,
    StreamErrorCode,
    StreamOpened,
    Usage,
    close_code_for,
    encode_frame,
)
from seedance.protocol.messages import Error, Message, Welcome

from .pair import ConnectionPair, frames_of

CODEC = PayloadCodec("msgpack")


def frame(message: Message, codec: str = "msgpack") -> bytes:
    return encode_frame(PayloadCodec(codec).encode(message))  # type: ignore[arg-type]


def test_12_connection_error_codes() -> None:
    assert {c.value for c in ErrorCode} == {
        "corrupted_frame", "frame_too_large", "invalid_message", "unknown_type",
        "protocol_violation", "unsupported_version", "invalid_heartbeat", "unauthorized",
        "overloaded", "internal",
    }


def test_12_stream_error_codes() -> None:
    assert {c.value for c in StreamErrorCode} == {
        "invalid_request", "unknown_model", "context_length_exceeded", "rate_limited",
        "overloaded", "internal", "shutting_down",
    }


@pytest.mark.parametrize(
    ("code", "close"),
    [
        ("corrupted_frame", 1002), ("frame_too_large", 1009), ("invalid_message", 1002),
        ("unknown_type", 1002), ("protocol_violation", 1002), ("unsupported_version", 1002),
        ("invalid_heartbeat", 1002), ("unauthorized", 1008), ("overloaded", 1013),
        ("internal", 1011),
    ],
)
def test_13_each_error_code_has_its_websocket_close_code(code: str, close: int) -> None:
    assert close_code_for(code) == close
    assert RemoteProtocolError(code, "x").close_code == close


def test_13_close_codes() -> None:
    assert {c.name: c.value for c in CloseCode} == {
        "NORMAL": 1000, "GOING_AWAY": 1001, "PROTOCOL_ERROR": 1002, "UNAUTHORIZED": 1008,
        "TOO_LARGE": 1009, "INTERNAL": 1011, "OVERLOADED": 1013,
    }


def test_12_errors_have_a_side() -> None:
    assert issubclass(LocalProtocolError, ProtocolError)
    assert issubclass(RemoteProtocolError, ProtocolError)
    assert not issubclass(LocalProtocolError, RemoteProtocolError)


def test_12_unauthorized_is_sent_by_the_application() -> None:
    server = ServerConnection()
    server.receive_data(frame(Hello(v=1, ack=0, api_key="wrong")), 0.0)
    list(server.events())
    server.send_error("unauthorized", "bad api key")
    (error,) = [CODEC.decode(p) for p in frames_of(server.data_to_send(0.0))]
    assert error == Error(code="unauthorized", message="bad api key")
    assert server.state is ConnectionState.CLOSED
    assert close_code_for("unauthorized") == 1008


def test_12_peer_error_event_carries_the_close_code() -> None:
    pair = ConnectionPair()
    pair.pump()
    pair.client.receive_data(frame(Error(code="internal", message="oops")), 0.0)
    assert list(pair.client.events()) == [PeerError("internal", "oops", 1011)]
    assert pair.client.state is ConnectionState.CLOSED


def test_12_a_stream_error_never_closes_the_connection() -> None:
    pair = ConnectionPair()
    pair.pump()
    for code in StreamErrorCode:
        stream = pair.client.open_stream(prompt="x")
        pair.pump()
        from seedance.protocol import StreamError

        pair.server.end_stream(stream, "error", Usage(), StreamError(code=code.value))
        pair.pump()
    assert len(pair.of("client", StreamEnded)) == len(StreamErrorCode)
    assert pair.client.state is pair.server.state is ConnectionState.OPEN


def test_12_local_misuse_leaves_the_connection_usable() -> None:
    pair = ConnectionPair()
    pair.pump()
    with pytest.raises(LocalProtocolError):
        pair.server.send_delta(5, "x", ())
    with pytest.raises(LocalProtocolError):
        pair.server.welcome(None)
    with pytest.raises(LocalProtocolError):
        pair.client.send_hello()
    assert pair.server.state is ConnectionState.OPEN
    pair.client.open_stream(prompt="still fine")
    pair.pump()
    assert pair.of("server", StreamOpened)


def test_15_unsupported_version_in_hello() -> None:
    server = ServerConnection()
    with pytest.raises(RemoteProtocolError) as info:
        server.receive_data(frame(Hello(v=2, ack=0)), 0.0)
    assert info.value.code == ErrorCode.UNSUPPORTED_VERSION


def test_15_unsupported_version_in_welcome() -> None:
    pair = ConnectionPair()
    pair.client.data_to_send(0.0)
    welcome = Welcome(v=2, session="s", resumed=False, ack=0, window=4,
                      heartbeat=Heartbeat(30, 15, 8),
                      max_frame=1 << 20, max_streams=1, resume_grace=1)
    with pytest.raises(RemoteProtocolError) as info:
        pair.client.receive_data(frame(welcome), 0.0)
    assert info.value.code == ErrorCode.UNSUPPORTED_VERSION


# -- §13 transports ----------------------------------------------------------------------------


@pytest.mark.parametrize("codec", ["msgpack", "json"])
def test_13_both_subprotocols_stream_end_to_end(codec: str) -> None:
    pair = ConnectionPair(codec=codec)
    pair.pump()
    stream = pair.client.open_stream(prompt="héllo ✓")
    pair.pump()
    pair.server.accept_stream(stream, 10, 1)
    for i, text in enumerate(["ü", "ñ", "😀"]):
        pair.server.send_delta(stream, text, (i,))
    pair.server.end_stream(stream, "stop", Usage(1, 3))
    pair.pump()
    assert "".join(e.text for e in pair.client_events if isinstance(e, DeltaReceived)) == "üñ😀"
    assert pair.of("server", StreamOpened)[0].open.prompt == "héllo ✓"


def test_13_json_subprotocol_frames_carry_utf8_json() -> None:
    pair = ConnectionPair(codec="json")
    data = pair.client.data_to_send(0.0)
    assert frames_of(data)[0].startswith(b'{"t":"hello"')


@pytest.mark.parametrize("seed", range(5))
def test_13_websocket_messages_may_split_and_join_frames(seed: int) -> None:
    """The gateway feeds each binary message as is: messages cut frames anywhere."""
    rng = random.Random(seed)
    pair = ConnectionPair()
    pair.pump()
    stream = pair.client.open_stream(prompt="x")
    pair.pump()
    pair.server.accept_stream(stream, 100, 1)
    for i in range(40):
        pair.server.send_delta(stream, f"tok{i} ", (i,))
    data = pair.server.data_to_send(pair.now)
    at = 0
    while at < len(data):
        size = rng.choice([1, 3, 8, 9, 50, 200, 1000])
        pair.client.receive_data(data[at : at + size], pair.now)
        at += size
    pair.drain_client()
    assert [e.index for e in pair.client_events if isinstance(e, DeltaReceived)] == list(
        range(40)
    )


def test_13_limits_validate_in_one_place() -> None:
    with pytest.raises(ValueError, match="window"):
        ProtocolLimits(window=0)
    with pytest.raises(ValueError, match="heartbeat"):
        ProtocolLimits(heartbeat=HeartbeatIntervals(
            connection=5, session=10, stream=1))
