"""The HTTP front door against hostile input (issue 12, holes 5-8), over raw sockets on a real
server with the null engine: request smuggling, bad bodies, deep nesting, loose booleans,
unknown HTTP versions and the head-size limit. Each bad request gets its error status, the
connection is closed, one structured log line is written, no traceback, and a normal client on
another connection is still served within its usual time."""

from __future__ import annotations

import json
import logging
import re
import socket
from collections.abc import Iterator, Sequence
from typing import Any

import httpx
import msgspec
import pytest
import trio

from seedance.server.http import h11_server
from tests.integration.protocol_peer import WsPeer, frame, protocol_server
from tests.integration.running_server import RunningServer, running_server

IO_TIMEOUT = 5.0
"""Seconds a raw-socket read waits for more bytes; silence that long means the server kept the
connection open (keep-alive waits 75 s)."""
NORMAL_SECONDS = 5.0
"""A short completion on the null engine takes milliseconds; this bound catches a stuck loop."""
COMPLETION = {"model": "null", "prompt": "hello", "max_tokens": 3}
BODY = json.dumps(COMPLETION).encode()
PIPELINED = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    with protocol_server() as running:
        yield running


def _exchange(
    port: int, pieces: Sequence[bytes], *, shut_write: bool = False
) -> tuple[bytes, bool]:
    """Send `pieces` (one send each) on a new connection, optionally half-close it, and read
    until the server closes it: (everything received, whether it closed within IO_TIMEOUT)."""
    with socket.create_connection(("127.0.0.1", port), timeout=IO_TIMEOUT) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for piece in pieces:
            sock.sendall(piece)
        if shut_write:
            sock.shutdown(socket.SHUT_WR)
        data = b""
        try:
            while piece := sock.recv(65536):
                data += piece
        except TimeoutError:
            return data, False
        except ConnectionResetError:
            return data, True
    return data, True


def _statuses(data: bytes) -> list[int]:
    """The status of each whole response in `data` (each has a Content-Length)."""
    statuses = []
    while data:
        head, found, data = data.partition(b"\r\n\r\n")
        match = re.match(rb"HTTP/1\.[01] (\d{3}) ", head)
        length = re.search(rb"(?im)^content-length: *(\d+)", head)
        if not found or match is None or length is None or len(data) < int(length[1]):
            statuses.append(-1)  # not a whole response
            break
        statuses.append(int(match[1]))
        data = data[int(length[1]) :]
    return statuses


def _error_code(data: bytes) -> str:
    _head, _, body = data.partition(b"\r\n\r\n")
    code: str = json.loads(body)["error"]["code"]
    return code


def _post(headers: bytes, body: bytes = BODY, version: bytes = b"1.1") -> bytes:
    return (b"POST /v1/completions HTTP/" + version + b"\r\nHost: x\r\n"
            b"Content-Type: application/json\r\n" + headers + b"\r\n" + body)


def _chunked(body: bytes) -> bytes:
    return b"%x\r\n%b\r\n0\r\n\r\n" % (len(body), body)


def _served_normally(server: RunningServer) -> None:
    """A completion on a fresh connection finishes within NORMAL_SECONDS."""

    async def ask() -> None:
        with trio.fail_after(NORMAL_SECONDS):
            async with httpx.AsyncClient(base_url=server.base_url) as http:
                response = await http.post("/v1/completions", json=COMPLETION)
        assert response.status_code == 200
        assert len(response.json()["choices"][0]["text"]) == 3

    trio.run(ask)


def _refused(
    server: RunningServer,
    records: list[logging.LogRecord],
    pieces: Sequence[bytes],
    status: int,
    *,
    shut_write: bool = False,
) -> bytes:
    """`pieces` get exactly one response, `status`, and the connection is closed; one
    `bad_request` log line and no error (traceback) line; then a normal client is served."""
    data, closed = _exchange(server.port, pieces, shut_write=shut_write)
    assert _statuses(data) == [status], data[:300]
    assert closed, "the server kept the connection open"
    assert [r.getMessage() for r in records if r.levelno >= logging.ERROR] == []
    assert len([r for r in records if r.getMessage() == "bad_request"]) == 1
    _served_normally(server)
    return data


# -- hole 5: request smuggling ---------------------------------------------------------------


@pytest.mark.parametrize(
    "headers",
    [
        b"Content-Length: %d\r\nTransfer-Encoding: chunked\r\n" % len(_chunked(BODY)),
        b"Transfer-Encoding: chunked\r\nContent-Length: 3\r\n",
    ],
    ids=["cl-then-te", "te-then-cl"],
)
def test_content_length_with_transfer_encoding_is_400_and_closes_before_the_next_request(
    server: RunningServer, seedance_log: list[logging.LogRecord], headers: bytes
) -> None:
    data = _refused(server, seedance_log, [_post(headers, _chunked(BODY)) + PIPELINED], 400)
    assert _error_code(data) == "invalid_framing"


@pytest.mark.parametrize(
    "headers",
    [
        b"Content-Length: %d\r\nContent-Length: %d\r\n" % (len(BODY), len(BODY)),
        b"Content-Length: %d, %d\r\n" % (len(BODY), len(BODY)),
        b"Content-Length: %d\r\nContent-Length: %d\r\n" % (len(BODY), len(BODY) + 1),
    ],
    ids=["repeated", "list", "conflicting"],
)
def test_more_than_one_content_length_is_400_and_closes(
    server: RunningServer, seedance_log: list[logging.LogRecord], headers: bytes
) -> None:
    _refused(server, seedance_log, [_post(headers) + PIPELINED], 400)


@pytest.mark.parametrize(
    ("coding", "status"),
    [
        (b"Transfer-Encoding: gzip, chunked\r\n", 501),  # a coding we do not implement
        (b"Transfer-Encoding: chunked, gzip\r\n", 400),  # chunked not last: length unknown
        (b"Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n", 400),  # chunked twice
    ],
    ids=["unknown-coding", "chunked-not-last", "chunked-twice"],
)
def test_transfer_codings_other_than_one_chunked_are_refused(
    server: RunningServer, seedance_log: list[logging.LogRecord], coding: bytes, status: int
) -> None:
    _refused(server, seedance_log, [_post(coding, _chunked(BODY)) + PIPELINED], status)


def test_transfer_encoding_in_an_http_1_0_request_is_400(
    server: RunningServer, seedance_log: list[logging.LogRecord]
) -> None:
    request = _post(b"Transfer-Encoding: chunked\r\n", _chunked(BODY), version=b"1.0")
    _refused(server, seedance_log, [request], 400)


def test_one_content_length_still_keeps_the_connection_alive(server: RunningServer) -> None:
    request = _post(b"Content-Length: %d\r\n" % len(BODY))
    with socket.create_connection(("127.0.0.1", server.port), timeout=IO_TIMEOUT) as sock:
        sock.sendall(request + request)
        data = b""
        while len(_statuses(data)) < 2 or _statuses(data)[-1] == -1:
            data += sock.recv(65536)
    assert _statuses(data) == [200, 200]


# -- hole 6: bad bodies ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "body",
    [
        b"zz\r\n{}\r\n0\r\n\r\n",  # not a hex size
        b"-5\r\n{}\r\n0\r\n\r\n",  # negative
        b"1" * 30 + b"\r\n{}\r\n0\r\n\r\n",  # overflowing
        b"2\r\n{}XX0\r\n\r\n",  # chunk data not followed by CRLF
    ],
    ids=["bad-size", "negative-size", "overflowing-size", "missing-crlf"],
)
def test_invalid_chunked_body_is_400_with_one_log_line(
    server: RunningServer, seedance_log: list[logging.LogRecord], body: bytes
) -> None:
    data = _refused(server, seedance_log, [_post(b"Transfer-Encoding: chunked\r\n", body)], 400)
    assert _error_code(data) == "invalid_body"


@pytest.mark.parametrize(
    ("headers", "body"),
    [
        (b"Transfer-Encoding: chunked\r\n", b"40\r\n" + BODY[:10]),  # EOF inside a chunk
        (b"Content-Length: %d\r\n" % (len(BODY) + 50), BODY),  # shorter than its length
    ],
    ids=["chunked", "content-length"],
)
def test_body_cut_by_eof_is_400_with_one_log_line(
    server: RunningServer, seedance_log: list[logging.LogRecord], headers: bytes, body: bytes
) -> None:
    data = _refused(server, seedance_log, [_post(headers, body)], 400, shut_write=True)
    assert _error_code(data) == "invalid_body"


def test_body_that_never_completes_is_408_after_the_request_timeout(
    server: RunningServer, seedance_log: list[logging.LogRecord], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(h11_server, "REQUEST_TIMEOUT", 0.5)
    with socket.create_connection(("127.0.0.1", server.port), timeout=IO_TIMEOUT) as sock:
        sock.sendall(_post(b"Content-Length: %d\r\n" % (len(BODY) + 50)))
        _served_normally(server)  # while that body is still awaited
        data = b""
        while piece := sock.recv(65536):
            data += piece
    assert _statuses(data) == [408]
    assert _error_code(data) == "request_timeout"
    assert [r.getMessage() for r in seedance_log if r.levelno >= logging.ERROR] == []


# -- hole 7: deep nesting --------------------------------------------------------------------


def _nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def test_deeply_nested_json_body_is_400_not_500(server: RunningServer) -> None:
    body = b'{"model": "null", "prompt": "x", "user": ' + _nested(100_000) + b"}"
    response = httpx.post(server.base_url + "/v1/completions", content=body, timeout=10)
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "nesting_too_deep"
    _served_normally(server)


def test_nesting_at_the_limit_is_accepted(server: RunningServer) -> None:
    body = b'{"model": "null", "prompt": "x", "max_tokens": 2, "user_data": ' + _nested(63)
    response = httpx.post(server.base_url + "/v1/completions", content=body + b"}", timeout=10)
    assert response.status_code == 200


@pytest.mark.parametrize(
    ("subprotocol", "payload"),
    [
        ("seedance.v1.json", b'{"t": "ack", "ack": 0, "x": ' + _nested(100_000) + b"}"),
        ("seedance.v1.msgpack",
         b"\x83" + msgspec.msgpack.encode({"t": "ack", "ack": 0})[1:]  # a third key: "x"
         + b"\xa1x" + b"\x91" * 100_000 + b"\xc0"),
    ],
    ids=["json", "msgpack"],
)
def test_deeply_nested_protocol_payload_is_invalid_message(
    server: RunningServer, subprotocol: str, payload: bytes
) -> None:
    peer = WsPeer(server.port, subprotocol)
    peer.hello()
    peer.send_bytes(frame(payload))
    error = peer.expect("error")
    assert error["code"] == "invalid_message"
    assert peer.closed_with() == 1002
    peer = WsPeer(server.port)
    peer.hello()
    peer.send({"t": "open", "seq": 0, "stream": 1, "prompt": "x", "params": {"max_tokens": 2}})
    peer.expect("accept")
    _deltas, end = peer.collect(1, timeout=NORMAL_SECONDS)
    assert end["reason"] == "length"
    peer.close()


# -- hole 8: loose types, unknown versions, the head limit -----------------------------------


@pytest.mark.parametrize("value", [0, "", [], {}, 1, "false"])
@pytest.mark.parametrize("name", ["ignore_eos", "include_stop_str_in_output",
                                  "skip_special_tokens", "stream", "echo"])
def test_boolean_parameters_must_be_json_booleans(
    server: RunningServer, name: str, value: Any
) -> None:
    response = httpx.post(server.base_url + "/v1/completions",
                          json={**COMPLETION, name: value}, timeout=10)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == name


@pytest.mark.parametrize("version", [b"9.9", b"2.0", b"0.9"])
def test_unknown_http_version_is_505(
    server: RunningServer, seedance_log: list[logging.LogRecord], version: bytes
) -> None:
    request = _post(b"Content-Length: %d\r\n" % len(BODY), version=version)
    data = _refused(server, seedance_log, [request], 505)
    assert _error_code(data) == "http_version_not_supported"


def _head_of(size: int) -> bytes:
    """A request whose head (request line, headers, blank line) is exactly `size` bytes."""
    start = _post(b"Content-Length: %d\r\nConnection: close\r\nX-Pad: " % len(BODY), b"")
    start = start[: -len(b"\r\n")]  # _post ended the head; the pad header goes last
    pad = size - len(start) - len(b"\r\n\r\n")
    return start + b"p" * pad + b"\r\n\r\n"


@pytest.mark.parametrize("trickled", [False, True], ids=["one-write", "trickled"])
def test_head_limit_is_the_same_however_the_head_arrives(
    server: RunningServer, seedance_log: list[logging.LogRecord], trickled: bool
) -> None:
    def pieces(data: bytes) -> list[bytes]:
        step = 1024 if trickled else len(data)
        return [data[i : i + step] for i in range(0, len(data), step)]

    limit = h11_server.MAX_HEAD_BYTES
    assert limit == 64 * 1024
    data, closed = _exchange(server.port, pieces(_head_of(limit) + BODY))
    assert _statuses(data) == [200] and closed
    for size in (limit + 1, 100 * 1024):
        seedance_log.clear()
        data = _refused(server, seedance_log, pieces(_head_of(size) + BODY), 431)
        assert _error_code(data) == "request_head_too_large"


def test_head_of_100_kb_is_431_in_one_write(server: RunningServer) -> None:
    """The prober's case: httpx sends the whole head at once."""
    response = httpx.post(server.base_url + "/v1/completions", json=COMPLETION,
                          headers={"x-big": "b" * (100 * 1024)}, timeout=10)
    assert response.status_code == 431
    _served_normally(server)


def test_ordinary_server_without_gateways_refuses_the_same(
    seedance_log: list[logging.LogRecord],
) -> None:
    """The checks live in the HTTP loop, not in a gateway: an HTTP-only server has them."""
    with running_server() as plain:
        request = _post(b"Content-Length: 3\r\nTransfer-Encoding: chunked\r\n", _chunked(BODY))
        _refused(plain, seedance_log, [request + PIPELINED], 400)

