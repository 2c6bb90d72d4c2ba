"""seedance.protocol._connection: API details of ClientConnection and ServerConnection."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from seedance.protocol import (
    ClientConnection,
    ConnectionState,
    DeltaReceived,
    HelloReceived,
    LocalProtocolError,
    ProtocolLimits,
    RemoteProtocolError,
    ServerConnection,
    StreamAccepted,
    StreamEnded,
    StreamOpened,
    Usage,
    Welcomed,
)
from seedance.protocol._framing import encode_frame
from seedance.protocol.messages import Ack, Batch, Delta, Error, PayloadCodec
from tests.conformance.pair import frames_of


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


# -- the client's read loop: every whole in-order delta of a read is applied in one pass -------


def server_output(streams: int = 3, deltas: int = 20) -> tuple[ClientConnection, bytes]:
    """A client with `streams` open streams and, not yet fed to it, the server's bytes: the
    accepts, `deltas` interleaved deltas per stream (one over SMALL_FRAME bytes), one end."""
    client, server = handshake()
    ids = [client.open_stream(prompt=f"p{i}") for i in range(streams)]
    server.receive_data(client.data_to_send(0.0), 0.0)
    assert all(isinstance(e, StreamOpened) for e in server.events())
    for stream in ids:
        server.accept_stream(stream, token_quota=1000, batch_size=1)
    for i in range(deltas):
        for stream in ids:
            text = "é" * 200 if i == 7 else f"t{i}"
            server.send_delta(stream, text, (i, i + 1))
    server.end_stream(ids[0], "stop", Usage(prompt_tokens=1, completion_tokens=2 * deltas))
    return client, server.data_to_send(0.0)


def client_view(client: ClientConnection) -> list[tuple[object, ...]]:
    seen: list[tuple[object, ...]] = []
    for event in client.events():
        if isinstance(event, DeltaReceived):
            seen.append(("delta", event.stream, event.index, event.text, event.tokens))
        elif isinstance(event, StreamAccepted):
            seen.append(("accept", event.stream))
        elif isinstance(event, StreamEnded):
            seen.append(("end", event.stream, event.reason))
    return seen


def acks_sent(client: ClientConnection, now: float) -> list[Ack]:
    """The acks in what the client sends now."""
    codec = PayloadCodec("msgpack")
    messages = [codec.decode(p) for p in frames_of(client.data_to_send(now))]
    return [m for m in messages if isinstance(m, Ack)]


@given(cuts=st.lists(st.integers(min_value=0, max_value=10_000), max_size=12))
def test_a_read_gives_the_same_events_and_acks_however_the_bytes_are_cut(
    cuts: list[int],
) -> None:
    client, data = server_output()
    client.receive_data(data, 0.0)
    whole = client_view(client)
    assert len([e for e in whole if e[0] == "delta"]) == 60 and whole[-1] == ("end", 1, "stop")
    client, data = server_output()
    bounds = sorted({min(c, len(data)) for c in cuts} | {0, len(data)})
    seen: list[tuple[object, ...]] = []
    for start, end in itertools.pairwise(bounds):
        client.receive_data(data[start:end], 0.0)
        seen += client_view(client)
    assert seen == whole
    client.handle_timers(1.0)
    assert acks_sent(client, 1.0)[-1].ack == 64  # 3 accepts, 60 deltas, 1 end


def test_one_ack_answers_a_read_of_many_deltas() -> None:
    client, data = server_output(streams=4, deltas=16)  # 4 accepts + 64 deltas + 1 end
    client.receive_data(data, 0.0)
    assert [ack.ack for ack in acks_sent(client, 0.0)] == [69]


def test_deltas_before_a_corrupt_frame_are_delivered_then_the_read_fails() -> None:
    client, data = server_output(streams=1, deltas=4)
    sizes = [len(encode_frame(p)) for p in frames_of(data)]
    cut = sum(sizes[:3])  # the accept and two deltas stay whole
    corrupt = data[:cut] + b"\x00\x00\x00\x00" + data[cut + 4:]
    with pytest.raises(RemoteProtocolError) as failure:
        client.receive_data(corrupt, 0.0)
    assert failure.value.code == "corrupted_frame"
    assert [e[0] for e in client_view(client)] == ["accept", "delta", "delta"]
    assert client.state is ConnectionState.CLOSED


def test_a_delta_out_of_order_in_a_read_is_held_and_sacked_not_delivered() -> None:
    client, data = server_output(streams=1, deltas=4)
    frames = frames_of(data)  # accept, 4 deltas, end
    swapped = [frames[0], frames[1], frames[3], frames[2], *frames[4:]]
    client.receive_data(b"".join(encode_frame(p) for p in swapped[:3]), 0.0)
    assert [e[2] for e in client_view(client) if e[0] == "delta"] == [0]
    ack = acks_sent(client, 0.0)[-1]
    assert ack.ack == 2 and ack.sack == ((3, 4),)  # accept and delta 0 in; delta 2 held
    client.receive_data(b"".join(encode_frame(p) for p in swapped[3:]), 0.0)
    assert [e[2] for e in client_view(client) if e[0] == "delta"] == [2, 4, 6]


# -- one rule for a delta, however it arrives ----------------------------------------------------

MSGPACK = PayloadCodec("msgpack")


def credited_client() -> tuple[ClientConnection, int]:
    """A client whose stream 1 is accepted with credit 4 and whose stream 2 is opened, not
    accepted; with the next seq it expects."""
    client, server = handshake()
    first = client.open_stream(prompt="a", credit=4)
    client.open_stream(prompt="b", credit=4)
    server.receive_data(client.data_to_send(0.0), 0.0)
    assert [type(e) for e in server.events()] == [StreamOpened, StreamOpened]
    server.accept_stream(first, token_quota=100, batch_size=1)
    client.receive_data(server.data_to_send(0.0), 0.0)
    assert [type(e) for e in client.events()] == [StreamAccepted]
    assert client.session is not None
    return client, client.session.recv.ack


BAD_DELTAS = {
    "index": (dict(stream=1, index=3, tokens=(1,)), "delta index 3 on stream 1, expected 1"),
    "credit": (dict(stream=1, index=1, tokens=(1, 2, 3, 4)), r"beyond stream 1's credit \(5 > 4\)"),
    "unknown stream": (dict(stream=9, index=0, tokens=(1,)), "delta for unknown stream 9"),
    "not accepted": (dict(stream=2, index=0, tokens=(1,)), "delta on stream 2 before accept"),
}


def arrivals(good: bytes, bad: bytes) -> dict[str, list[bytes]]:
    """The reads that bring a good delta then a bad one, each way a delta can arrive."""
    batch = encode_frame(MSGPACK.encode(Batch(codec="none", data=good + bad)))
    return {
        "a read each": [good, bad],
        "one read": [good + bad],
        "cut across reads": [good + bad[:5], bad[5:]],
        "in a batch": [batch],
        "held, then released": [bad, good],  # the bad one arrives early, out of order
    }


@pytest.mark.parametrize("way", list(arrivals(b"", b"")))
@pytest.mark.parametrize("rule", list(BAD_DELTAS))
def test_every_way_a_delta_arrives_is_checked_by_the_same_rule(way: str, rule: str) -> None:
    client, seq = credited_client()
    good = encode_frame(MSGPACK.encode(Delta(seq=seq, stream=1, index=0, text="ok", tokens=(7,))))
    fields, message = BAD_DELTAS[rule]
    bad = encode_frame(MSGPACK.encode(Delta(seq=seq + 1, text="no", **fields)))  # type: ignore[arg-type]
    *before, last = arrivals(good, bad)[way]
    for data in before:
        client.receive_data(data, 0.0)
    with pytest.raises(RemoteProtocolError, match=message) as failure:
        client.receive_data(last, 0.0)
    assert failure.value.code == "protocol_violation"
    assert [(e.stream, e.index) for e in client.events() if isinstance(e, DeltaReceived)] == [(1, 0)]
    assert client.state is ConnectionState.CLOSED
    (error,) = [MSGPACK.decode(p) for p in frames_of(client.data_to_send(0.0))]
    assert isinstance(error, Error) and error.code == "protocol_violation"


@pytest.mark.parametrize("way", [*list(arrivals(b"", b""))[:-1], "held twice"])
def test_a_duplicate_delta_is_dropped_and_reacked_however_it_arrives(way: str) -> None:
    client, seq = credited_client()
    first = encode_frame(MSGPACK.encode(Delta(seq=seq, stream=1, index=0, text="a", tokens=(7,))))
    ahead = encode_frame(MSGPACK.encode(Delta(seq=seq + 1, stream=1, index=1, text="b", tokens=(8,))))
    reads = [ahead, ahead, first] if way == "held twice" else arrivals(first, first)[way]
    for data in reads:
        client.receive_data(data, 0.0)
    delivered = [(e.stream, e.index) for e in client.events() if isinstance(e, DeltaReceived)]
    assert delivered == ([(1, 0), (1, 1)] if way == "held twice" else [(1, 0)])
    assert client.state is ConnectionState.OPEN
    assert client.session is not None and client.session.recv.duplicates == 1
    assert acks_sent(client, 0.0)[-1].ack == client.session.recv.ack  # acknowledged at once
