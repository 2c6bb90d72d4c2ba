"""docs/protocol.md §3 Messages and §4 Streams: the handshake, each message's effect, batches,
goaway, errors, and the stream state machine."""

from __future__ import annotations

import brotli
import pytest

from seedance.protocol import (
    TRANSITIONS,
    Accept,
    Ack,
    Batch,
    ChatMessage,
    ClientConnection,
    ConnectionState,
    Delta,
    DeltaReceived,
    End,
    ErrorCode,
    GoAway,
    GoAwayReceived,
    Hello,
    HelloReceived,
    LocalProtocolError,
    Open,
    PayloadCodec,
    PeerError,
    Ping,
    ProtocolLimits,
    RemoteProtocolError,
    SamplingOptions,
    ServerConnection,
    StreamAccepted,
    StreamCancelled,
    StreamEnded,
    StreamError,
    StreamOpened,
    StreamState,
    Usage,
    Welcome,
    Welcomed,
    encode_frame,
)
from seedance.protocol.messages import Cancel, Credit, Error, Message

from .pair import ConnectionPair, frames_of


def frame(message: Message, codec: str = "msgpack") -> bytes:
    buffer = bytearray()
    PayloadCodec(codec).encode_into(message, buffer, 0)  # type: ignore[arg-type]
    return encode_frame(bytes(buffer))


def decoded(data: bytes) -> list[Message]:
    codec = PayloadCodec("msgpack")
    return [codec.decode(p) for p in frames_of(data)]


def opened_pair(**open_kwargs: object) -> tuple[ConnectionPair, int]:
    pair = ConnectionPair()
    pair.pump()
    stream = pair.client.open_stream(prompt="Hi", **open_kwargs)  # type: ignore[arg-type]
    pair.pump()
    return pair, stream


# -- §3.1 handshake ----------------------------------------------------------------------------


def test_3_1_hello_then_welcome_opens_both_sides() -> None:
    pair = ConnectionPair(hello={"api_key": "k", "client": "test/1"})
    pair.pump()
    (hello,) = pair.of("server", HelloReceived)
    assert hello.hello == Hello(v=1, ack=0, window=256, api_key="k", client="test/1")
    (welcome,) = pair.of("client", Welcomed)
    assert not welcome.resumed and welcome.session_id
    assert welcome.max_frame == 1 << 20 and welcome.max_streams == 256
    assert welcome.resume_grace == 30.0 and welcome.window == 256
    assert pair.client.state is pair.server.state is ConnectionState.OPEN


def test_3_1_welcome_carries_every_field() -> None:
    server = ServerConnection(ProtocolLimits(max_streams=4, window=32, resume_grace=5))
    server.receive_data(frame(Hello(v=1, ack=0, window=64)), 0.0)
    list(server.events())
    session = server.welcome(None, session_id="abc")
    (welcome,) = decoded(server.data_to_send(0.0))
    assert welcome == Welcome(
        v=1, session="abc", resumed=False, ack=0, window=32,
        heartbeat=welcome.heartbeat, max_frame=1 << 20, max_streams=4, resume_grace=5.0,
    )
    assert session.send.peer_window == 64  # the client's hello.window bounds our sending


@pytest.mark.parametrize(
    "first",
    [Ack(ack=0), Credit(stream=1, limit=1), Open(seq=0, stream=1, prompt="x"),
     Ping(tier="connection", nonce=1)],
    ids=lambda m: type(m).__name__,
)
def test_3_1_anything_before_hello_is_protocol_violation(first: Message) -> None:
    server = ServerConnection()
    with pytest.raises(RemoteProtocolError) as info:
        server.receive_data(frame(first), 0.0)
    assert info.value.code == ErrorCode.PROTOCOL_VIOLATION


def test_3_1_second_hello_is_protocol_violation() -> None:
    pair = ConnectionPair()
    pair.pump()
    with pytest.raises(RemoteProtocolError) as info:
        pair.server.receive_data(frame(Hello(v=1, ack=0)), 0.0)
    assert info.value.code == ErrorCode.PROTOCOL_VIOLATION


def test_3_1_client_needs_welcome_first() -> None:
    client = ClientConnection()
    client.send_hello()
    with pytest.raises(RemoteProtocolError) as info:
        client.receive_data(frame(Ack(ack=0)), 0.0)
    assert info.value.code == ErrorCode.PROTOCOL_VIOLATION


def test_3_1_frames_pipelined_after_hello_wait_for_welcome() -> None:
    pair = ConnectionPair()
    stream = pair.client.open_stream(prompt="early")
    hello = pair.client.data_to_send(0.0)
    assert [type(m) for m in decoded(hello)] == [Hello]  # the open waits for the window
    pair.server.receive_data(hello, 0.0)
    pair.drain_server()
    pair.pump()
    assert [e.open.stream for e in pair.of("server", StreamOpened)] == [stream]


def test_3_1_pipelined_reliable_frames_are_parsed_after_welcome() -> None:
    server = ServerConnection()
    server.receive_data(
        frame(Hello(v=1, ack=0)) + frame(Open(seq=0, stream=1, prompt="p")), 0.0
    )
    assert [type(e) for e in server.events()] == [HelloReceived]
    server.welcome(None)
    assert [type(e) for e in server.events()] == [StreamOpened]


def test_3_1_messages_to_the_wrong_role_are_protocol_violation() -> None:
    pair = ConnectionPair()
    pair.pump()
    with pytest.raises(RemoteProtocolError) as info:
        pair.server.receive_data(
            frame(Delta(seq=0, stream=1, index=0, text="x", tokens=())), 0.0
        )
    assert info.value.code == ErrorCode.PROTOCOL_VIOLATION
    pair = ConnectionPair()
    pair.pump()
    with pytest.raises(RemoteProtocolError):
        pair.client.receive_data(frame(Open(seq=0, stream=1, prompt="x")), 0.0)


# -- §3.2 reliable messages --------------------------------------------------------------------


def test_3_2_open_delivers_every_field_to_the_server() -> None:
    pair = ConnectionPair()
    pair.pump()
    params = SamplingOptions(max_tokens=4, temperature=0.0, stop=("x",))
    stream = pair.client.open_stream(
        messages=[ChatMessage("user", "Hi")], model="tiny", params=params, priority=2,
        deadline_ms=900, credit=10, expected_tokens=3, max_latency_ms=40,
    )
    pair.pump()
    (opened,) = pair.of("server", StreamOpened)
    assert opened.open == Open(
        seq=0, stream=stream, messages=(ChatMessage("user", "Hi"),), model="tiny",
        params=params, priority=2, deadline_ms=900, credit=10, expected_tokens=3,
        max_latency_ms=40,
    )


def test_3_2_open_needs_exactly_one_of_prompt_and_messages() -> None:
    client = ClientConnection()
    with pytest.raises(LocalProtocolError):
        client.open_stream()
    with pytest.raises(LocalProtocolError):
        client.open_stream(prompt="a", messages=[ChatMessage("user", "b")])


def test_3_2_accept_delta_end_reach_the_client() -> None:
    pair, stream = opened_pair()
    pair.server.accept_stream(stream, token_quota=100, batch_size=4)
    pair.server.send_delta(stream, "He", (10, 11))
    pair.server.send_delta(stream, "llo", (12,))
    pair.server.end_stream(stream, "length", Usage(2, 3, 0))
    pair.pump()
    assert pair.client_events[-4:] == [
        StreamAccepted(stream=stream, token_quota=100, batch_size=4),
        DeltaReceived(
            stream, 0, "He", (10, 11)),
        DeltaReceived(
            stream, 2, "llo", (12,)),
        StreamEnded(stream=stream, reason="length", usage=Usage(2, 3, 0)),
    ]


def test_3_2_end_with_a_stream_error_keeps_the_connection() -> None:
    pair, stream = opened_pair()
    pair.server.end_stream(stream, "error", Usage(), StreamError("unknown_model", "nope"))
    pair.pump()
    (ended,) = pair.of("client", StreamEnded)
    assert ended.error == StreamError("unknown_model", "nope")
    assert pair.client.state is pair.server.state is ConnectionState.OPEN
    pair.client.open_stream(prompt="again")
    pair.pump()
    assert len(pair.of("server", StreamOpened)) == 2


def test_3_2_cancel_reaches_the_server_once() -> None:
    pair, stream = opened_pair()
    pair.client.cancel_stream(stream)
    pair.client.cancel_stream(stream)  # already cancelled: nothing more is sent
    pair.pump()
    assert pair.of("server", StreamCancelled) == [StreamCancelled(stream=stream)]
    pair.server.end_stream(stream, "cancelled", Usage(1, 0))
    pair.pump()
    assert pair.of("client", StreamEnded)[0].reason == "cancelled"


def test_3_2_delta_index_must_continue_the_stream() -> None:
    pair, stream = opened_pair()
    pair.server.accept_stream(stream, 10, 1)
    pair.pump()
    bad = Delta(seq=1, stream=stream, index=5, text="x", tokens=(1,))
    with pytest.raises(RemoteProtocolError) as info:
        pair.client.receive_data(frame(bad), 0.0)
    assert info.value.code == ErrorCode.PROTOCOL_VIOLATION


# -- §3.1 goaway, batch, error -----------------------------------------------------------------


def test_3_1_goaway_refuses_new_streams_and_running_ones_finish() -> None:
    pair, stream = opened_pair()
    pair.server.accept_stream(stream, 10, 1)
    pair.server.goaway("restart")
    pair.pump()
    assert pair.of("client", GoAwayReceived) == [GoAwayReceived(reason="restart")]
    with pytest.raises(LocalProtocolError):
        pair.client.open_stream(prompt="more")
    pair.server.send_delta(stream, "still", (1,))
    pair.server.end_stream(stream, "stop", Usage())
    pair.pump()
    assert pair.of("client", StreamEnded)[0].reason == "stop"


def test_3_1_open_crossing_goaway_is_refused_with_overloaded() -> None:
    pair = ConnectionPair()
    pair.pump()
    pair.server.goaway("restart")
    stream = pair.client.open_stream(prompt="crossing")
    pair.to_server()
    assert pair.of("server", StreamOpened) == []
    pair.pump()
    (ended,) = pair.of("client", StreamEnded)
    assert ended.stream == stream and ended.reason == "error"
    assert ended.error is not None and ended.error.code == "overloaded"


@pytest.mark.parametrize("codec", ["none", "brotli"])
def test_3_1_batch_is_understood(codec: str) -> None:
    pair, stream = opened_pair()
    pair.server.accept_stream(stream, 10, 1)
    inner = b"".join(
        frame(Delta(seq=1 + i, stream=stream, index=i, text="ab", tokens=(i,)))
        for i in range(5)
    )
    data = brotli.compress(inner) if codec == "brotli" else inner
    pair.server.data_to_send(0.0)  # the accept, re-sent inside the batch below
    accept = frame(Accept(seq=0, stream=stream, token_quota=10, batch_size=1))
    payload = accept + inner if codec == "none" else brotli.compress(accept + inner)
    pair.client.receive_data(frame(Batch(codec=codec, data=payload)), 0.0)  # type: ignore[arg-type]
    pair.drain_client()
    assert [e.index for e in pair.client_events if hasattr(e, "index")] == [0, 1, 2, 3, 4]
    assert data


def test_3_1_batch_inside_batch_is_protocol_violation() -> None:
    pair = ConnectionPair()
    pair.pump()
    nested = frame(Batch(codec="none", data=frame(Ack(ack=0))))
    with pytest.raises(RemoteProtocolError) as info:
        pair.server.receive_data(frame(Batch(codec="none", data=nested)), 0.0)
    assert info.value.code == ErrorCode.PROTOCOL_VIOLATION


def test_3_1_batch_ending_inside_a_frame_is_corrupted_frame() -> None:
    pair = ConnectionPair()
    pair.pump()
    with pytest.raises(RemoteProtocolError) as info:
        pair.server.receive_data(frame(Batch(codec="none", data=frame(Ack(ack=0))[:-1])), 0.0)
    assert info.value.code == ErrorCode.CORRUPTED_FRAME


def test_3_1_brotli_batch_expanding_past_max_frame_is_frame_too_large() -> None:
    pair = ConnectionPair(ProtocolLimits(max_frame=4096))
    pair.pump()
    bomb = brotli.compress(b"\x00" * 1_000_000)
    with pytest.raises(RemoteProtocolError) as info:
        pair.server.receive_data(frame(Batch(codec="brotli", data=bomb)), 0.0)
    assert info.value.code == ErrorCode.FRAME_TOO_LARGE


def test_3_1_corrupt_brotli_is_invalid_message() -> None:
    pair = ConnectionPair()
    pair.pump()
    with pytest.raises(RemoteProtocolError) as info:
        pair.server.receive_data(frame(Batch(codec="brotli", data=b"\xff\xff\xff")), 0.0)
    assert info.value.code == ErrorCode.INVALID_MESSAGE
    assert info.value.field == "data"


def test_3_1_coalescing_sends_one_batch_compressed_only_when_it_pays() -> None:
    pair = ConnectionPair()
    pair.server = ServerConnection(pair.limits, coalesce=True)
    pair.pump()
    stream = pair.client.open_stream(prompt="x")
    pair.pump()
    pair.server.accept_stream(stream, 1000, 1)
    for i in range(200):
        pair.server.send_delta(stream, " the same words again", (i,))
    data = pair.server.data_to_send(pair.now)
    (batch,) = decoded(data)
    assert isinstance(batch, Batch) and batch.codec == "brotli"
    pair.client.receive_data(data, pair.now)
    pair.drain_client()
    assert len([e for e in pair.client_events if hasattr(e, "index")]) == 200
    pair.server.send_delta(stream, "x", (1,))
    pair.server.send_delta(stream, "y", (2,))
    (small,) = decoded(pair.server.data_to_send(pair.now))
    assert isinstance(small, Batch) and small.codec == "none"
    pair.server.send_delta(stream, "z", (3,))
    (single,) = decoded(pair.server.data_to_send(pair.now))
    assert isinstance(single, Delta)  # one frame is never wrapped


def test_3_1_coalesced_batches_respect_max_frame() -> None:
    pair = ConnectionPair(ProtocolLimits(max_frame=1024))
    pair.server = ServerConnection(pair.limits, coalesce=True)
    pair.pump()
    pair.server._peer_max_frame = 1024
    stream = pair.client.open_stream(prompt="x")
    pair.pump()
    pair.server.accept_stream(stream, 1000, 1)
    import random

    rng = random.Random(1)
    for i in range(100):
        pair.server.send_delta(stream, "".join(rng.choice("abcdefgh") for _ in range(30)), (i,))
    data = pair.server.data_to_send(pair.now)
    assert len(frames_of(data)) > 1
    assert all(len(p) <= 1024 for p in frames_of(data))
    pair.client.receive_data(data, pair.now)
    pair.drain_client()
    assert len([e for e in pair.client_events if hasattr(e, "index")]) == 100


def test_3_1_error_is_fatal_and_the_session_is_discarded() -> None:
    pair, _ = opened_pair()
    pair.server.send_error("overloaded", "too busy")
    pair.to_client()
    (error,) = pair.of("client", PeerError)
    assert (error.code, error.message, error.close_code) == ("overloaded", "too busy", 1013)
    assert pair.client.state is pair.server.state is ConnectionState.CLOSED
    assert pair.client.session is not None and pair.client.session.discarded
    with pytest.raises(LocalProtocolError):
        pair.client.open_stream(prompt="x")
    with pytest.raises(LocalProtocolError):
        pair.client.receive_data(b"", 0.0)
    with pytest.raises(LocalProtocolError):
        pair.server.send_delta(1, "x", ())


def test_3_1_after_a_remote_error_the_connection_refuses_use() -> None:
    pair = ConnectionPair()
    pair.pump()
    with pytest.raises(RemoteProtocolError):
        pair.server.receive_data(b"\x00" * 8, 0.0)
    (error,) = decoded(pair.server.data_to_send(0.0))
    assert isinstance(error, Error) and error.code == "corrupted_frame"
    with pytest.raises(LocalProtocolError):
        pair.server.receive_data(b"", 0.0)
    with pytest.raises(LocalProtocolError):
        pair.server.goaway()


# -- §4 streams --------------------------------------------------------------------------------


def test_4_transition_table_is_the_state_diagram() -> None:
    o, a, x, c = (StreamState.OPENED, StreamState.ACCEPTED, StreamState.CANCELLED,
                  StreamState.CLOSED)
    assert {
        (o, "accept"): a, (o, "end"): c, (o, "cancel"): x,
        (a, "delta"): a, (a, "end"): c, (a, "cancel"): x,
        (x, "accept"): x, (x, "delta"): x, (x, "end"): c, (x, "cancel"): x,
    } == TRANSITIONS


def test_4_delta_before_accept_is_refused_locally_and_remotely() -> None:
    pair, stream = opened_pair()
    assert not pair.server.can_send_delta(stream)
    with pytest.raises(LocalProtocolError):
        pair.server.send_delta(stream, "x", (1,))
    with pytest.raises(RemoteProtocolError) as info:
        pair.client.receive_data(
            frame(Delta(seq=0, stream=stream, index=0, text="x", tokens=(1,))), 0.0
        )
    assert info.value.code == ErrorCode.PROTOCOL_VIOLATION


def test_4_nothing_after_end() -> None:
    pair, stream = opened_pair()
    pair.server.end_stream(stream, "stop", Usage())
    with pytest.raises(LocalProtocolError):
        pair.server.end_stream(stream, "stop", Usage())
    with pytest.raises(LocalProtocolError):
        pair.server.accept_stream(stream, 1, 1)
    pair.pump()
    with pytest.raises(RemoteProtocolError):
        pair.client.receive_data(
            frame(End(seq=1, stream=stream, reason="stop", usage=Usage())), 0.0
        )


def test_4_stream_ids_increase_and_are_never_reused() -> None:
    pair = ConnectionPair()
    pair.pump()
    assert [pair.client.open_stream(prompt="x") for _ in range(3)] == [1, 2, 3]
    pair.pump()
    with pytest.raises(RemoteProtocolError) as info:
        pair.server.receive_data(frame(Open(seq=3, stream=2, prompt="again")), 0.0)
    assert info.value.code == ErrorCode.PROTOCOL_VIOLATION


def test_4_cancel_crossing_end_is_ignored() -> None:
    pair, stream = opened_pair()
    pair.server.end_stream(stream, "stop", Usage())
    pair.client.cancel_stream(stream)  # before the end arrives
    pair.pump()
    assert pair.of("server", StreamCancelled) == []
    assert pair.server.state is ConnectionState.OPEN


def test_4_cancel_of_a_never_opened_stream_is_protocol_violation() -> None:
    pair = ConnectionPair()
    pair.pump()
    with pytest.raises(RemoteProtocolError):
        pair.server.receive_data(frame(Cancel(seq=0, stream=9)), 0.0)


def test_4_opens_over_max_streams_are_refused_with_overloaded() -> None:
    pair = ConnectionPair(ProtocolLimits(max_streams=2))
    pair.pump()
    streams = [pair.client.open_stream(prompt="x") for _ in range(3)]
    pair.pump()
    assert [e.open.stream for e in pair.of("server", StreamOpened)] == streams[:2]
    (ended,) = pair.of("client", StreamEnded)
    assert ended.stream == streams[2] and ended.error is not None
    assert ended.error.code == "overloaded"
    pair.server.end_stream(streams[0], "stop", Usage())
    pair.client.open_stream(prompt="now fits")
    pair.pump()
    assert len(pair.of("server", StreamOpened)) == 3


def test_4_server_may_reject_at_admission() -> None:
    pair, stream = opened_pair()
    pair.server.end_stream(stream, "error", Usage(), StreamError("context_length_exceeded"))
    pair.pump()
    (ended,) = pair.of("client", StreamEnded)
    assert ended.error == StreamError("context_length_exceeded")


def test_4_goaway_is_server_only() -> None:
    pair = ConnectionPair()
    pair.pump()
    with pytest.raises(RemoteProtocolError):
        pair.server.receive_data(frame(GoAway(reason="x")), 0.0)


def test_3_1_a_frame_too_big_to_share_a_batch_goes_out_alone() -> None:
    pair = ConnectionPair(ProtocolLimits(max_frame=1024))
    pair.server = ServerConnection(pair.limits, coalesce=True)
    pair.pump()
    pair.server._peer_max_frame = 1024
    stream = pair.client.open_stream(prompt="x")
    pair.pump()
    pair.server.accept_stream(stream, 1000, 1)
    pair.server.send_delta(stream, "y" * 950, (1,))  # alone it fits max_frame, not a batch
    pair.server.send_delta(stream, "z", (2,))
    data = pair.server.data_to_send(pair.now)
    assert [type(m).__name__ for m in decoded(data)] == ["Accept", "Delta", "Delta"]
    pair.client.receive_data(data, pair.now)
    pair.drain_client()
    assert [e.index for e in pair.client_events if isinstance(e, DeltaReceived)] == [0, 1]
