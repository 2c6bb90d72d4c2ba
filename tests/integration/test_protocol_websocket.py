"""The protocol over the WebSocket gateway, spoken frame by frame by the `websockets` library:
both subprotocols, the handshake, bad input and its errors and close codes, credit pausing the
engine request, cancel, heartbeat timeouts, resume-grace expiry and the drain's goaway."""

from __future__ import annotations

import socket
import struct
import time
from typing import Any

import pytest

from seedance.server.gateway.session_ids import stream_request_id
from tests.integration.protocol_peer import MAGIC, WsPeer, frame, protocol_server
from tests.integration.running_server import RunningServer

SHORT_HEARTBEATS = {
    "heartbeat": {"connection": 1.6, "session": 0.8, "stream": 0.4},
    "heartbeat_min": {"connection": 0.1, "session": 0.1, "stream": 0.1},
}


@pytest.fixture(scope="module")
def server() -> Any:
    with protocol_server({"protocol": {"resume_grace": 0.5}}) as srv:
        yield srv


def _open(stream: int, seq: int, **fields: Any) -> dict[str, Any]:
    return {"t": "open", "seq": seq, "stream": stream, **fields}


def _wait(predicate: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def _still_serving(server: RunningServer) -> None:
    peer = WsPeer(server.port)
    peer.hello()
    peer.send(_open(1, 0, prompt="still there?", params={"max_tokens": 5}))
    peer.expect("accept")
    deltas, end = peer.collect(1)
    assert end["reason"] == "length"
    assert sum(len(d["tokens"]) for d in deltas) == 5
    peer.close()


@pytest.mark.parametrize("subprotocol", ["seedance.v1.msgpack", "seedance.v1.json"])
def test_stream_over_each_subprotocol(server: RunningServer, subprotocol: str) -> None:
    peer = WsPeer(server.port, subprotocol)
    assert peer.ws.subprotocol == subprotocol
    welcome = peer.hello()
    assert welcome["resumed"] is False and welcome["session"]
    assert welcome["resume_grace"] == 0.5
    peer.send(_open(1, 0, prompt="Once upon", params={"max_tokens": 24}, expected_tokens=24))
    accept = peer.expect("accept")
    assert accept["stream"] == 1 and accept["token_quota"] == 24 and accept["batch_size"] >= 1
    deltas, end = peer.collect(1)
    tokens = [t for d in deltas for t in d["tokens"]]
    assert [d["index"] for d in deltas] == [
        sum(len(x["tokens"]) for x in deltas[:i]) for i in range(len(deltas))
    ]
    assert len(tokens) == 24
    assert "".join(d["text"] for d in deltas) == bytes(tokens).decode()
    assert end["reason"] == "length"
    assert end["usage"]["completion_tokens"] == 24
    peer.close()
    server.wait_engine_idle()


def test_one_message_may_split_or_join_frames(server: RunningServer) -> None:
    peer = WsPeer(server.port)
    data = peer.encode({"t": "hello", "v": 1, "ack": 0}) + peer.encode(
        _open(1, 0, prompt="split", params={"max_tokens": 3})
    )
    for i in range(0, len(data), 5):  # 5-byte WebSocket messages
        peer.send_bytes(data[i : i + 5])
    peer.expect("welcome")
    peer.expect("accept")
    _, end = peer.collect(1)
    assert end["reason"] == "length"
    peer.close()


def _raw_upgrade(port: int, headers: dict[str, str]) -> str:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        head = "GET /v2/infer HTTP/1.1\r\nHost: x\r\n" + "".join(
            f"{k}: {v}\r\n" for k, v in headers.items()
        )
        sock.sendall(head.encode() + b"\r\n")
        return sock.recv(4096).decode()


def test_bad_handshakes_get_http_errors(server: RunningServer) -> None:
    base = {"Upgrade": "websocket", "Connection": "Upgrade",
            "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ==", "Sec-WebSocket-Version": "13"}
    assert _raw_upgrade(server.port, {**base, "Sec-WebSocket-Protocol": "chat.v2"}).startswith(
        "HTTP/1.1 400"
    )
    no_key = {k: v for k, v in base.items() if k != "Sec-WebSocket-Key"}
    assert _raw_upgrade(server.port, no_key).startswith("HTTP/1.1 400")
    old = _raw_upgrade(server.port, {**base, "Sec-WebSocket-Version": "8"})
    assert old.startswith("HTTP/1.1 426") and "sec-websocket-version: 13" in old.lower()
    ok = _raw_upgrade(server.port, base)
    assert ok.startswith("HTTP/1.1 101") and "seedance.v1" not in ok  # no protocol offered


def _error_and_close(peer: WsPeer) -> tuple[dict[str, Any], int | None]:
    code = peer.closed_with()
    error = peer._pop()
    assert error is not None and error["t"] == "error", error
    return error, code


@pytest.mark.parametrize(
    ("payload", "code", "close"),
    [
        (b"\x00garbage bytes, no magic", "corrupted_frame", 1002),
        (struct.pack(">II", MAGIC, (1 << 20) + 1), "frame_too_large", 1009),
        (struct.pack(">II", MAGIC, 0), "corrupted_frame", 1002),
        (frame(b"\x81\xa1t\xa7unknown"), "unknown_type", 1002),
        (frame(b"\xc1\xc1"), "invalid_message", 1002),
    ],
)
def test_bad_bytes_get_error_and_close_code(
    server: RunningServer, payload: bytes, code: str, close: int
) -> None:
    peer = WsPeer(server.port)
    peer.hello()
    peer.send_bytes(payload)
    error, closed = _error_and_close(peer)
    assert error["code"] == code
    assert closed == close
    _still_serving(server)


def test_invalid_json_on_the_json_subprotocol(server: RunningServer) -> None:
    peer = WsPeer(server.port, "seedance.v1.json")
    peer.hello()
    peer.send_bytes(frame(b'{"t": "open", "seq": 0, '))
    error, closed = _error_and_close(peer)
    assert error["code"] == "invalid_message" and closed == 1002
    _still_serving(server)


def test_text_message_is_a_protocol_error(server: RunningServer) -> None:
    peer = WsPeer(server.port)
    peer.hello()
    peer.ws.send("hello as text")
    error, closed = _error_and_close(peer)
    assert error["code"] == "protocol_violation" and closed == 1002


def test_frame_before_hello_is_a_protocol_violation(server: RunningServer) -> None:
    peer = WsPeer(server.port)
    peer.send(_open(1, 0, prompt="x"))
    error, closed = _error_and_close(peer)
    assert error["code"] == "protocol_violation" and closed == 1002


@pytest.mark.parametrize(
    ("params", "param"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
    ],
)
def test_out_of_range_params_end_the_stream_with_invalid_request(
    server: RunningServer, params: dict[str, Any], param: str
) -> None:
    # §3.2.1: a well-typed but refused value is a stream error; the connection carries on
    peer = WsPeer(server.port)
    peer.hello()
    peer.send(_open(1, 0, prompt="x", params=params))
    end = peer.expect("end")
    assert end["reason"] == "error" and end["error"]["code"] == "invalid_request"
    assert param in end["error"]["message"]
    peer.send(_open(2, 1, prompt="fine", params={"max_tokens": 2}))
    peer.expect("accept")
    _, end = peer.collect(2)
    assert end["reason"] == "length"
    peer.close()
    _still_serving(server)


@pytest.mark.parametrize(
    ("params", "field"),
    [({"max_tokens": "ten"}, "params.max_tokens"), ({"temperature": "hot"}, "params.temperature")],
)
def test_mistyped_params_are_invalid_messages(
    server: RunningServer, params: dict[str, Any], field: str
) -> None:
    # §1/§3.2.1: a field of the wrong type is a malformed message, fatal to the connection
    peer = WsPeer(server.port)
    peer.hello()
    peer.send(_open(1, 0, prompt="x", params=params))
    error, closed = _error_and_close(peer)
    assert error["code"] == "invalid_message" and field in error["message"]
    assert closed == 1002
    _still_serving(server)


def test_stream_errors_end_the_stream_not_the_connection(server: RunningServer) -> None:
    peer = WsPeer(server.port)
    peer.hello()
    peer.send(_open(1, 0, prompt="x", model="no-such-model"))
    end = peer.expect("end")
    assert end["reason"] == "error" and end["error"]["code"] == "unknown_model"
    too_long = "y" * (server.engine.max_model_len + 10)
    peer.send(_open(2, 1, prompt=too_long))
    end = peer.expect("end")
    assert end["reason"] == "error" and end["error"]["code"] == "context_length_exceeded"
    peer.send(_open(3, 2, prompt="x", params={"stop": [""]}))
    end = peer.expect("end")
    assert end["error"]["code"] == "invalid_request" and "stop" in end["error"]["message"]
    peer.send(_open(4, 3, prompt="fine", params={"max_tokens": 2}))
    peer.expect("accept")
    _, end = peer.collect(4)
    assert end["reason"] == "length"
    peer.close()
    server.wait_engine_idle()


def test_unauthorized_hello_closes_1008() -> None:
    with protocol_server(api_keys=frozenset({"sekret"})) as srv:
        peer = WsPeer(srv.port)
        peer.send({"t": "hello", "v": 1, "ack": 0, "api_key": "wrong"})
        error, closed = _error_and_close(peer)
        assert error["code"] == "unauthorized" and closed == 1008
        peer = WsPeer(srv.port)
        assert peer.hello(api_key="sekret")["session"]
        peer.close()
        metrics = _metrics(srv)
        assert 'seedance_protocol_errors_total{code="unauthorized"} 1.0' in metrics


def _metrics(srv: RunningServer) -> str:
    import urllib.request

    with urllib.request.urlopen(srv.base_url + "/metrics", timeout=5) as response:
        text: str = response.read().decode()
    return text


def _paused(srv: RunningServer) -> int:
    return srv.engine.stats().num_paused


def test_credit_pauses_the_engine_request_and_resumes_it(server: RunningServer) -> None:
    peer = WsPeer(server.port)
    peer.hello()
    peer.send(_open(1, 0, prompt="credit", params={"max_tokens": 40}, credit=5))
    peer.expect("accept")
    got = 0
    while got < 5:
        got += len(peer.expect("delta")["tokens"])
    assert got == 5
    _wait(lambda: _paused(server) == 1)
    peer.send({"t": "credit", "stream": 1, "limit": 40})
    deltas, end = peer.collect(1)
    assert got + sum(len(d["tokens"]) for d in deltas) == 40
    assert end["reason"] == "length"
    peer.close()
    server.wait_engine_idle()


def test_cancel_ends_with_cancelled_and_frees_the_engine(server: RunningServer) -> None:
    peer = WsPeer(server.port)
    peer.hello()
    peer.send(_open(1, 0, prompt="cancel me", params={"max_tokens": 4000}, credit=3))
    peer.expect("accept")
    _wait(lambda: _paused(server) == 1)
    peer.send({"t": "cancel", "seq": 1, "stream": 1})
    _, end = peer.collect(1)
    assert end["reason"] == "cancelled"
    assert end["usage"]["prompt_tokens"] > 0
    server.wait_engine_idle()
    peer.close()


def test_stream_tier_timeout_aborts_a_stream_whose_client_stops_answering() -> None:
    with protocol_server({"protocol": SHORT_HEARTBEATS}) as srv:
        peer = WsPeer(srv.port)
        peer.hello()  # this peer answers connection pings only, never stream pings
        peer.send(_open(1, 0, prompt="slow reader", params={"max_tokens": 4000}, credit=2))
        deltas, end = peer.collect(1, timeout=10)
        assert end["reason"] == "timeout"
        assert sum(len(d["tokens"]) for d in deltas) == 2
        srv.wait_engine_idle()
        peer.close()


def test_dropped_connection_not_resumed_aborts_after_resume_grace(server: RunningServer) -> None:
    peer = WsPeer(server.port)
    session = peer.hello()["session"]
    peer.send(_open(1, 0, prompt="abandoned", params={"max_tokens": 4000}, credit=4))
    peer.expect("accept")
    _wait(lambda: _paused(server) == 1)  # held by its credit: it cannot finish by itself
    peer.ws.socket.shutdown(socket.SHUT_RDWR)  # no close handshake: a drop
    peer.ws.socket.close()
    started = time.monotonic()
    assert server.watched.reason_of(stream_request_id(session, 1)) == "cancelled"  # the server aborted it
    assert time.monotonic() - started >= 0.3  # kept for resume_grace (0.5 s) first
    server.wait_engine_idle(timeout=10)


def test_resume_with_hello_session_and_ack() -> None:
    # its own server with the default 30 s grace: the shared one's 0.5 s can pass on a busy machine
    with protocol_server() as server:
        peer = WsPeer(server.port)
        session = peer.hello()["session"]
        peer.send(_open(1, 0, prompt="resume me", params={"max_tokens": 30}, credit=30))
        peer.expect("accept")  # seq 0
        first = peer.expect("delta")  # seq >= 1, not acknowledged
        peer.ws.socket.shutdown(socket.SHUT_RDWR)
        peer.ws.socket.close()
        again = WsPeer(server.port)
        welcome = again.hello(session=session, ack=first["seq"] + 1)
        assert welcome["resumed"] is True and welcome["session"] == session
        deltas, end = again.collect(1)
        assert deltas[0]["index"] == len(first["tokens"])
        assert len(first["tokens"]) + sum(len(d["tokens"]) for d in deltas) == 30
        assert end["reason"] == "length"
        again.close()
        assert "seedance_sessions_resumed_total 1.0" in _metrics(server)
        server.wait_engine_idle()


def test_drain_sends_goaway_and_lets_the_stream_finish() -> None:
    with protocol_server() as srv:
        peer = WsPeer(srv.port)
        peer.hello()
        peer.send(_open(1, 0, prompt="drain", params={"max_tokens": 20}, credit=2))
        peer.expect("accept")
        _wait(lambda: _paused(srv) == 1)
        srv.call(srv.server.request_shutdown)
        goaway = peer.expect("goaway", skip=("ack", "ping", "pong", "delta"))
        assert goaway["reason"]
        peer.send(_open(2, 1, prompt="refused"))
        peer.send({"t": "credit", "stream": 1, "limit": 20})
        ends: dict[int, dict[str, Any]] = {}
        while len(ends) < 2:
            message = peer.next()
            if message["t"] == "end":
                ends[message["stream"]] = message
        assert ends[1]["reason"] == "length"
        assert ends[2]["reason"] == "error" and ends[2]["error"]["code"] == "overloaded"
        assert peer.closed_with() == 1001
