"""The protocol gateways under attack (issue 12, holes 1, 2, 9 and 10): idle sockets that never
say `hello`, connection caps per client and in total, resumes under other credentials or with
a bad `ack`, session ids in the log, a drain that times out, and WebSocket framing violations.
After each attack a normal client on another connection must still be served in its usual
time."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import resource
import selectors
import socket
import struct
import time
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
from websockets.sync.client import connect

from seedance.server.gateway.protocol_session import CLOSE_SECONDS
from seedance.server.gateway.session_ids import session_tag
from seedance.server.ops.structured_log import KeyValueFormatter
from tests.integration.protocol_peer import MAGIC, WsPeer, frame, protocol_server
from tests.integration.running_server import RunningServer

OTHER_CLIENT = "127.0.0.2"
"""A second loopback address: a client the flood's per-address cap does not cover."""
USUAL_SECONDS = 3.0
"""A 20-token stream on the null engine takes milliseconds; this bounds it on a busy machine."""
FLOOD_SECONDS = 15.0
"""While the server is still accepting and upgrading a 2,000-socket flood (a few ms of CPU
each) a client waits its turn, but it is not locked out: it is served within this."""


# -- helpers ------------------------------------------------------------------------------------


def _open(stream: int, seq: int, **fields: Any) -> dict[str, Any]:
    return {"t": "open", "seq": seq, "stream": stream, **fields}


def _wait(predicate: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


class SourcedWsPeer(WsPeer):
    """A `WsPeer` whose socket comes from `source` (another client address)."""

    def __init__(self, port: int, source: str) -> None:
        sock = socket.create_connection(("127.0.0.1", port), timeout=10,
                                        source_address=(source, 0))
        self.json = False
        self.ws = connect(f"ws://127.0.0.1:{port}/v2/infer", sock=sock,
                          subprotocols=["seedance.v1.msgpack"],  # type: ignore[list-item]
                          max_size=None, open_timeout=10).__enter__()
        self._buffer = b""
        self.received = []


def _served(port: int, source: str = "127.0.0.1", tokens: int = 20,
            within: float = USUAL_SECONDS, **hello: Any) -> float:
    """A normal client streams `tokens` tokens within `within` seconds; returns the time."""
    started = time.monotonic()
    peer = WsPeer(port) if source == "127.0.0.1" else SourcedWsPeer(port, source)
    try:
        peer.hello(**hello)
        peer.send(_open(1, 0, prompt="a normal client", params={"max_tokens": tokens}))
        peer.expect("accept")
        deltas, end = peer.collect(1)
        assert end["reason"] == "length"
        assert sum(len(d["tokens"]) for d in deltas) == tokens
    finally:
        peer.close()
    elapsed = time.monotonic() - started
    assert elapsed < within, f"a normal client took {elapsed:.2f} s"
    return elapsed


def _upgrade_request(port: int) -> bytes:
    return (f"GET /v2/infer HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\n"
            "Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
            "Sec-WebSocket-Version: 13\r\n\r\n").encode()


def _raise_own_fd_limit(needed: int) -> None:
    """Client and server ends of every socket live in this process."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < needed <= hard or hard == resource.RLIM_INFINITY:
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, needed), hard))
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < needed:
        pytest.fail(f"needs {needed} file descriptors, the hard limit is {hard}")


def _read_until_closed(socks: list[socket.socket], timeout: float) -> dict[socket.socket, bytes]:
    """Read every socket until the server closes it (EOF or reset); AssertionError naming
    how many are still open after `timeout` seconds. Returns what each received."""
    received = {sock: b"" for sock in socks}
    selector = selectors.DefaultSelector()
    for sock in socks:
        sock.setblocking(False)
        selector.register(sock, selectors.EVENT_READ, sock)
    open_ = len(socks)
    deadline = time.monotonic() + timeout
    try:
        while open_:
            left = deadline - time.monotonic()
            assert left > 0, f"{open_} of {len(socks)} sockets still open after {timeout} s"
            for key, _ in selector.select(min(left, 0.5)):
                sock = key.data
                try:
                    data = sock.recv(65536)
                except BlockingIOError:
                    continue
                except ConnectionError:
                    data = b""
                if data:
                    received[sock] += data
                    continue
                selector.unregister(sock)
                open_ -= 1
    finally:
        selector.close()
    return received


def _server_frames(data: bytes) -> Iterator[tuple[int, bytes]]:
    """(opcode, payload) of each unmasked WebSocket frame in `data`."""
    at = 0
    while at + 2 <= len(data):
        opcode, length = data[at] & 0x0F, data[at + 1] & 0x7F
        at += 2
        if length == 126:
            (length,) = struct.unpack(">H", data[at:at + 2])
            at += 2
        elif length == 127:
            (length,) = struct.unpack(">Q", data[at:at + 8])
            at += 8
        yield opcode, data[at:at + length]
        at += length


def _close_code(data: bytes) -> int | None:
    """The close code of the server's close frame in `data` (None: no close frame)."""
    for opcode, payload in _server_frames(data):
        if opcode == 0x8:
            return int(struct.unpack(">H", payload[:2])[0]) if len(payload) >= 2 else 1005
    return None


def _after_http_head(data: bytes) -> bytes:
    head, sep, rest = data.partition(b"\r\n\r\n")
    assert sep and head.startswith(b"HTTP/1.1 101"), head
    return rest


def _masked(opcode: int, payload: bytes, *, fin: bool = True) -> bytes:
    mask = os.urandom(4)
    head = bytes([(0x80 if fin else 0) | opcode])
    if len(payload) < 126:
        head += bytes([0x80 | len(payload)])
    else:
        head += bytes([0x80 | 126]) + struct.pack(">H", len(payload))
    return head + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload))


def _tcp_frames(sock: socket.socket, timeout: float = 10.0) -> Iterator[dict[str, Any]]:
    """Decoded protocol messages from a raw TCP peer until the server closes."""
    buffer = b""
    sock.settimeout(timeout)
    while True:
        while len(buffer) >= 8:
            magic, length = struct.unpack(">II", buffer[:8])
            assert magic == MAGIC
            if len(buffer) < 8 + length:
                break
            message: dict[str, Any] = msgspec.msgpack.decode(buffer[8:8 + length])
            buffer = buffer[8 + length:]
            yield message
        data = sock.recv(65536)
        if not data:
            return
        buffer += data


def _tcp_send(sock: socket.socket, message: dict[str, Any]) -> None:
    sock.sendall(frame(msgspec.msgpack.encode(message)))


# -- hole 1: idle sockets, connection caps ------------------------------------------------------

FLOOD = 2000


def test_an_idle_socket_flood_is_closed_by_the_handshake_deadline_while_a_client_streams(
) -> None:
    _raise_own_fd_limit(2 * FLOOD + 512)
    tree = {"server": {"tcp_port": 0, "handshake_timeout": 1.0,
                       "max_connections_per_client": 2 * FLOOD}}
    with protocol_server(tree) as srv:
        http, tcp = srv.port, srv.server.ports["tcp"]
        _served(http)
        flood: list[socket.socket] = []
        upgraded: list[socket.socket] = []
        try:
            request = _upgrade_request(http)
            for i in range(FLOOD):  # half upgrade to WebSocket, half connect to the TCP port
                sock = socket.create_connection(("127.0.0.1", http if i % 2 else tcp),
                                                timeout=10)
                if i % 2:
                    sock.sendall(request)
                    upgraded.append(sock)
                flood.append(sock)
            flooded_at = time.monotonic()
            _served(http, within=FLOOD_SECONDS)  # not locked out by the idle sockets
            bound = FLOOD_SECONDS + 1.0 + CLOSE_SECONDS
            received = _read_until_closed(flood, timeout=bound)
            closed_after = time.monotonic() - flooded_at
            assert closed_after < bound
            codes = {_close_code(_after_http_head(received[sock])) for sock in upgraded}
            assert codes == {1002}
        finally:
            for sock in flood:
                sock.close()
        _wait(lambda: srv.call(lambda: srv.server.caps.open) == 0)
        _served(http)
        _served(http, source=OTHER_CLIENT)


def test_past_the_per_client_cap_http_gets_503_tcp_is_closed_and_other_clients_are_served(
) -> None:
    cap = 8
    with protocol_server({"server": {"tcp_port": 0, "max_connections_per_client": cap}}) as srv:
        http, tcp = srv.port, srv.server.ports["tcp"]
        held = [socket.create_connection(("127.0.0.1", http), timeout=10) for _ in range(cap)]
        try:
            _wait(lambda: srv.call(lambda: srv.server.caps.held_by("127.0.0.1")) == cap)
            refused = socket.create_connection(("127.0.0.1", http), timeout=10)
            refused.sendall(_upgrade_request(http))
            answer = _read_until_closed([refused], timeout=5)[refused]
            head, _, body = answer.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 503"), head
            assert b"connection: close" in head.lower()
            assert json.loads(body)["error"]["code"] == "too_many_connections"
            tcp_refused = socket.create_connection(("127.0.0.1", tcp), timeout=10)
            assert _read_until_closed([tcp_refused], timeout=5)[tcp_refused] == b""
            _served(http, source=OTHER_CLIENT)
        finally:
            for sock in held:
                sock.close()
        _wait(lambda: srv.call(lambda: srv.server.caps.open) == 0)
        _served(http)


def test_past_the_total_cap_new_connections_are_refused_until_slots_free() -> None:
    cap = 4
    tree = {"server": {"tcp_port": 0, "max_connections": cap,
                       "max_connections_per_client": 100}}
    with protocol_server(tree) as srv:
        http, tcp = srv.port, srv.server.ports["tcp"]
        held = [socket.create_connection(("127.0.0.1", tcp), timeout=10,
                                         source_address=(OTHER_CLIENT, 0)) for _ in range(cap)]
        try:
            _wait(lambda: srv.call(lambda: srv.server.caps.open) == cap)
            refused = socket.create_connection(("127.0.0.1", http), timeout=10)
            answer = _read_until_closed([refused], timeout=5)[refused]
            assert answer.startswith(b"HTTP/1.1 503"), answer[:80]
            tcp_refused = socket.create_connection(("127.0.0.1", tcp), timeout=10)
            assert _read_until_closed([tcp_refused], timeout=5)[tcp_refused] == b""
        finally:
            for sock in held:
                sock.close()
        _wait(lambda: srv.call(lambda: srv.server.caps.open) == 0)
        _served(http)


# -- hole 2: resume bound to credentials, bad acks, hashed ids ----------------------------------


def _victim(srv: RunningServer, **hello: Any) -> tuple[WsPeer, str, int]:
    """A client with one stream held by its credit (4 of 40 tokens, acked); returns the peer,
    its session id and the tokens it received."""
    peer = WsPeer(srv.port)
    session = peer.hello(**hello)["session"]
    peer.send(_open(1, 0, prompt="victim", params={"max_tokens": 40}, credit=4))
    peer.expect("accept")
    got = 0
    while got < 4:
        delta = peer.expect("delta")
        got += len(delta["tokens"])
        peer.send({"t": "ack", "ack": delta["seq"] + 1})
    record = srv.call(lambda: srv.server.ctx.sessions.get(session))
    assert record is not None
    _wait(lambda: srv.call(lambda: record.session.send.acked) >= 2)  # accept and a delta
    return peer, session, got


def _victim_goes_on(peer: WsPeer, got: int) -> None:
    started = time.monotonic()
    peer.send({"t": "credit", "stream": 1, "limit": 40})
    deltas, end = peer.collect(1)
    assert end["reason"] == "length"
    assert got + sum(len(d["tokens"]) for d in deltas) == 40
    assert time.monotonic() - started < USUAL_SECONDS
    peer.close()


def test_a_resume_under_another_api_key_is_a_new_session_and_the_victim_streams_on() -> None:
    with protocol_server(api_keys=frozenset({"key-a", "key-b"})) as srv:
        victim, session, got = _victim(srv, api_key="key-a")
        thief = WsPeer(srv.port)
        stolen = thief.hello(session=session, ack=0, api_key="key-b")
        unknown = WsPeer(srv.port).hello(session="no-such-session", ack=0, api_key="key-b")
        assert stolen["resumed"] is False and stolen["session"] != session
        assert set(stolen) == set(unknown) and unknown["resumed"] is False  # no oracle
        _victim_goes_on(victim, got)
        thief.close()
        _served(srv.port, api_key="key-b")


@pytest.mark.parametrize("ack", [10**6, 0], ids=["beyond_what_was_sent", "below_what_was_acked"])
def test_a_resume_with_a_bad_ack_is_refused_and_the_victim_streams_on(ack: int) -> None:
    with protocol_server() as srv:
        victim, session, got = _victim(srv)
        bad = WsPeer(srv.port)
        bad.send({"t": "hello", "v": 1, "ack": ack, "session": session})
        error = bad.expect("error")
        assert error["code"] == "protocol_violation" and "ack" in error["message"]
        assert bad.closed_with() == 1002
        _victim_goes_on(victim, got)
        _served(srv.port)


def _drop(peer: WsPeer) -> None:
    """Lose the connection without a close handshake: the session waits for a resume."""
    peer.ws.socket.shutdown(socket.SHUT_RDWR)
    peer.ws.socket.close()


def test_session_ids_are_logged_only_as_a_short_hash(
    seedance_log: list[logging.LogRecord],
) -> None:
    with protocol_server({"protocol": {"resume_grace": 0.3}}) as srv:
        peer = WsPeer(srv.port)
        resumed = peer.hello()["session"]
        _drop(peer)
        again = WsPeer(srv.port)
        assert again.hello(session=resumed, ack=0)["resumed"] is True
        again.close()
        lost = WsPeer(srv.port)
        expired = lost.hello()["session"]
        _drop(lost)
        _wait(lambda: {"session_resumed", "session_expired"}
              <= {record.getMessage() for record in seedance_log})
        _served(srv.port)
    formatter = KeyValueFormatter()
    lines = [formatter.format(record) for record in seedance_log]
    assert any("event=session_resumed" in line and f"session={session_tag(resumed)}" in line
               for line in lines)
    assert any("event=session_expired" in line and f"session={session_tag(expired)}" in line
               for line in lines)
    assert not [line for line in lines if resumed in line or expired in line]


# -- hole 9: a drain that times out ends streams properly ---------------------------------------


def test_a_drain_timeout_ends_protocol_streams_with_shutting_down_then_closes() -> None:
    with protocol_server({"server": {"tcp_port": 0, "drain_timeout": 1.0}}) as srv:
        stuck = WsPeer(srv.port)  # held by its credit: it cannot finish within the drain
        stuck.hello()
        stuck.send(_open(1, 0, prompt="stuck", params={"max_tokens": 4000}, credit=2))
        stuck.expect("accept")
        got = 0
        while got < 2:  # read (and ack) what its credit allows before the drain
            delta = stuck.expect("delta")
            got += len(delta["tokens"])
            stuck.send({"t": "ack", "ack": delta["seq"] + 1})
        tcp = socket.create_connection(("127.0.0.1", srv.server.ports["tcp"]), timeout=10)
        _tcp_send(tcp, {"t": "hello", "v": 1, "ack": 0})
        _tcp_send(tcp, _open(1, 0, prompt="stuck on tcp", params={"max_tokens": 4000},
                             credit=2))
        normal = WsPeer(srv.port)  # finishes within the drain once it grants credit
        normal.hello()
        normal.send(_open(1, 0, prompt="normal", params={"max_tokens": 20}, credit=2))
        normal.expect("accept")
        _wait(lambda: srv.engine.stats().num_paused == 3)
        srv.call(srv.server.request_shutdown)
        normal.expect("goaway", skip=("ack", "ping", "pong", "delta"))
        normal.send({"t": "credit", "stream": 1, "limit": 20})
        end = normal.expect("end", skip=("ack", "ping", "pong", "delta"))  # no acks: it
        assert end["reason"] == "length"  # closes (1001) right after this end
        end = stuck.expect("end", skip=("ack", "ping", "pong", "goaway"))
        assert end["reason"] == "cancelled"
        assert end["error"]["code"] == "shutting_down"
        assert stuck.closed_with() == 1001
        ends = [m for m in _tcp_frames(tcp) if m["t"] == "end"]  # read until the server closes
        assert [(e["reason"], e["error"]["code"]) for e in ends] == [("cancelled",
                                                                      "shutting_down")]
        tcp.close()


def test_a_drain_timeout_ends_an_sse_stream_with_an_error_event_and_done() -> None:
    tree = {"server": {"drain_timeout": 1.0, "tcp_sndbuf": 4096},
            "engine": {"max_model_len": 200_000}}
    with protocol_server(tree) as srv:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.settimeout(10)
        sock.connect(("127.0.0.1", srv.port))
        body = json.dumps({"model": "null", "prompt": "x", "max_tokens": 150_000,
                           "stream": True}).encode()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body) + body)
        first = sock.recv(4096)
        assert first.startswith(b"HTTP/1.1 200"), first[:80]
        _wait(lambda: srv.engine.stats().num_paused == 1)  # the client does not read
        srv.call(srv.server.request_shutdown)
        srv.watched.wait_finished(1, timeout=10)  # cut at the drain timeout
        rest = first + b"".join(iter(lambda: sock.recv(65536), b""))
        sock.close()
        assert rest.endswith(b"0\r\n\r\n"), rest[-200:]  # the chunked body ended properly
        events = [line for line in rest.split(b"\n") if line.startswith(b"data: {\"error\"")]
        assert len(events) == 1
        error = json.loads(events[0].removeprefix(b"data: "))["error"]
        assert error["code"] == "shutting_down" and error["message"]
        assert rest.index(events[0]) < rest.index(b"data: [DONE]")


# -- hole 10: WebSocket framing violations get close 1002 --------------------------------------

VIOLATIONS = {
    "unmasked_client_frame": b"\x82\x05hello",
    "reserved_opcode": _masked(0x3, b""),
    "oversized_control_frame": _masked(0x9, b"p" * 126),
}


@pytest.mark.parametrize("violation", list(VIOLATIONS))
def test_a_websocket_framing_violation_gets_close_1002(violation: str) -> None:
    with protocol_server() as srv:
        sock = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
        with contextlib.closing(sock):
            sock.sendall(_upgrade_request(srv.port))
            hello = frame(msgspec.msgpack.encode({"t": "hello", "v": 1, "ack": 0}))
            sock.sendall(_masked(0x2, hello))
            sock.sendall(VIOLATIONS[violation])
            received = _read_until_closed([sock], timeout=CLOSE_SECONDS + 5)[sock]
        assert _close_code(_after_http_head(received)) == 1002
        _served(srv.port)
